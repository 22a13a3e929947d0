"""Issue 47 item 7: budget YAML read safely against alias expansion, budget entries and result JSONs checked
against their schema before use.

Before: a 424-byte budget file of nine nested YAML aliases (9**9 values once expanded) hung ``rlhfmem diff`` and
pytest's collection; a recursive alias was a thousand-line INTERNALERROR; entry fields of the wrong type were
tracebacks in ``diff``; 9 of 39 malformed result JSONs were tracebacks in diff, advise or plot. Now a budget file
holds no anchor or alias (refused in one line naming the file and line: the tool never writes them), nesting too
deep for Python is one line, and every field the reports read is checked first (``budgets._check_entry_fields``,
``report.RESULT_SCHEMA``): one line naming the file, the entry or result, the key and what is allowed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pytest_rlhfmem.budgets import BudgetError, load_budget_file
from pytest_rlhfmem.cli import main
from pytest_rlhfmem.memory.trace import ALLOC, FREE, PHASE, PHASE_END, Event, Trace
from pytest_rlhfmem.memory.trace_io import save_trace

LEVELS = "abcdefghi"
BOMB = "schema: 1\nprofile: cpu\n" + f"{LEVELS[0]}: &{LEVELS[0]} [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip(LEVELS, LEVELS[1:]))
METRICS = {"peak_reserved": "1 MiB", "peak_allocated": "1 MiB", "fragmentation_at_peak": "0 B",
           "cuda_malloc_count": 1, "alloc_retries": 0, "host_anon_growth": "0 B", "host_pinned_peak": "0 B"}


def _run(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def _one_line(rc: int, err: str, fragment: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("rlhfmem: error: ") and fragment in lines[0], (rc, err)


def test_an_alias_bomb_is_one_line_at_once(tmp_path):
    """Nine nested aliases of nine (the issue's file, 424 bytes with its entries): refused at the first anchor."""
    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB)
    assert len(BOMB) < 450
    r = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "diff", str(p), str(p)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"rlhfmem: error: {p}: line 3: YAML anchor &a: budget files hold no anchors or aliases (write the value out)"]


@pytest.mark.parametrize("text, fragment", [
    ("schema: 1\nentries: &e\n  x: *e\n", "line 2: YAML anchor &e: budget files hold no anchors or aliases"),
    ("schema: 1\nentries:\n  a/b: {metrics: *m}\n", "line 3: YAML alias *m"),  # undefined, or defined elsewhere
    ("schema: 1\nnotes: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply to read"),
])
def test_recursive_aliases_and_deep_nesting_are_one_line(tmp_path, text, fragment):
    p = tmp_path / "suite.yaml"
    p.write_text(text)
    with pytest.raises(BudgetError) as exc:
        load_budget_file(p)
    assert str(exc.value).startswith(f"{p}: ") and fragment in str(exc.value) and "\n" not in str(exc.value)


def test_pytest_collection_refuses_the_bomb_in_one_line(pytester):
    budget = pytester.path / "baselines" / "cpu" / "guarded.yaml"
    budget.parent.mkdir(parents=True)
    budget.write_text(BOMB)
    pytester.makepyfile(test_guarded="def test_guarded(memory_budget):\n    pass\n")
    r = pytester.runpytest_subprocess(timeout=120)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    lines = [ln for ln in r.stderr.lines if "guarded.yaml" in ln]
    assert len(lines) == 1 and "YAML anchor &a: budget files hold no anchors or aliases" in lines[0], r.stderr.str()
    assert "INTERNALERROR" not in r.stderr.str() + r.stdout.str()


@pytest.mark.parametrize("field, value, fragment", [
    ("versions", 3, "entry 'a/b'.versions: must be a mapping with text keys, got 3"),
    ("versions", {"torch": [2]}, "entry 'a/b'.versions.torch: must be a version (text or a number), got [2]"),
    ("host_cpu", [1], "entry 'a/b'.host_cpu: must be a mapping with text keys, got [1]"),
    ("capture", ["cpu"], "entry 'a/b'.capture: must be text, got ['cpu']"),
    ("device", 0, "entry 'a/b'.device: must be text, got 0"),
    ("world_size", 0, "entry 'a/b'.world_size: must be an integer >= 1, got 0"),
    ("capture_description", "x", "entry 'a/b'.capture_description: must be a mapping with text keys, got 'x'"),
    ("metrics", [1], "entry 'a/b'.metrics: must be a mapping with text keys, got [1]"),
])
def test_a_budget_entry_field_of_the_wrong_type_is_one_line_in_diff(capsys, tmp_path, field, value, fragment):
    p = tmp_path / "suite.yaml"
    p.write_text(json.dumps({"schema": 1, "entries": {"a/b": {"metrics": METRICS, field: value}}}))  # JSON is YAML
    rc, err = _run(capsys, "diff", str(p), str(p))
    _one_line(rc, err, f"{p}: {fragment}")


# -- result JSONs: diff, advise, plot ------------------------------------------------------------------------------

@pytest.fixture
def good(tmp_path) -> dict:
    """A run result naming a trace file, with a series: what diff, advise and plot each read."""
    ev = [Event(PHASE, 0, 0, 0, 1, "gen"), Event(ALLOC, 0x1000, 2**25, 0, 2), Event(FREE, 0x1000, 0, 0, 3),
          Event(PHASE_END, 0, 0, 0, 4, "gen"), Event(ALLOC, 0x2000, 2**25, 0, 5), Event(FREE, 0x2000, 0, 0, 6)]
    tf = save_trace(tmp_path / "t.rlhftrace", Trace(events=ev, capture="cpu-trace-simulated"))
    series = {"index": [0, 1, 2], "reserved": [1, 2, 3], "allocated": [1, 1, 1],
              "reserved_without_fragmentation": [1, 2, 2], "phase_starts": [["gen", 0]]}
    return {"scenario_id": "a/flush-none/x1", "status": "ok", "capture": "cpu-trace-simulated", "device": "cpu",
            "scenario": {"flush": "none"}, "metrics": {"peak_reserved": 2**25}, "iteration_wall_s": 3.0,
            "ranks": [{"rank": 0, "trace_file": str(tf), "series": series, "total": {"peak_reserved": 3},
                       "phases": [{"phase": "gen", "host_peak_rss": 5}],
                       "flush_cost": {"measured_flush_s": [0.1], "segments_released": 1}, "recipe": {}}]}


# (command, where the bad value goes, the value, what the line says): each was a traceback before
MALFORMED = [
    ("diff", ("results",), [1, "x"], "results[0]: must be a scenario result"),
    ("diff", ("metrics", "peak_reserved"), "12 MiB", "metrics.peak_reserved: must be a finite number, got '12 MiB'"),
    ("diff", ("metrics", "peak_reserved"), float("nan"),
     "metrics.peak_reserved: must be a finite number within +-(2**63-1), got nan"),
    ("diff", ("versions",), ["2.13"], "versions: must be a mapping, got ['2.13']"),
    ("diff", ("time_rounds",), ["fast"], "time_rounds[0]: must be a finite number, got 'fast'"),
    ("advise", ("ranks", 0, "flush_cost"), "x", "ranks[0].flush_cost: must be a mapping, got 'x'"),
    ("advise", ("ranks", 0, "flush_cost", "measured_flush_s"), [None], "measured_flush_s[0]: must be not null"),
    ("advise", ("ranks", 0, "recipe", "rollout_engine"), 1.5, "ranks[0].recipe.rollout_engine: must be a mapping"),
    ("advise", ("ranks", 0, "rank"), 1.5, "ranks[0].rank: must be an integer, got 1.5"),
    ("advise", ("versions",), {"torch": 2.13}, "versions.torch: must be text, got 2.13"),
    ("plot", ("ranks", 0, "series", "reserved", 1), "x", "series.reserved[1]: must be a finite number, got 'x'"),
    ("plot", ("ranks", 0, "series", "phase_starts", 0), ["gen"], "phase_starts[0]: must be a list of two"),
    ("plot", ("ranks", 0, "phases", 0, "phase"), [], "phases[0].phase: must be text, got []"),
    ("plot", ("ranks", 0, "total"), None, "ranks[0].total.peak_reserved: must be a number (bytes)"),
    ("plot", ("ranks", 0, "series", "index"), [], "must be lists of one equal length >= 1"),
    ("plot", ("results",), None, "results: must be a list of scenario results, got None"),
]


@pytest.mark.parametrize("command, where, value, fragment", MALFORMED,
                         ids=[f"{c}-{'.'.join(map(str, w))}" for c, w, _, _ in MALFORMED])
def test_a_malformed_result_json_is_one_line_naming_file_key_and_allowed(capsys, tmp_path, good, command, where,
                                                                         value, fragment):
    data = good
    if where == ("results",):
        data = {"results": value}
    else:
        node = data
        for k in where[:-1]:
            node = node[k]
        node[where[-1]] = value
    p = tmp_path / "r.json"
    p.write_text(json.dumps(data))
    argv = {"diff": ["diff", str(p), str(p)], "advise": ["advise", str(p), "--processes", "1"],
            "plot": ["plot", str(p), "-o", str(tmp_path / "f.png")]}[command]
    rc, err = _run(capsys, *argv)
    _one_line(rc, err, f"{p}: ")
    assert fragment in err, err


def test_the_good_result_goes_through_all_three(capsys, tmp_path, good):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(good))
    for argv in (["diff", str(p), str(p)], ["advise", str(p), "--processes", "1"],
                 ["plot", str(p), "-o", str(tmp_path / "f.png")]):
        rc, err = _run(capsys, *argv)
        assert rc == 0, (argv, err)
