"""ReMax and GRPO on the ColossalChat recipe (CPU, TorchDDPPlugin, tiny OPT, 2 ranks; the `colossalai` tox
environment): budgets in baselines/cpu/methods_colossalchat_cpu.yaml, no critic built."""

import math

import pytest

from pytest_rlhfmem.rlhf.scenario import ALGORITHM_PHASES


@pytest.mark.matrix("methods_colossalchat_cpu")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cpu")
    assert result.simulated and list(result.phases) == list(ALGORITHM_PHASES[scenario.algorithm])
    for rank in result["ranks"]:
        assert rank["recipe"]["critic_built"] is False and math.isfinite(rank["recipe"]["actor_loss"])
        assert rank["host"]["measured"] and rank["total"]["host_peak_rss"] > 0
    memory_budget.check(result)
