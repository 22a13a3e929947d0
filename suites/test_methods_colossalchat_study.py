"""ReMax and GRPO on the ColossalChat recipe with the study's pairs (batch 32), 4 x 24 GB GPUs, in the
`colossalai` environment: real CUDA figures against baselines/cuda-<gpu>-x4/methods_colossalchat_study.yaml."""

import pytest


@pytest.mark.matrix("methods_colossalchat_study")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cuda")
    assert not result.simulated and result.capture == "cuda-memory-history"
    assert result.metrics["host_peak_rss"] > 0
    memory_budget.check(result)
