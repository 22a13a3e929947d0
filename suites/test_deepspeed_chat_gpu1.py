"""The DeepSpeed-Chat recipe on one GPU (world size 1; issue 35: most GPU CI runners have one card).

``deepspeed_chat_gpu1``: tiny OPT and OPT-125m (a 16 GB card); ``deepspeed_chat_gpu1_study``: the study's pair,
OPT-1.3b actor/reference + OPT-350m critic/reward at the pair's defaults (batch 4, Hybrid Engine, EMA; an 80 GB
card). Strategies none, zero2, zero3, zero3-offload, grad-ckpt and all, flush none and after-inference. Real CUDA
figures (the GPU's caching allocator: memory history and ``memory_stats()``), checked against
``baselines/cuda-<gpu>-x1/deepspeed_chat_gpu1.yaml`` (the profile ``hardware.py: profile_name`` derives from the
visible card). Without such a card every cell skips naming it; the same cells simulated on a CPU-only machine:
``test_deepspeed_chat_gpu1_sim.py`` (CPU route) and ``test_deepspeed_chat_gpu1_fakecuda.py`` (fake-CUDA route)."""

import pytest


@pytest.mark.matrix("deepspeed_chat_gpu1", "deepspeed_chat_gpu1_study")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cuda")
    assert not result.simulated and result.capture == "cuda-memory-history"
    memory_budget.check(result)
