"""The Python replay engine: a trace replayed event by event through :class:`~.allocator.CachingAllocatorModel`.

The readable reference that mirrors ``c10/cuda/CUDACachingAllocator.cpp`` (``allocator.py``) driven over a
:class:`~.events.Trace`: every mode, private pools, the per-event series and the replayed events. The
compiled core (``replay_engine.py``) mirrors it function by function; ``replay.py`` picks between them.

In ``anchored`` mode the model's new segments take the recorded addresses, and a recorded release batch
followed by a cudaMalloc (:func:`~.recorded.recorded_release_batches`) is the allocator's own retry, taken
as given when the cache could not have served that request; any other release batch, and every FLUSH
event, is a ``release_cached_blocks`` (a user's ``torch.cuda.empty_cache()``).
"""

from __future__ import annotations

from collections.abc import Callable

from .allocator import AllocatorConfig, Block, CachingAllocatorModel, OutOfMemoryError
from .columns import CODE
from .events import (
    ALLOC, CUBLAS_WORKSPACE, EXTERNAL_MAP, EXTERNAL_UNMAP, FLUSH, FREE, FREE_REQUESTED, OOM, PHASE, POOL_ENTER,
    POOL_EXIT, POOL_RELEASE, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, Event, Trace,
)
from .metrics import MetricsCollector
from .recorded import CREATIONS, RELEASES, infer_capacity, recorded_release_batches
from .replay_types import (
    ADDRESS_OUT_OF_RANGE, ADDRESS_SPACE_EXHAUSTED, ANCHORED, CAPACITY_OUT_OF_RANGE, MAX_MODEL_ADDRESS, MAX_REPLAY_BYTES,
    MAX_SEGMENT_ADDRESS, MAX_TIME_US, PYTHON, RESERVED_OUT_OF_RANGE, SIZE_OUT_OF_RANGE, TIME_OUT_OF_RANGE,
    ReplayError, ReplayResult, bound_error, check_initial_segments,
)

_SIZED = frozenset((ALLOC, OOM, SEGMENT_ALLOC, SEGMENT_MAP, EXTERNAL_MAP))  # their size is bytes the model takes
_PLACED = frozenset((SEGMENT_ALLOC, SEGMENT_MAP))  # their address is where an anchored replay puts a segment


def check_event_ranges(events: list[Event], source: str) -> None:
    """Refuse, before anything replays, an event beyond the replay's bounds (``replay_types.MAX_REPLAY_BYTES``
    ...), in the order the compiled core checks (``csrc/replay_core.cpp``, ``Model::run``): per event its size,
    then its recorded segment address, then its time. Raises :class:`~.replay_types.ReplayError` (one line: the
    event, its action, the field and the allowed range)."""
    for idx, ev in enumerate(events):
        action = ev.action
        if action in _SIZED and not 0 <= ev.size <= MAX_REPLAY_BYTES:
            raise bound_error(SIZE_OUT_OF_RANGE, source, idx, action, ev.size)
        if action in _PLACED and not 0 <= ev.addr <= MAX_SEGMENT_ADDRESS:
            raise bound_error(ADDRESS_OUT_OF_RANGE, source, idx, action, ev.addr)
        if not -MAX_TIME_US <= ev.time_us <= MAX_TIME_US:
            raise bound_error(TIME_OUT_OF_RANGE, source, idx, action if action in CODE else "other")


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


def with_flush_events(trace: Trace, positions: list[int] | tuple[int, ...], names: list[str] | tuple[str, ...]
                      ) -> Trace:
    """``trace`` with a FLUSH inserted before each index of ``positions`` (:func:`with_flushes`)."""
    out = with_flushes(trace.events, positions, names)
    return Trace(events=out, initial_segments=trace.initial_segments, final_segments=trace.final_segments,
                 allocator_settings=trace.allocator_settings, capture=trace.capture, source=trace.source,
                 device=trace.device)


def _check_model_bounds(model: CachingAllocatorModel, source: str, idx: int, action: str) -> None:
    """After an ALLOC or OOM (the only events that reserve): the model's reserved bytes and its next segment
    address within the replay's bounds, as the compiled core's ``out_of_bounds``. Raises ``ReplayError``."""
    if model.stats.reserved_bytes > MAX_REPLAY_BYTES:
        raise bound_error(RESERVED_OUT_OF_RANGE, source, idx, action, model.stats.reserved_bytes)
    if model.next_synthetic_address > MAX_MODEL_ADDRESS:
        raise bound_error(ADDRESS_SPACE_EXHAUSTED, source, idx, action)


def replay_python(trace: Trace, config: AllocatorConfig, mode: str, capacity: int | None, record_series: bool,
                  record_events: bool, engine_reason: str,
                  address_for_new_segment: Callable[[int | None], int | None] | None = None,
                  stop_at_reserved: int | None = None) -> ReplayResult:
    """Replay ``trace`` through :class:`~.allocator.CachingAllocatorModel`, event by event, in ``mode``
    (``replay.replay``'s docstring says what the modes and arguments mean); ``engine_reason`` is recorded
    in the result. Raises :class:`~.replay_types.ReplayError` for a trace the model cannot follow.

    ``address_for_new_segment``, free-running only: the device address of each new segment, i.e. the pointer
    ``cudaMallocMaybeCapturing`` hands ``alloc_block`` (the driver's choice), called with the cudaMalloc size
    in bytes (``None`` for an expandable segment's virtual base); ``None`` from it, or no hook, places the
    segment above the model's previous one. Anchored mode takes the recorded addresses instead.

    ``stop_at_reserved`` (bytes): end the replay after the first allocation that takes reserved to it or above;
    the result (``model`` included) is then the state at that moment (e.g. the peak: ``peak_origin.py``)."""
    capacity_source = "given" if capacity is not None else "unlimited"
    if capacity is None:
        capacity = infer_capacity(trace)
        if capacity is not None:
            capacity_source = "inferred from the trace's oom entries"
    source = trace.source
    if capacity is not None and not -MAX_REPLAY_BYTES <= capacity <= MAX_REPLAY_BYTES:
        raise bound_error(CAPACITY_OUT_OF_RANGE, source, value=capacity)
    check_initial_segments(source, trace.initial_segments)
    events = trace.events
    check_event_ranges(events, source)
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
    model.address_for_new_segment = anchor if anchored else address_for_new_segment
    release_batches = recorded_release_batches(events)
    retry_allocs: set[int] = set()

    live: dict[int, Block] = {}  # recorded address -> model block
    unmatched_frees = 0
    oom_mismatches = 0
    flush_points: list[int] = []
    flushes: list[dict] = []
    flush_frees = 0
    requested_at_end: dict[str, int] = {}
    external_live: dict[int, int] = {}  # EXTERNAL_MAP id -> bytes, the mappings the device backed
    external_failures: list[dict] = []
    external_peak = 0
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
            if ev.name == CUBLAS_WORKSPACE:
                model.cublas_handle_created()
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
            _check_model_bounds(model, source, idx, action)
            if stop_at_reserved is not None and st.reserved_bytes >= stop_at_reserved:
                break
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
        elif action == FREE_REQUESTED:  # record_stream: out of the stats now, back in its pool at its FREE
            block = live.get(ev.addr) or model.active_blocks.get(ev.addr)
            if block is None:
                unmatched_frees += 1
                continue
            if out_events is not None:
                out_events.append(Event(FREE_REQUESTED, block.address, block.requested_size, ev.stream, ev.time_us))
            model.request_free(block)
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
            _check_model_bounds(model, source, idx, action)
        elif action in CREATIONS:
            pending_anchor.append((ev.addr, ev.size, action == SEGMENT_MAP))
        elif action in RELEASES:
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
        elif action == EXTERNAL_MAP:  # another allocator maps memory: it fails alone, nothing is released for it
            if model.map_external(ev.size):
                external_live[ev.addr] = ev.size
                external_peak = max(external_peak, model.external_bytes)
            else:
                st.num_ooms += 1
                collector.on_retry_or_oom(0, 1)
                external_failures.append({
                    "name": ev.name, "bytes": ev.size, "phase": collector.current.phase if collector.current else None,
                    "reserved": st.reserved_bytes, "external": model.external_bytes, "capacity": capacity})
            if out_events is not None:
                out_events.append(ev)
        elif action == EXTERNAL_UNMAP:
            size = external_live.pop(ev.addr, None)
            if size is not None:  # a mapping that failed has nothing to release
                model.unmap_external(size)
            if out_events is not None:
                out_events.append(ev)
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
        external_peak=external_peak, peak_device_used=max(model.peak_device_used, st.peak_reserved_bytes),
        external_map_failures=external_failures,
    )
