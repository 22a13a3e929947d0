"""Replay a :class:`~.trace.Trace` through :class:`~.allocator.CachingAllocatorModel`.

Two modes:

- ``anchored``: the model's new segments take the recorded ``segment_alloc`` addresses (when the size
  agrees) and a new expandable segment takes the address of the recorded ``segment_map`` that created
  it, so ties between equal-size free blocks break as they did on the real GPU, and a recorded
  cudaMalloc failure (a ``segment_free`` batch right before the ``segment_alloc`` of the same request)
  is taken as given: the device's capacity and other processes are outside the trace.
- ``free-running``: synthetic addresses; cudaMalloc fails only past ``capacity``. This is the mode for a
  captured CPU trace and for "what if" questions (``--alloc-conf``).

Either way, a recorded ``segment_free``/``segment_unmap`` batch that no allocation needed (a user's
``torch.cuda.empty_cache()``) and every ``FLUSH`` event call ``release_cached_blocks``; POOL_ENTER /
POOL_EXIT / POOL_RELEASE markers divert allocations to a private pool as ``use_mem_pool`` does (from a
snapshot, :func:`~.trace.trace_from_snapshot` places them from the recorded addresses' segments, so
both modes keep the recorded pool membership); a recorded ``oom`` entry is replayed as the failing
request, and its free-memory figure gives the device capacity when none is given.

Two engines replay (``replay_engine.py``, ``docs/replay-engine.md``): this module with ``allocator.py``
(the reference; every mode) and the compiled core ``csrc/replay_core.cpp`` that mirrors them function by
function for replays without private pools, series or replayed events, about 25 times faster. :func:`replay` uses the
Python model unless asked (``engine="auto"``); :func:`replay_columns` (the CLI and the advisor) picks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .allocator import AllocatorConfig, Block, CachingAllocatorModel, OutOfMemoryError
from .metrics import MetricsCollector, WindowMetrics
from .trace import (
    ALLOC, FLUSH, FREE, OOM, PHASE, POOL_ENTER, POOL_EXIT, POOL_RELEASE, SEGMENT_ALLOC, SEGMENT_FREE,
    SEGMENT_MAP, SEGMENT_UNMAP, Event, Trace,
)

PYTHON = "python"
ANCHORED = "anchored"
FREE_RUNNING = "free-running"
MODES = (ANCHORED, FREE_RUNNING)

_RELEASES = (SEGMENT_FREE, SEGMENT_UNMAP)
_CREATIONS = (SEGMENT_ALLOC, SEGMENT_MAP)


if TYPE_CHECKING:
    from .replay_engine import TraceColumns


class ReplayError(ValueError):
    """A trace the model cannot replay (e.g. unbalanced pool markers); the message names the event."""


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
    model: CachingAllocatorModel | None  # None from the compiled engine
    collector: MetricsCollector | None  # None from the compiled engine
    mode: str
    unmatched_frees: int = 0
    flush_points: list[int] = field(default_factory=list)  # event indices where a flush released memory
    flushes: list[dict] = field(default_factory=list)  # each FLUSH: name, phase, bytes and segments released
    cuda_frees_outside_flushes: int = 0  # cudaFree calls made by the miss path (retries), not by a flush
    requested_at_phase_end: dict[str, int] = field(default_factory=dict)  # live tensor bytes as each phase ends
    events: list[Event] | None = None  # with record_events: the replayed trace (model addresses, segment events)
    segment_maps: list[tuple[int, int]] = field(default_factory=list)  # expandable: (address, size) mapped
    segment_unmaps: list[tuple[int, int]] = field(default_factory=list)
    capacity: int | None = None  # the device bytes the replay ran against
    capacity_source: str = "unlimited"  # "given", "inferred from the trace's oom entries" or "unlimited"
    oom_mismatches: int = 0  # recorded OOMs the model could satisfy (the block was handed back at once)
    engine: str = "python"  # "python" (allocator.py) or "compiled" (csrc/replay_core.cpp): replay_engine.py
    engine_reason: str = ""  # why that engine (replay_engine.engine_for)

    @property
    def segments(self) -> list[dict]:
        """The end state in ``_snapshot()['segments']`` form (built on demand; Python engine only)."""
        if self.model is None:
            raise ValueError("the compiled replay engine keeps no end state: replay with engine='python'")
        return self.model.snapshot_segments()


def _recorded_release_batches(events: list) -> dict[int, int | None]:
    """For each recorded ``segment_free``/``segment_unmap`` batch (by its first index): the index of the
    ALLOC (or OOM) whose cudaMalloc followed it (a candidate retry: ``release_cached_blocks`` inside
    ``malloc``), or ``None`` when no allocation followed (a user's ``empty_cache()``). Whether a
    candidate really was a retry is decided during replay: it was not if the cache could have served
    that request."""
    batches: dict[int, int | None] = {}
    i, n = 0, len(events)
    while i < n:
        if events[i].action not in _RELEASES:
            i += 1
            continue
        start = i
        while i < n and events[i].action in _RELEASES:
            i += 1
        j = i
        while j < n and events[j].action in (*_CREATIONS, POOL_ENTER):
            j += 1
        created = any(events[k].action in _CREATIONS for k in range(i, j))
        follower = j < n and (events[j].action == OOM or (created and events[j].action == ALLOC))
        batches[start] = j if follower else None
    return batches


def infer_capacity(trace: Trace) -> int | None:
    """The device bytes the allocator could have held, from the trace's ``oom`` entries: at each, the
    recorded reserved bytes plus the free bytes ``cudaMemGetInfo`` reported (the entry's ``addr``); the
    smallest over the entries. ``None`` when the trace has no OOM with a free-memory figure."""
    reserved = sum(s.total_size for s in trace.initial_segments)
    cap: int | None = None
    for e in trace.events:
        if e.action in _CREATIONS:
            reserved += e.size
        elif e.action in _RELEASES:
            reserved -= e.size
        elif e.action == OOM and e.addr > 0:
            c = reserved + e.addr
            cap = c if cap is None else min(cap, c)
    return cap


def replay(trace: Trace, config: AllocatorConfig | None = None, mode: str = FREE_RUNNING,
           capacity: int | None = None, record_series: bool = True, record_events: bool = False,
           engine: str = PYTHON) -> ReplayResult:
    """Replay ``trace``; returns a :class:`ReplayResult`.

    ``engine``: ``python`` (this module and ``allocator.py``: the reference, and the only one returning
    ``model`` and ``collector``), ``auto`` (the compiled core of ``replay_engine.py`` when it supports
    this replay: no private pools, no series or events recorded; else Python) or
    ``compiled`` (raises ``ValueError`` when unsupported). ``ReplayResult.engine`` says which ran.

    ``record_events`` keeps the replayed trace (``ReplayResult.events``): allocations at the addresses the
    model chose, with its own segment_alloc/segment_free events, ready for :func:`~.trace.write_snapshot`.

    ``config`` defaults to the trace's recorded allocator settings; ``capacity`` is the device's bytes
    (``None``: inferred from the trace's ``oom`` entries if it has any, else unlimited). Raises
    ``ValueError`` for an unknown ``mode`` and :class:`ReplayError` for a trace the model cannot follow
    (unbalanced pool markers, a pre-existing segment its live blocks do not fit). A request the model
    cannot satisfy counts as an OOM (``ooms``) and the replay goes on, as a caught ``OutOfMemoryError``
    would.
    """
    if mode not in MODES:
        raise ValueError(f"replay mode {mode!r}: allowed values are {', '.join(MODES)}")
    config = config or AllocatorConfig.from_snapshot_settings(trace.allocator_settings)
    if engine != PYTHON:
        from .replay_engine import columns_from_trace

        return replay_columns(columns_from_trace(trace), config, mode, capacity, record_series, record_events,
                              engine, trace=trace)
    return _replay_python(trace, config, mode, capacity, record_series, record_events, "requested")


def replay_columns(cols: TraceColumns, config: AllocatorConfig | None = None, mode: str = FREE_RUNNING,
                   capacity: int | None = None, record_series: bool = False, record_events: bool = False,
                   engine: str = "auto", flush_at: list[int] | tuple[int, ...] = (),
                   flush_names: list[str] | tuple[str, ...] = (), trace: Trace | None = None) -> ReplayResult:
    """:func:`replay` of a trace given as columns (``replay_engine.TraceColumns``), by the engine
    :func:`~.replay_engine.engine_for` picks. ``flush_at``/``flush_names``: FLUSH events inserted before
    those event indices (:func:`with_flushes`). ``trace``: the same trace as Events, if the caller has
    it (saves rebuilding it for the Python engine). Raises as :func:`replay` does."""
    from .replay_engine import engine_for, infer_capacity_columns, run_compiled

    if mode not in MODES:
        raise ValueError(f"replay mode {mode!r}: allowed values are {', '.join(MODES)}")
    config = config or AllocatorConfig.from_snapshot_settings(cols.allocator_settings)
    name, why = engine_for(cols, config, mode, record_series, record_events, engine)
    if name == PYTHON:
        if trace is None:
            trace = cols.to_trace()
        if flush_at:
            trace = _with_flush_events(trace, flush_at, flush_names)
        return _replay_python(trace, config, mode, capacity, record_series, record_events, why)
    capacity_source = "given" if capacity is not None else "unlimited"
    if capacity is None:
        capacity = infer_capacity_columns(cols)
        if capacity is not None:
            capacity_source = "inferred from the trace's oom entries"
    result = run_compiled(cols, config, capacity, flush_at, flush_names, mode)
    result.capacity_source = capacity_source
    result.engine_reason = why
    return result


def with_flushes(events: list[Event], positions: list[int], names: list[str]) -> list[Event]:
    """``events`` with a FLUSH inserted before each index of ``positions`` (named ``after-<name>``): the
    Python engine's form of the compiled core's ``flush_at`` (the advisor's candidate flush placements)."""
    out: list[Event] = []
    last = 0
    for pos, name in sorted(zip(positions, names)):
        out.extend(events[last:pos])
        t = events[pos - 1].time_us if pos > 0 else 0
        out.append(Event(FLUSH, time_us=t, name=f"after-{name}"))
        last = pos
    out.extend(events[last:])
    return out


def _with_flush_events(trace: Trace, positions, names) -> Trace:
    """``trace`` with a FLUSH inserted before each index of ``positions`` (:func:`with_flushes`)."""
    out = with_flushes(trace.events, positions, names)
    return Trace(events=out, initial_segments=trace.initial_segments, final_segments=trace.final_segments,
                 allocator_settings=trace.allocator_settings, capture=trace.capture, source=trace.source,
                 device=trace.device)


def _replay_python(trace: Trace, config: AllocatorConfig, mode: str, capacity: int | None, record_series: bool,
                   record_events: bool, engine_reason: str) -> ReplayResult:
    capacity_source = "given" if capacity is not None else "unlimited"
    if capacity is None:
        capacity = infer_capacity(trace)
        if capacity is not None:
            capacity_source = "inferred from the trace's oom entries"
    events = trace.events
    anchored = mode == ANCHORED
    segment_allocs: list[tuple[int, int]] = []
    segment_maps: list[tuple[int, int]] = []
    segment_unmaps: list[tuple[int, int]] = []
    free_batches: list[list[tuple[int, int]]] = []
    pending_anchor: list[tuple[int, int, bool]] = []  # recorded (addr, size, is_map) awaiting the model's
    state = {"last_was_free": False, "time_us": 0}
    out_events: list[Event] | None = [] if record_events else None
    model = CachingAllocatorModel(config, capacity=capacity)
    st = model.stats

    try:
        for seg in trace.initial_segments:
            model.import_segment(seg.address, seg.total_size, seg.stream, seg.is_small, seg.live_blocks,
                                 pool_id=seg.pool_id)
    except ValueError as exc:
        raise ReplayError(f"{trace.source or 'trace'}: a segment that existed before the trace: {exc}") from None
    collector = MetricsCollector(st.reserved_bytes, st.allocated_bytes, record_series)

    def on_segment_alloc(address: int, size: int, stream: int) -> None:
        segment_allocs.append((address, size))
        if out_events is not None:
            out_events.append(Event(SEGMENT_ALLOC, address, size, stream, state["time_us"]))
        state["last_was_free"] = False
        collector.on_cuda_malloc(size, st.reserved_bytes, st.allocated_bytes, st.inactive_split_bytes)

    def on_segment_map(address: int, size: int, stream: int) -> None:
        segment_maps.append((address, size))
        if out_events is not None:
            out_events.append(Event(SEGMENT_MAP, address, size, stream, state["time_us"]))
        collector.on_cuda_malloc(size, st.reserved_bytes, st.allocated_bytes, st.inactive_split_bytes)

    def on_segment_free(address: int, size: int, stream: int) -> None:
        if not state["last_was_free"]:
            free_batches.append([])
            state["last_was_free"] = True
        free_batches[-1].append((address, size))
        collector.on_cuda_free()
        if out_events is not None:
            out_events.append(Event(SEGMENT_FREE, address, size, stream, state["time_us"]))

    def on_segment_unmap(address: int, size: int, stream: int) -> None:
        segment_unmaps.append((address, size))
        collector.on_cuda_free()
        if out_events is not None:
            out_events.append(Event(SEGMENT_UNMAP, address, size, stream, state["time_us"]))

    def anchor(size: int | None) -> int | None:
        for k, (addr, rec_size, is_map) in enumerate(pending_anchor):
            if size is None and is_map:  # a new expandable segment begins at its first recorded map
                del pending_anchor[k]
                return addr
            if size is not None and not is_map:
                if rec_size != size:
                    return None
                del pending_anchor[k]
                return addr
        return None

    model.on_segment_alloc = on_segment_alloc
    model.on_segment_free = on_segment_free
    model.on_segment_map = on_segment_map
    model.on_segment_unmap = on_segment_unmap
    if anchored:
        model.address_for_new_segment = anchor
    release_batches = _recorded_release_batches(events)
    retry_allocs: set[int] = set()

    live: dict[int, Block] = {}  # recorded address -> model block
    unmatched_frees = 0
    oom_mismatches = 0
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
        elif action == OOM:  # the recorded request that failed: the model must fail it too
            if idx in retry_allocs:
                model.fail_next_cuda_malloc = anchored
            retries, ooms = st.num_alloc_retries, st.num_ooms
            try:
                block = malloc(ev.size, ev.stream)
                free(block)  # the program never got it
                oom_mismatches += 1
            except OutOfMemoryError:
                if out_events is not None:
                    out_events.append(Event(OOM, ev.addr, ev.size, ev.stream, ev.time_us))
            model.fail_next_cuda_malloc = False
            pending_anchor.clear()
            collector.on_retry_or_oom(st.num_alloc_retries - retries, st.num_ooms - ooms)
            state["last_was_free"] = False
            after_event(st.reserved_bytes, st.allocated_bytes, ev.time_us)
        elif action in _CREATIONS:
            pending_anchor.append((ev.addr, ev.size, action == SEGMENT_MAP))
        elif action in _RELEASES:
            if idx not in release_batches:
                continue  # inside a batch already handled
            alloc_idx = release_batches[idx]
            follower = events[alloc_idx] if alloc_idx is not None else None
            if follower is not None and (follower.action == OOM
                                         or not model.can_serve_from_cache(follower.size, follower.stream)):
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
        elif action in (POOL_ENTER, POOL_EXIT, POOL_RELEASE):
            pool_id = (ev.addr, ev.size)
            try:
                if action == POOL_ENTER:  # use_mem_pool entry: the pool object holds it, the region too
                    if pool_id not in model.graph_pools:
                        model.create_or_incref_pool(pool_id)
                    model.begin_allocate_to_pool(pool_id)
                elif action == POOL_EXIT:
                    model.end_allocate_to_pool(pool_id)
                    model.release_pool(pool_id)
                else:  # MemPool destroyed: releasePool, then emptyCache(pool id)
                    model.release_pool(pool_id)
                    model.release_cached_blocks(pool_id)
            except ValueError as exc:
                raise ReplayError(f"{trace.source or 'trace'}: event {idx} ({action}): {exc}") from None
            if out_events is not None:
                out_events.append(ev)
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
        events=out_events, segment_maps=segment_maps, segment_unmaps=segment_unmaps, capacity=capacity,
        capacity_source=capacity_source, oom_mismatches=oom_mismatches, engine=PYTHON, engine_reason=engine_reason,
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
    segment_maps: list[tuple[int, int]] = field(default_factory=list)
    segment_unmaps: list[tuple[int, int]] = field(default_factory=list)
    ooms: int = 0


def recorded_summary(trace: Trace) -> RecordedSummary:
    """Read the recorded cudaMalloc/cudaFree decisions and reserved figures off ``trace``: one
    implementation, over columns (``replay_engine.recorded_summary_columns``, what ``rlhfmem replay`` uses)."""
    from .replay_engine import columns_from_trace, recorded_summary_columns

    return recorded_summary_columns(columns_from_trace(trace))


def agreement(recorded: RecordedSummary, sim: ReplayResult, has_segment_events: bool) -> dict:
    """The fidelity figures of ``rlhfmem replay --json``; ``available`` False (with a reason) when the
    trace holds no segment events to compare against."""
    if not has_segment_events:
        return {"available": False,
                "reason": "the trace holds no segment_alloc/segment_free/segment_map events (a captured CPU trace, "
                          "or a "
                          "snapshot recorded without them): nothing recorded to compare against"}
    same_pos = sum(1 for r, s in zip(recorded.segment_allocs, sim.segment_allocs) if r[1] == s[1])
    anchored = sim.mode == ANCHORED

    def matching(rec: list[tuple[int, int]], simulated: list[tuple[int, int]]) -> int:
        # anchored: same address and size at the same position; free-running addresses are synthetic
        return sum(1 for r, s in zip(rec, simulated) if (r == s if anchored else r[1] == s[1]))

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
        "segment_maps_recorded": len(recorded.segment_maps),
        "segment_maps_simulated": len(sim.segment_maps),
        "segment_maps_matching": matching(recorded.segment_maps, sim.segment_maps),
        "segment_unmaps_recorded": len(recorded.segment_unmaps),
        "segment_unmaps_simulated": len(sim.segment_unmaps),
        "segment_unmaps_matching": matching(recorded.segment_unmaps, sim.segment_unmaps),
        "ooms_recorded": recorded.ooms,
        "ooms_simulated": sim.total.ooms,
    }


def replay_json(path: str, mode: str, config: AllocatorConfig, trace: Trace, result: ReplayResult,
                rec: RecordedSummary, agree: dict) -> dict:
    """The ``rlhfmem replay --json`` object (also timed by benchmarks/replay_throughput.py)."""
    out = {
        "snapshot": path,
        "device": trace.device,
        "mode": mode,
        "alloc_conf": config.source,
        "expandable_segments": config.expandable_segments,
        "capacity": result.capacity,
        "capacity_source": result.capacity_source,
        "capture": trace.capture,
        "engine": result.engine,
        "engine_reason": result.engine_reason,
        "recorded": {
            "segment_allocs": [s for _, s in rec.segment_allocs],
            "segment_free_batches": [[s for _, s in b] for b in rec.segment_free_batches],
            "segment_maps": [s for _, s in rec.segment_maps],
            "segment_unmaps": [s for _, s in rec.segment_unmaps],
            "peak_reserved": rec.peak_reserved,
            "final_reserved": rec.final_reserved,
            "final_allocated": rec.final_allocated,
        },
        "simulated": {
            **result.total.to_dict(),
            "peak_phase": result.peak_phase,
            "final_reserved": result.final_reserved,
            "final_allocated": result.final_allocated,
            "segment_allocs": [s for _, s in result.segment_allocs],
            "segment_free_batches": [[s for _, s in b] for b in result.segment_free_batches],
            "segment_maps": [s for _, s in result.segment_maps],
            "segment_unmaps": [s for _, s in result.segment_unmaps],
            "label": "simulated (allocator model)",
        },
        "agreement": agree,
    }
    return out
