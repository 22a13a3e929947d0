"""Replay a :class:`~.trace.Trace` through :class:`~.allocator.CachingAllocatorModel`.

Two modes:

- ``anchored``: the model's new segments take the recorded ``segment_alloc`` addresses (when the size
  agrees), so ties between equal-size free blocks break as they did on the real GPU, and a recorded
  cudaMalloc failure (a ``segment_free`` batch right before the ``segment_alloc`` of the same request) is
  taken as given: the device's capacity and other processes are outside the trace.
- ``free-running``: synthetic addresses; cudaMalloc fails only past ``capacity``. This is the mode for a
  captured CPU trace and for "what if" questions (``--alloc-conf``).

Either way, a recorded ``segment_free`` batch that no allocation needed (a user's
``torch.cuda.empty_cache()``) and every ``FLUSH`` event call ``release_cached_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import AllocatorConfig, Block, CachingAllocatorModel, OutOfMemoryError
from .metrics import MetricsCollector, WindowMetrics
from .trace import ALLOC, FLUSH, FREE, OOM, PHASE, SEGMENT_ALLOC, SEGMENT_FREE, Event, Trace

ANCHORED = "anchored"
FREE_RUNNING = "free-running"
MODES = (ANCHORED, FREE_RUNNING)


@dataclass
class ReplayResult:
    """What a replay produced: metrics, the model's own cudaMalloc/cudaFree decisions, its end state."""

    total: WindowMetrics
    phases: list[WindowMetrics]
    peak_phase: str | None
    segment_allocs: list[tuple[int, int]]  # (address, size) in order
    segment_free_batches: list[list[tuple[int, int]]]
    final_reserved: int
    final_allocated: int
    final_requested: int
    model: CachingAllocatorModel
    collector: MetricsCollector
    mode: str
    unmatched_frees: int = 0
    flush_points: list[int] = field(default_factory=list)  # event indices where a flush released memory
    flushes: list[dict] = field(default_factory=list)  # each FLUSH: name, phase, bytes and segments released
    cuda_frees_outside_flushes: int = 0  # cudaFree calls made by the miss path (retries), not by a flush
    requested_at_phase_end: dict[str, int] = field(default_factory=dict)  # live tensor bytes as each phase ends
    events: list[Event] | None = None  # with record_events: the replayed trace (model addresses, segment events)

    @property
    def segments(self) -> list[dict]:
        """The end state in ``_snapshot()['segments']`` form (built on demand)."""
        return self.model.snapshot_segments()


def _recorded_release_batches(events: list) -> dict[int, int | None]:
    """For each recorded ``segment_free`` batch (by its first index): the index of the ALLOC whose
    cudaMalloc followed it (a candidate retry: ``release_cached_blocks`` inside ``malloc``), or ``None``
    when no allocation followed (a user's ``empty_cache()``). Whether a candidate really was a retry is
    decided during replay: it was not if the cache could have served that request."""
    batches: dict[int, int | None] = {}
    i, n = 0, len(events)
    while i < n:
        if events[i].action != SEGMENT_FREE:
            i += 1
            continue
        start = i
        while i < n and events[i].action == SEGMENT_FREE:
            i += 1
        j = i
        while j < n and events[j].action == SEGMENT_ALLOC:
            j += 1
        batches[start] = j if (j > i and j < n and events[j].action == ALLOC) else None
    return batches


def replay(trace: Trace, config: AllocatorConfig | None = None, mode: str = FREE_RUNNING,
           capacity: int | None = None, record_series: bool = True, record_events: bool = False) -> ReplayResult:
    """Replay ``trace``; returns a :class:`ReplayResult`.

    ``record_events`` keeps the replayed trace (``ReplayResult.events``): allocations at the addresses the
    model chose, with its own segment_alloc/segment_free events, ready for :func:`~.trace.write_snapshot`.

    ``config`` defaults to the trace's recorded allocator settings; ``capacity`` is the device's bytes
    (``None`` = unlimited). Raises ``ValueError`` for an unknown ``mode``. A request the model cannot
    satisfy counts as an OOM (``ooms``) and the replay goes on, as a caught ``OutOfMemoryError`` would.
    """
    if mode not in MODES:
        raise ValueError(f"replay mode {mode!r}: allowed values are {', '.join(MODES)}")
    config = config or AllocatorConfig.from_snapshot_settings(trace.allocator_settings)
    events = trace.events
    anchored = mode == ANCHORED
    segment_allocs: list[tuple[int, int]] = []
    free_batches: list[list[tuple[int, int]]] = []
    pending_anchor: list[tuple[int, int]] = []  # recorded (addr, size) awaiting the model's cudaMalloc
    state = {"last_was_free": False, "time_us": 0}
    out_events: list[Event] | None = [] if record_events else None
    model = CachingAllocatorModel(config, capacity=capacity)
    st = model.stats

    for seg in trace.initial_segments:
        model.import_segment(seg.address, seg.total_size, seg.stream, seg.is_small, seg.live_blocks)
    collector = MetricsCollector(st.reserved_bytes, st.allocated_bytes, record_series)

    def on_segment_alloc(address: int, size: int, stream: int) -> None:
        segment_allocs.append((address, size))
        if out_events is not None:
            out_events.append(Event(SEGMENT_ALLOC, address, size, stream, state["time_us"]))
        state["last_was_free"] = False
        collector.on_cuda_malloc(size, st.reserved_bytes, st.allocated_bytes, st.inactive_split_bytes)

    def on_segment_free(address: int, size: int, stream: int) -> None:
        if not state["last_was_free"]:
            free_batches.append([])
            state["last_was_free"] = True
        free_batches[-1].append((address, size))
        collector.on_cuda_free()
        if out_events is not None:
            out_events.append(Event(SEGMENT_FREE, address, size, stream, state["time_us"]))

    def anchor(size: int) -> int | None:
        if pending_anchor and pending_anchor[0][1] == size:
            return pending_anchor.pop(0)[0]
        return None

    model.on_segment_alloc = on_segment_alloc
    model.on_segment_free = on_segment_free
    if anchored:
        model.address_for_new_segment = anchor
    release_batches = _recorded_release_batches(events)
    retry_allocs: set[int] = set()

    live: dict[int, Block] = {}  # recorded address -> model block
    unmatched_frees = 0
    flush_points: list[int] = []
    flushes: list[dict] = []
    flush_frees = 0
    requested_at_end: dict[str, int] = {}
    malloc = model.malloc
    free = model.free
    after_event = collector.after_event
    for idx, ev in enumerate(events):
        action = ev.action
        if out_events is not None:
            state["time_us"] = ev.time_us
        if action == ALLOC:
            if idx in retry_allocs:
                model.fail_next_cuda_malloc = anchored
            retries, ooms = st.num_alloc_retries, st.num_ooms
            try:
                block = live[ev.addr] = malloc(ev.size, ev.stream)
                if out_events is not None:
                    out_events.append(Event(ALLOC, block.address, ev.size, ev.stream, ev.time_us))
            except OutOfMemoryError:
                if out_events is not None:
                    out_events.append(Event(OOM, 0, ev.size, ev.stream, ev.time_us))
            model.fail_next_cuda_malloc = False
            pending_anchor.clear()
            if st.num_alloc_retries != retries or st.num_ooms != ooms:
                collector.on_retry_or_oom(st.num_alloc_retries - retries, st.num_ooms - ooms)
            state["last_was_free"] = False
            after_event(st.reserved_bytes, st.allocated_bytes, ev.time_us)
        elif action == FREE:
            block = live.pop(ev.addr, None)
            if block is None:
                if ev.addr in model.active_blocks:  # allocated before the trace began
                    block = model.active_blocks[ev.addr]
                else:
                    unmatched_frees += 1
                    continue
            if out_events is not None:  # before free(): a merge may move the block's start address
                out_events.append(Event(FREE, block.address, block.requested_size, ev.stream, ev.time_us))
            free(block)
            state["last_was_free"] = False
            after_event(st.reserved_bytes, st.allocated_bytes, ev.time_us)
        elif action == SEGMENT_ALLOC:
            pending_anchor.append((ev.addr, ev.size))
        elif action == SEGMENT_FREE:
            if idx not in release_batches:
                continue  # inside a batch already handled
            alloc_idx = release_batches[idx]
            if alloc_idx is not None and not model.can_serve_from_cache(events[alloc_idx].size,
                                                                        events[alloc_idx].stream):
                retry_allocs.add(alloc_idx)  # the recorded cudaMalloc failed, then released and retried
            else:  # a user's torch.cuda.empty_cache()
                state["last_was_free"] = False
                model.release_cached_blocks()
                collector.on_flush(st.allocated_bytes)
                flush_points.append(idx)
        elif action == FLUSH:
            state["last_was_free"] = False
            before, frees_before, requested_before = st.reserved_bytes, st.num_device_free, st.requested_bytes
            model.release_cached_blocks()
            collector.on_flush(st.allocated_bytes)
            flush_frees += st.num_device_free - frees_before
            flushes.append({"name": ev.name, "phase": collector.current.phase if collector.current else None,
                            "released_bytes": before - st.reserved_bytes,
                            "segments_released": st.num_device_free - frees_before,
                            "requested_before": requested_before, "requested_after": st.requested_bytes})
            if st.reserved_bytes != before:
                flush_points.append(idx)
            after_event(st.reserved_bytes, st.allocated_bytes, ev.time_us)
        elif action == PHASE:
            if out_events is not None:
                out_events.append(ev)
            if collector.current is not None:
                requested_at_end[collector.current.phase] = st.requested_bytes
            collector.begin_phase(ev.name, st.reserved_bytes, st.allocated_bytes, ev.time_us)
    if collector.current is not None:
        requested_at_end[collector.current.phase] = st.requested_bytes
    return ReplayResult(
        total=collector.total, phases=collector.phases, peak_phase=collector.peak_phase,
        segment_allocs=segment_allocs, segment_free_batches=free_batches,
        final_reserved=st.reserved_bytes, final_allocated=st.allocated_bytes,
        final_requested=st.requested_bytes, model=model, collector=collector,
        mode=mode, unmatched_frees=unmatched_frees, flush_points=flush_points, flushes=flushes,
        cuda_frees_outside_flushes=st.num_device_free - flush_frees, requested_at_phase_end=requested_at_end,
        events=out_events,
    )


@dataclass
class RecordedSummary:
    """What the real allocator did, read from the trace and the final segments (bytes)."""

    segment_allocs: list[tuple[int, int]]
    segment_free_batches: list[list[tuple[int, int]]]
    peak_reserved: int
    final_reserved: int | None
    final_allocated: int | None
    initial_reserved: int


def recorded_summary(trace: Trace) -> RecordedSummary:
    """Read the recorded cudaMalloc/cudaFree decisions and reserved figures off ``trace``."""
    reserved = sum(s.total_size for s in trace.initial_segments)
    initial = peak = reserved
    allocs: list[tuple[int, int]] = []
    batches: list[list[tuple[int, int]]] = []
    last_free = False
    for e in trace.events:
        if e.action == SEGMENT_ALLOC:
            allocs.append((e.addr, e.size))
            reserved += e.size
            peak = max(peak, reserved)
            last_free = False
        elif e.action == SEGMENT_FREE:
            if not last_free:
                batches.append([])
                last_free = True
            batches[-1].append((e.addr, e.size))
            reserved -= e.size
        elif e.action in (ALLOC, FREE, FLUSH):
            last_free = False
    fs = trace.final_segments
    return RecordedSummary(
        segment_allocs=allocs, segment_free_batches=batches, peak_reserved=peak,
        final_reserved=sum(s["total_size"] for s in fs) if fs is not None else None,
        final_allocated=sum(s["allocated_size"] for s in fs) if fs is not None else None,
        initial_reserved=initial,
    )


def agreement(recorded: RecordedSummary, sim: ReplayResult, has_segment_events: bool) -> dict:
    """The fidelity figures of ``rlhfmem replay --json``; ``available`` False (with a reason) when the
    trace holds no segment events to compare against."""
    if not has_segment_events:
        return {"available": False,
                "reason": "the trace holds no segment_alloc/segment_free events (a captured CPU trace, or a "
                          "snapshot recorded without them): nothing recorded to compare against"}
    same_pos = sum(1 for r, s in zip(recorded.segment_allocs, sim.segment_allocs) if r[1] == s[1])
    anchored = sim.mode == ANCHORED

    def norm(batches: list[list[tuple[int, int]]]) -> list:
        return [b if anchored else sorted(sz for _, sz in b) for b in batches]

    return {
        "available": True,
        "segment_allocs_recorded": len(recorded.segment_allocs),
        "segment_allocs_simulated": len(sim.segment_allocs),
        "segment_allocs_matching": same_pos,
        "segment_free_batches_recorded": len(recorded.segment_free_batches),
        "segment_free_batches_simulated": len(sim.segment_free_batches),
        "segment_free_batches_equal": norm(recorded.segment_free_batches) == norm(sim.segment_free_batches),
        "final_reserved_equal": recorded.final_reserved == sim.final_reserved,
        "final_allocated_equal": recorded.final_allocated == sim.final_allocated,
        "peak_reserved_equal": recorded.peak_reserved == sim.total.peak_reserved,
    }
