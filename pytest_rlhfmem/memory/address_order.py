"""How much a replay's peak reserved depends on where the CUDA driver maps each new segment.

The caching allocator picks, among free blocks of the best-fitting size, the one at the lowest address
(``BlockComparatorSize``: stream, size, address; ``c10/cuda/CUDACachingAllocator.cpp``). Which address a
``cudaMalloc`` returns is the driver's choice: real recordings show new segments placed both above and below
earlier ones (``../shared/snapshots``: cs336_ctx256_fwd 203 of 470 successive cudaMallocs higher, 267 lower).
The model gives every new segment a higher address than the previous one (unless a first-fit placement is given:
``driver_va.py``, which reproduces one GPU's layout), so when a program leaves several equal-size candidates, a
GPU run of the same allocation sequence can keep a different block, and end with a different set of cached
segments.

:func:`address_order_spread` replays one trace under ``orders`` seeded random placements of the new segments
(segments that existed before the trace keep their recorded addresses) and reports the peak reserved of each:
the spread a budget on a simulated peak reserved has to allow for, whatever the program does. Peak allocated
never depends on addresses. Measured on the CS336 medium training step captured with ``rlhfmem capture
--device cuda-sim`` (the whole run, five warm-up steps included; the recorded step's allocations are the GPU's
event for event): the model's order gives 9,223,274,496 B, the GPU recorded 9,265,217,536 B, and 30 random
orders gave 9,181,331,456 (4), 9,223,274,496 (12), 9,227,468,800 (2), 9,265,217,536 (11) and 9,302,966,272 (1).

Each replay is :func:`~.python_engine.replay_python`'s, free-running (the model's order gives the peak
reserved of ``rlhfmem replay --free-running``), with a placement hook for the new segments
(``address_for_new_segment``). It is given only traces of allocations, frees and ``empty_cache`` points (what
captures hold; in a recorded snapshot, a ``segment_free`` batch that was not a retry's): a trace with private
pools, expandable segments or recorded OOMs is refused with a :class:`ValueError` naming what it holds.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

from .allocator import AllocatorConfig
from .events import ALLOC, FLUSH, FREE, FREE_REQUESTED, PHASE, PHASE_END, SEGMENT_ACTIONS, Trace
from .python_engine import replay_python
from .replay import allocator_config
from .replay_types import FREE_RUNNING

SUPPORTED = (ALLOC, FREE, FREE_REQUESTED, FLUSH, PHASE, PHASE_END, *SEGMENT_ACTIONS)


def random_placement(rng: random.Random) -> Callable[[int | None], int | None]:
    """A ``replay_python`` ``address_for_new_segment`` hook placing each new segment at a random address from
    ``rng``: 32 random high bits order the segments, a count in the bits below keeps every address distinct.
    ``None`` (the model's own placement) for an expandable segment."""
    count = 0

    def address(size: int | None) -> int | None:
        nonlocal count
        count += 1
        return None if size is None else (rng.getrandbits(32) << 64) + (count << 48)

    return address


def _peaks(trace: Trace, config: AllocatorConfig, placement: Callable[[int | None], int | None] | None
           ) -> tuple[int, int]:
    """(peak reserved, peak allocated) bytes of ``trace`` replayed free-running, new segments placed by
    ``placement`` (None: the model's own rule, each above the previous one)."""
    total = replay_python(trace, config, FREE_RUNNING, None, False, False, "address orders",
                          address_for_new_segment=placement).total
    return total.peak_reserved, total.peak_allocated


def address_order_spread(trace: Trace, orders: int = 16, seed: int = 0,
                         config: AllocatorConfig | None = None) -> dict:
    """Peak reserved of ``trace`` under the model's segment placement and under ``orders`` random ones.

    Returns ``{"orders", "seed", "model_order": {"peak_reserved", "peak_allocated"}, "peak_reserved":
    {"min", "max", "counts": {bytes: number of orders}}, "model_order_share": fraction of the random orders
    giving the model order's figure}``; bytes throughout. The same ``seed`` gives the same figures.
    ``config`` defaults to the trace's recorded allocator settings. Raises ``ValueError`` for ``orders`` < 1,
    for expandable segments (their addresses are reserved once, so placement is not the question) and for a
    trace holding events this replay does not follow (private pools, OOM entries), naming them.
    """
    if orders < 1:
        raise ValueError(f"address orders: {orders}; allowed values are 1 or more")
    config = config or allocator_config(trace.allocator_settings, source=trace.source)
    if config.expandable_segments:
        raise ValueError(f"{trace.source or 'trace'}: expandable segments: a segment's place is reserved once, "
                         "so the address order of cudaMalloc does not apply")
    other = sorted({ev.action for ev in trace.events} - set(SUPPORTED))
    if other:
        raise ValueError(f"{trace.source or 'trace'}: holds {', '.join(other)} events; the address-order "
                         f"replay follows only {', '.join(SUPPORTED)}")
    model_reserved, model_allocated = _peaks(trace, config, None)
    rng = random.Random(seed)
    counts = Counter(_peaks(trace, config, random_placement(rng))[0] for _ in range(orders))
    return {"orders": orders, "seed": seed,
            "model_order": {"peak_reserved": model_reserved, "peak_allocated": model_allocated},
            "peak_reserved": {"min": min(counts), "max": max(counts), "counts": dict(sorted(counts.items()))},
            "model_order_share": counts.get(model_reserved, 0) / orders}
