"""Issue 45: the GPU route rehearsed on the simulated CUDA device (``--device cuda-rehearsal``), on every run.

The rehearsal runs the CUDA route's own code (the launcher's CUDA path, ``RankCapture`` on ``cuda``, ``CudaHistory``:
``_record_memory_history``, the phase marks on the allocator's clock, ``memory_stats()`` per phase, ``_snapshot()``,
the anchored replay, the budgets) with the simulated CUDA device under it. Its figures must equal, to the byte, those
of the simulated routes that read the same device directly: the ``cuda-sim`` capture for users' commands, the
fake-CUDA route's ``sim`` tensors for the DeepSpeed-Chat recipe. Its results are labelled simulated, under their own
capture and profile, and never compared with a GPU's or a CPU route's budgets."""

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers import DATA

from pytest_rlhfmem.command.run import run_command
from pytest_rlhfmem.fakecuda.run import run_fake_cuda
from pytest_rlhfmem.memory.trace import load_snapshot
from pytest_rlhfmem.rlhf.launch import finish_work, run_scenario
from pytest_rlhfmem.rlhf.scenario import Scenario

COMMANDS = DATA / "commands"
REHEARSAL = "cuda-rehearsal"
# every figure a phase (and the run) reports that the two routes must agree on to the byte
FIGURES = ("peak_reserved", "peak_allocated", "fragmentation_at_peak", "inactive_split_at_peak", "max_fragmentation",
           "cuda_malloc_count", "cuda_free_count", "alloc_retries", "ooms", "events")


def figures(rank: dict) -> dict:
    """``{phase or "total": {figure: value}}`` of one rank's result."""
    out = {p["phase"]: {k: p.get(k) for k in FIGURES} for p in rank["phases"]}
    out["total"] = {k: rank["total"].get(k) for k in FIGURES} | {"events": rank["events"]}
    return out


def capture(tmp_path: Path, script: str, *args: str, device: str, values: str = "off", env: dict | None = None,
            world_size: int | None = None, snapshot_dir: Path | None = None) -> dict:
    work = tmp_path / device
    result = run_command([sys.executable, str(COMMANDS / script), *args], f"{Path(script).stem}", device=device,
                         work_dir=work, timeout=600, sim_values=values, env=env, world_size=world_size,
                         snapshot_dir=snapshot_dir)
    assert result["status"] == "ok", result.get("failure") or Path(result["log"]).read_text()[-3000:]
    finish_work(result)
    return result


# -- the user-command route: rehearsal == cuda-sim ----------------------------------------------------------

COMMAND_CASES = [
    pytest.param("cuda_phased_flush.py", (), "off", id="phased-loop-with-flush"),
    pytest.param("cuda_train.py", (), "off", id="autocast-training"),
    pytest.param("cuda_autocast.py", (), "off", id="autocast-cast-cache"),
    pytest.param("cuda_sdpa.py", (), "off", id="sdpa"),
    pytest.param("cuda_mask.py", (), "on", id="value-dependent-mask"),
]


@pytest.mark.parametrize("script, args, values", COMMAND_CASES)
def test_a_command_rehearsed_gives_the_cuda_sim_figures_to_the_byte(tmp_path, script, args, values):
    sim = capture(tmp_path, script, *args, device="cuda-sim", values=values, snapshot_dir=tmp_path / "sim-snapshots")
    reh = capture(tmp_path, script, *args, device=REHEARSAL, values=values, snapshot_dir=tmp_path / "snapshots")
    assert figures(reh["ranks"][0]) == figures(sim["ranks"][0])
    assert reh["capture"] == "cuda-rehearsal-simulated" and reh["simulated"] is True and reh["device"] == REHEARSAL
    rank = reh["ranks"][0]
    assert rank["capture_backend"] == "torch.cuda.memory._record_memory_history"  # the CUDA recorder ran
    assert rank["cuda_history"]["mark_clock"] == "allocator clock (external_annotations)"
    snap = load_snapshot(rank["snapshot"])  # the device's own history, as a GPU's snapshot is the allocator's own
    assert snap["allocator_settings"]["rlhfmem_note"].startswith("simulated: the CUDA route's memory history")
    assert snap["allocator_settings"]["rlhfmem_capture"] == "cuda-rehearsal-simulated"


def test_the_programs_own_history_and_snapshot_on_the_rehearsal(tmp_path):
    """cuda_functions.py calls _record_memory_history, reset_peak_memory_stats, memory_stats, empty_cache and
    _dump_snapshot itself: under the rehearsal the CUDA recorder serves those calls from its own history
    (CudaHistory), and the program's dumped snapshot holds the same allocations as under cuda-sim, where the device
    answers alone."""
    snaps = {}
    results = {}
    for device in ("cuda-sim", REHEARSAL):
        snaps[device] = tmp_path / f"{device}.pickle"
        results[device] = capture(tmp_path, "cuda_functions.py", str(snaps[device]), device=device)
    sim, reh = results["cuda-sim"], results[REHEARSAL]
    assert figures(reh["ranks"][0]) == figures(sim["ranks"][0])
    assert reh["ranks"][0]["cuda_history"]["program_calls"] == 2  # enable, then enabled=None

    def sequence(snap: dict) -> list:
        return [(e["action"], e["size"]) for e in snap["device_traces"][0]]

    a, b = load_snapshot(snaps["cuda-sim"]), load_snapshot(snaps[REHEARSAL])
    assert sequence(a) == sequence(b) and sequence(a)  # the program's window, cut as on a GPU
    assert [(s["address"], s["total_size"]) for s in a["segments"]] == [(s["address"], s["total_size"])
                                                                       for s in b["segments"]]
    assert not [x for x in b["external_annotations"] if x["name"].startswith("rlhfmem::")]  # ours are not its
    assert all(e["time_us"] > 1.7e15 for e in b["device_traces"][0])  # microseconds since the epoch (2023 on)


def test_a_wrapped_history_fails_the_rank_as_on_a_gpu(tmp_path):
    """A ring buffer too small for the run: the device's history really wraps (its first entries are overwritten),
    and the CUDA route refuses the partial trace with its own message (HistoryWrapped)."""
    result = run_command([sys.executable, str(COMMANDS / "cuda_phased_flush.py")], "wrapped", device=REHEARSAL,
                         work_dir=tmp_path / "w", timeout=600, sim_values="off",
                         env={"RLHFMEM_HISTORY_MAX_ENTRIES": "200"})
    assert result["status"] == "failed"
    failure = result["failure"]
    assert failure["phase"] == "finish" and failure["error"] == "HistoryWrapped", failure
    assert "filled its ring buffer of 200 entries" in failure["message"]
    assert "RLHFMEM_HISTORY_MAX_ENTRIES=400" in failure["message"]
    assert failure["simulated"] is True


@pytest.mark.parametrize("phase", ["run", "rollout", "score", "train"])
def test_a_program_error_in_each_phase_is_named_on_the_rehearsal(tmp_path, phase):
    result = run_command([sys.executable, str(COMMANDS / "cuda_phased_flush.py"), "--fail-in", phase], "fails",
                         device=REHEARSAL, work_dir=tmp_path / "w", timeout=600, sim_values="off")
    assert result["status"] == "failed"
    failure = result["failure"]
    assert (failure["rank"], failure["phase"], failure["error"]) == (0, phase, "RuntimeError"), failure
    assert failure["message"] == f"boom in {phase}"
    assert failure["simulated"] is True and failure["memory_so_far"]["peak_reserved"] > 0
    assert result["capture"] == "cuda-rehearsal-simulated"


# -- the recipe route: rehearsal == the fake-CUDA route's sim tensors ------------------------------------------

def _fake_route(scenario: Scenario, tmp_path: Path) -> dict:
    """The fake-CUDA route's results (``tensors="sim"``) of ``scenario`` and, for flush after-inference, of its
    flush-none twin (the same trace without the policy's marks)."""
    return run_fake_cuda(scenario, work_dir=tmp_path / "fake", tensors="sim", timeout=900,
                         without_flush=scenario.flush != "none")


def _rehearse(scenario: Scenario, tmp_path: Path) -> dict:
    result = run_scenario(scenario, device=REHEARSAL, timeout=900, work_dir=tmp_path / scenario.flush)
    assert result["status"] == "ok", result.get("failure")
    finish_work(result)
    return result


@pytest.mark.parametrize("strategy, world_size", [("zero2", 1), ("zero3", 1), ("zero3", 2)])
def test_the_recipe_rehearsed_gives_the_fake_cuda_routes_figures_to_the_byte(tmp_path, strategy, world_size):
    """DeepSpeed-Chat, tiny OPT: with the after-inference flush and without (world size 1), and ZeRO-3 at world size
    2 without: rank 0's every phase equal to the fake-CUDA route's rank 0 on the simulated device."""
    flushes = ("after-inference", "none") if world_size == 1 else ("none",)
    main = Scenario("deepspeed-chat", "tiny-opt", strategy, flushes[0], world_size)
    fake = _fake_route(main, tmp_path)
    for flush in flushes:
        cell = Scenario("deepspeed-chat", "tiny-opt", strategy, flush, world_size)
        reh = _rehearse(cell, tmp_path)
        rank0 = next(r for r in reh["ranks"] if r["rank"] == 0)
        assert figures(rank0) == figures(fake[cell.id]), cell.id
        assert reh["capture"] == "cuda-rehearsal-simulated" and reh["simulated"] is True
        assert rank0["rehearsal"]["stands_in_for"].keys() == {"GPU", "nvcc op builds", "NCCL"}
        # one FLUSH per policy flush on the CUDA route, and DeepSpeed's own empty_cache() calls named by their caller,
        # as the fake-CUDA route records them (no FLUSH of the recorder's own empty_cache through the interception)
        names = [f["name"] for f in rank0["flushes"]]
        assert names == [f["name"] for f in fake[cell.id]["flushes"]]
        assert [n for n in names if n.startswith("after-")] == (
            [f"after-{p}" for p in ("generate", "infer_actor", "infer_reference", "infer_reward", "infer_critic")]
            if flush == "after-inference" else [])


# -- the fixtures on the rehearsal device: update, pass, fail a cut budget ----------------------------------------

def _cut(path: Path, metric: str, factor: float) -> None:
    data = yaml.safe_load(path.read_text())
    for entry in data["entries"].values():
        size, unit = entry["metrics"][metric].split()
        entry["metrics"][metric] = f"{float(size) * factor:.6f} {unit}"
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.mark.parametrize("fixture_call", [
    pytest.param(f"""rlhfmem_command([sys.executable, {str(COMMANDS / 'cuda_phased_flush.py')!r}], id="loop")""",
                 id="rlhfmem_command"),
    # the recipe through the fixture: 110 s on 2 cores, tox -e long (its figures: the recipe test above, by default)
    pytest.param("""ppo_iteration(strategy="zero2", world_size=1)""", id="ppo_iteration", marks=pytest.mark.long),
])
def test_the_fixtures_on_the_rehearsal_update_pass_and_fail_a_cut_budget(pytester, monkeypatch, fixture_call):
    pytester.makepyfile(test_rehearsed=textwrap.dedent(f"""
        import sys

        def test_it(ppo_iteration, rlhfmem_command, memory_budget):
            memory_budget.check({fixture_call})
        """))
    env_args = ["--rlhfmem-device", REHEARSAL, "-p", "no:cacheprovider"]
    monkeypatch.setenv("RLHFMEM_SIM_CUDA_VALUES", "off")  # the loop reads no device value
    update = pytester.runpytest_subprocess(*env_args, "--rlhfmem-update-baselines", timeout=600)
    update.assert_outcomes(passed=1)
    budget = pytester.path / "baselines" / "cuda-rehearsal" / "rehearsed.yaml"
    entry = next(iter(yaml.safe_load(budget.read_text())["entries"].values()))
    assert entry["capture"] == "cuda-rehearsal-simulated"
    assert not (pytester.path / "baselines" / "cpu").exists()  # never a CPU route's profile
    pytester.runpytest_subprocess(*env_args, timeout=600).assert_outcomes(passed=1)
    _cut(budget, "peak_reserved", 0.5)
    failed = pytester.runpytest_subprocess(*env_args, timeout=600)
    failed.assert_outcomes(failed=1)
    assert "peak_reserved" in failed.stdout.str()


def test_a_rehearsal_budget_refuses_a_cpu_capture_and_the_reverse(tmp_path):
    from pytest_rlhfmem import budgets as B

    def entry(capture: str) -> B.BudgetEntry:
        return B.BudgetEntry("x", {}, {}, capture=capture, raw={"capture": capture})

    why = B.not_comparable(tmp_path / "b.yaml", entry("cuda-rehearsal-simulated"), "sim-cuda-simulated", {})
    assert why and "'cuda-rehearsal-simulated'" in why and "'sim-cuda-simulated'" in why
    assert B.not_comparable(tmp_path / "b.yaml", entry("cuda-memory-history"), "cuda-rehearsal-simulated", {})
    assert B.not_comparable(tmp_path / "b.yaml", entry("cuda-rehearsal-simulated"), "cuda-rehearsal-simulated",
                            {}) is None


def test_a_killed_ranks_progress_file_keeps_its_cuda_peaks_not_what_it_held(tmp_path):
    """The CUDA route's progress file (record/rank.py: RankCapture.progress) reads memory_stats()' peaks: a rank
    killed after freeing its peak and emptying the cache is reported with the peak it reached."""
    result = run_command([sys.executable, str(COMMANDS / "cuda_killed_after_peak.py")], "killed", device=REHEARSAL,
                         work_dir=tmp_path / "w", timeout=600, sim_values="off")
    assert result["status"] == "failed"
    failure = result["failure"]
    assert (failure["phase"], failure.get("signal")) == ("wait", "SIGKILL"), failure
    line = next(ln for ln in Path(result["log"]).read_text().splitlines() if ln.startswith("PEAKS "))
    peaks = json.loads(line.removeprefix("PEAKS "))
    assert peaks["reserved"] >= 64 << 20  # the program's own figures: the peak it reached
    so_far = failure["memory_so_far"]
    assert (so_far["peak_reserved"], so_far["peak_allocated"]) == (peaks["reserved"], peaks["allocated"])
