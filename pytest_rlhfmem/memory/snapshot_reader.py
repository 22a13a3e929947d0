"""The compiled snapshot reader (``csrc/snapshot_reader.cpp``) behind ctypes: a ``_dump_snapshot`` pickle's
opcodes read in C++, its trace entries straight into columns.

Python's unpickler builds a dict per trace entry (a million of them for a long trace: about 0.25M events/s,
the bound of ``rlhfmem replay FILE.pickle``). The C++ reader reads only the opcodes a memory snapshot is made
of and REFUSES every opcode that can name or call an object (GLOBAL, STACK_GLOBAL, INST, OBJ, REDUCE, BUILD,
NEWOBJ, PERSID, EXT...), so no pickle can run code through it by construction. It returns each device's kept
trace entries as columns (:class:`SnapshotEntries`) and the rest of the snapshot (segments, settings) as a
small pickle of builtins, which :func:`~.trace.load_snapshot_columnar` loads with the global-refusing
Unpickler of ``load_snapshot``. A stream it does not read exactly as Python would (truncated, damaged, an
opcode snapshots do not use, an entry whose numbers are not integers in 0..2**63-1, a live address allocated
again: an ``alloc`` with no ``free_completed`` since the last one there, a ``segment_alloc`` with no
``segment_free``) makes it DECLINE: Python then reads the file, and gives the one line naming the file and the entry
(``trace.py``), so both readers give every message and result alike.

Built like the replay core (``replay_engine.py``): the system's ``g++ -O2 -shared -fPIC`` into
``$XDG_CACHE_HOME/pytest-rlhfmem/snapshot_reader_<hash>.so`` under a ``filelock``; without a compiler
:func:`reader_available` says why and Python reads the pickle (``rlhfmem replay`` names the reader used).
This module sits below ``trace.py`` (which uses it) and above the column codes.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..cbuild import build_library
from .columns import ACTIONS, CODE
from .events import ALLOC, FREE, FREE_REQUESTED, OOM, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP

__all__ = ["COMPILED_READER", "PYTHON_READER", "ReaderUnavailable", "SnapshotEntries", "ParsedSnapshot",
           "library_path", "parse_snapshot", "reader_available"]

SOURCE = Path(__file__).with_name("csrc") / "snapshot_reader.cpp"
COMPILED_READER = "compiled"
PYTHON_READER = "python"
_lib: ctypes.CDLL | None = None
_unavailable: str | None = None


class ReaderUnavailable(RuntimeError):
    """The compiled reader cannot be built or loaded here; the message says why (e.g. no g++)."""


def library_path() -> Path:
    """Build the reader if no cached build matches (source, flags, compiler binary); return its path."""
    return build_library(SOURCE, ReaderUnavailable)


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(library_path()))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.sr_parse.argtypes, lib.sr_parse.restype = [p, i64, i64, p, p, p], p
        lib.sr_status.argtypes, lib.sr_status.restype = [p], i64
        lib.sr_message.argtypes, lib.sr_message.restype = [p], ctypes.c_char_p
        lib.sr_rest_size.argtypes, lib.sr_rest_size.restype = [p], i64
        lib.sr_rest_copy.argtypes, lib.sr_rest_copy.restype = [p, p], None
        lib.sr_devices.argtypes, lib.sr_devices.restype = [p], i64
        lib.sr_device_info.argtypes, lib.sr_device_info.restype = [p, p], None
        lib.sr_columns.argtypes, lib.sr_columns.restype = [p, i64, p, p, p, p, p], None
        lib.sr_patches.argtypes, lib.sr_patches.restype = [p, i64, p], None
        lib.sr_scan.argtypes, lib.sr_scan.restype = [p, i64, p, p, p, p], None
        lib.sr_free.argtypes, lib.sr_free.restype = [p], None
        _lib = lib
    return _lib


def reader_available() -> tuple[bool, str]:
    """``(True, "")`` when the compiled reader loads here, else ``(False, reason)`` (Python reads then)."""
    global _unavailable
    if _lib is not None:
        return True, ""
    if _unavailable is None:
        try:
            _load()
            return True, ""
        except (ReaderUnavailable, OSError) as exc:
            _unavailable = str(exc)
    return False, _unavailable


_NAMES = {CODE[a]: a for a in (ALLOC, FREE, FREE_REQUESTED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP,
                                OOM)}


class SnapshotEntries:
    """One device's trace as the compiled reader gives it, in the place of the list of entry dicts.

    ``len()`` is the number of entries in the file (every action, as ``len(list)``); iterating yields only the
    KEPT entries, rebuilt as dicts of the fields ``trace_from_snapshot`` reads (an oom entry's free bytes under
    ``device_free``, as PyTorch writes them; ``free``/``free_completed`` as ``free_completed``), so
    ``trace_from_snapshot`` gives the same Events. ``action`` (codes of :data:`~.columns.ACTIONS`), ``addr``,
    ``size``, ``stream``, ``time_us``: the kept entries as columns (oom: addr is device_free when present).
    ``lean_ok``: every kept entry carries addr, size, stream and time_us (``columns_from_snapshot``'s lean
    path, which reads an oom entry's ``addr``: ``lean_addr`` patches those, as (index, addr) pairs).
    ``scan``: the (action, addr, size, stream) rows that ``_rebuild_initial_segments`` needs (fewer than the
    events, same result; ``csrc/snapshot_reader.cpp`` ``reduce_scan``).
    """

    __slots__ = ("n", "action", "addr", "size", "stream", "time_us", "lean_ok", "lean_addr", "scan")

    def __init__(self, n: int, action: bytes, addr: array, size: array, stream: array, time_us: array,
                 lean_ok: bool, lean_addr: list[tuple[int, int]], scan: tuple[bytes, array, array, array]):
        self.n, self.action, self.addr, self.size, self.stream, self.time_us = n, action, addr, size, stream, time_us
        self.lean_ok, self.lean_addr, self.scan = lean_ok, lean_addr, scan

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self) -> Iterator[dict]:
        names = _NAMES
        for c, a, s, st, t in zip(self.action, self.addr, self.size, self.stream, self.time_us):
            name = names[c]
            key = "device_free" if name == OOM else "addr"
            yield {"action": name, key: a, "size": s, "stream": st, "time_us": t}

    def lean_columns(self) -> tuple[bytes, array, array, array, array]:
        """The columns as ``columns_from_snapshot``'s lean path reads them (oom entries: their addr)."""
        addr = self.addr
        if self.lean_addr:
            addr = array("q", addr)
            for i, a in self.lean_addr:
                addr[i] = a
        return self.action, addr, self.size, self.stream, self.time_us

    def scan_rows(self) -> Iterator[tuple[str, int, int, int]]:
        act, addr, size, stream = self.scan
        return zip(map(ACTIONS.__getitem__, act), addr, size, stream)


@dataclass
class ParsedSnapshot:
    """What :func:`parse_snapshot` read: ``status`` ``ok`` (``rest``: the snapshot pickled without its
    trace entries, each device trace read as columns replaced by None; ``devices``: per position in
    ``device_traces``, a :class:`SnapshotEntries` or None when the position was written back as it was),
    ``refused`` (``message``: what the pickle names or uses) or ``declined`` (Python reads the file;
    ``message`` says why)."""

    status: str
    message: str = ""
    rest: bytes = b""
    devices: list[SnapshotEntries | None] | None = None


def parse_snapshot(data: bytes, kept: dict[str, str]) -> ParsedSnapshot:
    """Read ``data`` (a whole pickle) with the compiled reader. ``kept``: the entry actions kept and their
    action (``trace._KEPT``). Raises :class:`ReaderUnavailable` when the reader cannot be built here."""
    ok, why = reader_available()
    if not ok:
        raise ReaderUnavailable(why)
    lib = _load()
    names = b"".join(k.encode() + b"\0" for k in kept)
    codes = array("b", [CODE[v] for v in kept.values()])
    special = array("b", [CODE[a] for a in (ALLOC, FREE, OOM, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP,
                                             SEGMENT_UNMAP)])
    h = lib.sr_parse(data, len(data), len(kept), names, codes.buffer_info()[0], special.buffer_info()[0])
    try:
        status = lib.sr_status(h)
        message = (lib.sr_message(h) or b"").decode("utf-8", "replace")
        if status == 1:
            return ParsedSnapshot("refused", message)
        if status != 0:
            return ParsedSnapshot("declined", message)
        rest = ctypes.create_string_buffer(lib.sr_rest_size(h))
        lib.sr_rest_copy(h, rest)
        k = lib.sr_devices(h)
        info = array("q", bytes(8 * 6 * k))
        if k:
            lib.sr_device_info(h, info.buffer_info()[0])
        devices: list[SnapshotEntries | None] = []
        for d in range(k):
            kind, n, m, lean_ok, n_patch, n_scan = info[6 * d:6 * d + 6]
            if kind < 0:
                devices.append(None)
                continue
            act = array("B", [0]) * m
            cols = [array("q", [0]) * m for _ in range(4)]
            if m:
                lib.sr_columns(h, d, *(c.buffer_info()[0] for c in (act, *cols)))
            patches = array("q", bytes(16 * n_patch))
            if n_patch:
                lib.sr_patches(h, d, patches.buffer_info()[0])
            s_act = array("B", [0]) * n_scan
            s_cols = [array("q", [0]) * n_scan for _ in range(3)]
            if n_scan:
                lib.sr_scan(h, d, *(c.buffer_info()[0] for c in (s_act, *s_cols)))
            devices.append(SnapshotEntries(
                n, act.tobytes(), *cols, bool(lean_ok), list(zip(patches[::2], patches[1::2])),
                (s_act.tobytes(), *s_cols)))
        return ParsedSnapshot("ok", rest=rest.raw, devices=devices)
    finally:
        lib.sr_free(h)
