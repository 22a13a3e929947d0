"""The mid-size pair (OPT-125m for actor, reference, critic and reward) on CPU, 2 ranks, fp16: the study's
strategies with and without the after-inference flush (issue 11's table) and the methods of the RLHF papers
(issue 12) side by side. Opt-in (``tox -e methods-mid``), minutes per cell. Budgets:
``baselines/cpu/methods_cpu_mid.yaml``."""

import math

import pytest


@pytest.mark.matrix("deepspeed_chat_cpu_mid", "methods_cpu_mid", "methods_cpu_mid_critic_free")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cpu")
    assert result.simulated and result.metrics["host_rss_growth"] > 0
    for rank in result["ranks"]:
        assert all(math.isfinite(v) for k, v in rank["recipe"].items() if k.endswith("_loss"))
    memory_budget.check(result)
