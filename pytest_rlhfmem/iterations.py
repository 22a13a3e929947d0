"""A run of several iterations: per-iteration figures, their growth from iteration 2 on, and when a card runs out.

One iteration cannot show a leak (verl #1232: a CUDA OOM after 50-60 steps; verl #630: host memory climbing until
the process is killed). A recorded run that marks its iterations (the recipes' ``iterations=N`` override, a
program's ``rlhfmem.iteration()`` at the top of each step) carries ``iterations``: one row per iteration
k = 1..N (iteration 0, before the first mark, is the setup: models built, engines initialised), each with (bytes):

- ``peak_reserved`` / ``peak_allocated``: the device peaks over the iteration's windows (simulated on the CPU route
  and the simulated CUDA device, measured on a GPU);
- ``cuda_malloc_count``: the cudaMalloc calls the iteration made;
- ``host_anon_peak`` / ``host_peak_rss``: the host peaks measured while it ran (always measured);
- ``recorder_bytes``: the host memory the recording itself held at the iteration's end (the CPU allocation
  recorder's entries and marks: ``Recorder.own_bytes``; it grows with every allocation recorded, about 3 MiB per
  iteration of the tiny DeepSpeed-Chat PPO cell), and ``host_anon_program``: ``host_anon_peak`` less it, the
  program's own anonymous memory, what the host growth budget gates;
- ``phases``: per phase name, its device peaks in this iteration;
- ``kept_by_phase``: per phase, the bytes the iteration allocated there that were still allocated when the
  recording ended (a leak's tensors; a program that frees its step's tensors keeps nothing from iterations
  2..N-1).

Growth (:func:`growth`, bytes per iteration) is the least-squares slope of a figure over iterations 2..N:
iteration 1 is left out because it fills what a run keeps for good (optimizer states made at the first step, the
allocator's cache, lazily built buffers). It needs :data:`MIN_ITERATIONS` iterations. A result's ``metrics`` carry
it under :data:`GROWTH_METRICS` (clamped at 0: a budget size is never negative), which a budget gates like any
size (``budgets.py``: ``GROWTH_BUDGETS``); :func:`growth_message` says what an excess means.
"""

from __future__ import annotations

import math
import os

from .units import format_size

MIN_ITERATIONS = 3  # growth from iteration 2 on needs two points
# growth metric -> the per-iteration figure it is the slope of
GROWTH_METRICS = {"growth_peak_reserved": "peak_reserved", "growth_peak_allocated": "peak_allocated",
                  "growth_host_anon": "host_anon_program"}
DEVICE_FIGURES = ("peak_reserved", "peak_allocated")
HOST_FIGURES = ("host_anon_peak", "host_peak_rss", "recorder_bytes", "host_anon_program")
COUNT_FIGURES = ("cuda_malloc_count", "alloc_retries", "ooms")
DEFAULT_CARD_BYTES = 24 * 2**30  # the card a device growth is extrapolated to, unless the run names its own


def iteration_rows(windows: list[dict], window_iterations: list[int], host: dict[int, dict] | None = None,
                   kept: dict[int, dict[str, int]] | None = None, n: int | None = None,
                   recorder_bytes: dict[int, int] | None = None) -> list[dict]:
    """One rank's rows for iterations 1..N. ``windows``: the replay's windows in trace order (dicts with ``phase``,
    ``peak_reserved``, ``peak_allocated`` and the counts, bytes); ``window_iterations``: the iteration each window
    belongs to (the recorder's, one per window: ``Recorder.window_iterations``); ``host``: per iteration its host
    peaks (``HostMemory.iterations``); ``kept``: per iteration, bytes still allocated at the end by the phase that
    allocated them; ``n``: the iterations marked (default: the last window's); ``recorder_bytes``: per iteration the
    recording's own host bytes at its end (``Recorder.recorder_bytes``). Raises ``ValueError`` when the two
    lists differ in length (a trace whose windows the recorder did not mark)."""
    if len(windows) != len(window_iterations):
        raise ValueError(f"{len(windows)} windows in the trace, {len(window_iterations)} phase marks recorded")
    last = n if n is not None else max(window_iterations, default=0)
    rows = [{"iteration": k, **dict.fromkeys(DEVICE_FIGURES, 0), **dict.fromkeys(COUNT_FIGURES, 0),
             **dict.fromkeys(HOST_FIGURES, None), "time_s": 0.0, "phases": {}, "kept_by_phase": {}}
            for k in range(1, last + 1)]
    for w, k in zip(windows, window_iterations):
        if k < 1:
            continue
        row = rows[k - 1]
        for m in DEVICE_FIGURES:
            row[m] = max(row[m], int(w.get(m) or 0))
        for m in COUNT_FIGURES:
            row[m] += int(w.get(m) or 0)
        row["time_s"] = round(row["time_s"] + float(w.get("time_s") or 0.0), 6)
        p = row["phases"].setdefault(w["phase"], dict.fromkeys(DEVICE_FIGURES, 0))
        for m in DEVICE_FIGURES:
            p[m] = max(p[m], int(w.get(m) or 0))
    for row in rows:
        h = (host or {}).get(row["iteration"]) or {}
        for m in ("host_anon_peak", "host_peak_rss"):
            row[m] = h.get(m)
        row["recorder_bytes"] = int((recorder_bytes or {}).get(row["iteration"], 0))
        row["host_anon_program"] = (None if row["host_anon_peak"] is None
                                    else max(0, row["host_anon_peak"] - row["recorder_bytes"]))
        row["kept_by_phase"] = dict((kept or {}).get(row["iteration"]) or {})
    return rows


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """The scenario's rows from each rank's (:func:`iteration_rows`): per iteration and figure the maximum over the
    ranks (a budget is per GPU), phases and kept bytes too; ``[]`` when no rank has rows. Ranks with fewer rows
    (one that failed early) add what they have."""
    n = max((len(r) for r in per_rank), default=0)
    out = []
    for k in range(n):
        rows = [r[k] for r in per_rank if len(r) > k]
        row: dict = {"iteration": k + 1}
        for m in DEVICE_FIGURES + COUNT_FIGURES:
            row[m] = max(int(r.get(m) or 0) for r in rows)
        for m in HOST_FIGURES:
            vals = [r[m] for r in rows if r.get(m) is not None]
            row[m] = max(vals) if vals else None
        row["time_s"] = max(float(r.get("time_s") or 0.0) for r in rows)
        phases: dict[str, dict] = {}
        kept: dict[str, int] = {}
        for r in rows:
            for name, p in (r.get("phases") or {}).items():
                q = phases.setdefault(name, dict.fromkeys(DEVICE_FIGURES, 0))
                for m in DEVICE_FIGURES:
                    q[m] = max(q[m], int(p.get(m) or 0))
            for name, b in (r.get("kept_by_phase") or {}).items():
                kept[name] = max(kept.get(name, 0), int(b))
        row["phases"], row["kept_by_phase"] = phases, kept
        out.append(row)
    return out


def slope(values: list[float]) -> float:
    """The least-squares slope of ``values`` against 0, 1, 2, ... (units of a value per step); 0.0 for fewer than
    two values."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    den = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / den


def figure_growth(rows: list[dict], figure: str) -> float | None:
    """Bytes per iteration of ``figure`` over iterations 2..N (signed; :func:`slope`), ``None`` with fewer than
    :data:`MIN_ITERATIONS` rows or where an iteration lacks the figure."""
    vals = [r.get(figure) for r in rows[1:]]
    if len(rows) < MIN_ITERATIONS or any(v is None for v in vals):
        return None
    return slope([float(v) for v in vals])


def growth(rows: list[dict]) -> dict[str, int]:
    """The growth metrics of a run's rows (bytes per iteration from iteration 2 on, rounded, at least 0), under
    :data:`GROWTH_METRICS`; ``{}`` with fewer than :data:`MIN_ITERATIONS` iterations. A host figure no iteration
    measured is left out."""
    out = {}
    for metric, figure in GROWTH_METRICS.items():
        g = figure_growth(rows, figure)
        if g is not None:
            out[metric] = max(0, int(round(g)))
    return out


def keeping_phase(rows: list[dict]) -> tuple[str, int] | None:
    """``(phase, bytes per iteration)``: the phase whose allocations of iterations 2..N-1 most stayed allocated
    to the end of the recording (mean over those iterations), or ``None`` when nothing was kept. Iteration N is
    left out (what it hands to a next iteration is still held when the recording ends) and so is iteration 1."""
    middle = rows[1:-1]
    if not middle:
        return None
    totals: dict[str, int] = {}
    for r in middle:
        for name, b in (r.get("kept_by_phase") or {}).items():
            totals[name] = totals.get(name, 0) + int(b)
    if not totals:
        return None
    name, total = max(totals.items(), key=lambda kv: kv[1])
    per = total // len(middle)
    return (name, per) if per > 0 else None


def growing_phase(rows: list[dict], figure: str = "peak_allocated") -> tuple[str, float] | None:
    """``(phase, bytes per iteration)``: the phase whose ``figure`` grows fastest over iterations 2..N, or ``None``
    (fewer than :data:`MIN_ITERATIONS` rows, or no phase grows)."""
    if len(rows) < MIN_ITERATIONS:
        return None
    names = [n for n in rows[-1].get("phases") or {} if all(n in (r.get("phases") or {}) for r in rows[1:])]
    best = None
    for n in names:
        g = slope([float(r["phases"][n][figure]) for r in rows[1:]])
        if g > 0 and (best is None or g > best[1]):
            best = (n, g)
    return best


def runs_out_at(rows: list[dict], rate: float, capacity: int, figure: str) -> int | None:
    """The iteration at which ``figure`` (bytes), growing ``rate`` bytes per iteration from the last row's value,
    first exceeds ``capacity`` bytes; ``None`` for a rate <= 0 or no rows. The last iteration itself when it
    already exceeds it."""
    if not rows or rate <= 0:
        return None
    last = rows[-1]
    have = last.get(figure)
    if have is None:
        return None
    if have > capacity:
        return int(last["iteration"])
    return int(last["iteration"]) + math.floor((capacity - have) / rate) + 1


def card_label(n: int) -> str:
    """``24 GiB`` for a whole number of GiB, else :func:`~.units.format_size`'s text."""
    return f"{n // 2**30} GiB" if n % 2**30 == 0 else format_size(n)


def host_memory_bytes() -> int | None:
    """This machine's memory (``MemTotal`` of ``/proc/meminfo``, bytes), or ``None`` where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def growth_message(metric: str, rows: list[dict], card_bytes: int | None = None, simulated: bool = True) -> str:
    """One line for a growth metric over its budget: ``"peak allocated grows 4.00 MiB per iteration (iterations
    2-5, simulated): at this rate a 24 GiB card OOMs at iteration 6141; phase 'train' keeps 4.00 MiB of each
    iteration allocated to the end"``. A device metric is extrapolated from the last iteration's peak reserved to
    ``card_bytes`` (default :data:`DEFAULT_CARD_BYTES`) at the faster of the reserved and allocated rates; the host
    one from the last iteration's peak RSS to this machine's memory. Raises ``KeyError`` for a metric not in
    :data:`GROWTH_METRICS`."""
    figure = GROWTH_METRICS[metric]
    rate = figure_growth(rows, figure) or 0.0
    n = len(rows)
    label = ", simulated" if simulated and figure in DEVICE_FIGURES else (", measured" if figure in HOST_FIGURES
                                                                          else "")
    what = {"peak_reserved": "peak reserved", "peak_allocated": "peak allocated",
            "host_anon_program": "host anonymous memory (RSS less file pages and the recorder's own)"}[figure]
    line = f"{what} grows {format_size(int(round(rate)))} per iteration (iterations 2-{n}{label})"
    if figure in DEVICE_FIGURES:
        card = card_bytes or DEFAULT_CARD_BYTES
        fastest = max(rate, *(figure_growth(rows, f) or 0.0 for f in DEVICE_FIGURES))
        at = runs_out_at(rows, fastest, card, "peak_reserved")
        if at is not None:
            line += f": at this rate a {card_label(card)} card OOMs at iteration {at}"
    else:
        total = host_memory_bytes()
        at = runs_out_at(rows, rate, total, "host_peak_rss") if total else None
        if at is not None:
            line += f": at this rate this host's {format_size(total)} of memory is full at iteration {at}"
    kept = keeping_phase(rows)
    if kept is not None:
        line += (f"; phase {kept[0]!r} keeps {format_size(kept[1])} of each iteration allocated to the end of the "
                 "run")
    else:
        grows = growing_phase(rows, "peak_allocated" if figure in DEVICE_FIGURES else "peak_reserved")
        if grows is not None and figure in DEVICE_FIGURES:
            line += f"; phase {grows[0]!r} grows fastest ({format_size(int(round(grows[1])))} per iteration)"
    return line


def describe_rows(rows: list[dict]) -> list[str]:
    """The rows as text lines (iteration, peak reserved, peak allocated, cudaMalloc, host anonymous peak, the
    recorder's own bytes, peak RSS), with a header; ``[]`` without rows."""
    if not rows:
        return []
    head = ("iteration", "peak reserved", "peak allocated", "cudaMalloc", "host anon peak", "recorder's own",
            "host peak RSS")
    lines = [head] + [(str(r["iteration"]), format_size(r["peak_reserved"]), format_size(r["peak_allocated"]),
                       str(r["cuda_malloc_count"]), format_size(r.get("host_anon_peak")),
                       format_size(r.get("recorder_bytes")), format_size(r.get("host_peak_rss"))) for r in rows]
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(x, widths))) for x in lines]


def env_iterations() -> int | None:
    """``$RLHFMEM_ITERATIONS``: the iterations a capture asked the program to run (``rlhfmem_command(...,
    iterations=N)``, ``rlhfmem capture --iterations N``), for a program that reads it; ``None`` when unset.
    Raises ``ValueError`` for a value that is not a whole number >= 1."""
    v = os.environ.get(ENV_ITERATIONS)
    if v is None:
        return None
    if not v.strip().isdigit() or int(v) < 1:
        raise ValueError(f"${ENV_ITERATIONS}={v!r}: allowed values are whole numbers >= 1")
    return int(v)


ENV_ITERATIONS = "RLHFMEM_ITERATIONS"
