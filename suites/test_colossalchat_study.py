"""The study's ColossalChat scenarios (Zhou et al., Table 1 on 4 x 24 GB, Table 2 on 4 x A100), batch 32:
real CUDA figures, checked against baselines/cuda-<gpu>-x4/colossalchat_study.yaml."""

import pytest
from matrix import load_matrix, run_benchmarked


STUDY = load_matrix("colossalchat_study_table1") + load_matrix("colossalchat_study_table2")


@pytest.mark.parametrize("scenario", STUDY)
def test_iteration_within_budget(scenario, ppo_iteration, memory_budget, benchmark):
    result = run_benchmarked(benchmark, ppo_iteration, scenario, device="cuda")
    assert not result.simulated and result.capture == "cuda-memory-history"
    memory_budget.check(result)
