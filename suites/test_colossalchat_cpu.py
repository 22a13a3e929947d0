"""The ColossalChat CPU matrix (runs in the `colossalai` tox environment): tiny OPT, 2 ranks, the
TorchDDPPlugin strategies (none, grad-ckpt) with each flush policy, figures simulated and checked against
baselines/cpu/colossalchat_cpu.yaml. The ZeRO strategies are gpu tests: ColossalAI runs them only on CUDA."""

import math

import pytest
from matrix import load_matrix, run_benchmarked


@pytest.mark.parametrize("scenario", load_matrix("colossalchat_cpu"))
def test_iteration_within_budget(scenario, ppo_iteration, memory_budget, benchmark, request):
    device = "cuda" if request.node.get_closest_marker("gpu") else "cpu"
    result = run_benchmarked(benchmark, ppo_iteration, scenario, device=device)
    assert result.simulated == (device == "cpu")
    for rank in result["ranks"]:
        assert math.isfinite(rank["recipe"]["actor_loss"]) and math.isfinite(rank["recipe"]["critic_loss"])
    memory_budget.check(result)
