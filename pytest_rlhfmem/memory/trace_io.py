"""A compact, versioned file for one rank's :class:`~.events.Trace`, saved beside its result.

Why not a snapshot pickle: a memory_viz snapshot is the *replayed* trace (the model's addresses and
segment events), not the program's own allocations, and a pickle of a million dicts is large and slow.
This file keeps exactly what the allocator model replays: every event (action, address, requested size,
stream, time, name), the segments that existed before the trace began, the recorded allocator
settings and how the trace was captured. ``rlhfmem advise`` reads it to replay the same program under
other flush placements and allocator settings.

Layout (version 1; integers little-endian)::

    b"RLHFMEM-TRACE\\n"                magic, 14 bytes
    uint16   version                  1
    uint32   header length H
    H bytes  header, UTF-8 JSON       {"capture", "source", "allocator_settings", "initial_segments",
                                       "events", "actions", "names", "payload_bytes"}
    payload  zlib stream of six arrays of ``events`` items each, in this order:
             uint8 action code (index into header "actions"), int64 address, int64 size, int64 stream,
             int64 time_us as differences from the previous event, int32 name index (-1 = no name)

Errors: every problem of a file (missing, not this format, another version, truncated, corrupt) raises
:class:`TraceFileError` whose message names the file and the one thing wrong with it.

Bounds, checked before anything is inflated: the file is a regular file of at most :data:`MAX_TRACE_FILE_BYTES`,
its header names at most :data:`MAX_TRACE_EVENTS` events, the payload inflates to exactly ``events`` x 37 bytes
(inflating stops one byte past that, so a payload that inflates further is refused, not held in memory) and never
to more than deflate's largest ratio (1032:1) allows for its compressed size.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import zlib
from array import array
from itertools import accumulate, repeat
from pathlib import Path

from ..units import read_file_bounded
from .columns import CODE, OTHER, RecordedSettings, TraceColumns
from .events import Event, SegmentState, Trace

MAGIC = b"RLHFMEM-TRACE\n"
VERSION = 1
SUFFIX = ".rlhftrace"
_HEAD = struct.Struct("<HI")
_EVENT_BYTES = 1 + 8 + 8 + 8 + 8 + 4  # one event in the inflated payload: action, addr, size, stream, dtime, name
MAX_TRACE_EVENTS = 2**28  # events a trace file may hold (inflated: 9.25 GiB); a recipe iteration holds ~10**5-10**6
MAX_TRACE_FILE_BYTES = 4 * 2**30  # bytes a trace file may have on disk (compressed)
_DEFLATE_MAX_RATIO = 1032  # deflate cannot inflate more than this per compressed byte (RFC 1951's longest matches)


class TraceFileError(ValueError):
    """A trace file that cannot be read; the message names the file and the reason."""


def _le(a: array) -> bytes:
    if sys.byteorder == "big":
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_le(typecode: str, data: bytes) -> array:
    a = array(typecode)
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a


def save_trace(path: str | Path, trace: Trace) -> Path:
    """Write ``trace`` to ``path`` (atomically: a temporary file, then a rename). Returns the path.

    Raises ``OSError`` when the file cannot be written.
    """
    events = trace.events
    actions: list[str] = []
    action_code: dict[str, int] = {}
    names: list[str] = []
    name_index: dict[str, int] = {}
    codes = array("B")
    addr, size, stream, dtime = array("q"), array("q"), array("q"), array("q")
    name_col = array("i")
    last_t = 0
    for e in events:
        c = action_code.get(e.action)
        if c is None:
            c = action_code[e.action] = len(actions)
            actions.append(e.action)
        codes.append(c)
        addr.append(e.addr)
        size.append(e.size)
        stream.append(e.stream)
        dtime.append(e.time_us - last_t)
        last_t = e.time_us
        if e.name:
            n = name_index.get(e.name)
            if n is None:
                n = name_index[e.name] = len(names)
                names.append(e.name)
            name_col.append(n)
        else:
            name_col.append(-1)
    payload = zlib.compress(b"".join(_le(a) for a in (codes, addr, size, stream, dtime, name_col)), 6)
    header = {
        "capture": trace.capture,
        "source": trace.source,
        "allocator_settings": trace.allocator_settings,
        "initial_segments": [[s.address, s.total_size, s.stream, s.is_small, [list(b) for b in s.live_blocks]]
                             for s in trace.initial_segments],
        "events": len(events),
        "actions": actions,
        "names": names,
        "payload_bytes": len(payload),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(_HEAD.pack(VERSION, len(head)))
        f.write(head)
        f.write(payload)
    tmp.replace(p)
    return p


def _read(path: str | Path) -> tuple[Path, dict, list[array]]:
    """The header and the six payload columns of a trace file (codes, addr, size, stream, dtime, name)."""
    p = Path(path)
    try:
        data = read_file_bounded(p, MAX_TRACE_FILE_BYTES, "trace file")
    except ValueError as exc:  # not a regular file, or too large
        raise TraceFileError(str(exc)) from None
    except OSError as exc:
        raise TraceFileError(f"{p}: cannot read the trace file: {exc.strerror or exc}") from None
    if not data.startswith(MAGIC):
        raise TraceFileError(f"{p}: not an rlhfmem trace file (it does not start with {MAGIC!r})")
    off = len(MAGIC)
    if len(data) < off + _HEAD.size:
        raise TraceFileError(f"{p}: truncated trace file (no header)")
    version, hlen = _HEAD.unpack_from(data, off)
    if version != VERSION:
        raise TraceFileError(f"{p}: trace file version {version}; this pytest-rlhfmem reads version {VERSION}")
    off += _HEAD.size
    try:
        header = json.loads(data[off:off + hlen].decode())
        n = int(header["events"])
        actions, names = list(header["actions"]), list(header["names"])
        plen = int(header["payload_bytes"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise TraceFileError(f"{p}: truncated or corrupt trace header") from None
    payload = data[off + hlen:]
    if len(payload) != plen:
        raise TraceFileError(f"{p}: truncated trace file ({len(payload)} of {plen} payload bytes)")
    if not 0 <= n <= MAX_TRACE_EVENTS:
        raise TraceFileError(f"{p}: corrupt trace header ({n} events; a trace file holds 0 to 2**28)")
    expected = n * _EVENT_BYTES
    if expected > _DEFLATE_MAX_RATIO * plen + 64:
        raise TraceFileError(f"{p}: corrupt trace header ({n} events cannot come out of {plen} compressed bytes)")
    inflater = zlib.decompressobj()
    try:  # never more than one byte past what the header's events take
        raw = inflater.decompress(payload, expected + 1)
    except zlib.error as exc:
        raise TraceFileError(f"{p}: corrupt trace payload ({exc})") from None
    if len(raw) > expected:
        raise TraceFileError(f"{p}: corrupt trace payload (it inflates past the {expected} bytes of its {n} events)")
    if not inflater.eof:
        raise TraceFileError(f"{p}: corrupt trace payload (incomplete or truncated stream)")
    widths = (1, 8, 8, 8, 8, 4)
    if len(raw) != n * sum(widths):
        raise TraceFileError(f"{p}: corrupt trace payload ({len(raw)} bytes for {n} events)")
    cols, pos = [], 0
    for tc, w in zip("Bqqqqi", widths):
        cols.append(_from_le(tc, raw[pos:pos + n * w]))
        pos += n * w
    codes, name_col = cols[0], cols[5]
    # every action code < len(actions) (bytes.translate deletes the valid ones), every name index in [-1, len)
    if codes.tobytes().translate(None, bytes(range(len(actions)))) or not set(name_col) <= set(range(-1, len(names))):
        raise TraceFileError(f"{p}: corrupt trace payload (an action or name index out of range)")
    header["actions"], header["names"] = actions, names
    return p, header, cols


def _initial_segments(p: Path, header: dict) -> list[SegmentState]:
    try:
        return [SegmentState(int(a), int(ts), int(s), bool(sm), [tuple(b) for b in blocks])
                for a, ts, s, sm, blocks in header.get("initial_segments") or []]
    except (TypeError, ValueError):
        raise TraceFileError(f"{p}: corrupt trace header (initial_segments)") from None


def load_trace(path: str | Path) -> Trace:
    """Read a file written by :func:`save_trace`. Raises :class:`TraceFileError` (one line: file and reason)."""
    p, header, cols = _read(path)
    actions, names = header["actions"], header["names"] + [""]  # index -1: no name
    codes, addr, size, stream, dtime, name_col = cols
    rows = zip(map(actions.__getitem__, codes), addr, size, stream, accumulate(dtime), map(names.__getitem__, name_col))
    events: list[Event] = list(map(tuple.__new__, repeat(Event), rows))  # Event(*row), in C
    initial = _initial_segments(p, header)
    return Trace(events=events, initial_segments=initial, allocator_settings=header.get("allocator_settings"),
                 capture=str(header.get("capture", "")), source=str(header.get("source", "")))


def load_columns(path: str | Path) -> tuple[TraceColumns, RecordedSettings]:
    """:func:`load_trace` without the Event objects: ``(columns, recorded settings)``, the columns' action codes
    the replay engine's (one ``bytes.translate``), times kept as differences (``time_is_delta``), ``source`` the
    header's or else ``path``; the settings as the header holds them (``reader`` ``"rlhftrace"``).
    Raises :class:`TraceFileError`."""
    p, header, cols = _read(path)
    codes, addr, size, stream, dtime, name_col = cols
    table = bytearray(range(256))
    for i, a in enumerate(header["actions"]):
        table[i] = CODE.get(a, OTHER)
    settings = header.get("allocator_settings")
    columns = TraceColumns(
        action=codes.tobytes().translate(bytes(table)), addr=addr, size=size, stream=stream, time_us=dtime,
        name=name_col, names=header["names"], time_is_delta=True, initial_segments=_initial_segments(p, header),
        allocator_settings=settings, capture=str(header.get("capture", "")),
        source=str(header.get("source", "")) or str(path))
    return columns, RecordedSettings(settings, str(path), "rlhftrace")


def is_trace_file(path: str | Path) -> bool:
    """Whether ``path`` begins with this format's magic (``False`` when it cannot be read or is not a regular file:
    opening a FIFO would wait for a writer)."""
    try:
        if not Path(path).is_file():
            return False
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def store_beside(results: list[dict], json_path: str | Path) -> None:
    """Copy each rank's trace file (``ranks[i]["trace_file"]``) into ``<json stem>-traces/`` beside the
    result JSON ``json_path`` and point ``trace_file`` at the copy, relative to the JSON's directory, so
    that the JSON and its traces move together. Ranks without a trace file are left as they are;
    a trace file that no longer exists is dropped from the result (``trace_file`` None)."""
    jp = Path(json_path)
    dest = jp.parent / f"{jp.stem}-traces"
    for r in results:
        sid = str(r.get("scenario_id", "scenario")).replace("/", "__")
        for rank in r.get("ranks") or []:
            src = rank.get("trace_file")
            if not src:
                continue
            sp = Path(src)
            if not sp.is_absolute():
                continue  # already stored beside a JSON
            if not sp.exists():
                rank["trace_file"] = None
                continue
            dest.mkdir(parents=True, exist_ok=True)
            target = dest / f"{sid}__rank{rank.get('rank', 0)}{SUFFIX}"
            shutil.copyfile(sp, target)
            rank["trace_file"] = str(target.relative_to(jp.parent))


def write_result_json(json_path: str | Path, payload: dict, results: list[dict]) -> Path:
    """The one way a result JSON is written (``rlhfmem run --json``, ``rlhfmem capture --json``, the plugin's
    ``--rlhfmem-json``): each rank's trace of ``results`` stored beside it first (:func:`store_beside`, which
    points ``trace_file`` at the copies; ``payload`` holds those same result dicts), then ``payload``. The
    JSON and its ``<stem>-traces/`` directory are self-contained: they can be moved together, and
    ``rlhfmem advise`` reads them after the run's work directory is gone. Raises ``OSError``."""
    jp = Path(json_path)
    jp.parent.mkdir(parents=True, exist_ok=True)
    store_beside(results, jp)
    jp.write_text(json.dumps(payload, indent=1))
    return jp


def resolve_trace_path(trace_file: str, json_path: str | Path) -> Path:
    """A result's ``trace_file``: absolute as written by the worker, or relative to the result JSON."""
    p = Path(trace_file)
    return p if p.is_absolute() else Path(json_path).parent / p
