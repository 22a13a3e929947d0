"""Issue 20, items 1 and 5, in real pytest sessions: a session leaves no work directory behind unless told to
(or a run failed, then it says where), and a budget file with a typo stops the session before any iteration
runs, with one line."""

from helpers import DATA

pytest_plugins = ["pytester"]

COMMANDS = DATA / "commands"

OWN_TEST = """
import sys
from pathlib import Path

def test_plain(rlhfmem_command, memory_budget):
    Path("iteration-started").write_text("yes")
    result = rlhfmem_command([sys.executable, {script!r}], id="plain", device="cpu")
    memory_budget.check(result)
"""


def _work_dirs(*roots):
    return [p for root in roots for p in root.rglob("rlhfmem-*") if not p.is_symlink()]


def _links(*roots):
    return [p for root in roots for p in root.rglob("rlhfmem-*") if p.is_symlink() and not p.exists()]


def test_a_passing_session_leaves_no_work_directory_and_its_json_advises(pytester, monkeypatch):
    scratch, base = pytester.path / "scratch", pytester.path / "basetemp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    pytester.makepyfile(test_own=OWN_TEST.format(script=str(COMMANDS / "plain_train.py")))
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--basetemp", str(base),
                                      "--rlhfmem-update-baselines", "--rlhfmem-json", "out/s.json")
    r.assert_outcomes(passed=1)
    assert _work_dirs(scratch, base) == [] and _links(scratch, base) == []
    assert (pytester.path / "out" / "s-traces" / "plain__rank0.rlhftrace").is_file()
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--basetemp", str(base), "--rlhfmem-keep-work")
    r.assert_outcomes(passed=1)
    kept = _work_dirs(scratch, base)
    assert len(kept) == 1 and f"rlhfmem: work directory kept: {kept[0]}" in r.stdout.str()


def test_a_budget_file_with_a_typo_fails_the_session_before_any_iteration_once(pytester):
    pytester.makepyfile(test_own=OWN_TEST.format(script=str(COMMANDS / "plain_train.py")))
    budget = pytester.path / "baselines" / "cpu" / "own.yaml"
    budget.parent.mkdir(parents=True)
    budget.write_text("entries:\n  plain:\n    metrix:\n      peak_reserved: 1 GiB\n")
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    out = r.stdout.str() + r.stderr.str()
    assert r.ret == 4, out  # a usage error
    assert not (pytester.path / "iteration-started").exists()
    assert out.count("metrix") == 1, out
    assert "malformed baseline file:" in out and "own.yaml" in out
    assert "During handling of the above exception" not in out and "Traceback" not in out
