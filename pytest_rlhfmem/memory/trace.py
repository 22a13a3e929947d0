"""The snapshot pickle format: ``torch.cuda.memory._dump_snapshot()`` files read into a
:class:`~.events.Trace` (or its columns) and written back.

A Trace comes from a ``torch.cuda.memory._dump_snapshot()`` pickle (a real GPU run; see
:func:`trace_from_snapshot`, or :func:`columns_from_snapshot` for the columns the compiled replay core
reads) or from the CPU capture of ``record/recorder.py`` (a simulated run), and it can be written back as a
snapshot pickle that ``torch.cuda._memory_viz`` and pytorch.org/memory_viz read (:func:`write_snapshot`).

Snapshot format followed: ``torch/cuda/memory.py`` (``_snapshot``), ``torch/cuda/_memory_viz.py`` and
``TraceEntry`` in ``c10/cuda/CUDACachingAllocator.h``. Sizes are bytes. The trace's types live in
``events.py``; this module re-exports them, as callers have always imported them from here.
"""

from __future__ import annotations

import bisect
import functools
import gc
import io
import operator
import os
import pickle
from array import array
from collections.abc import Iterable
from itertools import compress
from pathlib import Path
from typing import Any

from ..units import read_file_bounded
from .allocator import (
    DEFAULT_POOL, SEGMENT_PLACEMENT_KEY, AllocatorConfig, AllocatorConfigError, CachingAllocatorModel, kSmallBuffer,
    kSmallSize,
)
from .columns import (
    ACTIONS, CODE, RecordedSettings, TraceColumns, columns_from_trace, drop_immediate_request_events,
    drop_immediate_requests,
)
from .events import (
    ALLOC, CAPTURE_CPU_SIMULATED, CAPTURE_CUDA, CAPTURE_FAKE_CUDA_SIMULATED, CAPTURE_SIM_CUDA_SIMULATED,
    CAPTURE_SYNTHETIC, FLUSH, FREE, FREE_REQUESTED, OOM,
    PHASE, PHASE_END, POOL_ENTER, POOL_EXIT, POOL_RELEASE, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP,
    SIMULATED_CAPTURES, Event, SegmentState, Trace,
)
from .snapshot_reader import PYTHON_READER, ReaderUnavailable, SnapshotEntries, parse_snapshot

__all__ = [  # the snapshot format's own names, and the trace's types callers import from here
    "ALLOC", "CAPTURE_CPU_SIMULATED", "CAPTURE_CUDA", "CAPTURE_FAKE_CUDA_SIMULATED", "CAPTURE_SIM_CUDA_SIMULATED",
    "CAPTURE_SYNTHETIC", "FLUSH", "FREE", "FREE_REQUESTED",
    "OOM", "PHASE", "PHASE_END", "POOL_ENTER", "POOL_EXIT", "POOL_RELEASE", "SEGMENT_ALLOC", "SEGMENT_FREE",
    "SEGMENT_MAP", "SEGMENT_UNMAP", "SIMULATED_CAPTURES", "Event", "SegmentState", "SnapshotError", "Trace",
    "columns_from_snapshot", "load_snapshot", "load_snapshot_columnar", "snapshot_columns_for_replay",
    "trace_from_snapshot", "write_snapshot",
]


class SnapshotError(ValueError):
    """A file that is not a readable memory snapshot; the message names the file and the reason."""


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Snapshots are plain builtins: any global is refused before it is imported, so no code runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"names the global {module}.{name}")


def load_snapshot(path: str | Path) -> dict:
    """Read a ``_dump_snapshot`` pickle safely.

    Returns the snapshot dict (``segments``, ``device_traces``, optional ``allocator_settings``).
    Raises :class:`SnapshotError` for a missing or truncated file, a pickle naming any global (refused,
    nothing executed), or a pickle that is not a snapshot.
    """
    p = Path(path)
    return _unpickle_snapshot(p, _read_snapshot_bytes(p))


MAX_SNAPSHOT_BYTES = 8 * 2**30  # a snapshot pickle is read only when a regular file of at most this (1M events: 75 MB)


def _read_snapshot_bytes(p: Path) -> bytes:
    """The pickle's bytes: a regular file of at most :data:`MAX_SNAPSHOT_BYTES`, refused before it is read otherwise
    (``rlhfmem replay /dev/zero`` would read for ever). Raises :class:`SnapshotError`."""
    try:
        return read_file_bounded(p, MAX_SNAPSHOT_BYTES, "memory snapshot")
    except ValueError as exc:
        raise SnapshotError(str(exc)) from None
    except OSError as exc:
        raise SnapshotError(f"{p}: cannot read: {exc.strerror or exc}") from None


def _unpickle_snapshot(p: Path, data: bytes, check: bool = True) -> Any:
    """load_snapshot's unpickling of ``data`` (the file ``p``), its messages and (``check``) its test."""
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a million dicts: the cyclic GC would scan them again and again (3x the unpickling time)
    try:
        snap = _NoGlobalsUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        msg = str(exc)
        if msg.startswith("names the global"):
            raise SnapshotError(f"{p}: refused: the pickle {msg}; memory snapshots hold only builtins, "
                                "so nothing was loaded or run") from None
        if "truncated" in msg:
            raise SnapshotError(f"{p}: truncated or corrupt pickle ({msg})") from None
        raise SnapshotError(f"{p}: not a valid pickle ({msg})") from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError, OverflowError) as exc:
        raise SnapshotError(f"{p}: truncated or corrupt pickle ({type(exc).__name__}: {exc})") from None
    finally:
        if gc_was_enabled:
            gc.enable()
    if check:
        _check_snapshot(p, snap)
    return snap


def _check_snapshot(p: Path, snap: Any) -> None:
    if not isinstance(snap, dict) or "segments" not in snap or not isinstance(snap.get("segments"), list):
        kind = type(snap).__name__
        raise SnapshotError(f"{p}: not a torch.cuda.memory._snapshot() pickle (a {kind} without a "
                            "'segments' list)")


def load_snapshot_columnar(path: str | Path) -> tuple[dict, str]:
    """:func:`load_snapshot` for the columnar path: ``(snapshot, reader)``, the pickle read by the compiled
    reader (``csrc/snapshot_reader.cpp``, via ``snapshot_reader.py``) when it builds here.

    The snapshot is load_snapshot's dict except that each device trace the compiled reader read is a
    :class:`~.snapshot_reader.SnapshotEntries` (its kept entries as columns; iterating it yields them as
    dicts, so :func:`trace_from_snapshot` reads it as the list) instead of a list of entry dicts: for
    :func:`columns_from_snapshot` and :func:`trace_from_snapshot`, not for callers reading other entries.
    ``reader``: ``"compiled"``, or ``"python (<why>)"`` when Python's Unpickler read the file (no compiler,
    or a stream the compiled reader declines: truncated, damaged, unusual; Python then gives today's
    message; or ``RLHFMEM_SNAPSHOT_READER=python`` in the environment). A pickle naming a global (or using
    REDUCE, BUILD, ...) is refused by the compiled reader itself, with load_snapshot's message. Raises
    :class:`SnapshotError`.
    """
    p = Path(path)
    if os.environ.get("RLHFMEM_SNAPSHOT_READER") == PYTHON_READER:  # the benchmark's "before"
        return load_snapshot(p), "python (requested: RLHFMEM_SNAPSHOT_READER=python)"
    data = _read_snapshot_bytes(p)
    try:
        parsed = parse_snapshot(data, _KEPT)
    except ReaderUnavailable as exc:
        return _unpickle_snapshot(p, data), f"python (compiled reader unavailable: {exc})"
    if parsed.status == "refused":
        raise SnapshotError(f"{p}: refused: the pickle {parsed.message}; memory snapshots hold only builtins, "
                            "so nothing was loaded or run")
    if parsed.status != "ok":
        return _unpickle_snapshot(p, data), f"python (the compiled reader declined: {parsed.message})"
    del data
    try:
        snap = _unpickle_snapshot(p, parsed.rest, check=False)
    except SnapshotError:  # cannot happen (builtins only); read the file as before
        return load_snapshot(p), "python (the compiled reader's output did not load)"
    if parsed.devices and isinstance(snap, dict) and isinstance(snap.get("device_traces"), list):
        traces = snap["device_traces"]
        for i, entries in enumerate(parsed.devices):
            if entries is not None and i < len(traces):
                traces[i] = entries
    _check_snapshot(p, snap)
    return snap, "compiled"


def snapshot_columns_for_replay(path: str, device: int | None = None) -> tuple[TraceColumns, RecordedSettings]:
    """``rlhfmem replay FILE.pickle``'s input, read through :func:`load_snapshot_columnar` (the compiled snapshot
    reader when it builds here): ``(columns, recorded settings)``, the settings as the file holds them
    (``reader`` as :func:`load_snapshot_columnar` says it). ``device``: as :func:`trace_from_snapshot`. Blocks that
    existed before the trace are sized with the recording's own settings, as they were allocated; the replay's
    :class:`~.allocator.AllocatorConfig` is :func:`~.replay.allocator_config`'s. Raises :class:`SnapshotError`."""
    snap, reader = load_snapshot_columnar(path)
    settings = snap.get("allocator_settings")
    cols = columns_from_snapshot(snap, device, _recording_config(settings, path), path)
    return cols, RecordedSettings(settings, path, reader)


def _recording_config(settings: Any, source: str) -> AllocatorConfig:
    """The recording's own allocator settings, for sizing the blocks that existed before the trace (decoding, not
    replaying). Raises :class:`SnapshotError` (``<source>: allocator_settings: ...``) for settings PyTorch could not
    have written."""
    try:
        return AllocatorConfig.from_snapshot_settings(settings)
    except (AllocatorConfigError, AttributeError, TypeError) as exc:
        raise SnapshotError(f"{source}: allocator_settings: {exc}") from None


def _pick_device(snap: dict, device: int | None, source: str) -> int:
    traces = snap.get("device_traces") or []
    if not isinstance(traces, list):
        raise SnapshotError(f"{source}: 'device_traces' is a {type(traces).__name__}, not a list per device")
    if device is not None:
        with_events = [i for i, t in enumerate(traces) if t]
        if device < 0 or (traces and device >= len(traces)):
            raise SnapshotError(f"{source}: device {device} not in snapshot (it has {len(traces)} device traces; "
                                f"devices with events: {with_events})")
        if traces and not traces[device] and not any(s.get("device", 0) == device for s in snap["segments"]):
            raise SnapshotError(f"{source}: device {device} has no trace events and no segments, nothing to "
                                f"replay (devices with events: {with_events})")
        return device
    if traces:
        return max(range(len(traces)), key=lambda i: len(traces[i] or []))
    devs = [s.get("device", 0) for s in snap["segments"]]
    return max(set(devs), key=devs.count) if devs else 0


# The snapshot entries a trace keeps and their actions (snapshot entries, user annotations, ... skipped;
# free_requested kept, then dropped where its free_completed follows at once: columns.drop_immediate_requests).
_KEPT = {"alloc": ALLOC, "free_completed": FREE, "free": FREE, "free_requested": FREE_REQUESTED,
         SEGMENT_ALLOC: SEGMENT_ALLOC, SEGMENT_FREE: SEGMENT_FREE, SEGMENT_MAP: SEGMENT_MAP,
         SEGMENT_UNMAP: SEGMENT_UNMAP, OOM: OOM}


def trace_from_snapshot(snap: dict, device: int | None = None, config: AllocatorConfig | None = None,
                        source: str = "") -> Trace:
    """Turn a snapshot dict into a :class:`Trace` for one device (default: the one with most events).

    Handles every format PyTorch 1.13 to 2.9 writes: ``free_completed`` (or the old single ``free``) is
    the moment of free, ``free_requested`` and ``snapshot`` entries are skipped, missing
    ``stream``/``time_us`` default to 0, blocks without ``address`` (older files) get the segment's
    address plus the sizes of the blocks before them, ``segment_map``/``segment_unmap`` (expandable
    segments) and ``oom`` (the device's free bytes, PyTorch's ``device_free``, become its ``addr``) are
    kept. Segments that existed before the trace began are rebuilt from the final ``segments`` plus blocks
    freed in the trace that were never allocated in it (their block size is the rounded request, extended
    over a gap the allocator could not have left free). Allocations that landed in a private pool's segment
    (``segment_pool_id`` other than (0, 0)) are bracketed by POOL_ENTER/POOL_EXIT markers.
    ``config`` gives the rounding (default: the snapshot's own ``allocator_settings``).

    Raises :class:`SnapshotError` (one line naming ``source`` and the reason) for a device not in the
    file, malformed entries, or a trace that contradicts the final segments.
    """
    src = source or "snapshot"
    try:
        return _trace_from_snapshot(snap, device, config, src)
    except SnapshotError:
        raise
    except AllocatorConfigError as exc:
        raise SnapshotError(f"{src}: allocator_settings: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise SnapshotError(f"{src}: malformed snapshot entry ({type(exc).__name__}: {exc})") from None


def _int(v: object) -> int:
    return int(v or 0)  # type: ignore[call-overload]


def _normalize_segment(seg: dict, src: str) -> dict:
    """A segment dict in today's form: every block has ``address`` and ``state``, the pool id is a tuple."""
    out = dict(seg)
    address, total = _int(seg["address"]), _int(seg["total_size"])
    out["address"], out["total_size"] = address, total
    pid = seg.get("segment_pool_id") or (0, 0)
    out["segment_pool_id"] = (int(pid[0]), int(pid[1]))
    out["stream"] = _int(seg.get("stream"))
    blocks, cursor = [], address
    for b in seg.get("blocks") or []:
        nb = dict(b)
        nb["size"] = _int(b["size"])
        if "address" not in b:  # pre-2.1 files: blocks lie back to back from the segment's address
            nb["address"] = cursor
        if "state" not in b:
            nb["state"] = "active_allocated" if b.get("allocated") else "inactive"
        cursor = nb["address"] + nb["size"]
        blocks.append(nb)
    if blocks and sum(b["size"] for b in blocks) != total:
        raise SnapshotError(f"{src}: segment 0x{address:x}: its blocks add up to {sum(b['size'] for b in blocks)} "
                            f"bytes, not its total_size {total}")
    out["blocks"] = blocks
    if "allocated_size" not in seg:
        out["allocated_size"] = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return out


_INT64_MAX = 2**63 - 1


def _bad_number(raw: Any, src: str, dev: int) -> str:
    """The one line for the first kept entry of ``raw`` whose addr/size/stream/time_us (oom: device_free) is not
    an integer in 0..2**63-1 (the range of the int64 columns; PyTorch writes them from ``size_t``/``int64_t``)."""
    for i, e in enumerate(raw):
        act = _KEPT.get(e.get("action"))
        if act is None:
            continue
        keys = ("device_free" if act == OOM and "device_free" in e else "addr", "size", "stream", "time_us")
        for k in keys:
            v = e.get(k) or 0
            if type(v) is not int or not 0 <= v <= _INT64_MAX:
                what = "out of range (0 to 2**63-1)" if type(v) is int else "not an integer"
                return (f"{src}: malformed snapshot entry: device {dev} trace entry {i} ({e.get('action')}): "
                        f"{k} {v!r} is {what}")
    return f"{src}: malformed snapshot entry: device {dev}: a number that is not an integer in 0..2**63-1"


def _refuse_duplicate_live(action: bytes, addr: Any, size: Any, src: str, dev: int) -> None:
    """Raise :class:`SnapshotError` (one line naming the file and the entry) where the trace allocates an address
    that is live: a block (``alloc``) whose earlier ``alloc`` at that address was not freed (``free_completed``)
    since, or a ``segment_alloc`` whose segment was not ``segment_free``'d since. PyTorch's caching allocator
    (c10/cuda/CUDACachingAllocator.cpp) never hands out a live block or cudaMallocs a live address; replaying
    such a trace would count one block or segment twice, silently. ``action``/``addr``/``size``: the kept
    columns after :func:`~.columns.drop_immediate_requests` (entries are counted in that order)."""
    a_alloc, a_free, a_seg, a_segfree = CODE[ALLOC], CODE[FREE], CODE[SEGMENT_ALLOC], CODE[SEGMENT_FREE]
    if action.find(bytes([a_alloc])) < 0 and action.find(bytes([a_seg])) < 0:
        return
    live: dict[int, int] = {}
    segs: dict[int, int] = {}
    for i, (c, a) in enumerate(zip(action, addr)):
        if c == a_alloc:
            if a in live:
                raise SnapshotError(_duplicate(src, dev, "alloc", i, a, size[i], live[a], "block", "free_completed"))
            live[a] = i
        elif c == a_free:
            live.pop(a, None)
        elif c == a_seg:
            if a in segs:
                raise SnapshotError(_duplicate(src, dev, "segment_alloc", i, a, size[i], segs[a], "segment",
                                               "segment_free"))
            segs[a] = i
        elif c == a_segfree:
            segs.pop(a, None)


def _duplicate(src: str, dev: int, what: str, i: int, a: int, n: int, first: int, kind: str, free: str) -> str:
    return (f"{src}: malformed snapshot: device {dev} {what} #{i} of the kept entries (address 0x{a:x}, {n} bytes): "
            f"the {kind} at that address is live, allocated by kept entry #{first} with no {free} between; "
            f"the caching allocator never hands out a live address twice")


def _trace_from_snapshot(snap: dict, device: int | None, config: AllocatorConfig | None, src: str) -> Trace:
    dev = _pick_device(snap, device, src)
    config = config or AllocatorConfig.from_snapshot_settings(snap.get("allocator_settings"))
    traces = snap.get("device_traces") or []
    raw = (traces[dev] if dev < len(traces) else None) or []
    # Plain "free" is the one free entry of 1.13-era files; later files write free_requested and
    # free_completed (a request is kept only where its completion does not follow at once: record_stream).
    # snapshot entries and user annotations map to None and are skipped.
    events: list[Event] = []
    append, get_act = events.append, _KEPT.get
    make = functools.partial(tuple.__new__, Event)  # Event(...) without the Python-level __new__
    for e in raw:
        act = get_act(e["action"])
        if act is not None:
            g = e.get
            # an oom entry carries the device's free bytes under "device_free" and no "addr"
            # (torch/csrc/cuda/memory_snapshot.cpp: TraceEntry::OOM writes device_free_s instead of addr_s)
            addr = (g("device_free") if act == OOM and "device_free" in e else g("addr")) or 0
            append(make((act, addr, g("size") or 0, g("stream") or 0, g("time_us") or 0, "")))
    try:  # every number must be an int64 >= 0, as the columns hold it (array raises TypeError/OverflowError)
        if any(min(array("q", map(operator.itemgetter(column), events)), default=0) < 0 for column in range(1, 5)):
            raise OverflowError
    except (TypeError, OverflowError):
        raise SnapshotError(_bad_number(raw, src, dev)) from None
    events = drop_immediate_request_events(events)
    _refuse_duplicate_live(bytes(CODE[e.action] for e in events), [e.addr for e in events],
                           [e.size for e in events], src, dev)
    segments = [_normalize_segment(s, src) for s in snap["segments"] if s.get("device", dev) == dev]
    initial = _rebuild_initial_segments(events, segments, config, src)
    events = _with_pool_markers(events, segments, initial)
    return Trace(events=events, initial_segments=initial, final_segments=segments,
                 allocator_settings=snap.get("allocator_settings"), capture=CAPTURE_CUDA, source=src, device=dev)


def _with_pool_markers(events: list[Event], final_segments: list[dict], initial: list[SegmentState]) -> list[Event]:
    """Bracket the allocations that went to a private pool with POOL_ENTER/POOL_EXIT.

    An allocation's pool is that of the segment holding its recorded address at that moment: a segment
    that outlives the trace has its final ``segment_pool_id``; one cudaFree'd within the trace belonged
    to the default pools (a held private pool never returns segments); pages of an expandable segment
    take the pool of the final mapped range holding them. The region is as tight as the evidence: it
    opens just before the cudaMalloc/map that the first allocation triggered and closes right after the
    last allocation.
    """
    final_pool = {s["address"]: s["segment_pool_id"] for s in final_segments}
    if all(p == DEFAULT_POOL for p in final_pool.values()):
        return events
    survives: dict[int, bool] = {}
    freed_later: set[int] = set()
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e.action == SEGMENT_FREE:
            freed_later.add(e.addr)
        elif e.action == SEGMENT_ALLOC:
            survives[i] = e.addr not in freed_later
            freed_later.discard(e.addr)
    expandable = sorted((s["address"], s["total_size"], s["segment_pool_id"]) for s in final_segments
                        if s.get("is_expandable"))
    es_starts = [x[0] for x in expandable]
    live: dict[int, tuple[int, tuple[int, int]]] = {s.address: (s.total_size, s.pool_id) for s in initial}
    starts = sorted(live)
    alloc_pool: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(events):
        if e.action == SEGMENT_ALLOC:
            live[e.addr] = (e.size, final_pool.get(e.addr, DEFAULT_POOL) if survives[i] else DEFAULT_POOL)
            bisect.insort(starts, e.addr)
        elif e.action == SEGMENT_FREE and e.addr in live:
            del live[e.addr]
            starts.remove(e.addr)
        elif e.action == ALLOC:
            pid = DEFAULT_POOL
            j = bisect.bisect_right(starts, e.addr) - 1
            if j >= 0 and e.addr < starts[j] + live[starts[j]][0]:
                pid = live[starts[j]][1]
            else:
                j = bisect.bisect_right(es_starts, e.addr) - 1
                if j >= 0 and e.addr < expandable[j][0] + expandable[j][1]:
                    pid = expandable[j][2]
            alloc_pool[i] = pid
    if all(p == DEFAULT_POOL for p in alloc_pool.values()):
        return events
    out: list[Event] = []
    cur, last_alloc = DEFAULT_POOL, -1
    for i, e in enumerate(events):
        if e.action == ALLOC:
            p = alloc_pool[i]
            if p != cur:
                if cur != DEFAULT_POOL:
                    out.insert(last_alloc + 1, Event(POOL_EXIT, cur[0], cur[1], 0, out[last_alloc].time_us))
                if p != DEFAULT_POOL:
                    k = len(out)
                    while k > 0 and out[k - 1].action in (SEGMENT_ALLOC, SEGMENT_MAP):
                        k -= 1
                    out.insert(k, Event(POOL_ENTER, p[0], p[1], 0, e.time_us))
                cur = p
            out.append(e)
            last_alloc = len(out) - 1
        else:
            out.append(e)
    if cur != DEFAULT_POOL:
        out.insert(last_alloc + 1, Event(POOL_EXIT, cur[0], cur[1], 0, out[last_alloc].time_us))
    return out


def _rebuild_initial_segments(events: list[Event], final_segments: list[dict], config: AllocatorConfig,
                              source: str, rows: Iterable[tuple[str, int, int, int]] | None = None
                              ) -> list[SegmentState]:
    """The segments that existed before ``events`` began. ``rows``: the events as (action, addr, size,
    stream) tuples instead (the columnar loader's; ``events`` is then unused)."""
    live: set[int] = set()
    pre_live: dict[int, tuple[int, int]] = {}  # addr -> (requested size, stream): freed, never allocated
    created: set[int] = set()
    pre_segments: dict[int, tuple[int, int, bool]] = {}  # addr -> (size, stream, is_small)
    mapped_in_trace = 0
    n_rows = 0
    if rows is None:
        rows = ((e.action, e.addr, e.size, e.stream) for e in events)
    starts_seen: list[tuple[int, int]] = []  # (address, event index) of every allocation: proven block starts
    freed_at: dict[int, int] = {}  # a pre-trace block -> the index of the free that ended it
    for action, addr, size, stream in rows:
        n_rows += 1
        if action == ALLOC:
            live.add(addr)
            starts_seen.append((addr, n_rows))
        elif action == FREE:
            if addr in live:
                live.discard(addr)
            else:
                pre_live[addr] = (size, stream)
                freed_at.setdefault(addr, n_rows)
        elif action == SEGMENT_ALLOC:
            created.add(addr)
        elif action == SEGMENT_FREE:
            if addr in created:
                created.discard(addr)
            else:
                pre_segments[addr] = (size, stream, size == kSmallBuffer)
        elif action == SEGMENT_MAP:
            mapped_in_trace += size
        elif action == SEGMENT_UNMAP:
            mapped_in_trace -= size
    expandable_at_end = sum(s["total_size"] for s in final_segments if s.get("is_expandable"))
    if expandable_at_end and not n_rows:
        # Nothing was recorded (empty device trace): there is no mapping decision to replay, only the state at the
        # end. Its expandable segments' mapped pages enter as plain segments of their mapped size, so the replay
        # reports that state and says agreement is unavailable, as for the default allocator.
        final_segments = [{**s, "is_expandable": False} for s in final_segments]
        expandable_at_end = 0
    if expandable_at_end != mapped_in_trace:
        raise SnapshotError(
            f"{source}: expandable segments hold {expandable_at_end} bytes at the end but the trace maps "
            f"{mapped_in_trace}: pages mapped before the trace began cannot be rebuilt (record the history "
            "from the start, or with a larger max_entries)")
    exact: dict[int, tuple[int, int]] = {}  # addr -> (block size, requested): live from start to end
    pool_of: dict[int, tuple[int, int]] = {}
    for s in final_segments:
        if s.get("is_expandable"):
            continue
        if s["address"] not in created:
            pre_segments[s["address"]] = (s["total_size"], s["stream"], s.get("segment_type") == "small")
            pool_of[s["address"]] = s["segment_pool_id"]
        for b in s.get("blocks", []):
            if b.get("state", "").startswith("active") and b["address"] not in live:
                exact[b["address"]] = (b["size"], b.get("requested_size", b["size"]))
    if not pre_segments:
        if pre_live:
            raise SnapshotError(f"{source}: {len(pre_live)} blocks freed before being allocated, "
                                "but no segment existed before the trace")
        return []
    starts = sorted(pre_segments)
    by_segment: dict[int, list[tuple[int, int | None, int]]] = {a: [] for a in starts}

    def owner(addr: int) -> int | None:
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr >= starts[i] + pre_segments[starts[i]][0]:
            return None
        return starts[i]

    for addr, (req, _stream) in pre_live.items():
        seg = owner(addr)
        if seg is None:
            raise SnapshotError(f"{source}: block 0x{addr:x} was live before the trace but lies in no segment "
                                "that existed then")
        by_segment[seg].append((addr, None, req))
    for addr, (size, req) in exact.items():
        seg = owner(addr)
        if seg is not None:  # else: allocated in the trace in a segment created in the trace
            by_segment[seg].append((addr, size, req))

    starts_seen.sort()

    def proven_end(addr: int, limit: int) -> int:
        """The lowest block start above ``addr`` (below ``limit``) that an allocation proved while the block at
        ``addr`` was still allocated: that block cannot reach past it."""
        k = bisect.bisect_right(starts_seen, (addr, n_rows + 1))
        while k < len(starts_seen) and starts_seen[k][0] < limit:
            if starts_seen[k][1] < freed_at.get(addr, n_rows + 1):
                return starts_seen[k][0]
            k += 1
        return limit

    model = CachingAllocatorModel(config)
    out = []
    for seg_addr in starts:
        size, stream, is_small = pre_segments[seg_addr]
        blocks = sorted(by_segment[seg_addr])
        resolved = []
        for i, (addr, bsize, req) in enumerate(blocks):
            if bsize is None:
                bsize = model.round_size(req)
                # the next block start known: the next pre-trace block, or an allocation made in the trace
                # while this block was allocated (CUDACachingAllocator.cpp never leaves a free large-pool block
                # of <= kSmallSize: such a remainder belongs to the block before it)
                boundary = proven_end(addr, blocks[i + 1][0] if i + 1 < len(blocks) else seg_addr + size)
                gap = boundary - (addr + bsize)
                # A large-pool block is not split when the remainder is <= 1 MiB (or, for a request
                # >= max_split_size, below max_non_split_rounding): the block then owns that gap.
                if not is_small and 0 < gap and (
                    gap <= kSmallSize
                    or (req >= config.max_split_size and gap < config.max_non_split_rounding_size)
                ):
                    bsize += gap
            resolved.append((addr, bsize, req))
        out.append(SegmentState(seg_addr, size, stream, is_small, resolved, pool_of.get(seg_addr, DEFAULT_POOL)))
    return out




def columns_from_snapshot(snap: dict, device: int | None = None, config: AllocatorConfig | None = None,
                          source: str = "") -> TraceColumns:
    """:func:`trace_from_snapshot` as columns: the same events, initial segments and errors.

    The lean path reads each field of the kept entries with ``operator.itemgetter`` straight into an
    ``array('q')`` (no Event objects); an entry it cannot read that way (a missing ``stream``, a ``None``,
    a negative number) or a snapshot with private pools takes :func:`trace_from_snapshot` itself and
    converts its Events. Raises :class:`SnapshotError`.
    """
    src = source or "snapshot"

    def slow() -> TraceColumns:
        return columns_from_trace(trace_from_snapshot(snap, device, config, source))

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        dev = _pick_device(snap, device, src)
        try:
            cfg = config or AllocatorConfig.from_snapshot_settings(snap.get("allocator_settings"))
            traces = snap.get("device_traces") or []
            raw = (traces[dev] if dev < len(traces) else None) or []
            segments = [_normalize_segment(s, src) for s in snap["segments"] if s.get("device", dev) == dev]
        except (AllocatorConfigError, KeyError, TypeError, ValueError, AttributeError, IndexError):
            return slow()  # its error message
        if any(s["segment_pool_id"] != DEFAULT_POOL for s in segments):
            return slow()  # pool markers: placed from the Events
        if isinstance(raw, SnapshotEntries):  # load_snapshot_columnar: the compiled reader's columns
            if not raw.lean_ok:
                return slow()  # its Events: missing or None numbers read as 0 (no error: they were checked)
            # (no live address allocated twice: the compiled reader declines those, csrc/snapshot_reader.cpp)
            action, addr, size, stream, time_us = drop_immediate_requests(*raw.lean_columns())
            try:
                initial = _rebuild_initial_segments([], segments, cfg, src, rows=raw.scan_rows())
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                if isinstance(exc, SnapshotError):
                    raise
                return slow()
            return TraceColumns(
                action=action, addr=addr, size=size, stream=stream, time_us=time_us,
                name=array("i", [-1]) * len(action), names=[],
                initial_segments=initial, final_segments=segments, allocator_settings=snap.get("allocator_settings"),
                capture=CAPTURE_CUDA, source=src, device=dev)
        try:
            names = list(map(operator.itemgetter("action"), raw))
            keep = [a in _KEPT for a in names]
            kept = list(compress(raw, keep)) if not all(keep) else raw
            acts = [_KEPT[a] for a in compress(names, keep)]
            cols = [array("q", map(operator.itemgetter(k), kept)) for k in ("addr", "size", "stream", "time_us")]
        except (KeyError, TypeError, OverflowError):
            return slow()
        if any(c and min(c) < 0 for c in cols):
            return slow()
        codes, addr, size, stream, time_us = drop_immediate_requests(bytes(map(CODE.__getitem__, acts)), *cols)
        _refuse_duplicate_live(codes, addr, size, src, dev)
        acts = [ACTIONS[c] for c in codes]
        try:
            initial = _rebuild_initial_segments([], segments, cfg, src, rows=zip(acts, addr, size, stream))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            if isinstance(exc, SnapshotError):
                raise
            return slow()
        return TraceColumns(
            action=codes, addr=addr, size=size, stream=stream, time_us=time_us,
            name=array("i", [-1]) * len(acts), names=[],
            initial_segments=initial, final_segments=segments, allocator_settings=snap.get("allocator_settings"),
            capture=CAPTURE_CUDA, source=src, device=dev)
    finally:
        if gc_was_enabled:
            gc.enable()


def write_snapshot(path: str | Path, trace: Trace, segments: list[dict], *, device_count: int = 1,
                   note: str = "") -> Path:
    """Write ``trace`` as a ``_dump_snapshot`` pickle that ``torch.cuda._memory_viz`` can read.

    ``segments`` is the end state (``CachingAllocatorModel.snapshot_segments()`` for a simulated run).
    Phases become ``external_annotations`` (START/END), as ``torch.profiler.record_function`` writes
    them; the capture method is recorded under ``allocator_settings['rlhfmem_capture']``.
    Returns the path written.
    """
    entries: list[dict] = []
    annotations: list[dict] = []
    open_phase: tuple[str, int] | None = None
    requested: set[int] = set()  # blocks whose free was requested and not completed yet
    for e in trace.events:
        if e.action == ALLOC:
            entries.append({"action": "alloc", "addr": e.addr, "size": e.size, "stream": e.stream,
                            "time_us": e.time_us, "frames": []})
        elif e.action in (FREE, FREE_REQUESTED):  # a FREE after its own FREE_REQUESTED: the completion only
            acts = (("free_requested",) if e.action == FREE_REQUESTED else
                    ("free_completed",) if e.addr in requested else ("free_requested", "free_completed"))
            if e.action == FREE_REQUESTED:
                requested.add(e.addr)
            else:
                requested.discard(e.addr)
            for a in acts:
                entries.append({"action": a, "addr": e.addr, "size": e.size, "stream": e.stream,
                                "time_us": e.time_us, "frames": []})
        elif e.action == OOM:  # PyTorch's layout: the free bytes under device_free, no addr
            entries.append({"action": e.action, "device_free": e.addr, "size": e.size, "stream": e.stream,
                            "time_us": e.time_us, "frames": []})
        elif e.action in (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP):
            entries.append({"action": e.action, "addr": e.addr, "size": e.size, "stream": e.stream,
                            "time_us": e.time_us, "frames": []})
        elif e.action == PHASE:
            if open_phase:
                annotations.append({"stage": "END", "name": open_phase[0], "device": 0, "time_us": e.time_us})
            annotations.append({"stage": "START", "name": e.name, "device": 0, "time_us": e.time_us})
            open_phase = (e.name, e.time_us)
    if open_phase and trace.events:
        annotations.append({"stage": "END", "name": open_phase[0], "device": 0,
                            "time_us": trace.events[-1].time_us})
    snap = {
        "segments": segments,
        "device_traces": [entries] + [[] for _ in range(device_count - 1)],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False,
                               "rlhfmem_capture": trace.capture, "rlhfmem_note": note},
        "external_annotations": annotations,
    }
    placement = (trace.allocator_settings or {}).get(SEGMENT_PLACEMENT_KEY)
    if placement:  # a replay of the snapshot places new segments as the capture did
        snap["allocator_settings"][SEGMENT_PLACEMENT_KEY] = placement
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    tmp.replace(p)
    return p
