"""The study's Figure 1 for one scenario (or two, one panel each): reserved, allocated and reserved without
fragmentation over the iteration, with phase bands, the reserved peak and the fragmentation-free peak.

Input: a result with per-rank ``series`` (``rlhfmem run --json`` or a session ``--rlhfmem-json``). The
x axis is the allocator event index (events are what the allocator sees); y is in the unit the data needs
(KiB, MiB or GiB: :func:`axis_unit`), the host RSS axis in its own. Nothing is placed where it can cover
anything else: the peaks are markers whose values are in the legend (one entry per run), each phase name is
written once per panel in one row above the curves (on its widest window, where it fits), the legend names every
phase band's colour, and the time note is below the legend, outside the axes. Two runs of different lengths get one
panel each, so each run's bands are its own.
"""

from __future__ import annotations

import re
from pathlib import Path

from .report import ReportInputError, read_results

GIB = float(2**30)
# one light colour per phase name (bands), distinct at a glance and light enough for the curves on them
PHASE_COLOURS = ("#e8e8e8", "#dce9f7", "#fbe5d0", "#dff2dc", "#efe0f5", "#fdf5c9", "#d9f2f2", "#f7dde3")
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
HOST_STYLES = ((":", "#7d3c98"), ("-.", "#d35400"))  # per run: host peak RSS line style and colour


def load_result(path: str | Path, scenario: str | None = None) -> dict:
    """One scenario result from a run JSON or a session JSON (read and checked by :func:`~.report.read_results`).
    Raises :class:`ReportInputError` naming the file and, when a session holds several scenarios, the ids to
    choose from; or the key of a result that cannot be drawn (a rank's series of unequal lengths, none with a
    point, a ranked series without ``total.peak_reserved``)."""
    p = Path(path)
    every = read_results(p)
    results = every
    if scenario:
        exact = [r for r in results if r["scenario_id"] == scenario]
        # in a second file, the scenario that differs only in its flush policy (to overlay policies)
        results = exact or [r for r in results if _flushless(r["scenario_id"]) == _flushless(scenario)]
    if len(results) != 1:
        ids = [r["scenario_id"] for r in every] if len(every) > 1 else []
        raise ReportInputError(f"{p}: {'no' if not results else 'several'} scenario results"
                               + (f" for {scenario!r}" if scenario else "") +
                               (f"; choose one with --scenario: {', '.join(ids)}" if ids else ""))
    r = results[0]
    if not any(rank.get("series") for rank in r.get("ranks") or []):
        raise ReportInputError(f"{p}: {r['scenario_id']} has no memory series (failed run?)")
    for k, rank in enumerate(r["ranks"]):
        s = rank.get("series")
        if not s:
            continue
        where = f"{p}: {r['scenario_id']}: ranks[{k}].series"
        lengths = {key: len(s.get(key) or []) for key in ("index", "reserved", "allocated",
                                                          "reserved_without_fragmentation")}
        if len(set(lengths.values())) != 1 or not lengths["index"]:
            raise ReportInputError(f"{where}: index, reserved, allocated and reserved_without_fragmentation must be "
                                   f"lists of one equal length >= 1, got lengths {lengths}")
        if (rank.get("total") or {}).get("peak_reserved") is None:
            raise ReportInputError(f"{p}: {r['scenario_id']}: ranks[{k}].total.peak_reserved: must be a number "
                                   "(bytes) for a rank with a series")
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
    return {p["phase"]: p.get("host_peak_rss") for p in rank.get("phases") or [] if p and p.get("host_peak_rss")}


def _segments(series: dict) -> list[tuple[str, int, int]]:
    """The run's phase windows as ``(phase, first event, end)``; a phase resumed after a nested one, or repeated once
    per step, is several windows of one name."""
    starts = [(p, int(s)) for p, s in (series.get("phase_starts") or [])]
    end = (series["index"][-1] + 1) if series.get("index") else 0
    return [(p, s, starts[n + 1][1] if n + 1 < len(starts) else end) for n, (p, s) in enumerate(starts)]


def phase_colours(results: list[tuple[str, dict]]) -> dict[str, str]:
    """One band colour per phase NAME, in order of first appearance over every run, so a phase has the same colour
    in each panel and the legend names it once."""
    names: list[str] = []
    for _, r in results:
        for phase, _, _ in _segments(_peak_rank(r)["series"]):
            if phase not in names:
                names.append(phase)
    return {name: PHASE_COLOURS[n % len(PHASE_COLOURS)] for n, name in enumerate(names)}


def _plot_host_rss(ax, run: tuple[str, dict], i: int, segments: list, top: float, tagged: bool) -> list:
    """The run's host peak RSS per phase (measured, never simulated) as steps on a right-hand axis, one line style and
    colour per run; ``top``: the highest host figure of every run (one scale for every panel). Returns the legend
    handle (one, or none)."""
    label, r = run
    per = _host_per_phase(_peak_rank(r))
    if not segments or not top or not per:
        return []
    unit, div = axis_unit(top)
    ax2 = ax.twinx()
    style, colour = HOST_STYLES[i]
    h = None
    for phase, start, stop in segments:
        v = per.get(phase)
        if v:
            h = ax2.hlines(v / div, start, stop, colors=colour, lw=1.6, linestyles=style,
                           label=f"host peak RSS per phase, measured{f' ({label})' if tagged else ''}")
    ax2.set_ylabel(f"host peak RSS, {unit} (measured)", color=HOST_STYLES[0][1])
    ax2.set_ylim(bottom=0, top=top / div * 1.3)
    return [h] if h is not None else []


def _bands_and_names(fig, ax, segments: list, colours: dict[str, str]) -> float:
    """Shade each phase window in its phase's colour, and write each phase NAME once, centred on its widest window,
    in one row at the top of the axes; a name wider than its widest window, or touching a name already written, is
    left to the legend (which names every band). Returns the names' bottom in axes fraction (1.0 without names), for
    the caller to keep the curves below them."""
    import matplotlib.transforms as mtransforms

    trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    for phase, start, stop in segments:
        ax.axvspan(start, stop, color=colours[phase], zorder=0, lw=0)
    widest: dict[str, tuple[int, int]] = {}
    for phase, start, stop in segments:
        if phase not in widest or stop - start > widest[phase][1] - widest[phase][0]:
            widest[phase] = (start, stop)
    renderer = fig.canvas.get_renderer()
    placed: list = []
    for phase, (start, stop) in sorted(widest.items(), key=lambda kv: kv[1][0] - kv[1][1]):  # widest first
        t = ax.text((start + stop) / 2, 0.985, phase, transform=trans, ha="center", va="top", fontsize=8,
                    color="#333333", clip_on=False)
        box = t.get_window_extent(renderer).expanded(1.08, 1.1)
        x0, x1 = (ax.transData.transform((v, 0))[0] for v in (start, stop))
        if box.width > x1 - x0 or any(box.overlaps(b) for b in placed):
            t.remove()
            continue
        placed.append(box)
    if not placed:
        return 1.0
    return min(ax.transAxes.inverted().transform((0, b.y0))[1] for b in placed)


def _matplotlib():
    """matplotlib.pyplot on the Agg backend, or :class:`ReportInputError` naming the ``plot`` extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportInputError("plot needs matplotlib: pip install 'pytest-rlhfmem[plot]'") from None
    return plt


def plot_results(results: list[tuple[str, dict]], out: str | Path) -> Path:
    """Draw Figure 1 for up to two ``(label, result)`` pairs into ``out`` (PNG), one panel per run (each with its own
    events and phase bands; one y scale for both). Returns the path."""
    plt = _matplotlib()
    from matplotlib.patches import Patch

    results = results[:2]
    tagged = len(results) > 1
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 6 if not tagged else 9.5), dpi=110, sharey=True,
                             squeeze=False)
    axes = [a for (a,) in axes]
    styles = ("-", "--")
    colours = {"reserved": "#c0392b", "allocated": "#2471a3", "reserved_without_fragmentation": "#229954"}
    names = {"reserved": "reserved", "allocated": "allocated",
             "reserved_without_fragmentation": "reserved w/o fragmentation"}
    unit, div = axis_unit(max(max(_peak_rank(r)["series"]["reserved"] or [0]) for _, r in results))
    bands = phase_colours(results)
    host_top = max((v for _, r in results for v in _host_per_phase(_peak_rank(r)).values()), default=0)
    top = max(max(_peak_rank(r)["series"]["reserved"] or [0]) for _, r in results) / div
    lowest, host, segments_of = 1.0, [], []
    r0 = results[0][1]
    sim = " (simulated: CPU trace through the allocator model)" if r0.get("simulated") else " (CUDA)"
    for i, ((label, result), ax) in enumerate(zip(results, axes)):
        s = _peak_rank(result)["series"]
        x = s["index"]
        tag = f" ({label})" if tagged else ""
        for key in ("reserved", "allocated", "reserved_without_fragmentation"):
            ax.plot(x, [v / div for v in s[key]], styles[i], color=colours[key], lw=1.6 if i == 0 else 1.3,
                    label=f"{names[key]}{tag}")
        k = max(range(len(x)), key=lambda j: s["reserved"][j])
        j = max(range(len(x)), key=lambda q: s["reserved_without_fragmentation"][q])
        pr, rwf = s["reserved"][k] / div, s["reserved_without_fragmentation"][j] / div
        fill = colours["reserved"] if i == 0 else "white"
        ax.plot([x[k]], [pr], "o", color=colours["reserved"], mfc=fill, ms=7, zorder=5,
                label=f"peak reserved {pr:.2f} {unit}{tag}")
        ax.plot([x[j]], [rwf], "s", color=colours["reserved_without_fragmentation"],
                mfc=colours["reserved_without_fragmentation"] if i == 0 else "white", ms=6, zorder=5,
                label=f"fragmentation-free peak {rwf:.2f} {unit}{tag}")
        segments = _segments(s)
        segments_of.append(segments)
        ax.set_xlim(0, max(segments[-1][2] if segments else 0, x[-1] if x else 0, 1))
        ax.set_ylim(bottom=0, top=(top or 1.0) * 1.15)
        host += _plot_host_rss(ax, (label, result), i, segments, host_top, tagged)
        ax.set_xlabel(f"allocator events{f' of {label}' if tagged else ''}")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if tagged:
            ax.set_title(f"{label}: {result['scenario_id']}", fontsize=9, loc="left")
    title = fig.suptitle(f"{r0['scenario_id']}{sim}" if not tagged else
                 f"{_flushless(r0['scenario_id'])}: {results[0][0]} vs {results[1][0]}{sim}", fontsize=10)
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    handles += host
    labels += [h.get_label() for h in host]
    for name, colour in bands.items():  # what the shaded bands are: one entry per phase name
        handles.append(Patch(facecolor=colour, edgecolor="#999999", lw=0.5))
        labels.append(f"phase {name}")
    last = axes[-1]
    leg = last.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14 if tagged else -0.11),
                      fontsize=8, ncol=3, frameon=False,
                      title="shaded bands: the phase each allocator event fell in", title_fontsize=8)
    from .timing import compare_times, time_figure

    figs = [time_figure(r) for _, r in results]
    if len(figs) == 2:  # a time difference is shown only with its noise (issue 15)
        tnote = compare_times(figs[0], figs[1])[1] + f" ({results[0][0]} vs {results[1][0]})"
    else:
        tnote = f"iteration time {figs[0].text()}" if figs[0] else ""
    artists = [leg, title]
    if tnote:  # below the legend, outside the axes: nothing can cover it
        artists.append(last.annotate(tnote, xy=(0, 0), xycoords=leg, xytext=(0, -4), textcoords="offset points",
                                     va="top", ha="left", fontsize=8, color="#555555"))
    fig.tight_layout()
    for ax, segments in zip(axes, segments_of):  # last: the layout is final, overlaps measured right
        lowest = min(lowest, _bands_and_names(fig, ax, segments, bands))
    for ax in axes:
        ax.set_ylim(bottom=0, top=(top or 1.0) / max(0.3, lowest - 0.04))  # the curves stay below the names
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, bbox_inches="tight", bbox_extra_artists=artists)
    plt.close(fig)
    return p
