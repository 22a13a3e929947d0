"""`rlhfmem capture -- COMMAND` and the `rlhfmem_command` fixture as a new user meets them: real training
commands (plain PyTorch, torchrun with 2 ranks, a Hugging Face Trainer) in subprocesses and pytester
sessions; the public API's null path checked structurally in a fresh interpreter."""

import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import DATA

from pytest_rlhfmem.command.run import run_command
from pytest_rlhfmem.record.rank import merge_windows

pytest_plugins = ["pytester"]

COMMANDS = DATA / "commands"
CUBLAS_WORKSPACE = 8_519_680  # CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8, PyTorch's default before sm_90
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_ppo.py"


def rlhfmem_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def capture(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return rlhfmem_cli("capture", *args, timeout=timeout)


@pytest.fixture(autouse=True)
def _work_dirs_under_tmp_path(tmp_path_factory, monkeypatch):
    """A capture keeps its work directory (``tempfile.mkdtemp``) with ``--keep-work`` or after a failed run: these
    tests make both, so the CLI's temporary directory is pytest's, not /tmp (three were left per run)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))


def test_api_without_capture_loads_nothing_and_returns_the_null_context():
    code = """
import sys
import pytest_rlhfmem as rlhfmem
assert rlhfmem.active() is None
ctx = rlhfmem.phase("generate")
assert ctx is rlhfmem.NULL_PHASE and rlhfmem.phase("train") is ctx
with ctx as value:
    assert value is None
assert rlhfmem.flush_point("after-generate") is None
for call in (rlhfmem.host_resident, rlhfmem.moved_to_host, rlhfmem.moved_to_device, rlhfmem.deepspeed_offload):
    assert call([object()]) is None  # not even looked at
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "pytest_rlhfmem.memory",
                                                                         "pytest_rlhfmem.command")))
print(loaded)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plain_script_without_rlhfmem_is_one_window_and_its_empty_cache_a_flush(tmp_path):
    out = tmp_path / "plain.json"
    r = capture("--id", "plain-loop", "--device", "cpu", "--json", str(out), "--", str(COMMANDS / "plain_train.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plain-loop on cpu x1 (simulated" in r.stdout
    res = json.loads(out.read_text())
    assert res["status"] == "ok" and res["scenario_id"] == "plain-loop" and res["simulated"]
    assert res["scenario"] == {"kind": "command", "id": "plain-loop", "world_size": 1,
                               "command": [sys.executable, str(COMMANDS / "plain_train.py")]}
    assert list(res["phases"]) == ["run"]
    assert res["phases"]["run"]["peak_reserved"] == res["metrics"]["peak_reserved"]
    # Linear(256, 1024) + Linear(1024, 256): 525,568 fp32 parameters; weights, grads and AdamW's two states
    # are 4 x 2,102,272 B, and the CUDA emulation adds two cuBLAS workspaces (forward and autograd threads);
    # AdamW's foreach temporaries (one parameter-sized copy) and the activations (batch 64) stay under 4 MiB
    # (measured: 2,234,880 B above the states and workspaces). A model tensor left unrecorded falls below.
    states = 4 * 525_568 * 4
    low = states + 2 * CUBLAS_WORKSPACE
    assert low <= res["metrics"]["peak_allocated"] <= low + (4 << 20)
    assert res["phases"]["run"]["host_peak_rss"] == res["metrics"]["host_peak_rss"] > 0  # the one window is the run
    rank = res["ranks"][0]
    assert rank["capture_backend"].startswith("rlhfmem CPU allocator recorder")
    assert [f["name"] for f in rank["flushes"]] == ["empty_cache@plain_train.py:16"]


def test_three_phase_marks_give_three_phases_each_merged_over_its_repeats(tmp_path):
    out = tmp_path / "phased.json"
    r = capture("--id", "phased", "--device", "cpu", "--json", str(out), "--", str(COMMANDS / "phased_train.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert list(res["phases"]) == ["run", "generate", "score", "train"]
    windows = {p["phase"]: p["windows"] for p in res["ranks"][0]["phases"]}
    assert windows == {"run": 10, "generate": 3, "score": 3, "train": 3}  # run resumes after each phase
    assert res["peak_phase"] in ("score", "train")
    for line in ("phase * peak reserved * peak allocated * fragmentation * cudaMalloc * time",
                 "generate *", "score *", "train *", "iteration *"):
        assert any(fnmatch.fnmatch(ln, line) for ln in r.stdout.splitlines()), line


def test_torchrun_line_with_two_ranks_records_both_and_not_the_agent(tmp_path):
    out = tmp_path / "ppo.json"
    r = capture("--id", "tiny-ppo", "--device", "cpu", "--json", str(out), "--keep-work", "--",
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and [x["rank"] for x in res["ranks"]] == [0, 1]
    assert {"generate", "score", "train"} <= set(res["phases"])
    assert all(x["flushes"][0]["name"] == "after-generate" for x in res["ranks"])
    claims = sorted(p.name for p in Path(res["work_dir"]).glob("claim-rank*"))
    assert claims == ["claim-rank0", "claim-rank1"]  # the torchrun agent claimed nothing


def test_hugging_face_trainer_runs_unchanged_under_capture(tmp_path):
    out = tmp_path / "hf.json"
    r = capture("--id", "hf-trainer", "--device", "cpu", "--json", str(out), "--keep-work", "--",
                str(COMMANDS / "hf_trainer.py"), str(tmp_path / "hf-out"))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["status"] == "ok" and list(res["phases"]) == ["run"]
    # GPT-2 (2 layers, 64 wide, vocab 1000, tied head) + AdamW: 168,192 parameters, weights + grads + 2 states
    # = 2,691,072 B, plus the two cuBLAS workspaces; activations (4 x 64 tokens, logits 1,000 wide) under 8 MiB
    states = 4 * 168_192 * 4
    low = states + 2 * CUBLAS_WORKSPACE
    assert low <= res["metrics"]["peak_allocated"] <= low + (8 << 20)
    assert "trained 4 steps" in Path(res["log"]).read_text()


@pytest.mark.parametrize("command, message", [
    (["no-such-program-xyz"], "rlhfmem: error: command not found: no-such-program-xyz"),
    (["missing_script.py"], "rlhfmem: error: command not found: missing_script.py (no such script)"),
    ([sys.executable, "-c", "import sys; print('bad flag', file=sys.stderr); sys.exit(3)"],
     "exited with code 3 before its first allocation (torch was never imported): bad flag"),
    ([sys.executable, "-c", "pass"], "finished without importing torch: nothing to measure"),
    ([sys.executable, "-c", "import sys, torch; print('no GPU config', file=sys.stderr); sys.exit(4)"],
     "exited with code 4 before its first allocation: no GPU config"),
    ([sys.executable, "-c", "import torch; raise ValueError('bad config')"],
     "exited with code 1 before its first allocation: ValueError: bad config"),
    ([sys.executable, "-c", "import torch"], "imported torch but allocated no tensor memory: nothing to measure"),
    (["--world-size", "2", "--nproc-per-node", "2", "--", sys.executable, "x.py"], "not allowed with argument"),
    ([], "rlhfmem: error: no command given"),
])
def test_bad_input_is_one_line_and_exit_2(command, message):
    args = command if "--" in command else ["--id", "bad", "--", *command]
    r = capture(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2  # argparse: usage + error


def test_merge_windows_peaks_are_maxima_counts_and_times_sums():
    class Rec:
        def __init__(self, name, wall_s):
            self.name, self.wall_s = name, wall_s

    w = [{"phase": "run", "peak_reserved": 10, "peak_allocated": 5, "fragmentation_at_peak": 1,
          "inactive_split_at_peak": 1, "max_fragmentation": 1, "cuda_malloc_count": 1, "time_s": 1.0},
         {"phase": "train", "peak_reserved": 30, "peak_allocated": 20, "fragmentation_at_peak": 4,
          "inactive_split_at_peak": 4, "max_fragmentation": 4, "cuda_malloc_count": 2, "time_s": 2.0},
         {"phase": "train", "peak_reserved": 20, "peak_allocated": 25, "fragmentation_at_peak": 9,
          "inactive_split_at_peak": 9, "max_fragmentation": 9, "cuda_malloc_count": 3, "time_s": 3.0}]
    rows = merge_windows(w, [Rec("train", 0.5), Rec("train", 0.25)], "run", 9.0)
    assert [r["phase"] for r in rows] == ["run", "train"]
    train = rows[1]
    assert (train["peak_reserved"], train["fragmentation_at_peak"], train["peak_allocated"]) == (30, 4, 25)
    assert (train["cuda_malloc_count"], train["time_s"], train["wall_s"], train["windows"]) == (5, 5.0, 0.75, 2)
    assert rows[0]["wall_s"] == 9.0
    # CUDA: every occurrence carries memory_stats() figures -> they win (peaks max, counts summed)
    real = [Rec("train", 0.5), Rec("train", 0.25)]
    for r, (pr, n) in zip(real, ((40, 1), (50, 2))):
        r.cuda_stats = {"peak_reserved": pr, "peak_allocated": pr - 5, "cuda_malloc_count": n,
                        "cuda_free_count": 0, "alloc_retries": 0, "ooms": 0}
    train = merge_windows(w, real, "run", 9.0)[1]
    assert (train["peak_reserved"], train["peak_allocated"], train["cuda_malloc_count"]) == (50, 45, 3)


FIXTURE_TEST = """
import sys

def test_my_trainer(rlhfmem_command, memory_budget):
    result = rlhfmem_command([sys.executable, {script!r}], id="my-trainer/phased", device="cpu")
    assert set(result.phases) == {{"run", "generate", "score", "train"}}
    memory_budget.check(result)
"""


def test_fixture_update_then_pass_then_lowered_budget_fails_with_the_table(pytester):
    pytester.makepyfile(test_own=FIXTURE_TEST.format(script=str(COMMANDS / "phased_train.py")))
    r = pytester.runpytest_subprocess("--rlhfmem-update-baselines")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*own.yaml: 0 updated, 1 new, 0 unchanged*"])
    budget = pytester.path / "baselines" / "cpu" / "own.yaml"
    data = yaml.safe_load(budget.read_text())
    assert data["entries"]["my-trainer/phased"]["capture"] == "cpu-trace-simulated"
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*rlhfmem: memory per scenario*", "my-trainer/phased*simulated*ok*"])
    data["entries"]["my-trainer/phased"]["metrics"]["peak_reserved"] = "1 MiB"
    budget.write_text(yaml.safe_dump(data))
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*my-trainer/phased is over its memory budget (simulated*",
                            "*peak reserved reached in phase: *",
                            "*metric*budget*measured*delta*tolerance*",
                            "*peak_reserved*1.00 MiB*OVER BUDGET*"])


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_fixture_names_crash_oom_hang_and_a_command_that_cannot_run(pytester):
    pytester.makepyfile(test_fail=f"""
import sys

def test_crash(rlhfmem_command):
    rlhfmem_command([sys.executable, {str(COMMANDS / 'crash.py')!r}], id="crashes", device="cpu")

def test_hang(rlhfmem_command):
    rlhfmem_command([sys.executable, {str(COMMANDS / 'hang.py')!r}], id="hangs", device="cpu", timeout=20)

def test_oom(rlhfmem_command):
    rlhfmem_command([sys.executable, {str(COMMANDS / 'oom.py')!r}], id="ooms", device="cpu")

def test_not_found(rlhfmem_command):
    rlhfmem_command(["no-such-trainer", "--fast"], id="missing")

def test_exits_before_torch(rlhfmem_command):
    rlhfmem_command([sys.executable, "-c", "raise SystemExit(5)"], id="early-exit")
""")
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    r.assert_outcomes(failed=5)
    r.stdout.fnmatch_lines([
        "*crashes: rank 0 failed in phase 'train': RuntimeError: boom in the training step*",
        "*memory so far (simulated): peak reserved *MiB, peak allocated *MiB*",
    ])
    r.stdout.fnmatch_lines(["*ooms: rank 0 failed in phase 'generate': OOM: *DefaultCPUAllocator: can't allocate*",
                            "*memory so far (simulated): peak reserved *MiB, peak allocated 4.00 MiB*"])
    r.stdout.fnmatch_lines(["*hangs: rank 0 failed in phase 'wait': Hang: hung: no result after the 20 s timeout*"])
    r.stdout.fnmatch_lines(["*rlhfmem_command('missing'): command not found: no-such-trainer*"])
    r.stdout.fnmatch_lines(["*rlhfmem_command('early-exit'): * -c 'raise SystemExit(5)' exited with code 5 "
                            "before its first allocation*"])
    assert "During handling of the above exception" not in r.stdout.str()


def test_nested_phase_resumes_the_enclosing_one(tmp_path):
    out = tmp_path / "nested.json"
    r = capture("--id", "nested", "--device", "cpu", "--json", str(out), "--", str(COMMANDS / "nested_train.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["ranks"][0]["phases"]
    assert [(p["phase"], p["windows"]) for p in rows] == [("run", 2), ("train", 2), ("backward", 1)]
    backward = rows[2]
    assert backward["peak_allocated"] >= 2 * 512 * 512 * 4  # weight + its gradient, fp32 bytes


def test_a_non_zero_exit_status_without_an_exception_is_a_failure_naming_rank_and_phase(tmp_path):
    out = tmp_path / "exit.json"
    r = capture("--id", "exit-5", "--device", "cpu", "--json", str(out), "--", sys.executable, "-c",
                "import sys, torch, pytest_rlhfmem as rlhfmem\nx = torch.ones(1 << 20)\n"
                "with rlhfmem.phase('train'):\n    sys.exit(5)")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rank 0 failed in phase 'train': ExitStatus: exited with code 5 with no uncaught exception" in r.stdout
    res = json.loads(out.read_text())
    assert res["status"] == "failed" and res["failure"]["memory_so_far"]["peak_allocated"] >= 4 << 20


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_reports_plot_diff_and_advise_work_on_a_fixture_session(pytester, tmp_path):
    """A user's script through the fixture feeds the same outputs as a recipe: session JSON, the per-PR
    report, memory_viz snapshots, `rlhfmem diff`, `rlhfmem plot` and `rlhfmem advise`."""
    pytester.makepyfile(test_own=FIXTURE_TEST.format(script=str(COMMANDS / "phased_train.py")))
    out = tmp_path / "out"
    r = pytester.runpytest_subprocess("--rlhfmem-update-baselines", "--rlhfmem-json", str(out / "s.json"),
                                      "--rlhfmem-report", str(out / "report.md"),
                                      "--rlhfmem-snapshots", str(out / "snaps"))
    r.assert_outcomes(passed=1)
    assert "`my-trainer/phased`" in (out / "report.md").read_text()
    assert list((out / "snaps").glob("my-trainer__phased__rank0.pickle"))
    d = rlhfmem_cli("diff", str(out / "s.json"), str(out / "s.json"), "--fail-on-regression")
    assert d.returncode == 0 and "0 regressed" in d.stdout, d.stdout + d.stderr
    p = rlhfmem_cli("plot", str(out / "s.json"), "-o", str(tmp_path / "fig.png"))
    assert p.returncode == 0 and (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p.stderr
    a = rlhfmem_cli("advise", str(out / "s.json"))
    assert a.returncode == 0 and "my-trainer/phased" in a.stdout and "recommendation:" in a.stdout, a.stderr


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_one_line_takes_a_deepspeed_engines_offloaded_state_out_of_the_device_trace(tmp_path, monkeypatch):
    """A user's DeepSpeed ZeRO-2 + CPU offload script, captured without and with ``rlhfmem.deepspeed_offload``:
    with the line, the fp32 master partition and Adam's two states (host memory under offload) leave the
    device trace and show as host bytes."""
    pytest.importorskip("deepspeed")
    n_params = 4 * (512 * 512 + 512)  # the script's 4 Linear(512, 512) layers
    results = {}
    for declare in ("0", "1"):
        monkeypatch.setenv("RLHFMEM_EXAMPLE_DECLARE", declare)
        out = tmp_path / f"ds-{declare}.json"
        r = capture("--id", f"ds-offload/{declare}", "--device", "cpu", "--json", str(out), "--",
                    sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                    str(COMMANDS / "deepspeed_offload.py"))
        assert r.returncode == 0, r.stdout + r.stderr
        results[declare] = json.loads(out.read_text())
    bare, declared = results["0"], results["1"]
    assert bare["ranks"][0]["host_bytes_annotated"] == 0 and bare["metrics"]["host_pinned_peak"] == 0
    states = 3 * n_params * 4  # fp32 master + exp_avg + exp_avg_sq, bytes
    assert declared["ranks"][0]["host_bytes_annotated"] >= states
    assert declared["metrics"]["host_pinned_peak"] >= states
    saved = bare["metrics"]["peak_allocated"] - declared["metrics"]["peak_allocated"]
    assert saved >= 0.9 * states, (saved, states)


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_capture_cuda_emulation_and_time_rounds_switches_reach_the_command(tmp_path):
    """rlhfmem capture has run's switches: --cuda-emulation off records the CPU trace as is (no cuBLAS
    workspace added: the peak drops by it), --time-rounds 2 runs the command twice."""
    figures = {}
    for switch, rounds in (("on", 2), ("off", 1)):
        out = tmp_path / f"{switch}.json"
        r = capture("--id", "plain-loop", "--device", "cpu", "--cuda-emulation", switch, "--time-rounds", str(rounds),
                    "--json", str(out), "--", str(COMMANDS / "plain_train.py"))
        assert r.returncode == 0, r.stdout + r.stderr
        figures[switch] = json.loads(out.read_text())
    assert len(figures["on"]["time_rounds"]) == 2 and figures["on"]["time_rounds_failed"] == 0
    assert not figures["off"].get("time_rounds")  # one round: no rounds listed
    assert figures["off"]["capture_description"]["cuda_emulation"] == "off"
    assert "cublas-workspace" in figures["on"]["capture_description"]["cuda_emulation"]["adjustments"]
    added = figures["on"]["ranks"][0]["cuda_emulation_report"]
    assert added is not None and figures["off"]["ranks"][0]["cuda_emulation_report"] is None
    r = capture("--time-rounds", "0", "--", str(COMMANDS / "plain_train.py"))
    assert r.returncode == 2 and "argument --time-rounds: '0': allowed values are an integer >= 1" in r.stderr


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_fixture_follows_the_cuda_emulation_and_time_rounds_options(pytester):
    pytester.makepyfile(test_opts=f"""
import sys

def test_opts(rlhfmem_command):
    result = rlhfmem_command([sys.executable, {str(COMMANDS / "plain_train.py")!r}], id="plain", device="cpu")
    assert result.data["capture_description"]["cuda_emulation"] == "off"
    assert len(result.data["time_rounds"]) == 2
""")
    r = pytester.runpytest_subprocess("--rlhfmem-cuda-emulation=off", "--rlhfmem-time-rounds=2")
    r.assert_outcomes(passed=1)


def test_a_program_that_looks_torch_up_before_importing_it_is_still_captured(tmp_path):
    """The bootstrap waits for torch to execute, not for the first lookup of its spec: a program (transformers)
    that calls ``importlib.util.find_spec("torch")`` first was reported as never importing torch."""
    result = run_command([str(COMMANDS / "find_spec_first.py")], "find-spec-first", device="cpu",
                         work_dir=tmp_path / "work")
    assert result["status"] == "ok", result.get("failure")
    assert result["metrics"]["peak_allocated"] >= 3 * 256 * 256 * 4  # x, x @ x and x's gradient
