"""Which phase left the blocks behind a trace's peak reserved: the allocator model's state at that moment.

The study (Zhou et al., Sec. 3.1) puts the peak in training "but mostly due to a large size of memory
fragmentation accumulated from inferences". A replay says where the peak is; this says what it is made of:
just before the cudaMalloc that sets the peak reserved, every segment's free (cached, unallocated) bytes by the
phase whose cudaMalloc made the segment, and the live bytes by the phase that allocated them. Fragmentation at
the peak (``metrics.py``: reserved minus allocated just before that cudaMalloc) is the sum of the first.

Follows ``python_engine.replay_python`` (the reference engine, stopped at the peak with ``stop_at_reserved``)
and the model's segments (``allocator.py``: ``CachingAllocatorModel.segments``, each a linked list of
``Block`` by address, as ``CUDACachingAllocator.cpp``'s segments are).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import AllocatorConfig
from .events import ALLOC, FREE, PHASE, SEGMENT_ALLOC, Trace
from .python_engine import replay_python
from .replay import allocator_config
from .replay_types import FREE_RUNNING

BEFORE_PHASES = "(before the first phase)"


@dataclass
class PeakOrigin:
    """The model's state just before the cudaMalloc that sets the peak reserved (bytes).

    ``peak_reserved`` includes that cudaMalloc's ``segment_size``; ``allocated`` is before its request.
    ``free_by_segment_phase``: free bytes of cached segments by the phase that created the segment;
    ``allocated_by_phase``: live block bytes by the phase that allocated them; ``reserved_by_phase``: segment
    bytes by creating phase (the new segment not included). ``phase``: the phase the peak falls in."""

    peak_reserved: int
    segment_size: int
    allocated: int
    phase: str | None
    free_by_segment_phase: dict[str, int] = field(default_factory=dict)
    allocated_by_phase: dict[str, int] = field(default_factory=dict)
    reserved_by_phase: dict[str, int] = field(default_factory=dict)

    @property
    def fragmentation(self) -> int:
        return self.peak_reserved - self.segment_size - self.allocated


def peak_origin(trace: Trace, peak_reserved: int, config: AllocatorConfig | None = None) -> PeakOrigin:
    """Replay ``trace`` (free-running, the model's placement) up to the first allocation that takes reserved to
    ``peak_reserved`` bytes (a replay's ``total.peak_reserved``) and break the state down by phase. Raises
    ``ValueError`` when the replay never reaches ``peak_reserved`` (a figure of another replay or setting)."""
    config = config or allocator_config(trace.allocator_settings, source=trace.source)
    res = replay_python(trace, config, FREE_RUNNING, None, False, True, "peak origin",
                        stop_at_reserved=peak_reserved)
    model = res.model
    if model.stats.reserved_bytes < peak_reserved:
        raise ValueError(f"{trace.source or 'trace'}: the replay never reserves {peak_reserved} B "
                         f"(its peak: {res.total.peak_reserved} B)")
    phase = BEFORE_PHASES
    new_segment = None  # the peak's own cudaMalloc: the last segment made
    segment_phase: dict[int, str] = {}
    block_phase: dict[int, str] = {}
    for ev in res.events or []:
        if ev.action == PHASE:
            phase = ev.name
        elif ev.action == SEGMENT_ALLOC:
            segment_phase[ev.addr] = phase
            new_segment = (ev.addr, ev.size)
        elif ev.action == ALLOC:
            block_phase[ev.addr] = phase
        elif ev.action == FREE:
            block_phase.pop(ev.addr, None)
    if new_segment is None:
        raise ValueError(f"{trace.source or 'trace'}: no cudaMalloc reached {peak_reserved} B")
    out = PeakOrigin(peak_reserved=model.stats.reserved_bytes, segment_size=new_segment[1], allocated=0,
                     phase=res.collector.current.phase if res.collector.current else None)
    for address, block in model.segments.items():
        if address == new_segment[0]:
            continue
        made = segment_phase.get(address, BEFORE_PHASES)
        while block is not None:
            if block.mapped:
                out.reserved_by_phase[made] = out.reserved_by_phase.get(made, 0) + block.size
                if block.allocated:
                    out.allocated += block.size
                    p = block_phase.get(block.address, BEFORE_PHASES)
                    out.allocated_by_phase[p] = out.allocated_by_phase.get(p, 0) + block.size
                else:
                    out.free_by_segment_phase[made] = out.free_by_segment_phase.get(made, 0) + block.size
            block = block.next
    return out
