"""Issue 48, incident 4 (verl #1232: a CUDA OOM after 50-60 steps; verl #630: host memory climbing until the OOM):
a run of several iterations, per-iteration figures and a growth budget.

- the figures' arithmetic (iterations.py): rows from windows, the maximum over ranks, the slope from iteration 2 on,
  the iteration at which a card runs out, the phase that keeps memory;
- the budget: growth metrics load, gate and refuse a run that could not measure them (budgets.py);
- bad input in one line before anything runs (a scenario's iterations, the fixture's, rlhfmem capture's);
- the incident at CI scale: tests/data/commands/leaky_train.py under the rlhfmem_command fixture, 3 iterations; its
  budget recorded without the leak, the same trainer passes it, and with the leak (a list of per-step 4 MiB tensors
  kept alive) fails naming the rate, the iteration a 24 GiB card runs out at and the phase that keeps the tensors.
"""

import pytest
import yaml
from helpers import DATA, rlhfmem_cli

from pytest_rlhfmem.budgets import (
    GROWTH_BUDGETS, compare, entry_from_result, growth_unmeasured, incomplete, load_budget_file,
)
from pytest_rlhfmem.iterations import (
    growth, growth_message, iteration_rows, keeping_phase, merge_ranks, runs_out_at, slope,
)
from pytest_rlhfmem.memory.events import ALLOC, FREE, PHASE, Event, Trace
from pytest_rlhfmem.record.rank import kept_by_iteration
from pytest_rlhfmem.rlhf.scenario import Scenario, ScenarioError

MiB = 2**20
LEAKY = DATA / "commands" / "leaky_train.py"


def _window(phase: str, reserved: int, allocated: int, mallocs: int = 0) -> dict:
    return {"phase": phase, "peak_reserved": reserved, "peak_allocated": allocated, "cuda_malloc_count": mallocs,
            "alloc_retries": 0, "ooms": 0, "time_s": 0.5}


def _leaking_rows(n: int = 4, leak: int = 4 * MiB) -> list[dict]:
    """n iterations of generate/score/train whose peak allocated grows ``leak`` a step; score keeps it."""
    windows, its = [_window("init", 40 * MiB, 30 * MiB, 3)], [0]
    for k in range(1, n + 1):
        for phase in ("generate", "score", "train"):
            windows.append(_window(phase, 64 * MiB + (k // 3) * 20 * MiB, 40 * MiB + k * leak, 1 if k == 1 else 0))
            its.append(k)
    kept = {k: {"score": leak} for k in range(1, n + 1)}
    host = {k: {"host_anon_peak": 400 * MiB + k * leak, "host_peak_rss": 600 * MiB + k * leak} for k in range(1, n + 1)}
    return iteration_rows(windows, its, host, kept, n, {k: k * MiB // 4 for k in range(1, n + 1)})


def test_rows_slope_and_growth_from_iteration_2():
    rows = _leaking_rows()
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["peak_allocated"] for r in rows] == [44 * MiB, 48 * MiB, 52 * MiB, 56 * MiB]
    assert rows[0]["cuda_malloc_count"] == 3 and rows[1]["cuda_malloc_count"] == 0  # init's belong to no iteration
    assert rows[2]["phases"]["score"] == {"peak_reserved": 84 * MiB, "peak_allocated": 52 * MiB}
    assert rows[3]["host_anon_program"] == 400 * MiB + 16 * MiB - MiB  # the recorder's own bytes taken out
    assert slope([1.0, 3.0, 5.0]) == 2.0 and slope([7.0]) == 0.0
    g = growth(rows)
    assert g["growth_peak_allocated"] == 4 * MiB
    assert g["growth_peak_reserved"] == 10 * MiB  # 64, 84, 84 MiB over iterations 2-4: least squares
    assert g["growth_host_anon"] == 4 * MiB - MiB // 4
    assert growth(rows[:2]) == {}  # two iterations: no growth from iteration 2 on
    assert keeping_phase(rows) == ("score", 4 * MiB)


def test_windows_not_marked_one_for_one_are_refused():
    with pytest.raises(ValueError, match="2 windows in the trace, 1 phase marks"):
        iteration_rows([_window("a", 1, 1), _window("b", 1, 1)], [1])


def test_merge_takes_each_rank_s_maximum():
    a, b = _leaking_rows(3), _leaking_rows(3, leak=8 * MiB)
    merged = merge_ranks([a, b])
    assert [r["peak_allocated"] for r in merged] == [r["peak_allocated"] for r in b]
    assert merged[1]["kept_by_phase"] == {"score": 8 * MiB}
    assert merge_ranks([]) == []


def test_the_card_runs_out_at_the_extrapolated_iteration_and_the_message_names_phase_and_rate():
    rows = _leaking_rows()
    # peak reserved 84 MiB at iteration 4, growing 10 MiB an iteration: 24 GiB - 84 MiB = 24492 MiB -> 2450 more
    assert runs_out_at(rows, 10 * MiB, 24 * 2**30, "peak_reserved") == 4 + 2449 + 1
    assert runs_out_at(rows, 0.0, 24 * 2**30, "peak_reserved") is None
    assert runs_out_at(rows, 1.0, 80 * MiB, "peak_reserved") == 4  # already past it
    msg = growth_message("growth_peak_allocated", rows)
    assert msg.startswith("peak allocated grows 4.00 MiB per iteration (iterations 2-4, simulated): at this rate a "
                          "24 GiB card OOMs at iteration 2454"), msg
    assert "phase 'score' keeps 4.00 MiB of each iteration allocated to the end of the run" in msg
    assert "80 GiB card OOMs at iteration" in growth_message("growth_peak_reserved", rows, 80 * 2**30)


def test_kept_bytes_are_those_allocated_in_an_iteration_and_never_freed():
    ev = [Event(PHASE, name="init"), Event(ALLOC, 1, 100),
          Event(PHASE, name="score"), Event(ALLOC, 2, 10), Event(ALLOC, 3, 20), Event(FREE, 3, 20),
          Event(PHASE, name="train"), Event(ALLOC, 4, 5),
          Event(PHASE, name="score"), Event(ALLOC, 5, 10), Event(FREE, 4, 5)]
    kept = kept_by_iteration(Trace(events=ev), [0, 1, 1, 2])
    assert kept == {1: {"score": 10}, 2: {"score": 10}}  # init's belongs to no iteration; 3 and 4 were freed


def _budget(tmp_path, growth_metrics: dict) -> tuple:
    metrics = {"peak_reserved": "64 MiB", "peak_allocated": "50 MiB", "fragmentation_at_peak": "14 MiB",
               "cuda_malloc_count": 12, "alloc_retries": 0, "host_anon_growth": "90 MiB", "host_pinned_peak": "0 B",
               **growth_metrics}
    p = tmp_path / "b.yaml"
    p.write_text(yaml.safe_dump({"schema": 1, "entries": {"leaky": {"metrics": metrics}}}))
    bf = load_budget_file(p)
    return p, bf, bf.entries["leaky"]


def test_a_growth_budget_gates_with_its_tolerance_and_refuses_a_run_without_iterations(tmp_path):
    p, bf, entry = _budget(tmp_path, {m: "0 B" for m in GROWTH_BUDGETS})
    measured = {"peak_reserved": 64 * MiB, "peak_allocated": 50 * MiB, "fragmentation_at_peak": 14 * MiB,
                "cuda_malloc_count": 12, "host_anon_growth": 90 * MiB, "growth_peak_reserved": 2 * MiB,
                "growth_peak_allocated": MiB + 1, "growth_host_anon": 16 * MiB}
    rows = {r.metric: r.status for r in compare(bf, entry, measured)}
    assert rows["growth_peak_reserved"] == "ok" and rows["growth_host_anon"] == "ok"  # at the tolerance: passes
    assert rows["growth_peak_allocated"] == "over"  # one byte past 1 MiB an iteration
    result = {"metrics": {k: v for k, v in measured.items() if not k.startswith("growth")}, "iterations": []}
    line = growth_unmeasured(p, entry, result)
    assert "gates growth across iterations (growth_peak_reserved, growth_peak_allocated, growth_host_anon)" in line
    assert "recorded 0 iteration(s): growth needs at least 3" in line
    assert growth_unmeasured(p, entry, {"metrics": measured}) is None
    p, _, cut = _budget(tmp_path, {"growth_peak_allocated": "0 B"})  # the three or none
    assert "missing growth_peak_reserved, growth_host_anon" in incomplete(p, cut)
    written = entry_from_result({"metrics": measured})
    assert set(GROWTH_BUDGETS) <= set(written["metrics"])
    assert not set(GROWTH_BUDGETS) & set(entry_from_result({"metrics": result["metrics"]})["metrics"])


def test_bad_iterations_are_one_line_before_anything_runs(tmp_path):
    with pytest.raises(ScenarioError, match="override iterations=0: allowed values are whole numbers >= 1"):
        Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1, {"iterations": 0})
    with pytest.raises(ScenarioError, match="colossalchat's moves its reference"):
        Scenario("colossalchat", "tiny-opt", "none", "none", 1, {"iterations": 3})
    assert Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1, {"iterations": 1}).id.endswith("/x1")
    assert Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1, {"iterations": 3}).id.endswith("/iterations=3")
    r = rlhfmem_cli("capture", "--iterations", "0", "--", str(LEAKY))
    assert r.returncode == 2 and "argument --iterations: '0': allowed values are whole numbers >= 1" in r.stderr
    r = rlhfmem_cli("run", "--iterations", "-1")
    assert r.returncode == 2 and "--iterations" in r.stderr


LEAK_TESTS = """
import sys
from pathlib import Path

from pytest_rlhfmem.budgets import entry_from_result, update_budget_file

SCRIPT = {script!r}
BUDGET = Path("baselines") / "cpu" / "leak.yaml"


def run(rlhfmem_command, *args):
    return rlhfmem_command([sys.executable, SCRIPT, *args], id="leaky-trainer", device="cpu", iterations=3)


def test_1_record_the_budget_without_the_leak(rlhfmem_command):
    result = run(rlhfmem_command)
    assert [r["iteration"] for r in result["iterations"]] == [1, 2, 3]
    # what --rlhfmem-update-baselines writes (budget_check.py), here in the same session as the checks
    update_budget_file(BUDGET, {{"leaky-trainer": entry_from_result(result.data)}}, "cpu")


def test_2_before_passes(rlhfmem_command, memory_budget):
    memory_budget.check(run(rlhfmem_command))


def test_3_after_the_leak_fails(rlhfmem_command, memory_budget):
    memory_budget.check(run(rlhfmem_command, "--leak"))


def test_4_fewer_iterations_than_asked(rlhfmem_command):
    run(rlhfmem_command, "--steps", "2")
"""


def test_incident_4_a_kept_list_of_step_tensors_fails_the_growth_budget(pytester):
    """Before: the trainer without the leak records its budget (growth 0 B per iteration; with the update's own
    function) and a second run passes it. After: the same trainer keeping each step's 4 MiB log-probs fails, naming
    the rate, the iteration at which a 24 GiB card runs out and the phase that keeps them (simulated device figures,
    CPU route, 3 iterations). A program that marks 2 iterations where 3 were asked fails in one line."""
    pytester.makepyfile(test_leak=LEAK_TESTS.format(script=str(LEAKY)))
    r = pytester.runpytest_subprocess("-rf")
    r.assert_outcomes(passed=2, failed=2)  # 1 and 2 pass; 3 and 4 fail:
    r.stdout.fnmatch_lines(["FAILED test_leak.py::test_3_after_the_leak_fails*",
                            "FAILED test_leak.py::test_4_fewer_iterations_than_asked*"])
    entry = yaml.safe_load((pytester.path / "baselines" / "cpu" / "leak.yaml").read_text())["entries"]["leaky-trainer"]
    assert entry["metrics"]["growth_peak_allocated"] == "0 B" and "growth_host_anon" in entry["metrics"]
    r.stdout.fnmatch_lines([
        "*leaky-trainer is over its memory budget (simulated*",
        "*peak allocated grows 4.00 MiB per iteration (iterations 2-3, simulated): at this rate a 24 GiB card OOMs at "
        "iteration *; phase 'score' keeps 4.00 MiB of each iteration allocated to the end of the run*",
        "*growth_peak_allocated*0 B*4.00 MiB*OVER BUDGET*"])
    r.stdout.fnmatch_lines(["*rlhfmem_command('leaky-trainer'): iterations=3 asked, but * marked 2 iteration(s): "
                            "call rlhfmem.iteration() at the top of each step*"])
