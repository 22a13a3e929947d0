"""The study's Figure 1 for one scenario (or two overlaid): reserved, allocated and reserved without
fragmentation over the iteration, with phase bands, the reserved peak and the fragmentation-free peak.

Input: a result with per-rank ``series`` (``rlhfmem run --json`` or a session ``--rlhfmem-json``). The
x axis is the allocator event index (events are what the allocator sees); y is GiB.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .report import ReportInputError

GIB = float(2**30)
PHASE_COLOURS = ("#f2f2f2", "#e3ecf7")


def load_result(path: str | Path, scenario: str | None = None) -> dict:
    """One scenario result from a run JSON or a session JSON. Raises :class:`ReportInputError` naming
    the file and, when a session holds several scenarios, the ids to choose from."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportInputError(f"{p}: cannot read a result ({exc})") from None
    results = data.get("results") if isinstance(data, dict) and "results" in data else [data]
    results = [r for r in results if isinstance(r, dict) and "scenario_id" in r]
    if scenario:
        exact = [r for r in results if r["scenario_id"] == scenario]
        # in a second file, the scenario that differs only in its flush policy (to overlay policies)
        results = exact or [r for r in results if _flushless(r["scenario_id"]) == _flushless(scenario)]
    if len(results) != 1:
        ids = [r["scenario_id"] for r in (data.get("results") or [])] if isinstance(data, dict) else []
        raise ReportInputError(f"{p}: {'no' if not results else 'several'} scenario results"
                               + (f" for {scenario!r}" if scenario else "") +
                               (f"; choose one with --scenario: {', '.join(ids)}" if ids else ""))
    r = results[0]
    if not any(rank.get("series") for rank in r.get("ranks", [])):
        raise ReportInputError(f"{p}: {r['scenario_id']} has no memory series (failed run?)")
    return r


def _flushless(scenario_id: str) -> str:
    return re.sub(r"/flush-[a-z-]+/", "/flush-*/", scenario_id)


def _peak_rank(result: dict) -> dict:
    ranks = [rk for rk in result["ranks"] if rk.get("series")]
    return max(ranks, key=lambda rk: rk["total"]["peak_reserved"])


def _plot_host_rss(ax, rank: dict, starts: list, end: int) -> None:
    """The rank's host peak RSS per phase (measured, never simulated) as steps on a right-hand axis."""
    per = {p["phase"]: p.get("host_peak_rss") for p in rank.get("phases", [])}
    if not starts or not any(per.values()):
        return
    ax2 = ax.twinx()
    for n, (phase, start) in enumerate(starts):
        stop = starts[n + 1][1] if n + 1 < len(starts) else end
        v = per.get(phase)
        if v:
            ax2.hlines(v / GIB, start, stop, colors="#7d3c98", lw=1.4, linestyles=":",
                       label="host peak RSS per phase (measured)" if n == 0 else None)
    ax2.set_ylabel("host peak RSS, GiB (measured)", color="#7d3c98")
    ax2.set_ylim(bottom=0, top=max(v for v in per.values() if v) / GIB * 1.15)
    ax2.legend(loc="upper right", fontsize=8, frameon=False)


def plot_results(results: list[tuple[str, dict]], out: str | Path) -> Path:
    """Draw Figure 1 for up to two ``(label, result)`` pairs into ``out`` (PNG). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 6), dpi=110)
    styles = ("-", "--")
    colours = {"reserved": "#c0392b", "allocated": "#2471a3", "reserved_without_fragmentation": "#229954"}
    names = {"reserved": "reserved", "allocated": "allocated",
             "reserved_without_fragmentation": "reserved w/o fragmentation"}
    first_series = None
    for i, (label, result) in enumerate(results[:2]):
        rank = _peak_rank(result)
        s = rank["series"]
        first_series = first_series or s
        x = s["index"]
        for key in ("reserved", "allocated", "reserved_without_fragmentation"):
            ax.plot(x, [v / GIB for v in s[key]], styles[i], color=colours[key], lw=1.6 if i == 0 else 1.3,
                    label=f"{names[key]} ({label})" if len(results) > 1 else names[key])
        k = max(range(len(x)), key=lambda j: s["reserved"][j])
        tag = f" ({label})" if len(results) > 1 else ""
        ax.annotate(f"peak reserved {s['reserved'][k] / GIB:.3f} GiB{tag}", (x[k], s["reserved"][k] / GIB),
                    xytext=(0.42, 0.80 - 0.07 * i), textcoords="axes fraction", color=colours["reserved"], fontsize=9,
                    arrowprops={"arrowstyle": "->", "color": colours["reserved"], "lw": 0.8})
        ax.plot([x[k]], [s["reserved"][k] / GIB], "o", color=colours["reserved"])
        j = max(range(len(x)), key=lambda q: s["reserved_without_fragmentation"][q])
        rwf = s["reserved_without_fragmentation"][j] / GIB
        ax.plot([x[j]], [rwf], "s", color=colours["reserved_without_fragmentation"])
        ax.annotate(f"fragmentation-free peak {rwf:.3f} GiB{tag}", (x[j], rwf), xytext=(0.42, 0.60 - 0.07 * i),
                    textcoords="axes fraction", color=colours["reserved_without_fragmentation"], fontsize=9,
                    arrowprops={"arrowstyle": "->", "color": colours["reserved_without_fragmentation"], "lw": 0.8})
    # phase bands of the first result
    starts = first_series.get("phase_starts") or []
    end = first_series["index"][-1] if first_series["index"] else 0
    ymax = ax.get_ylim()[1]
    for n, (phase, start) in enumerate(starts):
        stop = starts[n + 1][1] if n + 1 < len(starts) else end
        ax.axvspan(start, stop, color=PHASE_COLOURS[n % 2], zorder=0)
        ax.text((start + stop) / 2, ymax * 0.98, phase, ha="center", va="top", fontsize=8, rotation=90)
    _plot_host_rss(ax, _peak_rank(results[0][1]), starts, end)
    from .timing import compare_times, time_figure

    figs = [time_figure(r) for _, r in results[:2]]
    if len(figs) == 2:  # a time difference is shown only with its noise (issue 15)
        tnote = compare_times(figs[0], figs[1])[1] + f" ({results[0][0]} vs {results[1][0]})"
    else:
        tnote = f"iteration time {figs[0].text()}" if figs[0] else ""
    if tnote:
        ax.text(0.01, 0.01, tnote, transform=ax.transAxes, fontsize=8, color="#555555", va="bottom")
    r0 = results[0][1]
    sim = " (simulated: CPU trace through the allocator model)" if r0.get("simulated") else " (CUDA)"
    ax.set_title(f"{r0['scenario_id']}{sim}" if len(results) == 1 else
                 f"{_flushless(r0['scenario_id'])}: {results[0][0]} vs {results[1][0]}{sim}", fontsize=10)
    ax.set_xlabel("allocator events")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0, top=ymax * 1.08)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, ncol=3, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    plt.close(fig)
    return p
