"""Distributed programs, unchanged, on the simulated CUDA device, gated by a budget (``tox -e sim-dist``).

The programs (tests/data/commands/) are plain scripts written for a GPU machine, run under their own launchers:
DDP and FSDP2 (``fully_shard``) loops under torchrun, a DeepSpeed ZeRO-2 and ZeRO-3 script with the user's own
``deepspeed.initialize``, an Accelerate loop under ``accelerate launch --num_processes 2``, and a DeepSpeed-Chat
step-3 PPO script (the shipped recipe's tiny-opt pair, ZeRO-3). For each, at world size 2 on ``--device cuda-sim``
(values on):

- a user's test gates it with the ``rlhfmem_command`` fixture in real pytest sessions: the budget is recorded
  (``--rlhfmem-update-baselines``), the same run passes it with identical per-rank figures (the sessions'
  ``--rlhfmem-json``: the program ran to its end twice), and the run with its batch doubled fails;
- the same program on the CPU route (``--device cpu``: gloo, DeepSpeed's CPU accelerator) beside it: per-rank
  figures, wall time and host memory (``report_line``: printed, and docs/fidelity.md's table), peak allocated held
  within the differences docs/fidelity.md explains.

Also: every collective and point-to-point op checked with nccl, gloo and ``cuda:nccl,cpu:gloo``; DDP and FSDP2 at
world size 4; a backend the device lacks named in one line; the programs from the project's wheel in a fresh
virtual environment, gated there by the same user's test with the checkout's figures. Figures simulated
(``sim-cuda-simulated``).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem.command.run import CommandError, run_command
from pytest_rlhfmem.memory.metrics import METRIC_NAMES

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: tox -e sim-dist installs the deepspeed extra")
pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ROOT / "tests" / "data" / "commands"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def torchrun(script: str, *args: str, nproc: int = 2, python: str = sys.executable) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(COMMANDS / script),
            *args]


# id -> (the command as a GPU runner runs it, the same program on the CPU route, its batch flag and recorded batch).
# The batches are large enough that the doubled one launches the same reductions with global staging (the device's
# capture description counts them, and a budget entry holds only a run of the same description)
PROGRAMS = {
    "ddp": (torchrun("dist_train.py", "--mode", "ddp"), torchrun("dist_train.py", "--mode", "ddp", "--device", "cpu"),
            "--batch", 1024),
    "fsdp2": (torchrun("dist_train.py", "--mode", "fsdp2"),
              torchrun("dist_train.py", "--mode", "fsdp2", "--device", "cpu"), "--batch", 1024),
    "deepspeed-zero2": (torchrun("ds_train.py", "--stage", "2"), torchrun("ds_train.py", "--stage", "2", "--device",
                                                                          "cpu"), "--batch", 1024),
    "deepspeed-zero3": (torchrun("ds_train.py", "--stage", "3"), torchrun("ds_train.py", "--stage", "3", "--device",
                                                                          "cpu"), "--batch", 1024),
    # on the CPU route under torchrun: accelerate launch's multi-CPU launcher is mpirun (not installed here); the
    # script reads torchrun's environment as it reads accelerate launch's
    "accelerate": ([ACCELERATE, "launch", "--num_processes", "2", str(COMMANDS / "accel_train.py")],
                   torchrun("accel_train.py", "--cpu"), "--batch", 1024),
    "deepspeed-chat-zero3": (torchrun("ds_chat_ppo.py", "--stage", "3"),
                             torchrun("ds_chat_ppo.py", "--stage", "3", "--device", "cpu"), "--batch", 8),
}

USER_TEST = """
import json, os

def test_distributed_memory(rlhfmem_command, memory_budget):
    result = rlhfmem_command(json.loads(os.environ["COMMAND"]), id=os.environ["ID"], device="cuda-sim")
    assert result["world_size"] == 2 and sorted(r["rank"] for r in result["ranks"]) == [0, 1]
    memory_budget.check(result)
"""


def per_rank(result: dict) -> list[dict]:
    """Each rank's device figures (bytes and counts), by rank."""
    return [{k: r["total"][k] for k in METRIC_NAMES if k in r["total"]}
            for r in sorted(result["ranks"], key=lambda r: r["rank"])]


def session_result(path: Path) -> dict:
    (result,) = json.loads(path.read_text())["results"]
    return result


@pytest.mark.parametrize("ident", list(PROGRAMS))
def test_a_user_gates_it_and_it_runs_twice_with_the_same_figures_and_a_doubled_batch_fails(ident, pytester,
                                                                                          monkeypatch):
    command, _cpu, flag, batch = PROGRAMS[ident]
    pytester.makepyfile(test_distributed_memory=USER_TEST)
    monkeypatch.setenv("ID", ident)
    monkeypatch.setenv("COMMAND", json.dumps([*command, flag, str(batch)]))
    r = pytester.runpytest_subprocess("--rlhfmem-update-baselines", "--rlhfmem-json=first.json")
    r.assert_outcomes(passed=1)
    assert ident in (pytester.path / "baselines" / "cpu" / "distributed_memory.yaml").read_text()
    r = pytester.runpytest_subprocess("--rlhfmem-json=second.json")
    r.assert_outcomes(passed=1)
    first, second = (session_result(pytester.path / f) for f in ("first.json", "second.json"))
    assert first["capture"] == "sim-cuda-simulated" and first["status"] == "ok"
    assert per_rank(first) == per_rank(second), "two runs of the same program, different figures"
    monkeypatch.setenv("COMMAND", json.dumps([*command, flag, str(2 * batch)]))
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([f"*{ident} is over its memory budget (simulated*", "*OVER BUDGET*"])


def report_line(ident: str, sim: dict, cpu: dict) -> str:
    """One line: per-rank peak reserved / allocated (MiB) on each route, wall time and host peak RSS ratios."""
    def mib(v: float) -> str:
        return f"{v / 2**20:.2f}"
    ranks = " ".join(f"r{k}: {mib(s['peak_reserved'])}/{mib(s['peak_allocated'])} vs "
                     f"{mib(c['peak_reserved'])}/{mib(c['peak_allocated'])}"
                     for k, (s, c) in enumerate(zip(per_rank(sim), per_rank(cpu))))
    rss = max(r["total"]["host_peak_rss"] for r in sim["ranks"]) / max(r["total"]["host_peak_rss"]
                                                                        for r in cpu["ranks"])
    return (f"SIMDIST {ident}: {ranks} MiB (cuda-sim vs cpu); wall {sim['wall_s']:.1f} vs {cpu['wall_s']:.1f} s "
            f"({sim['wall_s'] / cpu['wall_s']:.2f}x); host peak RSS {rss:.2f}x")


# peak allocated on the CPU route within this fraction of cuda-sim's (docs/fidelity.md: the CPU route emulates CUDA's
# allocations from CPU ones; FSDP2's and ZeRO-3's side streams change peak reserved, not what is allocated)
ALLOCATED_WITHIN = 0.15


@pytest.mark.parametrize("ident", list(PROGRAMS))
def test_the_same_program_on_the_cpu_route_beside_it(ident, tmp_path):
    command, cpu_command, flag, batch = PROGRAMS[ident]
    sim = run_command([*command, flag, str(batch)], ident, device="cuda-sim", work_dir=tmp_path / "sim", timeout=1200)
    cpu = run_command([*cpu_command, flag, str(batch)], ident, device="cpu", work_dir=tmp_path / "cpu", timeout=1200)
    assert sim["status"] == "ok" and cpu["status"] == "ok", (sim.get("failure"), cpu.get("failure"))
    print(report_line(ident, sim, cpu))
    for s, c in zip(per_rank(sim), per_rank(cpu)):
        assert abs(s["peak_allocated"] - c["peak_allocated"]) <= ALLOCATED_WITHIN * s["peak_allocated"], (s, c)


@pytest.mark.parametrize("backend", ["nccl", "gloo", "cuda:nccl,cpu:gloo"])
def test_every_collective_and_point_to_point_op_gives_its_result(backend, tmp_path):
    r = run_command(torchrun("dist_collectives.py", backend), "collectives", device="cuda-sim",
                    work_dir=tmp_path, timeout=600)
    assert r["status"] == "ok", r.get("failure") or Path(r["log"]).read_text()[-3000:]
    lines = sorted(re.findall(r"rank \d+ ok \d+ ops", Path(r["log"]).read_text()))  # the ranks' lines may interleave
    # gloo: the subset gloo runs on device tensors; rank 0 also checks gather, rank 1 send/recv and not reduce
    ops = (17, 16) if backend == "gloo" else (22, 22)
    assert lines == [f"rank {k} ok {ops[k]} ops" for k in range(2)], lines
    names = set().union(*(rank["collectives"] for rank in r["ranks"]))
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
            "send", "recv"} <= names, names
    # barrier: the device's group for nccl; a group with a CPU backend (gloo, cuda:nccl,cpu:gloo) runs it there
    # (distributed_c10d.py: barrier uses the CPU device when the group has one: _get_object_coll_device)
    assert ("barrier" in names) == (backend == "nccl"), names


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_world_size_four(mode, tmp_path):
    """Four ranks on four simulated devices: the same figures on each rank (DDP replicates; FSDP2 shards evenly)."""
    r = run_command(torchrun("dist_train.py", "--mode", mode, nproc=4), f"{mode}/x4", device="cuda-sim",
                    work_dir=tmp_path, timeout=1200)
    assert r["status"] == "ok", r.get("failure")
    figures = per_rank(r)
    assert len(figures) == 4 and all(f == figures[0] for f in figures), figures
    printed = [json.loads(ln.removeprefix("FIGURES ")) for ln in Path(r["log"]).read_text().splitlines()
               if ln.startswith("FIGURES ")]
    assert len({p["param_sum"] for p in printed}) == 1 and len(printed) == 4


@pytest.mark.parametrize("backend, named", [("mpi", "MPI"), ("ucc", "UCC")])
def test_a_backend_the_device_lacks_is_one_line_naming_it(backend, named, tmp_path):
    """Nothing was allocated: one line (the rank's own exception, not torchrun's failure dump) and the run's
    directory removed."""
    with pytest.raises(CommandError) as err:
        run_command(torchrun("dist_all_reduce.py", backend), "lacks", device="cuda-sim", work_dir=tmp_path / "w",
                    timeout=300)
    message = str(err.value)
    assert "\n" not in message and named in message and "before its first allocation" in message, message
    assert not (tmp_path / "w").exists()


WHEEL_PROGRAMS = ("ddp", "fsdp2", "deepspeed-zero3", "accelerate")


@pytest.mark.parametrize("ident", WHEEL_PROGRAMS)
def test_from_the_wheel_in_a_fresh_venv_gated_with_the_checkout_s_figures(ident, wheel_venv, tmp_path):
    """``pip install`` of the wheel, no checkout on the path (the root conftest's ``wheel_venv``): the user's test runs
    under that environment's pytest (the plugin from the wheel's entry point), records the budget, passes with the
    same per-rank figures, fails with the batch doubled; the figures are the checkout's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    py = str(wheel_venv / "bin" / "python")
    command, _cpu, flag, batch = PROGRAMS[ident]
    venv_command = ([py, "-m", "accelerate.commands.launch", *command[2:]] if command[0] == ACCELERATE
                    else [py, *command[1:]])
    (tmp_path / "test_distributed_memory.py").write_text(USER_TEST)

    def session(*args: str, batch_size: int = batch) -> subprocess.CompletedProcess:
        return subprocess.run([py, "-m", "pytest", "-p", "no:cacheprovider", "test_distributed_memory.py", *args],
                              cwd=tmp_path, env={**env, "ID": ident,
                                                 "COMMAND": json.dumps([*venv_command, flag, str(batch_size)])},
                              capture_output=True, text=True, timeout=1800)

    for args in (("--rlhfmem-update-baselines", "--rlhfmem-json=first.json"), ("--rlhfmem-json=second.json",)):
        r = session(*args)
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    first, second = (session_result(tmp_path / f) for f in ("first.json", "second.json"))
    assert per_rank(first) == per_rank(second)
    r = session(batch_size=2 * batch)
    assert r.returncode == 1 and f"{ident} is over its memory budget" in r.stdout, r.stdout[-3000:]
    here = run_command([*command, flag, str(batch)], ident, device="cuda-sim", work_dir=tmp_path / "here",
                       timeout=1200)
    assert per_rank(first) == per_rank(here), "the wheel's figures differ from the checkout's"
