"""The budget workflow as a user meets it: real pytest sessions (pytester) running real iterations
(tiny OPT, DeepSpeed on CPU) from a directory outside this repository."""

import json
import subprocess

import pytest
import yaml

pytest_plugins = ["pytester"]

USER_TEST = """
def test_my_rlhf_step(ppo_iteration, memory_budget):
    result = ppo_iteration(framework="deepspeed-chat", models="tiny-opt", strategy="none",
                           flush="after-inference", world_size=1, device="cpu")
    memory_budget.check(result)
"""
SCENARIO = "deepspeed-chat/tiny-opt/none/flush-after-inference/x1"


def _budget(pytester):
    return pytester.path / "baselines" / "cpu" / "my_rlhf.yaml"


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_users_own_test_update_check_and_lowered_budget(pytester):
    """Four sessions, as a user meets them: no budget yet, the update (beside a teammate's entry it must keep),
    within budget, and over a lowered budget with the advice and the per-PR report."""
    pytester.makepyfile(test_my_rlhf=USER_TEST)
    # 1. no baseline yet: fails, says which command creates it
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([f"*no baseline file*my_rlhf.yaml for {SCENARIO}; create it with: "
                            "pytest test_my_rlhf.py --rlhfmem-update-baselines*"])
    # 2. update beside an entry no collected test produces: writes this scenario's entry, keeps the other and
    #    lists it as stale (the count of updated/unchanged entries: tests/test_budget_file.py)
    other = "deepspeed-chat/tiny-opt/zero1/flush-none/x1"
    _budget(pytester).parent.mkdir(parents=True)
    _budget(pytester).write_text(yaml.safe_dump({"entries": {other: {"metrics": {"peak_reserved": "1 GiB"}}}}))
    r = pytester.runpytest_subprocess("--rlhfmem-update-baselines")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*my_rlhf.yaml: 0 updated, 1 new, 0 unchanged*",
                            f"*1 stale entries (no collected test produces them): {other}*"])
    data = yaml.safe_load(_budget(pytester).read_text())
    assert set(data["entries"]) == {SCENARIO, other}
    entry = data["entries"][SCENARIO]
    assert entry["capture"] == "cpu-trace-simulated" and entry["device"] == "cpu"
    assert entry["metrics"]["peak_reserved"].endswith("iB")  # a size with a unit
    assert entry["metrics"]["host_anon_growth"].endswith("iB") and "host_rss_growth" not in entry["metrics"]
    assert entry["host_cpu"]["aten_cpu_capability"] and "cpu_model" in entry["host_cpu"]  # what could move a figure
    assert "deepspeed_dtype_checks" in entry["capture_description"]  # fp16 on any CPU, said in every result
    # 3. within budget: passes, the summary table shows it
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*rlhfmem: memory per scenario*", f"{SCENARIO}*simulated*ok*"])
    # 4. lower the budget: fails with the table and the phase of the peak; a budget recorded on another CPU
    #    (here: one that dispatched to a made-up ISA) is named in the failure; --rlhfmem-advise adds rlhfmem
    #    advise's answer from the run's own trace to the failure and the report
    data["entries"][SCENARIO]["metrics"]["peak_reserved"] = "8 MiB"  # far below: nothing fits, the advisor says so
    data["entries"][SCENARIO]["host_cpu"]["aten_cpu_capability"] = "OTHER-ISA"
    _budget(pytester).write_text(yaml.safe_dump(data))
    r = pytester.runpytest_subprocess("--rlhfmem-advise", "--rlhfmem-report", "report.md")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([f"*{SCENARIO} is over its memory budget (simulated*",
                            "*peak reserved reached in phase: *",
                            "*metric*budget*measured*delta*tolerance*",
                            "*peak_reserved*8.00 MiB*OVER BUDGET*",
                            "*this host differs from the budget's (this run vs budget): "
                            "aten_cpu_capability: * vs OTHER-ISA*"])
    r.stdout.fnmatch_lines(["*rlhfmem advise: no evaluated change fits 8.00 MiB*"])
    assert "What to try" in (pytester.path / "report.md").read_text()


MALFORMED = {
    "no_unit": ("entries:\n  {id}:\n    metrics:\n      peak_reserved: 123456\n",
                "entry '{id}'.metrics.peak_reserved: 123456 is not a size with a unit"),
    "neg_tol": ("entries:\n  {id}:\n    metrics:\n      peak_reserved: 1 GiB\n    tolerances:\n"
                "      peak_reserved: {{rel: -0.5}}\n", "tolerances.peak_reserved.rel: must be a number >= 0"),
    "unknown_key": ("entries:\n  {id}:\n    metrix:\n      peak_reserved: 1 GiB\n",
                    "entry '{id}': unknown key 'metrix'; allowed: capture, device"),
    "bad_yaml": ("entries: [unclosed\n", "line 2: not valid YAML"),
    "rss_budget": ("entries:\n  {id}:\n    metrics:\n      host_peak_rss: 600 MiB\n",
                   "entry '{id}'.metrics: host_peak_rss is reported, not budgeted (peak RSS includes the "
                   "environment's resident library pages): the gated host figure is host_anon_growth"),
    "rss_growth_budget": ("entries:\n  {id}:\n    metrics:\n      host_rss_growth: 300 MiB\n",
                          "entry '{id}'.metrics: host_rss_growth is reported, not budgeted (RSS growth includes "
                          "library pages faulted in during the iteration"),
}


def test_malformed_budget_files_name_file_entry_and_key(pytester):
    for suite, (text, _) in MALFORMED.items():
        (pytester.path / "baselines" / "cpu").mkdir(parents=True, exist_ok=True)
        (pytester.path / "baselines" / "cpu" / f"{suite}.yaml").write_text(text.format(id=SCENARIO))
    pytester.makepyfile(test_malformed=f"""
import pytest

def test_each_malformed_file(ppo_iteration, memory_budget):
    result = ppo_iteration(models="tiny-opt", strategy="none", flush="after-inference", world_size=1, device="cpu")
    for suite in {list(MALFORMED)!r}:
        with pytest.raises(pytest.fail.Exception) as exc:
            memory_budget.check(result, suite=suite)
        print("ERR", exc.value)
""")
    r = pytester.runpytest_subprocess("-s")
    r.assert_outcomes(passed=1)
    out = r.stdout.str()
    for suite, (_, fragment) in MALFORMED.items():
        line = next(ln for ln in out.splitlines() if "ERR malformed" in ln and f"{suite}.yaml" in ln)
        assert "malformed baseline file" in line and fragment.format(id=SCENARIO) in line, line


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_xdist_two_workers_update_one_file(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_pair="""
import pytest

@pytest.mark.parametrize("strategy", ["none", "grad-ckpt"])
def test_strategy(strategy, ppo_iteration, memory_budget):
    memory_budget.check(ppo_iteration(models="tiny-opt", strategy=strategy, world_size=1, device="cpu"))
""")
    r = pytester.runpytest_subprocess("-n", "2", "--rlhfmem-update-baselines", "--rlhfmem-json", "session.json")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["*pair.yaml: 0 updated, 2 new, 0 unchanged*"])
    entries = yaml.safe_load((pytester.path / "baselines" / "cpu" / "pair.yaml").read_text())["entries"]
    assert set(entries) == {"deepspeed-chat/tiny-opt/none/flush-none/x1",
                            "deepspeed-chat/tiny-opt/grad-ckpt/flush-none/x1"}
    session = json.loads((pytester.path / "session.json").read_text())
    assert len(session["results"]) == 2 and all(r["simulated"] for r in session["results"])
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=2)


def test_crashed_rank_fails_the_test_with_rank_and_phase(pytester):
    pytester.makepyfile(test_crash="""
def test_crash(ppo_iteration):
    ppo_iteration(models="tiny-opt", strategy="zero2", world_size=2, device="cpu", inject_crash="generate:1")

def test_after_crash_session_goes_on():
    assert True
""")
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1, passed=1)
    r.stdout.fnmatch_lines(["*rank 1 failed in phase 'generate': RuntimeError: injected crash in phase generate*",
                            "*memory so far (simulated): peak reserved *"])


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_hung_rank_is_killed_at_the_timeout_and_nothing_is_left(pytester):
    pytester.makepyfile(test_hang="""
def test_hang(ppo_iteration):
    ppo_iteration(models="tiny-opt", strategy="zero2", world_size=2, device="cpu", inject_hang="infer_actor:0")
""")
    r = pytester.runpytest_subprocess("--rlhfmem-timeout=45", "--durations=1")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*rank 0 failed in phase 'infer_actor': Hang: hung: no result after the 45 s timeout*"])
    left = subprocess.run(["pgrep", "-f", "inject_hang"], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
