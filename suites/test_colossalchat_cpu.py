"""The ColossalChat CPU matrix (runs in the `colossalai` tox environment): tiny OPT, 2 ranks, the
TorchDDPPlugin strategies (none, grad-ckpt) with each flush policy, figures simulated and checked against
baselines/cpu/colossalchat_cpu.yaml. The ZeRO strategies are gpu tests: ColossalAI runs them only on CUDA."""

import math

import pytest


@pytest.mark.matrix("colossalchat_cpu")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget, request):
    device = "cuda" if request.node.get_closest_marker("gpu") else "cpu"
    result = benchmarked_iteration(scenario, device)
    assert result.simulated == (device == "cpu")
    for rank in result["ranks"]:
        assert math.isfinite(rank["recipe"]["actor_loss"]) and math.isfinite(rank["recipe"]["critic_loss"])
    assert result.metrics["host_peak_rss"] > 0  # host figures: measured in every scenario
    memory_budget.check(result)
