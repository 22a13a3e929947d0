"""Sizes with units: bytes inside the code, "18.8 GiB" in files and human output (powers of 1024)."""

from __future__ import annotations

import re

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
          "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
_SIZE_RE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")


def parse_size(text: str) -> int:
    """``"312.5 MiB"`` -> bytes. Units: B, KiB, MiB, GiB, TiB (KB/MB/GB/TB read as powers of 1024 too).

    Raises ``ValueError`` naming the allowed units for a bare number or an unknown unit.
    """
    if isinstance(text, bool) or not isinstance(text, str):
        raise ValueError(f"{text!r} is not a size with a unit (e.g. '312.5 MiB'; units: B, KiB, MiB, GiB, TiB)")
    m = _SIZE_RE.match(text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a size with a unit (e.g. '312.5 MiB'; units: B, KiB, MiB, GiB, TiB)")
    return int(round(float(m.group(1)) * _UNITS[m.group(2)]))


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
