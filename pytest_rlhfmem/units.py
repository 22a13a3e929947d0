"""Sizes with units: bytes inside the code, "18.8 GiB" in files and human output (powers of 1024; a size read in
KB, MB, GB or TB is in powers of 1000)."""

from __future__ import annotations

import math
import os
import re
import stat

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
          # decimal units are what they say, powers of 1000, as cards are sold and as the gpu marker's
          # min_memory_gb reads GB (hardware.py): "24 GB" is 24 * 10**9 bytes, 22.35 GiB
          "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_RE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")
MAX_SIZE = 2**63 - 1  # bytes: the largest size a result, a budget or a snapshot holds (int64)
_ALLOWED = ("e.g. '312.5 MiB'; units: B, KiB, MiB, GiB, TiB (powers of 1024), KB, MB, GB, TB (powers of 1000); "
            "at most 2**63-1 bytes")


def parse_size(text: str) -> int:
    """``"312.5 MiB"`` -> bytes. Units: B, KiB, MiB, GiB, TiB (powers of 1024) and KB (or kB), MB, GB, TB (powers
    of 1000: ``"24 GB"`` is 24 * 10**9 bytes, as the gpu marker's ``min_memory_gb``). The number is decimal
    digits (no exponent, so never inf or nan) and its magnitude at most 2**63-1 bytes; a negative size is
    returned for the caller to refuse in its own words.

    Raises ``ValueError`` naming what is allowed for a bare number, an unknown unit or a size past 2**63-1 bytes.
    """
    shown = repr(text) if len(repr(text)) <= 40 else repr(text)[:36] + "...'"
    if isinstance(text, bool) or not isinstance(text, str):
        raise ValueError(f"{shown} is not a size with a unit ({_ALLOWED})")
    m = _SIZE_RE.match(text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"{shown} is not a size with a unit ({_ALLOWED})")
    v = float(m.group(1)) * _UNITS[m.group(2)]  # float, as sizes were always read (same bytes for every file)
    if not math.isfinite(v) or abs(v) >= 2.0**63:
        raise ValueError(f"{shown} is out of range ({_ALLOWED})")
    return int(round(v))


def format_size(n: int | None, exact: bool = False) -> str:
    """bytes -> ``"1.25 GiB"`` (3 significant decimals). ``exact`` keeps bytes exact (used in YAML so a
    round trip loses nothing). ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    if exact:
        for unit in ("GiB", "MiB", "KiB"):
            f = _UNITS[unit]
            if abs(n) >= f and n % (f // 1024 if f >= 1024 else 1) == 0:
                v = n / f
                s = f"{v:.6f}".rstrip("0").rstrip(".")
                if parse_size(f"{s} {unit}") == n:
                    return f"{s} {unit}"
        return f"{n} B"
    a = abs(n)
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if a >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.2f} {unit}"
    return f"{n} B"


def read_file_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, refused before they are read when it is not a regular file (a
    device such as ``/dev/zero``, a FIFO, a directory) or holds more than ``limit`` bytes (``what`` names the
    kind of file in the message). Raises ``ValueError`` (one line: the file, what is allowed) or ``OSError``
    (cannot be opened or read)."""
    _check_regular(path, os.stat(path), limit, what)  # before opening: opening a FIFO waits for a writer
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        _check_regular(path, st, limit, what)  # the file opened (it may have been replaced)
        parts = [f.read(st.st_size + 1)]  # read() allocates what it is asked for: the file's size, not the bound
        total = len(parts[0])
        while total > st.st_size and total <= limit:  # it grew while read: on, in pieces, up to the bound
            chunk = f.read(1 << 20)
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
    if total > limit:
        raise ValueError(f"{path}: refused: larger than a {what} may be ({format_size(limit)} at most)")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _check_regular(path: str | os.PathLike, st: os.stat_result, limit: int, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: cannot read: not a regular file (a {what} is read from a regular file only)")
    if st.st_size > limit:
        raise ValueError(f"{path}: refused: {format_size(st.st_size)} is larger than a {what} may be "
                         f"({format_size(limit)} at most)")
