"""The CPU matrix: DeepSpeed-Chat on a tiny OPT pair, 7 strategies x 2 flush policies, 2 ranks.

Figures are simulated (CPU allocation trace replayed through the CUDA caching allocator model) and
checked against baselines/cpu/deepspeed_chat_cpu.yaml.
"""

import math

import pytest
from matrix import load_matrix


@pytest.mark.parametrize("scenario", load_matrix("deepspeed_chat_cpu"))
def test_iteration_within_budget(scenario, ppo_iteration, memory_budget):
    result = ppo_iteration(scenario.framework, scenario.models, scenario.strategy, scenario.flush,
                           scenario.world_size, device="cpu", **scenario.overrides)
    assert result.simulated and result.capture == "cpu-trace-simulated"
    for rank in result["ranks"]:
        assert math.isfinite(rank["recipe"]["actor_loss"]) and math.isfinite(rank["recipe"]["critic_loss"])
    memory_budget.check(result)
