"""ZeRO-Infinity's staging buffers, counted from the recipe side for the host meter (``record/host.py``).

DeepSpeed (``runtime/swap_tensor/``, 0.16-0.19) stages every NVMe read and write in page-locked host buffers
(``new_cpu_locked_tensor``: ``posix_memalign`` + ``mlock``) owned by two kinds of swapper:

- ``AsyncPartitionedParameterSwapper`` (one per ``zero.Init``, i.e. per engine; parameters carry it as
  ``nvme_swapper``): ``buffers``, ``buffer_count`` slots of ``buffer_size`` elements (I/O-aligned) of the
  model's dtype. A slot is in use while a parameter partition lives in it (``param_id_to_buffer_id``) or it
  is lent out (``reserved_buffer_ids``); the others (``available_buffer_ids``) are idle. With optimizer
  offload also ``partitioned_swap_buffer``, which holds all fp16 partitions while ``step`` writes them out in
  one synchronous call (``swap_out_partitioned_params``) and nothing between: counted idle.
- ``OptimizerSwapper`` (``PartitionedOptimizerSwapper`` / ``PipelinedOptimizerSwapper``, one per training
  engine): ``swap_buffer_manager.all_buffers``, ``buffer_count`` fp32 buffers of the largest partition; the
  indices in ``free_buffer_index`` are idle (the gradient swapper's buffers come from the same manager).

:func:`track` wraps both classes' ``__init__`` (once per process) to remember every swapper built
afterwards, weakly, and registers :func:`staging_now` as a host staging probe. Not counted: the async I/O
op's own bounce buffers for unpinned tensors (C++, per request) and buffers of swappers already collected.
"""

from __future__ import annotations

import weakref

from ...record.host import register_staging_probe

_SWAPPERS: weakref.WeakSet = weakref.WeakSet()


def _nbytes(t) -> int:  # noqa: ANN001 - a torch.Tensor
    return int(t.numel()) * int(t.element_size()) if t is not None else 0


def staging_now() -> tuple[int, int, int, int]:
    """(held bytes, held buffers, idle bytes, idle buffers) over the live swappers now."""
    held = n_held = idle = n_idle = 0
    for s in list(_SWAPPERS):
        if hasattr(s, "available_buffer_ids"):  # parameter swapper
            buffers = getattr(s, "buffers", None)
            count = int(getattr(s, "param_buffer_count", 0) or 0)
            if buffers is not None and count:
                slot = _nbytes(buffers) // count
                free = len(s.available_buffer_ids)
                held, n_held, idle, n_idle = held + slot * count, n_held + count, idle + slot * free, n_idle + free
            part = getattr(s, "partitioned_swap_buffer", None)
            if part is not None:
                held, n_held, idle, n_idle = held + _nbytes(part), n_held + 1, idle + _nbytes(part), n_idle + 1
        else:  # optimizer swapper
            mgr = getattr(s, "swap_buffer_manager", None)
            for i, b in enumerate(getattr(mgr, "all_buffers", None) or []):
                held, n_held = held + _nbytes(b), n_held + 1
                if i in mgr.free_buffer_index:
                    idle, n_idle = idle + _nbytes(b), n_idle + 1
    return held, n_held, idle, n_idle


def track() -> None:
    """Remember every DeepSpeed swapper built from now on and count its buffers in the host meter."""
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    for cls in (AsyncPartitionedParameterSwapper, OptimizerSwapper):
        if getattr(cls.__init__, "_rlhfmem_tracked", False):
            continue
        original = cls.__init__

        def init(self, *args, _original=original, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
            _original(self, *args, **kwargs)
            _SWAPPERS.add(self)

        init._rlhfmem_tracked = True  # type: ignore[attr-defined]
        init.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__init__ = init
    register_staging_probe(staging_now)
