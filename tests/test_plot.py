"""Issue 20 item 3: `rlhfmem plot` reads right: the y unit follows the data, phase names, legend and the time
note never overlap each other or the curves' area, and two runs' host RSS lines differ. Checked on the
figure as saved (matplotlib's own text extents), for 1, 2 and 3 phases and for two runs. Issue 39: two runs of
different lengths get one panel each with their own phase bands; a phase resumed after a nested one, or repeated per
step, is named once; the legend says what the bands are; without matplotlib the command is one line naming the
`plot` extra."""

import subprocess
import sys

import matplotlib
import pytest

from pytest_rlhfmem.plot import plot_results

matplotlib.use("Agg")
MiB = 2**20


def result(phases, peak_mib, sid="train.py", host_mib=300.0, wall=3.0, widths=None):
    widths = widths or [40] * len(phases)
    n = sum(widths)
    reserved = [int(peak_mib * MiB * min(1.0, (i + 1) / (n * 0.6))) for i in range(n)]
    series = {"index": list(range(n)), "reserved": reserved, "allocated": [int(r * 0.8) for r in reserved],
              "reserved_without_fragmentation": [int(r * 0.85) for r in reserved],
              "phase_starts": [[p, sum(widths[:k])] for k, p in enumerate(phases)]}
    rank = {"rank": 0, "series": series, "total": {"peak_reserved": max(reserved)},
            "phases": [{"phase": p, "host_peak_rss": int((host_mib + 10 * k) * MiB)} for k, p in enumerate(phases)]}
    return {"scenario_id": sid, "scenario": {}, "simulated": True, "ranks": [rank], "iteration_wall_s": wall}


@pytest.fixture
def saved(monkeypatch):
    """The figure as it is saved: its axes and texts, measured with the renderer that draws the PNG."""
    from matplotlib.figure import Figure

    seen = {}
    original = Figure.savefig

    def spy(fig, *a, **kw):
        original(fig, *a, **kw)
        fig.canvas.draw()
        seen["fig"], seen["renderer"] = fig, fig.canvas.get_renderer()

    monkeypatch.setattr(Figure, "savefig", spy)
    return seen


def boxes(fig, r):
    ax = fig.axes[0]
    phase = [t.get_window_extent(r) for t in ax.texts if "time" not in t.get_text()]
    note = [t.get_window_extent(r) for t in ax.texts + fig.texts if "time" in t.get_text()]
    return ax, phase, note, r


def test_the_y_unit_follows_the_data():
    from pytest_rlhfmem.plot import axis_unit

    assert axis_unit(42 * MiB) == ("MiB", float(MiB))
    assert axis_unit(3 * 2**30) == ("GiB", float(2**30))
    assert axis_unit(500 * 1024) == ("KiB", 1024.0)


@pytest.mark.parametrize("phases", [["run"], ["run", "train"], ["run", "generate", "train"],
                                    ["run", "generate", "run", "score", "run", "train", "run"]])
def test_one_run_mib_axis_and_nothing_overlaps(tmp_path, saved, phases):
    plot_results([("a", result(phases, 42))], tmp_path / "f.png")
    fig = saved["fig"]
    ax, phase, note, r = boxes(fig, saved["renderer"])
    assert ax.get_ylabel() == "MiB" and fig.axes[1].get_ylabel().startswith("host peak RSS, MiB")
    names = [t.get_text() for t in ax.texts if t.get_text() in phases]
    assert sorted(names) == sorted(set(phases)), "each phase is named once"
    for i, a in enumerate(phase):
        assert not any(a.overlaps(b) for b in phase[i + 1:]), "phase names overlap"
    top_of_curves = ax.transData.transform((0, 42 * 1.0))[1]
    assert all(b.y0 > top_of_curves for b in phase), "a phase name sits on the curves"
    axes_box = ax.get_window_extent(r)
    leg = ax.get_legend().get_window_extent(r)
    assert note and note[0].y1 <= leg.y0 + 1 and note[0].y1 < axes_box.y0, "the time note is covered or inside"
    assert any("peak reserved 42.00 MiB" in t.get_text() for t in ax.get_legend().get_texts())


def test_two_runs_have_their_own_peaks_in_the_legend_and_distinct_host_lines(tmp_path, saved):
    runs = [("batch4", result(["run", "generate", "train"], 42, host_mib=300)),
            ("batch8", result(["run", "generate", "train"], 58, host_mib=301))]
    plot_results(runs, tmp_path / "f.png")
    fig = saved["fig"]
    legend = [t.get_text() for t in _legend(fig).get_texts()]
    assert "peak reserved 42.00 MiB (batch4)" in legend and "peak reserved 58.00 MiB (batch8)" in legend
    host = [c for a in fig.axes[2:] for c in a.collections]
    styles = {(str(c.get_linestyle()), tuple(c.get_edgecolor()[0])) for c in host}
    assert len(styles) == 2, "the two runs' host RSS lines look alike"
    assert any("(batch4)" in t for t in legend if t.startswith("host")) and \
        any("(batch8)" in t for t in legend if t.startswith("host"))


def _legend(fig):
    (leg,) = [a.get_legend() for a in fig.axes if a.get_legend()]
    return leg


def _bands(ax):
    """(x0, x1, colour) of each shaded phase band, left to right."""
    out = []
    for patch in ax.patches:  # a Rectangle from matplotlib 3.9 on, a Polygon before
        xs = [patch.get_x(), patch.get_x() + patch.get_width()] if hasattr(patch, "get_width") else \
            [v[0] for v in patch.get_xy()]
        out.append((min(xs), max(xs), matplotlib.colors.to_hex(patch.get_facecolor())))
    return sorted(out)


def test_two_runs_of_different_lengths_each_get_their_own_bands(tmp_path, saved):
    """A base run of 3 phases (120 events) and a longer PR run (2 steps, 240 events): each panel's bands are its own
    run's and reach its last event (they used to be the first run's, the second run's curve running past them)."""
    base = result(["run", "generate", "train"], 42)
    pr = result(["run", "generate", "train", "run", "generate", "train"], 58)
    plot_results([("base", base), ("pr", pr)], tmp_path / "f.png")
    fig = saved["fig"]
    panels = fig.axes[:2]
    for ax, n, windows in zip(panels, (120, 240), (3, 6)):
        bands = _bands(ax)
        assert len(bands) == windows
        assert bands[0][0] == 0 and bands[-1][1] == n, f"the bands span {bands[0][0]}..{bands[-1][1]}, not 0..{n}"
        assert ax.get_xlim()[1] >= n
    assert panels[0].get_ylim() == panels[1].get_ylim(), "the panels share one y scale"
    # one colour per phase name, the same in both panels, and the legend says which
    colours = {}
    for ax, phases in zip(panels, (base, pr)):
        starts = [p for p, _ in phases["ranks"][0]["series"]["phase_starts"]]
        for (_, _, colour), phase in zip(_bands(ax), starts):
            assert colours.setdefault(phase, colour) == colour
    leg = _legend(fig)
    entries = {t.get_text(): h for t, h in zip(leg.get_texts(), leg.legend_handles)}
    for phase, colour in colours.items():
        assert matplotlib.colors.to_hex(entries[f"phase {phase}"].get_facecolor()) == colour
    assert "phase" in leg.get_title().get_text()


def test_nested_and_repeated_phases_are_named_once_in_one_row(tmp_path, saved):
    """Three steps of run / train / optimizer (nested in train: train resumes after it) with narrow windows: each name
    is written at most once, all in one row, none overlapping; the legend names every band."""
    phases, widths = [], []
    for _ in range(3):
        phases += ["run", "train", "optimizer", "train"]
        widths += [3, 30, 2, 5]
    plot_results([("a", result(phases, 42, widths=widths))], tmp_path / "f.png")
    fig, r = saved["fig"], saved["renderer"]
    ax = fig.axes[0]
    texts = [t for t in ax.texts if t.get_text() in phases]
    assert len(texts) == len({t.get_text() for t in texts}), [t.get_text() for t in texts]
    assert "train" in [t.get_text() for t in texts]
    assert len({round(t.get_window_extent(r).y0) for t in texts}) == 1, "the names stack into rows"
    b = [t.get_window_extent(r) for t in texts]
    assert not any(x.overlaps(y) for i, x in enumerate(b) for y in b[i + 1:])
    legend = [t.get_text() for t in _legend(fig).get_texts()]
    assert [e for e in legend if e.startswith("phase ")] == ["phase run", "phase train", "phase optimizer"]


def test_plot_without_matplotlib_is_one_line_naming_the_extra(tmp_path):
    import json

    src = tmp_path / "r.json"
    src.write_text(json.dumps(result(["run"], 42)))
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from pytest_rlhfmem.cli import main\n"
            f"sys.exit(main(['plot', {str(src)!r}, '-o', {str(tmp_path / 'f.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["rlhfmem: error: plot needs matplotlib: pip install "
                                                "'pytest-rlhfmem[plot]'"]
    assert not (tmp_path / "f.png").exists()
