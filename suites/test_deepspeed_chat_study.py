"""The study's DeepSpeed-Chat matrix (Zhou et al., Table 1): OPT-1.3b/350m and GPT2-xl/medium, the 7
strategies, flush none and after-inference, 4 ranks on 4 x 24 GB GPUs. Real CUDA figures, checked against
baselines/cuda-<gpu>-x4/deepspeed_chat_study.yaml."""

import pytest


@pytest.mark.matrix("deepspeed_chat_study")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cuda")
    assert not result.simulated and result.capture == "cuda-memory-history"
    memory_budget.check(result)
