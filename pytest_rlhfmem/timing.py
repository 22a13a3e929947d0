"""Iteration times with their uncertainty: a time change inside run-to-run noise is never a finding.

One PPO iteration in a fresh process group on a shared machine varies by tens of percent from run to run
(issue 15: 9.33 s -> 50.97 s for the same program under other load). So every time comparison printed by
the project (session summary, diff report, plot, advisor) goes through :func:`compare_times`, which says
"within noise (+-X%)" unless the two figures' intervals are disjoint.

A figure's interval, in order of preference:

1. repeated iterations of this run (``--rlhfmem-time-rounds N`` in the plugin, ``rlhfmem run --time-rounds
   N``): the median of the rounds +- half their range;
2. the run-to-run spread recorded for that scenario (``baselines/<profile>/time_spread.yaml``, written by
   ``benchmarks/time_spread.py``): the figure +- the recorded relative half-range;
3. neither: the noise is unknown and the comparison says so instead of printing a percentage.

Two figures differ beyond noise when ``|head - base| > base_halfwidth + head_halfwidth`` (their intervals do
not overlap); the printed +-X% is that sum relative to ``base``. Times are seconds.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .budgets import read_yaml_file

SPREAD_FILE = "time_spread.yaml"


@dataclass
class TimeFigure:
    """An iteration time (seconds, the median of its rounds) and its relative half-width (``None`` = unknown)."""

    seconds: float
    noise_rel: float | None
    source: str  # "3 rounds", "recorded spread (5 runs)", "1 round"
    rounds: tuple[float, ...] = ()

    @property
    def halfwidth(self) -> float | None:
        return None if self.noise_rel is None else self.seconds * self.noise_rel

    def text(self) -> str:
        if self.noise_rel is None:
            return f"{self.seconds:.2f} s ({self.source}, noise unknown)"
        return f"{self.seconds:.2f} s +-{100 * self.noise_rel:.0f}% ({self.source})"


def rounds_spread(times: list[float]) -> tuple[float, float]:
    """``(median, relative range)`` of repeated times (seconds): the interval is the median +- the whole
    range ``max - min``. A half range is too narrow for a handful of rounds: ``[min, max]`` of n rounds holds
    the true median only with probability ``1 - 2**(1 - n)`` (75% for 3), and the median itself may sit at
    either end. Raises ``ValueError`` for no times."""
    if not times:
        raise ValueError("no times")
    med = statistics.median(times)
    return med, ((max(times) - min(times)) / med) if med > 0 else 0.0


def load_spreads(path: str | Path | None, strict: bool = False) -> dict[str, dict]:
    """``time_spread.yaml`` entries (scenario id -> {runs, median_s, spread}), read as budget files are
    (``budgets.read_yaml_file``: a regular file, no YAML anchor or alias); ``{}`` when absent. A file that cannot be
    read or holds anything else (a spread that is not a finite number >= 0) is ``{}`` too, or with ``strict`` (a
    file the user named: ``rlhfmem diff --time-spread``) raises ``ValueError``, one line naming the file and key."""
    if not path or not Path(path).exists():
        return {}
    try:
        data = read_yaml_file(path) or {}
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries or {}, dict):
            raise ValueError(f"{path}: entries: must be a mapping of scenario id -> {{runs, median_s, spread}}")
        for sid, e in (entries or {}).items():
            sp = e.get("spread") if isinstance(e, dict) else None
            if not isinstance(e, dict) or (sp is not None and (isinstance(sp, bool) or not isinstance(sp, (int, float))
                                                               or not math.isfinite(sp) or sp < 0)):
                raise ValueError(f"{path}: entry {sid!r}: must be a mapping whose spread is a finite number >= 0 "
                                 f"(a fraction of the median), got {e!r}")
    except ValueError:  # BudgetError included
        if strict:
            raise
        return {}
    return dict(entries or {})


def _flushless(sid: str) -> str:
    import re

    return re.sub(r"/flush-[a-z-]+/", "/flush-*/", sid)


def time_figure(result: dict, spreads: dict[str, dict] | None = None) -> TimeFigure | None:
    """The iteration time of a scenario result with its noise (see the module docstring); ``None`` when the
    result carries no time. A recorded spread is looked up by scenario id, then by the id with any flush
    policy (on CPU a flush is a trace marker: it cannot change the iteration's time)."""
    spreads = spreads or {}
    sid = result.get("scenario_id", "")
    rec = spreads.get(sid) or next((v for k, v in spreads.items() if _flushless(k) == _flushless(sid)), None)
    rounds = [t for t in (result.get("time_rounds") or []) if t]
    if len(rounds) >= 2:
        # Rounds run back to back see the load of their minutes only; a recorded spread (between sessions)
        # is the floor when there is one.
        med, rel = rounds_spread(rounds)
        if rec and rec.get("spread") is not None and float(rec["spread"]) > rel:
            return TimeFigure(med, float(rec["spread"]), f"{len(rounds)} rounds, recorded spread floor",
                              tuple(rounds))
        return TimeFigure(med, rel, f"{len(rounds)} rounds", tuple(rounds))
    t = result.get("iteration_wall_s")
    if not t:
        return None
    if rec and rec.get("spread") is not None:
        return TimeFigure(float(t), float(rec["spread"]), f"recorded spread of {rec.get('runs', '?')} runs", (t,))
    return TimeFigure(float(t), None, "1 round", (t,))


def compare_times(base: TimeFigure | None, head: TimeFigure | None) -> tuple[str, str]:
    """``(status, text)``: status ``within-noise``, ``slower``, ``faster`` or ``unknown``; the text never
    prints a bare percentage."""
    if base is None or head is None:
        return "unknown", "time -"
    arrow = f"time {base.seconds:.2f} s -> {head.seconds:.2f} s"
    if base.halfwidth is None or head.halfwidth is None:
        return "unknown", (f"{arrow} (noise unknown: {base.source} vs {head.source}; measure it with "
                           "--rlhfmem-time-rounds N)")
    noise = base.halfwidth + head.halfwidth
    pct = 100.0 * noise / base.seconds if base.seconds else 0.0
    delta = head.seconds - base.seconds
    if abs(delta) <= noise:
        return "within-noise", f"{arrow}: within noise (+-{pct:.0f}%, {base.source} vs {head.source})"
    return ("slower" if delta > 0 else "faster"), (f"{arrow}: {100.0 * delta / base.seconds:+.1f}% (beyond noise "
                                                   f"+-{pct:.0f}%, {base.source} vs {head.source})")


def run_rounds(once, rounds: int, snapshot_dir=None) -> tuple[dict, list[dict]]:  # noqa: ANN001
    """Run ``once(snapshot_dir)`` and, when it succeeded and ``rounds`` > 1, ``once(None)`` ``rounds - 1`` more
    times (snapshots from the first run only); returns the result with the extra rounds folded in
    (:func:`with_rounds`) and every run made (for their work directories). ``rlhfmem run``, ``rlhfmem capture``
    and the plugin's two fixtures share it."""
    first = once(snapshot_dir)
    runs = [first]
    if rounds > 1 and first["status"] == "ok":  # time noise from repeated runs
        runs += [once(None) for _ in range(rounds - 1)]
        return with_rounds(first, runs[1:]), runs
    return first, runs


def with_rounds(first: dict, more: list[dict]) -> dict:
    """Fold extra rounds of the same scenario into ``first`` (its memory figures and traces are kept):
    ``time_rounds`` lists each round's iteration time, ``iteration_wall_s`` becomes their median. A failed
    extra round is noted in ``time_rounds_failed`` and left out."""
    times = [first.get("iteration_wall_s")] + [r.get("iteration_wall_s") for r in more if r.get("status") == "ok"]
    times = [t for t in times if t]
    out = dict(first)
    out["time_rounds"] = times
    out["time_rounds_failed"] = sum(1 for r in more if r.get("status") != "ok")
    if len(times) >= 2:
        out["iteration_wall_s"] = round(statistics.median(times), 6)
    return out


def flush_cost_text(result: dict) -> str | None:
    """The flush's own cost read from the result's traces (max over ranks): count, the cudaMalloc/cudaFree
    calls it causes and the bytes re-acquired; on CUDA the measured seconds of the flushes."""
    from .units import format_size

    costs = [rk.get("flush_cost") for rk in result.get("ranks") or [] if rk.get("flush_cost")]
    if not costs:
        return None
    n = max(c["flushes"] for c in costs)
    if not n:
        return "no flush"
    m = max(c["extra_cuda_malloc"] for c in costs)
    f = max(c["extra_cuda_free"] for c in costs)
    b = max(c["bytes_reacquired"] for c in costs)
    measured = [sum(c.get("measured_flush_s") or []) for c in costs if c.get("measured_flush_s")]
    t = f", measured {1e3 * max(measured):.1f} ms in empty_cache" if measured else ""
    return (f"flush cost (from the trace): {n} flushes, {m:+d} cudaMalloc, {f:+d} cudaFree, "
            f"{format_size(b)} re-acquired{t}")


def session_spreads(baselines_dir: str | Path) -> dict[str, dict]:
    """Every recorded spread under ``baselines_dir`` (``<profile>/time_spread.yaml``), merged."""
    out: dict[str, dict] = {}
    d = Path(baselines_dir)
    if d.is_dir():
        for f in sorted(d.glob(f"*/{SPREAD_FILE}")):
            out.update(load_spreads(f))
    return out
