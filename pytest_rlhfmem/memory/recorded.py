"""What a recorded trace says by itself, before any replay: the device capacity its OOMs imply, the
release batches that were the allocator's own retries or a user's ``empty_cache()``, and the real
allocator's cudaMalloc/cudaFree decisions (:class:`~.replay_types.RecordedSummary`).

Both engines and the advisor read these; nothing here replays. Sizes are bytes.
"""

from __future__ import annotations

import re

from .columns import CODE, TraceColumns, as_columns
from .events import (
    ALLOC, FLUSH, FREE, OOM, POOL_ENTER, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, Trace,
)
from .replay_types import RecordedSummary

RELEASES = (SEGMENT_FREE, SEGMENT_UNMAP)  # events that give memory back to the driver
CREATIONS = (SEGMENT_ALLOC, SEGMENT_MAP)  # events that take memory from it


def recorded_release_batches(events: list) -> dict[int, int | None]:
    """For each recorded ``segment_free``/``segment_unmap`` batch (by its first index): the index of the
    ALLOC (or OOM) whose cudaMalloc followed it (a candidate retry: ``release_cached_blocks`` inside
    ``malloc``), or ``None`` when no allocation followed (a user's ``empty_cache()``). Whether a
    candidate really was a retry is decided during replay: it was not if the cache could have served
    that request."""
    batches: dict[int, int | None] = {}
    i, n = 0, len(events)
    while i < n:
        if events[i].action not in RELEASES:
            i += 1
            continue
        start = i
        while i < n and events[i].action in RELEASES:
            i += 1
        j = i
        while j < n and events[j].action in (*CREATIONS, POOL_ENTER):
            j += 1
        created = any(events[k].action in CREATIONS for k in range(i, j))
        follower = j < n and (events[j].action == OOM or (created and events[j].action == ALLOC))
        batches[start] = j if follower else None
    return batches


_RECORDED = re.compile(b"[" + re.escape(bytes(CODE[a] for a in (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP,
                                                                 OOM))) + b"]")
_BATCH_BREAK = re.compile(b"[" + re.escape(bytes(CODE[a] for a in (ALLOC, FREE, FLUSH))) + b"]")
_OOM = bytes([CODE[OOM]])


def infer_capacity(trace: Trace | TraceColumns) -> int | None:
    """The device bytes the allocator could have held, from the trace's ``oom`` entries: at each, the
    recorded reserved bytes plus the free bytes ``cudaMemGetInfo`` reported (the entry's ``addr``); the
    smallest over the entries. ``None`` when the trace has no OOM with a free-memory figure.

    Visits only the segment and oom events of the columns (found by a regular expression over the action
    codes, at C speed); a :class:`~.events.Trace` without an ``oom`` event is answered without converting it."""
    if isinstance(trace, Trace) and not any(e.action == OOM for e in trace.events):
        return None
    cols = as_columns(trace)
    if _OOM not in cols.action:
        return None
    reserved = sum(s.total_size for s in cols.initial_segments)
    cap: int | None = None
    act, addr, size = cols.action, cols.addr, cols.size
    c_alloc, c_map, c_oom = CODE[SEGMENT_ALLOC], CODE[SEGMENT_MAP], CODE[OOM]
    for m in _RECORDED.finditer(act):
        i = m.start()
        a = act[i]
        if a == c_oom:
            if addr[i] > 0:
                c = reserved + addr[i]
                cap = c if cap is None else min(cap, c)
        elif a in (c_alloc, c_map):
            reserved += size[i]
        else:  # segment_free, segment_unmap
            reserved -= size[i]
    return cap


def recorded_summary(trace: Trace | TraceColumns) -> RecordedSummary:
    """Read the recorded cudaMalloc/cudaFree decisions and reserved figures off ``trace`` (a
    :class:`~.events.Trace` is converted once: :func:`~.columns.as_columns`). Visits only the segment and oom
    events (found by a regular expression over the action codes, at C speed) and asks the same expression
    language whether an alloc, free or flush lies between two segment_free events (which ends a batch)."""
    cols = as_columns(trace)
    reserved = sum(s.total_size for s in cols.initial_segments)
    initial = peak = reserved
    allocs: list[tuple[int, int]] = []
    maps: list[tuple[int, int]] = []
    unmaps: list[tuple[int, int]] = []
    batches: list[list[tuple[int, int]]] = []
    last_free, ooms, prev = False, 0, -1
    act, addr, size = cols.action, cols.addr, cols.size
    c_alloc, c_free, c_map, c_unmap = (CODE[a] for a in (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP))
    for m in _RECORDED.finditer(act):
        i = m.start()
        if last_free and _BATCH_BREAK.search(act, prev + 1, i):
            last_free = False
        prev = i
        a = act[i]
        if a == c_map:
            maps.append((addr[i], size[i]))
            reserved += size[i]
            peak = max(peak, reserved)
        elif a == c_unmap:
            unmaps.append((addr[i], size[i]))
            reserved -= size[i]
        elif a == c_alloc:
            allocs.append((addr[i], size[i]))
            reserved += size[i]
            peak = max(peak, reserved)
            last_free = False
        elif a == c_free:
            if not last_free:
                batches.append([])
                last_free = True
            batches[-1].append((addr[i], size[i]))
            reserved -= size[i]
        else:
            ooms += 1
    fs = cols.final_segments
    return RecordedSummary(
        segment_allocs=allocs, segment_free_batches=batches, peak_reserved=peak,
        final_reserved=sum(s["total_size"] for s in fs) if fs is not None else None,
        final_allocated=sum(s["allocated_size"] for s in fs) if fs is not None else None,
        initial_reserved=initial, segment_maps=maps, segment_unmaps=unmaps, ooms=ooms,
    )
