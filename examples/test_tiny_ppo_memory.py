"""Gate examples/tiny_ppo.py's memory with the rlhfmem_command fixture and a YAML budget (the README's quick start).

    pytest test_tiny_ppo_memory.py --rlhfmem-update-baselines   # once: writes the budget, commit it
    pytest test_tiny_ppo_memory.py                              # from then on: fails over budget

The budget lives in baselines/<profile>/tiny_ppo_memory.yaml under the rootdir (profile ``cpu`` for simulated
figures, ``cuda-<gpu model>-x<visible GPUs>`` on a GPU), under the entry named by ``id``.

Ranks: 2 (torchrun, gloo) on a CPU runner. On a GPU runner one rank per GPU, at most 2: a one-GPU runner runs one
rank (``tiny-ppo/x1``), since a CUDA run needs a GPU per rank.
"""

import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("tiny_ppo.py")


def ranks(request, rlhfmem_session) -> int:
    """2, or the number of GPUs (at most 2) when this run measures on CUDA (``auto`` or ``cuda`` with a GPU)."""
    device = request.config.getoption("rlhfmem_device") or request.config.getini("rlhfmem_device") or "auto"
    gpus = len(rlhfmem_session.devices) if device in ("auto", "cuda") else 0
    return min(2, gpus) if gpus else 2


def test_tiny_ppo_step_fits_its_budget(request, rlhfmem_session, rlhfmem_command, memory_budget):
    n = ranks(request, rlhfmem_session)
    result = rlhfmem_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={n}", str(SCRIPT)], id=f"tiny-ppo/x{n}")
    assert [r["rank"] for r in result["ranks"]] == list(range(n))
    assert {"generate", "score", "train"} <= set(result.phases)
    assert result.metrics["alloc_retries"] == 0
    memory_budget.check(result)
