"""Run one scenario in fresh worker processes with torch's elastic launcher; gather the ranks.

``torchrun --standalone`` (a free rendezvous port on localhost) starts N ranks of ``worker.py`` (gloo on
CPU, nccl on CUDA). The whole run has a timeout; on expiry torchrun gets SIGTERM (it kills its workers'
process groups), then every process group still alive gets SIGKILL, so nothing is left behind. A rank
that raised, ran out of memory, or hung becomes a structured failure: rank, phase, error, memory so far.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..hostcpu import fp16_answer
from ..memory.host import HOST_IO_NAMES, HOST_METRIC_NAMES, HOST_SWAP_NAMES
from ..memory.metrics import METRIC_NAMES
from .scenario import DEVICES, Scenario, ScenarioError

DEFAULT_TIMEOUT_S = 900.0


def resolve_device(device: str, world_size: int) -> str:
    """``auto`` -> ``cuda`` when at least ``world_size`` CUDA devices are visible, else ``cpu``."""
    if device not in DEVICES:
        raise ScenarioError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"


def require_libaio() -> None:
    """ZeRO-Infinity's NVMe swapping runs DeepSpeed's async I/O op, which builds against libaio. Raises
    :class:`ScenarioError` (one line: what to install) when its header or library is missing."""
    import ctypes.util

    header = any(Path(d, "libaio.h").exists() for d in ("/usr/include", "/usr/local/include"))
    if not header or ctypes.util.find_library("aio") is None:
        raise ScenarioError("strategy zero3-nvme swaps to NVMe through DeepSpeed's async I/O op, which needs libaio: "
                            "install it (Debian/Ubuntu: apt-get install libaio-dev; Fedora/RHEL: dnf install "
                            "libaio-devel) and run again")


def prebuild_ops(device: str, offload: bool | str, framework: str = "deepspeed-chat") -> None:
    """Build DeepSpeed's JIT ops (and, on CPU, the allocation recorder) once, under a file lock, before
    ranks start: two ranks building the same op at once race. Cached in torch's extension directory;
    a warm call takes about a second."""
    from filelock import FileLock

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pytest-rlhfmem"
    cache.mkdir(parents=True, exist_ok=True)
    builders = ((["ShareMemCommBuilder"] if device == "cpu" else []) + (["CPUAdamBuilder"] if offload else [])
                + (["AsyncIOBuilder"] if offload == "nvme" else []))
    if framework != "deepspeed-chat":
        builders = []
    if not builders and device != "cpu":
        return
    code = ""
    if builders:
        code = ("from deepspeed.accelerator import get_accelerator\n"
                f"for b in {builders!r}:\n"
                "    ob = get_accelerator().create_op_builder(b)\n"
                "    ob = None if type(ob).__name__ == \"NotImplementedBuilder\" else ob\n"
                "    ob is not None and ob.is_compatible() and ob.load(verbose=False)\n")
    if device == "cpu":
        code += "from pytest_rlhfmem.memory.cpu_recorder import load_recorder\nload_recorder()\n"
    with FileLock(str(cache / "ds-ops.lock")):
        subprocess.run([sys.executable, "-c", code], env=_worker_env(device, 1), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)


def _worker_env(device: str, threads: int) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_scenario(scenario: Scenario, device: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                 snapshot_dir: str | Path | None = None, work_dir: str | Path | None = None,
                 capture: bool = True, cuda_emulation: str = "on") -> dict:
    """Run ``scenario`` once; returns the scenario result (see :func:`aggregate`). Never raises for a
    failed run: the result's ``status`` is ``failed`` and ``failure`` says which rank, phase and why.
    Raises :class:`ScenarioError` before launching for a scenario this device cannot run.
    ``capture=False`` runs the bare iteration (timed, nothing recorded): the capture-overhead baseline.
    ``cuda_emulation`` (``on``/``off``): the CPU capture's CUDA emulation (``memory/emulation.py``)."""
    from .colossalchat import CPU_STRATEGIES
    from .deepspeed_chat import STRATEGY_SETTINGS

    _check_framework_installed(scenario.framework)
    try:  # a bad $RLHFMEM_CPU_FP16_KERNELS is one line here, not a traceback in every worker's log
        fp16_answer()
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None
    device = resolve_device(device, scenario.world_size)
    if scenario.framework == "colossalchat" and device == "cpu" and scenario.strategy not in CPU_STRATEGIES:
        raise ScenarioError(f"colossalchat strategy {scenario.strategy!r} needs CUDA (ColossalAI's LowLevelZero "
                            f"and Gemini plugins assert a CUDA/NPU accelerator); on CPU: {', '.join(CPU_STRATEGIES)}")
    if scenario.get("hybrid_engine_kernels"):
        raise ScenarioError("override hybrid_engine_kernels runs on the fake-CUDA route only (pytest_rlhfmem.fakecuda, "
                            "tensors='sim'): DeepSpeed 0.19.8 keeps transformers 5's OPT on the native path "
                            "(hybrid_engine.py: populate_all_inference_policies), so there is no injected layer to "
                            f"run on {device}")
    if scenario.framework == "deepspeed-chat" and STRATEGY_SETTINGS.get(scenario.strategy, (0, False))[1] == "nvme":
        require_libaio()
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="rlhfmem-"))
    work.mkdir(parents=True, exist_ok=True)
    offload = STRATEGY_SETTINGS.get(scenario.strategy, (0, False, False))[1]
    t0 = time.perf_counter()
    prebuild_ops(device, offload and scenario.framework == "deepspeed-chat", scenario.framework)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={scenario.world_size}", "--max-restarts=0", "--monitor-interval=0.5",
           "-m", "pytest_rlhfmem.rlhf.worker", "--scenario", json.dumps(scenario.to_dict()),
           "--out-dir", str(work), "--device", device]
    if snapshot_dir:
        cmd += ["--snapshot-dir", str(snapshot_dir)]
    if not capture:
        cmd.append("--no-capture")
    cmd += ["--cuda-emulation", cuda_emulation]
    log_path = work / "launcher.log"
    returncode, timed_out = run_process_group(cmd, log_path, _worker_env(device, scenario.get("threads", 1)),
                                              timeout, work)
    return aggregate(scenario, device, work, returncode, timed_out, timeout, time.perf_counter() - t0, log_path)


def finish_work(result: dict, keep: bool = False) -> Path | None:
    """After a run's result is used (its JSON and traces written): remove its work directory
    (``result["work_dir"]``: the ranks' files, the launcher log) unless ``keep``; a failed run's is always
    kept, its log and the ranks' files say what went wrong. Returns the directory kept (for the caller to
    print), or ``None`` when it was removed or there was none."""
    wd = result.get("work_dir")
    if not wd or not Path(wd).is_dir():
        return None
    if keep or result.get("status") != "ok":
        return Path(wd)
    shutil.rmtree(wd, ignore_errors=True)
    return None


def run_process_group(cmd: list[str], log_path: Path, env: dict[str, str], timeout: float, work: Path,
                      cwd: str | Path | None = None) -> tuple[int, bool]:
    """Run ``cmd`` (a torchrun line or a user's command) in its own session, stdout and stderr to
    ``log_path``; at ``timeout`` seconds terminate the whole group (SIGTERM, then SIGKILL after 15 s).
    Afterwards kill any worker group still alive (each rank announces its pid in ``work``'s progress
    files). Returns ``(returncode, timed_out)``; raises ``OSError`` when ``cmd`` cannot start."""
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=cwd)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _terminate(proc)
    _kill_leftover_workers(work)
    return proc.returncode, timed_out


FRAMEWORK_PACKAGES = {
    "deepspeed-chat": ("deepspeed", "pip install 'pytest-rlhfmem[deepspeed]', or tox -e py"),
    "colossalchat": ("colossalai",
                     "pip install 'pytest-rlhfmem[colossalai]' in its own environment, or tox -e colossalai"),
}


def _check_framework_installed(framework: str) -> None:
    """Raise :class:`ScenarioError` naming the install command when the framework's package is missing."""
    import importlib.util

    package, how = FRAMEWORK_PACKAGES[framework]
    if importlib.util.find_spec(package) is None:
        raise ScenarioError(f"framework {framework!r} needs the {package} package, which this environment lacks: {how}")


def _terminate(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun forwards it to its workers' process groups
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _kill_leftover_workers(work: Path) -> None:
    """Every worker runs in its own session (torchrun's choice): kill any group still alive."""
    for p in work.glob("progress-rank*.json"):
        try:
            pid = json.loads(p.read_text())["pid"]
            os.killpg(pid, signal.SIGKILL)
        except (ValueError, KeyError, OSError):
            pass


def _exit_status_failure(ranks: list[dict], returncode: int | None, log_path: Path) -> dict:
    """Every rank wrote its result without an exception, yet the command's exit status is non-zero
    (``sys.exit(3)``, an exit code set by a library): name the rank torchrun reports as the root cause
    (its ``rank : R (local_rank: L)`` line), else the only rank, with its phase at exit and its peaks."""
    rank = ranks[0]["rank"] if len(ranks) == 1 else None
    if rank is None and log_path.exists():
        m = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", log_path.read_text(errors="replace"), re.S)
        rank = int(m.group(1)) if m else None
    res = next((r for r in ranks if r["rank"] == rank), ranks[0])
    return {"rank": rank, "phase": res.get("exit_phase"), "error": "ExitStatus",
            "message": f"exited with code {returncode} with no uncaught exception (sys.exit or an exit status "
                       f"set by the program)",
            "memory_so_far": {k: res["total"][k] for k in ("peak_reserved", "peak_allocated")},
            "simulated": res["simulated"]}


def aggregate(scenario: Scenario, device: str, work: Path, returncode: int | None, timed_out: bool,
              timeout: float, wall_s: float, log_path: Path) -> dict:
    """The scenario result: per metric the maximum over ranks (the budget is per GPU), per phase too,
    plus every rank's own result. ``status`` is ``ok`` only if every rank finished."""
    ranks, failures = [], []
    for r in range(scenario.world_size):
        res_p, prog_p = work / f"result-rank{r}.json", work / f"progress-rank{r}.json"
        if res_p.exists():
            res = json.loads(res_p.read_text())
            ranks.append(res)
            if res["error"]:
                failures.append({"rank": r, "phase": res["error"]["phase"], "error": res["error"]["type"],
                                 "time": res["error"].get("time"),
                                 "message": res["error"]["message"],
                                 "memory_so_far": {k: res["total"][k] for k in ("peak_reserved", "peak_allocated")},
                                 "simulated": res["simulated"]})
        else:
            prog = json.loads(prog_p.read_text()) if prog_p.exists() else {}
            why = (f"hung: no result after the {timeout:g} s timeout; the process group was killed" if timed_out
                   else f"exited without a result (launcher exit code {returncode})")
            failures.append({"rank": r, "phase": prog.get("phase", "startup"),
                             "error": "Hang" if timed_out else "Crash", "message": why,
                             "memory_so_far": {"host_rss": prog.get("host_rss")}})
    if ranks and not failures and returncode != 0 and not timed_out and len(ranks) == scenario.world_size:
        failures.append(_exit_status_failure(ranks, returncode, log_path))
    # The root cause first: the earliest exception; ranks that died without a result (killed by torchrun
    # after another rank failed, or hung) last. A peer's "connection reset" comes after the cause.
    failures.sort(key=lambda f: (f.get("time") is None, f.get("time") or 0.0, f["rank"]))
    ok = not failures and returncode == 0 and len(ranks) == scenario.world_size
    first = ranks[0] if ranks else {}
    # device figures (simulated on CPU), host figures (measured), the CPU-only host estimate (host.py)
    names = METRIC_NAMES + HOST_METRIC_NAMES + HOST_IO_NAMES + HOST_SWAP_NAMES + ("host_rss_outside_device",)
    metrics = {m: max((r["total"].get(m) or 0) for r in ranks) for m in names} if ranks else {}
    if not any("host_rss_outside_device" in r["total"] for r in ranks):
        metrics.pop("host_rss_outside_device", None)
    phase_names = [p["phase"] for p in first.get("phases", [])]
    phases = {}
    for name in phase_names:
        per = [p for r in ranks for p in r["phases"] if p["phase"] == name]
        phases[name] = {m: max((p.get(m) or 0) for p in per) for m in names + ("wall_s",)}
    peak_rank = max(ranks, key=lambda r: r["total"]["peak_reserved"]) if ranks else {}
    log_tail = ""
    if not ok and log_path.exists():
        log_tail = log_path.read_bytes()[-3000:].decode(errors="replace")
    return {
        "schema": 1,
        "scenario": scenario.to_dict(),
        "scenario_id": scenario.id,
        "status": "ok" if ok else "failed",
        "failure": failures[0] if failures else ({"rank": None, "phase": None, "error": "LaunchError",
                                                   "message": f"launcher exit code {returncode}"} if not ok else None),
        "failures": failures,
        "device": device,
        "capture": first.get("capture"),
        "capture_description": first.get("capture_description", {}),
        "simulated": first.get("simulated", device == "cpu"),
        "host": {k: first.get("host", {}).get(k) for k in ("rss_method", "anon_method", "pinned_method", "heap_method",
                                                          "measured")},
        "host_cpu": first.get("host_cpu"),  # what of the host could move a figure (hostcpu.py)
        "world_size": scenario.world_size,
        "versions": first.get("versions", {}),
        "threads": first.get("threads"),
        "metrics": metrics,
        "phases": phases,
        "peak_phase": peak_rank.get("peak_phase"),
        "wall_s": round(wall_s, 3),
        "iteration_wall_s": max((r["wall_s"] for r in ranks), default=None),
        "ranks": ranks,
        "work_dir": str(work),
        "log_tail": log_tail,
    }
