"""The CPU matrix: DeepSpeed-Chat on a tiny OPT pair, 7 strategies x 2 flush policies, 2 ranks.

Figures are simulated (CPU allocation trace replayed through the CUDA caching allocator model) and
checked against baselines/cpu/deepspeed_chat_cpu.yaml.
"""

import math

import pytest


@pytest.mark.matrix("deepspeed_chat_cpu")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cpu")
    assert result.simulated and result.capture == "cpu-trace-simulated"
    for rank in result["ranks"]:
        assert math.isfinite(rank["recipe"]["actor_loss"]) and math.isfinite(rank["recipe"]["critic_loss"])
    assert result.metrics["host_peak_rss"] > 0  # host figures: measured in every scenario
    memory_budget.check(result)
