"""Which engine replays a trace, and the compiled one (``csrc/replay_core.cpp``) behind ctypes.

Two engines give the same figures (``tests/test_replay_core.py`` holds them to it, field for field):

- ``python``: :class:`~.allocator.CachingAllocatorModel` through :func:`~.replay.replay`, the readable
  reference that mirrors ``c10/cuda/CUDACachingAllocator.cpp``; it replays everything.
- ``compiled``: ``csrc/replay_core.cpp``, the same functions under the same names (``malloc``,
  ``get_free_block``, ``alloc_found_block``, ``free_block``, ``release_cached_blocks``, ``get_pool``,
  ``create_or_incref_pool``, ``release_pool``, ...) in both modes, private pools included: about two orders of
  magnitude faster. :func:`engine_for` says
  when it applies and, when not, why.

The compiled core is built with the system's ``g++ -O2 -shared -fPIC`` (never through torch: ``import
torch`` alone costs 1.5 s) into ``$XDG_CACHE_HOME/pytest-rlhfmem`` (default ``~/.cache``), named by a hash
of the source and the compiler, under a ``filelock``; it is loaded with ctypes. Without a compiler the
Python engine replays everything, after a one-line notice on stderr.

A trace reaches the core as columns (:class:`~.columns.TraceColumns`): action codes as ``bytes`` and
``array('q')`` address, size, stream and time columns, never as a million ``Event`` objects. The settings cross
the seam by name, as one ``struct ReplaySettings`` (mirrored here once, :class:`ReplaySettings`), and ``rc_run``
answers with an ``enum ReplayStatus`` (:class:`ReplayStatus`; its messages in one table). This module sits beside
``python_engine.py``, above the trace types; ``replay.py`` is its one caller.
"""
from __future__ import annotations

import ctypes
import enum
import sys
from array import array
from pathlib import Path

from .allocator import (
    DEFAULT_POOL, EMPTY_CACHE_ALL_FREEABLE_POOLS, NESTED_POOLS_INNERMOST, USE_ON_OOM_BEFORE_RELEASE, AllocatorConfig,
    allowed_memory_maximum, kRoundUpPowerOfTwoIntervals,
)
from ..cbuild import build_library
from .columns import ACTIONS, TraceColumns
from .driver_va import ABOVE_LAST
from .events import SegmentState
from .metrics import WindowMetrics
from . import replay_types as _rt
from .replay_types import (
    ANCHORED, COMPILED, ENGINES, MAX_MODEL_ADDRESS, MAX_REPLAY_BYTES, MAX_SEGMENT_ADDRESS, MAX_TIME_US, PYTHON,
    ReplayError, ReplayResult, bound_error, check_initial_segments,
)

__all__ = [
    "COMPILED", "ENGINES", "PYTHON", "SOURCE", "STATUS_MESSAGES", "EngineUnavailable", "ReplaySettings", "ReplayStatus",
    "compiled_available", "engine_for", "library_path", "load_library", "run_compiled",
]

SOURCE = Path(__file__).with_name("csrc") / "replay_core.cpp"


class EngineUnavailable(RuntimeError):
    """The compiled core cannot be built or loaded here; the message says why (e.g. no g++)."""


# ---------------------------------------------------------------------------------------------------
# The seam: the settings struct and the status enum of csrc/replay_core.cpp, mirrored once
# ---------------------------------------------------------------------------------------------------


class ReplaySettings(ctypes.Structure):
    """``struct ReplaySettings`` of ``csrc/replay_core.cpp``, field for field (``rc_new``'s one argument).

    Names are :class:`~.allocator.AllocatorConfig`'s and ``CUDACachingAllocator.cpp``'s (``CUDAAllocatorConfig``:
    ``max_split_size``, ``max_non_split_rounding_size``, ``roundup_power2_divisions``,
    ``garbage_collection_threshold``, ``expandable_segments``; ``DeviceCachingAllocator::allowed_memory_maximum``).
    Sizes are bytes; flags 0 or 1; ``has_*`` 0 stands for None. :meth:`from_config` fills it;
    ``rc_settings_layout`` reports the C++ struct's size and offsets (``tests/test_replay_core.py`` compares).
    """

    _fields_ = [
        ("max_split_size", ctypes.c_int64),  # bytes; INT64_MAX (allocator.UNLIMITED) = unlimited
        ("max_non_split_rounding_size", ctypes.c_int64),  # bytes
        ("roundup_power2_divisions", ctypes.c_int64 * kRoundUpPowerOfTwoIntervals),
        ("garbage_collection_threshold", ctypes.c_double),  # 0.0 = off
        ("expandable_segments", ctypes.c_int64),
        ("capacity", ctypes.c_int64),  # bytes the allocator may reserve (after per_process_memory_fraction)
        ("has_capacity", ctypes.c_int64),  # 0: unlimited
        ("has_allowed_memory_maximum", ctypes.c_int64),  # per_process_memory_fraction < 1.0: capacity is that cap
        ("device_total", ctypes.c_int64),  # bytes of the device before the fraction (allocator.py: device_total)
        ("has_device_total", ctypes.c_int64),
        ("anchored", ctypes.c_int64),  # the replay mode: 1 anchored, 0 free-running
        ("innermost_pool", ctypes.c_int64),  # AllocatorConfig.since(NESTED_POOLS_INNERMOST), PR 168382
        ("use_on_oom_before_release", ctypes.c_int64),  # since(USE_ON_OOM_BEFORE_RELEASE), PR 169699
        ("empty_cache_scoped_to_region", ctypes.c_int64),  # not since(EMPTY_CACHE_ALL_FREEABLE_POOLS), PR 133602
    ]

    @classmethod
    def from_config(cls, config: AllocatorConfig, capacity: int | None, mode: str) -> ReplaySettings:
        """The settings of a replay of ``config`` on a device of ``capacity`` bytes (``None``: unlimited) in
        ``mode``: the capacity the core enforces is :func:`~.allocator.allowed_memory_maximum`'s, as the Python
        model's."""
        allowed = allowed_memory_maximum(config, capacity)
        return cls(
            max_split_size=config.max_split_size,
            max_non_split_rounding_size=config.max_non_split_rounding_size,
            roundup_power2_divisions=(ctypes.c_int64 * kRoundUpPowerOfTwoIntervals)(
                *config.roundup_power2_divisions[:kRoundUpPowerOfTwoIntervals]),
            garbage_collection_threshold=float(config.garbage_collection_threshold),
            expandable_segments=int(config.expandable_segments),
            capacity=allowed or 0, has_capacity=int(allowed is not None),
            has_allowed_memory_maximum=int(config.per_process_memory_fraction < 1.0 and allowed is not None),
            device_total=capacity or 0, has_device_total=int(capacity is not None),
            anchored=int(mode == ANCHORED),
            innermost_pool=int(config.since(NESTED_POOLS_INNERMOST)),
            use_on_oom_before_release=int(config.since(USE_ON_OOM_BEFORE_RELEASE)),
            empty_cache_scoped_to_region=int(not config.since(EMPTY_CACHE_ALL_FREEABLE_POOLS)))


def core_bounds() -> tuple[int, int, int, int]:
    """The compiled core's bounds (``rc_bounds``): ``kMaxReplayBytes``, ``kMaxSegmentAddress``, ``kMaxTimeUs``,
    ``kMaxModelAddress``, which ``replay_types.py`` mirrors. Raises :class:`EngineUnavailable`."""
    out = array("q", bytes(8 * 4))
    load_library().rc_bounds(out.buffer_info()[0])
    return out[0], out[1], out[2], out[3]


BOUNDS = (MAX_REPLAY_BYTES, MAX_SEGMENT_ADDRESS, MAX_TIME_US, MAX_MODEL_ADDRESS)  # as core_bounds() must report


def settings_layout() -> tuple[int, list[int]]:
    """``(sizeof, offsets)`` of the C++ ``struct ReplaySettings`` as the compiled core reports them
    (``rc_settings_layout``; offsets in field order). Raises :class:`EngineUnavailable`."""
    out = array("q", bytes(8 * (1 + len(ReplaySettings._fields_))))
    load_library().rc_settings_layout(out.buffer_info()[0])
    return out[0], list(out[1:])


class ReplayStatus(enum.IntEnum):
    """``enum ReplayStatus`` of ``csrc/replay_core.cpp``: what ``rc_run`` returns. :data:`STATUS_MESSAGES` holds
    what the Python engine says in each case (:func:`run_compiled` raises with it)."""

    OK = 0
    DOUBLE_FREE = 1  # ValueError
    POOL_ALREADY_RECORDING = 2  # allocator.py: begin_allocate_to_pool's ValueError
    POOL_RELEASED_WHILE_IN_USE = 3  # allocator.py: get_pool's KeyError
    POOL_NOT_RECORDING = 4  # end_allocate_to_pool's ValueError
    POOL_UNKNOWN = 5  # release_pool's ValueError
    # beyond the replay's bounds (replay_types.MAX_REPLAY_BYTES ...): replay_types' one-line ReplayErrors
    SIZE_OUT_OF_RANGE = 6
    ADDRESS_OUT_OF_RANGE = 7
    TIME_OUT_OF_RANGE = 8
    RESERVED_OUT_OF_RANGE = 9
    ADDRESS_SPACE_EXHAUSTED = 10
    CAPACITY_OUT_OF_RANGE = 11
    SEGMENT_OUT_OF_RANGE = 12


# Each error status -> (exception, message). {source}, {event}, {action}, {pool_id}: the trace, the event index
# (flushes inserted), its action and pool id. The pool markers' texts are allocator.py's, word for word, as
# python_engine.py's ReplayError gives them.
STATUS_MESSAGES: dict[ReplayStatus, tuple[type[Exception], str]] = {
    ReplayStatus.DOUBLE_FREE: (ValueError, "double free at event {event} (model address reused by the trace)"),
    ReplayStatus.POOL_ALREADY_RECORDING: (
        ReplayError, "{source}: event {event} ({action}): beginAllocateToPool: already recording to mempool_id "
                     "{pool_id}"),
    ReplayStatus.POOL_RELEASED_WHILE_IN_USE: (
        ReplayError, "{source}: event {event}: allocations go to a private pool that was released and emptied while "
                     "a use_mem_pool region still held it (the Python model raises KeyError there)"),
    ReplayStatus.POOL_NOT_RECORDING: (
        ReplayError, "{source}: event {event} ({action}): endAllocateToPool: not currently recording to mempool_id "
                     "{pool_id}"),
    ReplayStatus.POOL_UNKNOWN: (ReplayError, "{source}: event {event} ({action}): releasePool: no pool with "
                                             "mempool_id {pool_id}"),
    # the bounds ({value}: the event's size or address, the reserved bytes, the capacity): replay_types' texts
    ReplayStatus.SIZE_OUT_OF_RANGE: (ReplayError, _rt.SIZE_OUT_OF_RANGE),
    ReplayStatus.ADDRESS_OUT_OF_RANGE: (ReplayError, _rt.ADDRESS_OUT_OF_RANGE),
    ReplayStatus.TIME_OUT_OF_RANGE: (ReplayError, _rt.TIME_OUT_OF_RANGE),
    ReplayStatus.RESERVED_OUT_OF_RANGE: (ReplayError, _rt.RESERVED_OUT_OF_RANGE),
    ReplayStatus.ADDRESS_SPACE_EXHAUSTED: (ReplayError, _rt.ADDRESS_SPACE_EXHAUSTED),
    ReplayStatus.CAPACITY_OUT_OF_RANGE: (ReplayError, _rt.CAPACITY_OUT_OF_RANGE),
    ReplayStatus.SEGMENT_OUT_OF_RANGE: (ReplayError, "{source}: a segment that existed before the trace is out of "
                                                     "the replay's bounds"),
}


# ---------------------------------------------------------------------------------------------------
# Building and loading the core
# ---------------------------------------------------------------------------------------------------

_lib: ctypes.CDLL | None = None
_unavailable: str | None = None


def library_path() -> Path:
    """Build the core if no cached build matches (source, flags, compiler binary); return its path.

    Raises :class:`EngineUnavailable` without a compiler or when the build fails.
    """
    return build_library(SOURCE, EngineUnavailable)


def load_library() -> ctypes.CDLL:
    """The loaded core (built on first use). Raises :class:`EngineUnavailable`."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(library_path()))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.rc_settings_layout.argtypes, lib.rc_settings_layout.restype = [p], None
        lib.rc_bounds.argtypes, lib.rc_bounds.restype = [p], None
        lib.rc_new.argtypes, lib.rc_new.restype = [ctypes.POINTER(ReplaySettings)], p
        lib.rc_import_segment.argtypes, lib.rc_import_segment.restype = [p, i64, i64, i64, i32, i64, p, i64, i64], None
        lib.rc_run.argtypes, lib.rc_run.restype = [p, i64, p, p, p, p, p, i32, i64, p], i32
        lib.rc_result_size.argtypes, lib.rc_result_size.restype = [p], i64
        lib.rc_result_copy.argtypes, lib.rc_result_copy.restype = [p, p], None
        lib.rc_free.argtypes, lib.rc_free.restype = [p], None
        lib.rc_set_pools.argtypes, lib.rc_set_pools.restype = [p, i64, p, i64, p], None
        _lib = lib
    return _lib


def compiled_available() -> tuple[bool, str]:
    """``(True, "")`` when the core loads here, else ``(False, reason)``; the first failure prints one
    notice on stderr (the Python engine then replays everything)."""
    global _unavailable
    if _lib is not None:
        return True, ""
    if _unavailable is None:
        try:
            load_library()
            return True, ""
        except (EngineUnavailable, OSError) as exc:
            _unavailable = str(exc)
            print(f"rlhfmem: note: compiled replay engine unavailable ({_unavailable}); replaying in Python",
                  file=sys.stderr)
    return False, _unavailable


# ---------------------------------------------------------------------------------------------------
# Which engine
# ---------------------------------------------------------------------------------------------------


def engine_for(cols: TraceColumns | None, config: AllocatorConfig, mode: str, record_series: bool = False,
               record_events: bool = False, requested: str = "auto") -> tuple[str, str]:
    """``(engine, reason)``: the engine a replay takes and why. ``requested`` is ``auto`` (the compiled
    core when it supports the replay), ``python`` or ``compiled`` (raises ``ValueError`` naming the
    reason when the core cannot replay this)."""
    if requested not in ENGINES:
        raise ValueError(f"replay engine {requested!r}: allowed values are {', '.join(ENGINES)}")
    if requested == PYTHON:
        return PYTHON, "requested"
    why = None
    if config.segment_placement.kind != ABOVE_LAST:
        why = f"segment placement {config.segment_placement.spec()}: the Python model's (driver_va.py)"
    elif record_series:
        why = "the per-event series is recorded by the Python model"
    elif record_events:
        why = "the replayed events are recorded by the Python model"
    elif cols is not None and cols.has_external_mappings():
        why = "device memory mapped outside the caching allocator (external_map) is modelled by the Python model"
    else:
        ok, reason = compiled_available()
        if not ok:
            why = f"compiled core unavailable: {reason}"
    if why is None:
        pools = cols is not None and (cols.has_pool_markers()
                                      or any(s.pool_id != DEFAULT_POOL for s in cols.initial_segments))
        return COMPILED, f"{mode}, {'with' if pools else 'no'} private pools"
    if requested == COMPILED:
        raise ValueError(f"the compiled replay engine cannot replay this: {why}")
    return PYTHON, why


# ---------------------------------------------------------------------------------------------------
# Running the core
# ---------------------------------------------------------------------------------------------------


def _buf(a: array | bytes) -> int:
    if isinstance(a, bytes):
        return ctypes.cast(ctypes.c_char_p(a), ctypes.c_void_p).value or 0
    return a.buffer_info()[0]


def _segment_pieces(seg: SegmentState) -> array:
    """``import_segment``'s blocks as (address, size, requested or -1) triples; raises ``ValueError`` as
    :meth:`~.allocator.CachingAllocatorModel.import_segment` does."""
    out = array("q")
    cursor, end = seg.address, seg.address + seg.total_size
    for b_addr, b_size, b_req in sorted(seg.live_blocks):
        if b_addr < cursor or b_addr + b_size > end:
            raise ValueError(f"live block 0x{b_addr:x}+{b_size} does not fit segment 0x{seg.address:x}+"
                             f"{seg.total_size}")
        if b_addr > cursor:
            out.extend((cursor, b_addr - cursor, -1))
        out.extend((b_addr, b_size, b_req))
        cursor = b_addr + b_size
    if cursor < end:
        out.extend((cursor, end - cursor, -1))
    return out


_NONE = -(2**63)
_WINDOW_FIELDS = ("peak_reserved", "peak_allocated", "fragmentation_at_peak", "max_fragmentation",
                  "inactive_split_at_peak", "cuda_malloc_count", "cuda_free_count", "alloc_retries", "ooms",
                  "events", "start_us", "end_us")


_BOUND_STATUSES = frozenset(ReplayStatus(v) for v in range(ReplayStatus.SIZE_OUT_OF_RANGE, len(ReplayStatus)))


def _bound_error(status: ReplayStatus, cols: TraceColumns, event: int, original, reserved: int,  # noqa: ANN001
                 capacity: int | None) -> ReplayError:
    """The one line of a bound the core refused or passed at ``event`` (the index with flushes inserted;
    ``original`` maps it to the trace's index, or to an inserted flush's name), as the Python engine words it."""
    i = original(event) if event >= 0 else -1
    if isinstance(i, str):
        action, size, addr = "flush", 0, 0
    elif i >= 0:
        code = cols.action[i]
        action, size, addr = (ACTIONS[code] if code < len(ACTIONS) else "other"), cols.size[i], cols.addr[i]
    else:
        action, size, addr = "", 0, 0
    value = {ReplayStatus.SIZE_OUT_OF_RANGE: size, ReplayStatus.ADDRESS_OUT_OF_RANGE: addr,
             ReplayStatus.RESERVED_OUT_OF_RANGE: reserved, ReplayStatus.CAPACITY_OUT_OF_RANGE: capacity}.get(status, 0)
    return bound_error(STATUS_MESSAGES[status][1], cols.source, event, action, value)


def run_compiled(cols: TraceColumns, config: AllocatorConfig, capacity: int | None,
                 flush_at: list[int] | tuple[int, ...] = (), flush_names: list[str] | tuple[str, ...] = (),
                 mode: str = "free-running") -> ReplayResult:
    """Replay ``cols`` through the compiled core in ``mode`` (``free-running`` or ``anchored``, as
    :func:`~.replay.replay`); returns a :class:`~.replay_types.ReplayResult` (``model`` and ``collector`` None,
    ``engine`` "compiled").

    ``flush_at``: sorted event indices before which a FLUSH named ``flush_names[k]`` is inserted (the
    advisor's candidates, as ``python_engine.with_flushes``), without copying the columns in Python. Raises
    :class:`~.replay_types.ReplayError` for a segment that existed before the trace whose blocks do not fit it
    or unbalanced pool markers, ``ValueError`` for a double free (:class:`ReplayStatus`, with the Python engine's
    messages). ``capacity`` is bytes (``None``: unlimited).
    """
    lib = load_library()
    source = cols.source
    # bounds the core refuses too (RC_CAPACITY_OUT_OF_RANGE, RC_SEGMENT_OUT_OF_RANGE), checked here first: a
    # capacity past int64 would not even reach it (ctypes wraps), and the messages are the Python engine's
    if capacity is not None and not -MAX_REPLAY_BYTES <= capacity <= MAX_REPLAY_BYTES:
        raise bound_error(STATUS_MESSAGES[ReplayStatus.CAPACITY_OUT_OF_RANGE][1], source, value=capacity)
    check_initial_segments(source, cols.initial_segments)
    settings = ReplaySettings.from_config(config, capacity, mode)
    inserted = sorted(zip(flush_at, flush_names))  # with_flushes' order
    h = lib.rc_new(ctypes.byref(settings))
    try:
        if config.use_on_oom_pools or config.no_split_pools:
            oom = array("q", [x for pid in config.use_on_oom_pools for x in pid])
            no_split = array("q", [x for pid in config.no_split_pools for x in pid])
            lib.rc_set_pools(h, len(oom) // 2, _buf(oom) if oom else None, len(no_split) // 2,
                             _buf(no_split) if no_split else None)
        for seg in cols.initial_segments:
            try:
                pieces = _segment_pieces(seg)
            except ValueError as exc:
                raise ReplayError(f"{cols.source or 'trace'}: a segment that existed before the trace: {exc}") from None
            lib.rc_import_segment(h, seg.address, seg.total_size, seg.stream, int(seg.is_small), len(pieces) // 3,
                                  _buf(pieces), seg.pool_id[0], seg.pool_id[1])
        fa = array("q", [p for p, _ in inserted])
        n = len(cols)
        rc = lib.rc_run(h, n, _buf(cols.action), _buf(cols.addr), _buf(cols.size), _buf(cols.stream),
                        _buf(cols.time_us), int(cols.time_is_delta), len(fa), _buf(fa) if fa else None)
        out = array("q", bytes(8 * lib.rc_result_size(h)))
        lib.rc_result_copy(h, _buf(out))
    finally:
        lib.rc_free(h)
    (_status, error_event, final_reserved, final_allocated, final_requested, unmatched, oom_mismatches, num_free,
     flush_frees, peak_phase, n_phases, n_dec, n_flush, n_points, n_req, _num_alloc) = out[:16]

    # Event index in the replayed list (flushes inserted) -> the original event's index, or the inserted
    # flush's name.
    def original(v: int) -> int | str:
        # v counts the inserted flushes before it: undo that to find the original event or the flush
        k = 0
        while k < len(inserted) and inserted[k][0] + k <= v:
            if inserted[k][0] + k == v:
                return f"after-{inserted[k][1]}"
            k += 1
        return v - k

    def name_of(v: int) -> str:
        i = original(v)
        if isinstance(i, str):
            return i
        j = cols.name[i]
        return cols.names[j] if j >= 0 else ""

    status = ReplayStatus(rc)
    if status in _BOUND_STATUSES:
        raise _bound_error(status, cols, error_event, original, final_reserved, capacity)
    if status != ReplayStatus.OK:
        error, template = STATUS_MESSAGES[status]
        i = original(error_event)  # the pool statuses stop at a recorded POOL_* event, never an inserted flush
        action, pool_id = (ACTIONS[cols.action[i]], (cols.addr[i], cols.size[i])) if isinstance(i, int) else (i, None)
        raise error(template.format(source=cols.source or "trace", event=error_event, action=action,
                                    pool_id=pool_id))
    pos = 16

    def window(phase: str) -> WindowMetrics:
        nonlocal pos
        f = out[pos:pos + 13]
        pos += 13
        kw = dict(zip(_WINDOW_FIELDS, f))
        for k in ("fragmentation_at_peak", "inactive_split_at_peak"):
            if kw[k] == _NONE:
                kw[k] = None
        return WindowMetrics(phase=phase if phase else name_of(f[12]), **kw)

    total = window("iteration")
    phases = [window("") for _ in range(n_phases)]
    segment_allocs: list[tuple[int, int]] = []
    batches: list[list[tuple[int, int]]] = []
    maps: list[tuple[int, int]] = []
    unmaps: list[tuple[int, int]] = []
    for k in range(n_dec):
        kind, a, s = out[pos + 3 * k:pos + 3 * k + 3]
        if kind == 0:
            segment_allocs.append((a, s))
        elif kind == 1:
            batches.append([(a, s)])
        elif kind == 2:
            batches[-1].append((a, s))
        elif kind == 3:
            maps.append((a, s))
        else:
            unmaps.append((a, s))
    pos += 3 * n_dec
    flushes = []
    for k in range(n_flush):
        ev, ph, released, segs, req_b, req_a = out[pos + 6 * k:pos + 6 * k + 6]
        flushes.append({"name": name_of(ev), "phase": phases[ph].phase if ph >= 0 else None,
                        "released_bytes": released, "segments_released": segs, "requested_before": req_b,
                        "requested_after": req_a})
    pos += 6 * n_flush
    flush_points = list(out[pos:pos + n_points])
    pos += n_points
    requested_at_end = {phases[out[pos + 2 * k]].phase: out[pos + 2 * k + 1] for k in range(n_req)}
    return ReplayResult(
        total=total, phases=phases, peak_phase=phases[peak_phase].phase if peak_phase >= 0 else None,
        segment_allocs=segment_allocs, segment_free_batches=batches, final_reserved=final_reserved,
        final_allocated=final_allocated, final_requested=final_requested, model=None, collector=None,
        mode=mode, unmatched_frees=unmatched, flush_points=flush_points, flushes=flushes,
        cuda_frees_outside_flushes=num_free - flush_frees, requested_at_phase_end=requested_at_end,
        capacity=capacity, oom_mismatches=oom_mismatches, engine=COMPILED, segment_maps=maps, segment_unmaps=unmaps)
