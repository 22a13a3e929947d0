"""The study's Figure 1 for one scenario (or two overlaid): reserved, allocated and reserved without
fragmentation over the iteration, with phase bands, the reserved peak and the fragmentation-free peak.

Input: a result with per-rank ``series`` (``rlhfmem run --json`` or a session ``--rlhfmem-json``). The
x axis is the allocator event index (events are what the allocator sees); y is in the unit the data needs
(KiB, MiB or GiB: :func:`axis_unit`), the host RSS axis in its own. Nothing is placed where it can cover
anything else: the peaks are markers whose values are in the legend (one entry per run), the phase names
sit in a band above the curves, staggered into rows where neighbours would touch, and the time note is
below the legend, outside the axes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .report import ReportInputError

GIB = float(2**30)
PHASE_COLOURS = ("#f2f2f2", "#e3ecf7")
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
HOST_STYLES = ((":", "#7d3c98"), ("-.", "#d35400"))  # per run: host peak RSS line style and colour


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


def axis_unit(max_bytes: float) -> tuple[str, float]:
    """The largest binary unit in which ``max_bytes`` is at least 1 (``("MiB", 2**20)`` for 42 MiB); bytes
    below 1 KiB are shown in KiB."""
    for u, f in UNITS:
        if max_bytes >= f:
            return u, float(f)
    return "KiB", 1024.0


def _host_per_phase(rank: dict) -> dict:
    return {p["phase"]: p.get("host_peak_rss") for p in rank.get("phases", []) if p.get("host_peak_rss")}


def _plot_host_rss(ax, runs: list[tuple[str, dict]], starts: list, end: int, tagged: bool) -> list:
    """Each run's host peak RSS per phase (measured, never simulated) as steps on a right-hand axis, one line
    style and colour per run. Returns the legend handles."""
    pers = [(label, _host_per_phase(_peak_rank(r))) for label, r in runs]
    top = max((v for _, per in pers for v in per.values()), default=0)
    if not starts or not top:
        return []
    unit, div = axis_unit(top)
    ax2 = ax.twinx()
    handles = []
    for i, (label, per) in enumerate(pers):
        style, colour = HOST_STYLES[i]
        for n, (phase, start) in enumerate(starts):
            stop = starts[n + 1][1] if n + 1 < len(starts) else end
            v = per.get(phase)
            if v:
                h = ax2.hlines(v / div, start, stop, colors=colour, lw=1.6, linestyles=style,
                               label=f"host peak RSS per phase, measured{f' ({label})' if tagged else ''}")
        if per:
            handles.append(h)
    ax2.set_ylabel(f"host peak RSS, {unit} (measured)", color=HOST_STYLES[0][1])
    ax2.set_ylim(bottom=0, top=top / div * 1.3)
    return handles


def _place_phase_labels(fig, ax, starts: list, end: int) -> float:
    """Phase names centred on their bands at the top of the axes, horizontal; a name that would touch one
    already placed moves down a row (rows are tried until it fits). Returns the lowest label's bottom, in
    axes fraction (1.0 without labels), for the caller to keep the curves below it."""
    import matplotlib.transforms as mtransforms

    trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    renderer = fig.canvas.get_renderer()
    placed: list = []
    for n, (phase, start) in enumerate(starts):
        stop = starts[n + 1][1] if n + 1 < len(starts) else end
        ax.axvspan(start, stop, color=PHASE_COLOURS[n % 2], zorder=0)
        for row in range(len(starts)):
            t = ax.text((start + stop) / 2, 0.985 - 0.05 * row, phase, transform=trans, ha="center", va="top",
                        fontsize=8, color="#333333", clip_on=False)
            box = t.get_window_extent(renderer).expanded(1.08, 1.1)
            if not any(box.overlaps(b) for b in placed):
                placed.append(box)
                break
            t.remove()
    if not placed:
        return 1.0
    return min(ax.transAxes.inverted().transform((0, b.y0))[1] for b in placed)


def plot_results(results: list[tuple[str, dict]], out: str | Path) -> Path:
    """Draw Figure 1 for up to two ``(label, result)`` pairs into ``out`` (PNG). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = results[:2]
    tagged = len(results) > 1
    fig, ax = plt.subplots(figsize=(11, 6), dpi=110)
    styles = ("-", "--")
    colours = {"reserved": "#c0392b", "allocated": "#2471a3", "reserved_without_fragmentation": "#229954"}
    names = {"reserved": "reserved", "allocated": "allocated",
             "reserved_without_fragmentation": "reserved w/o fragmentation"}
    unit, div = axis_unit(max(max(_peak_rank(r)["series"]["reserved"] or [0]) for _, r in results))
    first_series = None
    top = 0.0
    for i, (label, result) in enumerate(results):
        s = _peak_rank(result)["series"]
        first_series = first_series or s
        x = s["index"]
        tag = f" ({label})" if tagged else ""
        for key in ("reserved", "allocated", "reserved_without_fragmentation"):
            ax.plot(x, [v / div for v in s[key]], styles[i], color=colours[key], lw=1.6 if i == 0 else 1.3,
                    label=f"{names[key]}{tag}")
        k = max(range(len(x)), key=lambda j: s["reserved"][j])
        j = max(range(len(x)), key=lambda q: s["reserved_without_fragmentation"][q])
        pr, rwf = s["reserved"][k] / div, s["reserved_without_fragmentation"][j] / div
        top = max(top, pr)
        fill = colours["reserved"] if i == 0 else "white"
        ax.plot([x[k]], [pr], "o", color=colours["reserved"], mfc=fill, ms=7, zorder=5,
                label=f"peak reserved {pr:.2f} {unit}{tag}")
        ax.plot([x[j]], [rwf], "s", color=colours["reserved_without_fragmentation"],
                mfc=colours["reserved_without_fragmentation"] if i == 0 else "white", ms=6, zorder=5,
                label=f"fragmentation-free peak {rwf:.2f} {unit}{tag}")
    starts = first_series.get("phase_starts") or []
    end = first_series["index"][-1] if first_series["index"] else 0
    ax.set_ylim(bottom=0, top=(top or 1.0) * 1.15)
    host = _plot_host_rss(ax, results, starts, end, tagged)
    r0 = results[0][1]
    sim = " (simulated: CPU trace through the allocator model)" if r0.get("simulated") else " (CUDA)"
    ax.set_title(f"{r0['scenario_id']}{sim}" if not tagged else
                 f"{_flushless(r0['scenario_id'])}: {results[0][0]} vs {results[1][0]}{sim}", fontsize=10)
    ax.set_xlabel("allocator events")
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    handles += host
    labels += [h.get_label() for h in host]
    leg = ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.11), fontsize=8,
                    ncol=2 if tagged else 3, frameon=False)
    from .timing import compare_times, time_figure

    figs = [time_figure(r) for _, r in results]
    if len(figs) == 2:  # a time difference is shown only with its noise (issue 15)
        tnote = compare_times(figs[0], figs[1])[1] + f" ({results[0][0]} vs {results[1][0]})"
    else:
        tnote = f"iteration time {figs[0].text()}" if figs[0] else ""
    artists = [leg]
    if tnote:  # below the legend, outside the axes: nothing can cover it
        artists.append(ax.annotate(tnote, xy=(0, 0), xycoords=leg, xytext=(0, -4), textcoords="offset points",
                                   va="top", ha="left", fontsize=8, color="#555555"))
    lowest = _place_phase_labels(fig, ax, starts, end)  # last: the layout is final, overlaps measured right
    ax.set_ylim(bottom=0, top=(top or 1.0) / max(0.3, lowest - 0.04))  # the curves stay below the names
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, bbox_inches="tight", bbox_extra_artists=artists)
    plt.close(fig)
    return p
