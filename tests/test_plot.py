"""Issue 20 item 3: `rlhfmem plot` reads right: the y unit follows the data, phase names, legend and the time
note never overlap each other or the curves' area, and two runs' host RSS lines differ. Checked on the
figure as saved (matplotlib's own text extents), for 1, 2 and 3 phases and for two runs."""

import matplotlib
import pytest

from pytest_rlhfmem.plot import plot_results

matplotlib.use("Agg")
MiB = 2**20


def result(phases, peak_mib, sid="train.py", host_mib=300.0, wall=3.0):
    n = 40 * len(phases)
    reserved = [int(peak_mib * MiB * min(1.0, (i + 1) / (n * 0.6))) for i in range(n)]
    series = {"index": list(range(n)), "reserved": reserved, "allocated": [int(r * 0.8) for r in reserved],
              "reserved_without_fragmentation": [int(r * 0.85) for r in reserved],
              "phase_starts": [[p, 40 * k] for k, p in enumerate(phases)]}
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
    names = [t for t in ax.texts if t.get_text() in phases]
    assert len(names) == len(phases)
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
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "peak reserved 42.00 MiB (batch4)" in legend and "peak reserved 58.00 MiB (batch8)" in legend
    host = fig.axes[1].collections
    styles = {(str(c.get_linestyle()), tuple(c.get_edgecolor()[0])) for c in host}
    assert len(styles) == 2, "the two runs' host RSS lines look alike"
    assert any("(batch4)" in t for t in legend if t.startswith("host")) and \
        any("(batch8)" in t for t in legend if t.startswith("host"))
