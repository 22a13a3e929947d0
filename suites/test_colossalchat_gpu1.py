"""The ColossalChat recipe on one GPU (world size 1; issue 35), tiny OPT and OPT-125m on a 16 GB card, runs in the
``colossalai`` tox environments. Every plugin of the recipe runs at world size 1 (colossalai 0.5.0):
``TorchDDPPlugin`` (none, grad-ckpt: DDP over a group of one), ``LowLevelZeroPlugin(stage=2)`` (zero2,
zero2-offload: one partition of each flat buffer, ``zero/low_level/low_level_optim.py``) and ``GeminiPlugin``
(zero3, zero3-offload, all: its chunks take the ``pg_size == 1`` path of ``zero/gemini/chunk/chunk.py:
Chunk.reduce``, no collective). Flush none and after-inference. Real CUDA figures, checked against
``baselines/cuda-<gpu>-x1/colossalchat_gpu1.yaml``; without such a card every cell skips naming it."""

import pytest


@pytest.mark.matrix("colossalchat_gpu1")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cuda")
    assert not result.simulated and result.capture == "cuda-memory-history"
    memory_budget.check(result)
