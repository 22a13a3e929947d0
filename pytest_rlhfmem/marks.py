"""The ``gpu`` marker: its help line and how its arguments are read.

What a marked test does when its devices are missing (run, skip or fail) is ``--gpu-marker``'s choice,
applied by the session's setup hook (``session.py``). Memory is given in GB as cards are sold
(``min_memory_gb``) or in binary GiB (``min_memory_gib``); the comparison with a device's ``total_memory``
(bytes) is :func:`~pytest_rlhfmem.hardware.gpu_shortfall`'s.
"""

from __future__ import annotations

import pytest

GPU_MARKER_HELP = (
    "gpu(count=1, min_memory_gb=None): needs `count` CUDA devices, each sold as at least "
    "`min_memory_gb` GB: a device qualifies when its total_memory is at least 0.96 x min_memory_gb x 10^9 "
    "bytes, so every card sold as N GB qualifies for N (an A10G reports 23,028 MiB, an RTX 3090 24,268 MiB: "
    "both 24) and none sold a size smaller; min_memory_gib=N instead asks for exactly N binary GiB "
    "(N x 2^30 bytes; no card sold as 24 GB has 24 GiB); see --gpu-marker for what happens when they are missing")

GPU_MARK_KEYS = ("count", "min_memory_gb", "min_memory_gib")


def gpu_mark_args(mark: pytest.Mark) -> tuple[int, float | None, float | None]:
    """``(count, min_memory_gib, min_memory_gb)`` of a ``gpu`` mark: ``gpu(count=1, min_memory_gb=None)``,
    or ``min_memory_gib`` (binary GiB) instead of ``min_memory_gb`` (GB as sold; see
    :func:`~pytest_rlhfmem.hardware.gpu_shortfall`). Raises ``ValueError`` (one line naming the key and the
    allowed ones) for an unknown keyword, a memory given by position (GB or GiB?), both memory keys, or a
    count or memory that is not a positive number."""
    unknown = [k for k in mark.kwargs if k not in GPU_MARK_KEYS]
    if unknown:
        raise ValueError(f"gpu mark: unknown keyword {unknown[0]!r}; allowed: count, min_memory_gb (GB as sold), "
                         f"min_memory_gib (binary GiB)")
    if len(mark.args) > 1:
        raise ValueError(f"gpu mark: memory given by position ({mark.args[1]!r}); give it by keyword: "
                         f"min_memory_gb (GB as sold) or min_memory_gib (binary GiB)")
    if "min_memory_gb" in mark.kwargs and "min_memory_gib" in mark.kwargs:
        raise ValueError("gpu mark: min_memory_gb and min_memory_gib both given; allowed: one of them")
    values = {"count": mark.kwargs.get("count", mark.args[0] if mark.args else 1),
              "min_memory_gb": mark.kwargs.get("min_memory_gb"), "min_memory_gib": mark.kwargs.get("min_memory_gib")}
    for key, v in values.items():
        ok = v is None and key != "count" or (
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and (key != "count" or v == int(v)))
        if not ok:
            kind = "an integer >= 1" if key == "count" else "a number > 0"
            raise ValueError(f"gpu mark: {key}={v!r}; allowed: {kind}")
    gib, gb = values["min_memory_gib"], values["min_memory_gb"]
    return int(values["count"]), (float(gib) if gib is not None else None), (float(gb) if gb is not None else None)
