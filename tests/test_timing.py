"""Time figures carry their noise (issue 15): the comparison rules, the diff's time row, the session summary
with the flush's own cost, and a real session's rounds."""

import json

import pytest

from pytest_rlhfmem.report import TIME_METRIC, Side, diff, flush_tradeoffs, to_markdown
from pytest_rlhfmem.timing import compare_times, rounds_spread, time_figure, with_rounds

pytest_plugins = ["pytester"]


def result(sid: str, times: list[float], flush: str = "none", peak: int = 64 << 20, cost: dict | None = None) -> dict:
    r = {"scenario_id": sid.replace("FLUSH", flush), "status": "ok", "scenario": {"flush": flush},
         "metrics": {"peak_reserved": peak, "peak_allocated": peak // 2, "fragmentation_at_peak": 0,
                     "cuda_malloc_count": 3, "alloc_retries": 0},
         "iteration_wall_s": times[0], "ranks": [{"flush_cost": cost}] if cost else []}
    return with_rounds(r, [{"status": "ok", "iteration_wall_s": t} for t in times[1:]]) if len(times) > 1 else r


SID = "deepspeed-chat/tiny-opt/none/flush-FLUSH/x2"


def test_rounds_give_median_and_range():
    assert rounds_spread([10.0, 12.0, 14.0]) == (12.0, pytest.approx(4 / 12))
    f = time_figure(result(SID, [9.0, 12.0, 10.0]))
    assert f.seconds == 10.0 and f.noise_rel == pytest.approx(0.3) and f.source == "3 rounds"


def test_the_issue_15_line_is_within_noise_when_the_rounds_overlap():
    base = time_figure(result(SID, [9.33, 30.0, 50.0]))
    head = time_figure(result(SID, [50.97, 12.0, 20.0], "after-inference"))
    status, text = compare_times(base, head)
    assert status == "within-noise" and "within noise (+-" in text and "446" not in text


def test_a_change_beyond_both_intervals_is_reported_with_its_noise():
    status, text = compare_times(time_figure(result(SID, [10.0, 10.2, 9.8])),
                                 time_figure(result(SID, [20.0, 20.4, 19.6])))
    assert status == "slower" and "+100.0% (beyond noise +-12%" in text


def test_one_round_without_recorded_spread_prints_no_percentage():
    status, text = compare_times(time_figure(result(SID, [9.33])), time_figure(result(SID, [50.97])))
    assert status == "unknown" and "%" not in text and "noise unknown" in text and "--rlhfmem-time-rounds" in text


def test_recorded_spread_is_used_for_one_round_and_matches_any_flush_policy():
    spreads = {SID.replace("FLUSH", "none"): {"runs": 5, "spread": 0.5}}
    f = time_figure(result(SID, [10.0], "after-inference"), spreads)
    assert f.noise_rel == 0.5 and "recorded spread of 5 runs" in f.source


def test_summary_line_has_noise_and_the_flush_cost_from_the_trace():
    cost = {"flushes": 5, "extra_cuda_malloc": 3, "extra_cuda_free": 3, "bytes_reacquired": 6 << 20,
            "segments_released": 3, "measured_flush_s": []}
    lines = flush_tradeoffs([result(SID, [9.33, 30.0]), result(SID, [50.97, 12.0], "after-inference", cost=cost)])
    assert len(lines) == 1
    assert "within noise" in lines[0] and "+446" not in lines[0]
    assert "flush cost (from the trace): 5 flushes, +3 cudaMalloc, +3 cudaFree, 6.00 MiB re-acquired" in lines[0]


def test_diff_time_regression_must_beat_the_noise_floor():
    def side(label, times):
        s = Side(label)
        r = result(SID.replace("FLUSH", "none"), times)
        s.scenarios[r["scenario_id"]] = {"metrics": r["metrics"], "status": "ok", "env": {}, "result": r}
        return s

    noisy = diff(side("a", [10.0, 14.0, 6.0]), side("b", [16.0, 20.0, 12.0]))
    row = next(r for r in noisy.rows if r.metric == TIME_METRIC)
    assert row.status == "unchanged" and "within noise" in row.note
    assert "within noise" in to_markdown(noisy)
    clear = diff(side("a", [10.0, 10.1, 9.9]), side("b", [16.0, 16.1, 15.9]))
    row = next(r for r in clear.rows if r.metric == TIME_METRIC)
    assert row.status == "regressed" and "beyond noise" in row.note
    one = diff(side("a", [10.0]), side("b", [16.0]))
    row = next(r for r in one.rows if r.metric == TIME_METRIC)
    assert row.status == "unchanged" and "noise unknown" in row.note


SAME_PROGRAM = """
import pytest

@pytest.mark.parametrize("flush", ["none", "after-inference"])
def test_step(ppo_iteration, flush):
    ppo_iteration(framework="deepspeed-chat", models="tiny-opt", strategy="none", flush=flush, world_size=1,
                  device="cpu")
"""


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_time_rounds_reach_the_session_summary_with_the_flush_cost(pytester):
    """``--rlhfmem-time-rounds 2`` in a real session: each result keeps its 2 rounds, and the flush policy's
    summary line compares the two times with their noise and the flush's own cost counted from the trace.
    Which verdict it gives depends on this machine's load at the time, so the verdict rules are tested above
    on fixed rounds (no timed assertion here)."""
    pytester.makepyfile(test_same=SAME_PROGRAM)
    r = pytester.runpytest_subprocess("--rlhfmem-time-rounds", "2", "--rlhfmem-json", "s.json")
    r.assert_outcomes(passed=2)
    # the flush-policy line of the summary ("<id>: peak reserved ... time ..."), not the memory table's row
    line = next(x for x in r.outlines if x.strip().startswith("deepspeed-chat/tiny-opt/none/flush-after-inference/x1:"))
    assert ("within noise (+-" in line or "beyond noise" in line) and "2 rounds vs 2 rounds" in line, line
    assert "flush cost (from the trace): 5 flushes" in line
    data = json.loads((pytester.path / "s.json").read_text())
    assert all(len(x["time_rounds"]) == 2 for x in data["results"])
