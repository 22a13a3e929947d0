"""pytest-rlhfmem: keep RLHF (PPO) training inside its GPU memory budget.

The public recorder API (no torch import here; every call is a no-op without an active capture)::

    import pytest_rlhfmem as rlhfmem

    with rlhfmem.phase("generate"):
        ...
    rlhfmem.flush_point("after-generate")
    for step in range(steps):
        rlhfmem.iteration()                  # iteration k begins: per-iteration figures, growth budgets

See :mod:`pytest_rlhfmem.record.api`.
"""

from .record.api import (
    NULL_PHASE, active, begin_phase, deepspeed_offload, end_phase, flush_point, host_resident, iteration,
    moved_to_device, moved_to_host, phase,
)

__all__ = ["NULL_PHASE", "active", "begin_phase", "deepspeed_offload", "end_phase", "flush_point", "host_resident",
           "iteration", "moved_to_device", "moved_to_host", "phase"]
