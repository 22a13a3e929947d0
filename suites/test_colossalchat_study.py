"""The study's ColossalChat scenarios (Zhou et al., Table 1 on 4 x 24 GB, Table 2 on 4 x A100), batch 32:
real CUDA figures, checked against baselines/cuda-<gpu>-x4/colossalchat_study.yaml."""

import pytest


@pytest.mark.matrix("colossalchat_study_table1", "colossalchat_study_table2")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cuda")
    assert not result.simulated and result.capture == "cuda-memory-history"
    memory_budget.check(result)
