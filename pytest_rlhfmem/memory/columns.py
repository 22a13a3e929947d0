"""A trace as columns: what the compiled replay core, the ``.rlhftrace`` reader and the advisor pass around.

:class:`TraceColumns` holds action codes as ``bytes`` and ``array('q')`` address, size, stream and time
columns, never a million ``Event`` objects; :func:`columns_from_trace` builds it from a
:class:`~.events.Trace` and :meth:`TraceColumns.to_trace` goes back. The action codes (:data:`ACTIONS`,
:data:`CODE`, :data:`OTHER`) are shared with ``csrc/replay_core.cpp`` (its ``enum Action``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import accumulate, compress
from operator import itemgetter
from typing import NamedTuple

from .events import (
    ALLOC, EXTERNAL_MAP, EXTERNAL_UNMAP, FLUSH, FREE, FREE_REQUESTED, OOM, PHASE, PHASE_END, POOL_ENTER, POOL_EXIT,
    POOL_RELEASE, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, Event, SegmentState, Trace,
)

# Action codes shared with replay_core.cpp (enum Action): the index in this tuple. Anything else is OTHER.
ACTIONS = (ALLOC, FREE, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, OOM, POOL_ENTER, POOL_EXIT,
           POOL_RELEASE, PHASE, PHASE_END, FLUSH, FREE_REQUESTED, EXTERNAL_MAP, EXTERNAL_UNMAP)
OTHER = len(ACTIONS)
CODE = {a: i for i, a in enumerate(ACTIONS)}
_SEGMENT_CODES = bytes(CODE[a] for a in (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP))


@dataclass
class TraceColumns:
    """A :class:`~.events.Trace` as columns, ``n`` events long.

    ``action``: one code per event (index into :data:`ACTIONS`, :data:`OTHER` for the rest); ``addr``,
    ``size``, ``stream``, ``time_us``: ``array('q')`` (``time_is_delta``: differences from the previous
    event, as ``.rlhftrace`` stores them); ``name``: ``array('i')`` index into ``names`` or -1. The other
    fields are the Trace's own.
    """

    action: bytes
    addr: array
    size: array
    stream: array
    time_us: array
    name: array
    names: list[str]
    time_is_delta: bool = False
    initial_segments: list[SegmentState] = field(default_factory=list)
    final_segments: list[dict] | None = None
    allocator_settings: dict | None = None
    capture: str = ""
    source: str = ""
    device: int = 0
    # the Trace these columns were built from (columns_from_trace), handed back by to_trace: one conversion each way
    trace: Trace | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.action)

    def has_segment_events(self) -> bool:
        return any(bytes([c]) in self.action for c in _SEGMENT_CODES)

    def has_pool_markers(self) -> bool:
        return any(bytes([CODE[a]]) in self.action for a in (POOL_ENTER, POOL_EXIT, POOL_RELEASE))

    def has_external_mappings(self) -> bool:
        """Whether the trace maps device memory outside the caching allocator (``EXTERNAL_MAP``)."""
        return bytes([CODE[EXTERNAL_MAP]]) in self.action

    def count(self, *actions: str) -> int:
        """Events whose action is one of ``actions`` (C speed: ``bytes.count``)."""
        return sum(self.action.count(bytes([CODE[a]])) for a in actions)

    def absolute_times(self) -> array | list[int]:
        """The time column as absolute microseconds: itself, or the running sum of the differences (an
        ``array('q')``; a plain list where a sum leaves int64, for the replay's bound to refuse in one line)."""
        if not self.time_is_delta:
            return self.time_us
        out = list(accumulate(self.time_us))
        try:
            return array("q", out)
        except OverflowError:
            return out

    def to_trace(self) -> Trace:
        """The Event list (for the Python engine): one Python object per event; the Trace itself when these
        columns were built from one (:func:`as_columns`)."""
        if self.trace is not None:
            return self.trace
        names, acts = self.names, ACTIONS + ("other",)
        times = self.absolute_times()
        events = [Event(acts[c], a, s, st, t, names[k] if k >= 0 else "")
                  for c, a, s, st, t, k in zip(self.action, self.addr, self.size, self.stream, times, self.name)]
        return Trace(events=events, initial_segments=self.initial_segments, final_segments=self.final_segments,
                     allocator_settings=self.allocator_settings, capture=self.capture, source=self.source,
                     device=self.device)


class RecordedSettings(NamedTuple):
    """What a trace file says about its recording beside the events, as read (nothing parsed): what a loader
    returns with the columns (``trace.snapshot_columns_for_replay``, ``trace_io.load_columns``), for
    :func:`~.replay.allocator_config` to build the :class:`~.allocator.AllocatorConfig` from, once.

    ``allocator_settings``: the recording's ``allocator_settings`` (a snapshot's, ``torch/csrc/cuda/Module.cpp``
    ``_memory_snapshot``; an ``.rlhftrace`` header's), ``None`` when the file holds none. ``source``: the file.
    ``reader``: what read it: ``"rlhftrace"``, or a pickle's reader (``"compiled"``: ``csrc/snapshot_reader.cpp``;
    ``"python (<why>)"``: Python's Unpickler)."""

    allocator_settings: dict | None
    source: str
    reader: str


def as_columns(trace: Trace | TraceColumns) -> TraceColumns:
    """The one conversion at replay's surface: ``trace`` as columns (itself when it is columns; a
    :class:`~.events.Trace` converted once, by :func:`columns_from_trace`, and kept: ``to_trace()`` returns it)."""
    return trace if isinstance(trace, TraceColumns) else columns_from_trace(trace)


def columns_from_trace(trace: Trace) -> TraceColumns:
    """The columns of ``trace`` (one pass over its events; an unknown action becomes OTHER); ``trace`` is kept
    (``to_trace()`` returns it)."""
    names: list[str] = []
    index: dict[str, int] = {"": -1}

    def name_of(n: str) -> int:
        k = index.get(n)
        if k is None:
            k = index[n] = len(names)
            names.append(n)
        return k

    ev = trace.events
    get = CODE.get

    def column(i: int) -> array:
        return array("q", map(itemgetter(i), ev))

    return TraceColumns(
        action=bytes([get(e[0], OTHER) for e in ev]),
        addr=column(1), size=column(2), stream=column(3), time_us=column(4),
        name=array("i", map(name_of, map(itemgetter(5), ev))), names=names,
        initial_segments=trace.initial_segments, final_segments=trace.final_segments,
        allocator_settings=trace.allocator_settings, capture=trace.capture, source=trace.source,
        device=trace.device, trace=trace)


def drop_immediate_requests(action: bytes, addr: array, *rest: array) -> tuple:
    """``(action, addr, *rest)`` without each FREE_REQUESTED that its block's FREE follows at once: a snapshot
    writes ``free_requested`` + ``free_completed`` for every free, and only a request whose completion comes
    later (the block used by another stream, ``Tensor.record_stream``) changes what the allocator does. C speed
    where there are none (``bytes.find``); the columns are rebuilt once where there are."""
    req, free = CODE[FREE_REQUESTED], CODE[FREE]
    i = action.find(req)
    if i < 0:
        return (action, addr, *rest)
    keep = bytearray(b"\x01") * len(action)
    last = len(action) - 1
    while i >= 0:
        if i < last and action[i + 1] == free and addr[i + 1] == addr[i]:
            keep[i] = 0
        i = action.find(req, i + 1)
    return (bytes(compress(action, keep)), *(array(c.typecode, compress(c, keep)) for c in (addr, *rest)))


def drop_immediate_request_events(events: list[Event]) -> list[Event]:
    """:func:`drop_immediate_requests` on an Event list."""
    n = len(events)
    return [e for i, e in enumerate(events)
            if not (e.action == FREE_REQUESTED and i + 1 < n and events[i + 1].action == FREE
                    and events[i + 1].addr == e.addr)]
