"""The one-GPU DeepSpeed-Chat cells (``deepspeed_chat_gpu1``) simulated on CPU: the recipe at world size 1 (one
torchrun worker), strategies none, zero2, zero3, zero3-offload, grad-ckpt and all, flush none and after-inference.

Figures are simulated (the CPU allocation trace replayed through the CUDA caching allocator model). Opt-in
(``tox -e gpu1-sim``): tiny OPT (``deepspeed_chat_gpu1_cpu``, against ``baselines/cpu/deepspeed_chat_gpu1_cpu.yaml``;
in the default run until 2026-11-27, 14 cells, about 160 s of its test time, while the DeepSpeed-Chat CPU matrix
at world size 2 runs the same recipe there) and OPT-125m (``deepspeed_chat_gpu1_cpu_mid``, minutes per cell), against
``baselines/cpu/deepspeed_chat_gpu1_cpu_mid.yaml``: two budget files, so that a run of the tiny cells alone does
not call the OPT-125m entries stale.
"""

import math

import pytest


def _check(result, memory_budget, suite: str) -> None:
    assert result.simulated and result.capture == "cpu-trace-simulated"
    assert result["world_size"] == 1 and len(result["ranks"]) == 1
    for rank in result["ranks"]:
        assert math.isfinite(rank["recipe"]["actor_loss"]) and math.isfinite(rank["recipe"]["critic_loss"])
    assert result.metrics["host_peak_rss"] > 0  # host figures: measured in every scenario
    memory_budget.check(result, suite=suite)


@pytest.mark.matrix("deepspeed_chat_gpu1_cpu")
def test_tiny_opt_within_budget(scenario, benchmarked_iteration, memory_budget):
    _check(benchmarked_iteration(scenario, "cpu"), memory_budget, "deepspeed_chat_gpu1_cpu")


@pytest.mark.matrix("deepspeed_chat_gpu1_cpu_mid")
def test_opt_125m_within_budget(scenario, benchmarked_iteration, memory_budget):
    _check(benchmarked_iteration(scenario, "cpu"), memory_budget, "deepspeed_chat_gpu1_cpu_mid")
