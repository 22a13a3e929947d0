"""The methods on the study's pairs (OPT-1.3b/350m, GPT2-xl/medium), 4 x 24 GB GPUs: real CUDA figures
against baselines/cuda-<gpu>-x4/methods_study.yaml, and the host-memory claim of ZeRO-Offload on a GPU."""

import pytest

from pytest_rlhfmem.rlhf.scenario import Scenario


@pytest.mark.matrix("methods_study")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cuda")
    assert not result.simulated and result.capture == "cuda-memory-history"
    assert result.metrics["host_peak_rss"] > 0
    memory_budget.check(result)


@pytest.mark.gpu(count=4, min_memory_gb=24)
def test_zero3_offload_raises_host_peak_rss_and_lowers_the_device_peak(iteration_result):
    offload = iteration_result(Scenario("deepspeed-chat", "opt-1.3b", "zero3-offload", "none", 4), "cuda")
    plain = iteration_result(Scenario("deepspeed-chat", "opt-1.3b", "zero3", "none", 4), "cuda")
    assert offload.metrics["peak_reserved"] < plain.metrics["peak_reserved"]
    assert offload.metrics["host_peak_rss"] > plain.metrics["host_peak_rss"]
    assert offload.metrics["host_pinned_peak"] > plain.metrics["host_pinned_peak"]
