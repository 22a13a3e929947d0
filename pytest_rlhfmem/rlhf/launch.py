"""Run one scenario in fresh worker processes with torch's elastic launcher; gather the ranks.

``torchrun --standalone`` (a free rendezvous port on localhost) starts N ranks of ``worker.py`` (gloo on
CPU, nccl on CUDA). The whole run has a timeout (the wait for DeepSpeed's op-build lock and the JIT builds
included); on expiry torchrun gets SIGTERM (it kills its workers' process groups), then every process group
still alive gets SIGKILL, so nothing is left behind. SIGINT, SIGTERM and SIGHUP to this process while a run's
processes are alive do the same within seconds and raise :class:`RunInterrupted` (each rank's phase, the work
directory). torchrun's own per-run directories (``--log-dir``: its error files, ``torchelastic_*``) go under
the run's work directory. A rank that raised, ran out of memory, or hung becomes a structured failure: rank,
phase, error, memory so far; the rank whose process died first comes first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from ..cbuild import cache_dir
from ..units import format_size
from ..hardware import REHEARSAL_DEVICE, code_device, cuda_device_count
from ..hostcpu import fp16_answer
from ..owned import (LEFTOVERS, WorkDirError, claim_work_dir, is_run_process, new_token, remove_work, run_env,
                     run_processes, start_ticks, stop_processes)
from ..record.recorder import history_settings
from ..record.host import HOST_IO_NAMES, HOST_METRIC_NAMES, HOST_SWAP_NAMES
from ..memory.metrics import METRIC_NAMES
from ..budgets import ENGINE_SIZE_NAMES
from ..iterations import growth, merge_ranks
from .scenario import DEVICES, Scenario, ScenarioError

DEFAULT_TIMEOUT_S = 900.0
# The rehearsal's rank (started by name, as torchrun starts worker.py): the simulated device loaded before torch,
# the stand-ins for what needs real hardware, then worker.py unchanged on the CUDA route's code
REHEARSAL_WORKER = "pytest_rlhfmem.fakecuda.rehearsal"
SIM_LIBRARY_ENV = "RLHFMEM_SIM_CUDA_LIBRARY"  # simcuda/library.py: ENV_LIBRARY


def resolve_device(device: str, ranks: int, device_count: int | None = None) -> str:
    """Where ``ranks`` processes on this machine run, one CUDA device each (torchrun's ``LOCAL_RANK`` is the
    device index): ``cuda`` or ``cpu``.

    ``auto`` -> ``cuda`` when at least ``ranks`` CUDA devices are visible, ``cpu`` (the allocator model,
    simulated figures) when there is none. ``device_count``: the visible CUDA devices (default
    :func:`~pytest_rlhfmem.hardware.cuda_device_count`). Raises :class:`ScenarioError`, one line naming the
    device, the ranks, the devices found and what to do, before any rank starts: for an unknown device; for
    ``cuda`` without a CUDA device; for ``cuda`` or ``auto`` with CUDA devices but fewer than ``ranks`` (a rank
    would ask for a device that is not there; ``auto`` would run the CPU route, against ``baselines/cpu``, on a
    machine whose GPUs were meant to run it). The rehearsal device needs no GPU: each rank gets a simulated
    device of its own (the one hardware check it stands in for: ``fakecuda/rehearsal.py``)."""
    if device not in DEVICES:
        raise ScenarioError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    if device in ("cpu", REHEARSAL_DEVICE):
        return device
    found = cuda_device_count() if device_count is None else device_count
    if device == "cuda" and found == 0:
        raise ScenarioError(f"device cuda: {no_cuda_device()}")
    if found == 0:
        return "cpu"
    if found < ranks:
        raise ScenarioError(f"device {device}: {ranks} ranks on this machine need {ranks} CUDA devices (one per "
                            f"rank), found {found}: give a world size of at most {found}, or device cpu (figures "
                            f"simulated by the allocator model)")
    return "cuda"


def no_cuda_device() -> str:
    """Why device ``cuda`` cannot run here, in one line: no CUDA device (a CPU build of torch, or no visible
    GPU), and what to do instead."""
    try:
        import torch
    except ImportError:
        why = "torch is not installed"
    else:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = (f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else
               "torch.cuda.is_available() is False" + (f"; CUDA_VISIBLE_DEVICES={hidden!r}" if hidden is not None
                                                       else ""))
    return (f"no CUDA device here ({why}); run on device cpu (figures simulated by the allocator model), a "
            f"command's CUDA code unchanged on the simulated CUDA device (rlhfmem capture --device cuda-sim), or on a "
            f"machine with a GPU")


def require_libaio() -> None:
    """ZeRO-Infinity's NVMe swapping runs DeepSpeed's async I/O op, which builds against libaio. Raises
    :class:`ScenarioError` (one line: what to install) when its header or library is missing."""
    import ctypes.util

    header = any(Path(d, "libaio.h").exists() for d in ("/usr/include", "/usr/local/include"))
    if not header or ctypes.util.find_library("aio") is None:
        raise ScenarioError("strategy zero3-nvme swaps to NVMe through DeepSpeed's async I/O op, which needs libaio: "
                            "install it (Debian/Ubuntu: apt-get install libaio-dev; Fedora/RHEL: dnf install "
                            "libaio-devel) and run again")


def jit_ops(scenario: Scenario, device: str) -> list[str]:
    """DeepSpeed's op builders (``deepspeed/ops/op_builder``) the ranks of ``scenario`` on ``device`` would
    JIT-build: on CPU ``ShareMemCommBuilder`` (the CPU accelerator's collectives); under offload
    ``CPUAdamBuilder`` (DeepSpeedCPUAdam), else on CUDA ``FusedAdamBuilder`` (FusedAdam): DeepSpeed-Chat's
    step-3 ``main.py`` takes ``DeepSpeedCPUAdam if args.offload else FusedAdam`` (``builders.make_optimizer``);
    ``AsyncIOBuilder`` for NVMe; on CUDA ``InferenceBuilder`` (``transformer_inference``) when the actor is a
    Hybrid Engine, whose ``WorkspaceOp`` loads it even when no layer is injected
    (``runtime/hybrid_engine.py``, ``ops/transformer/inference/op_binding/base.py``). None for ColossalChat."""
    if scenario.framework != "deepspeed-chat":
        return []
    from .deepspeed_chat.configs import STRATEGY_SETTINGS, ppo_setting

    if device == REHEARSAL_DEVICE:  # nvcc's builds need a GPU toolchain: the fake-CUDA route's optimizers stand in
        return []
    offload = STRATEGY_SETTINGS[scenario.strategy][1]
    ops = ["ShareMemCommBuilder"] if device == "cpu" else []
    ops += ["CPUAdamBuilder"] if offload else ["FusedAdamBuilder"] if device == "cuda" else []
    ops += ["AsyncIOBuilder"] if offload == "nvme" else []
    if (device == "cuda" and scenario.algorithm == "ppo" and scenario.strategy != "hydra"
            and ppo_setting(scenario, "hybrid_engine")):
        ops.append("InferenceBuilder")
    return ops


RECORDER_OP = "the CPU allocation recorder"  # record/cpu_recorder.py, JIT-built with the ops on CPU
_BUILDING = "rlhfmem: building "  # the build script's line before each op: says which one failed


def prebuild_ops(device: str, ops: list[str], timeout: float = 1800.0) -> float:
    """Build DeepSpeed's JIT ops ``ops`` (:func:`jit_ops`; and, on CPU, the allocation recorder) once, under
    a file lock, in a child process, before ranks start: two ranks building the same op at once race.
    Cached in torch's extension directory (``$TORCH_EXTENSIONS_DIR``); a warm call takes about a second.

    ``timeout`` (seconds) bounds the wait for the lock (``ds-ops.lock`` in ``cbuild.py: cache_dir()``, which
    every run of every environment of this user shares) and the builds together.

    Returns the seconds the builds took (the lock's wait excluded): a first build of FusedAdam or
    ``transformer_inference`` on CUDA takes minutes. Raises :class:`ScenarioError`, one line naming the op, the
    last line of its error and what it needs (on CUDA: nvcc, ``CUDA_HOME``; pip's torch brings neither), when a
    build fails or runs past ``timeout``; one line naming the lock file when another run holds it past
    ``timeout``."""
    from filelock import FileLock

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    if not ops and device != "cpu":
        return 0.0
    code = "import sys\n"
    if ops:
        code += ("from deepspeed.accelerator import get_accelerator\n"
                 f"for b in {ops!r}:\n"
                 f"    print({_BUILDING!r} + b, file=sys.stderr, flush=True)\n"
                 "    ob = get_accelerator().create_op_builder(b)\n"
                 "    ob = None if type(ob).__name__ == \"NotImplementedBuilder\" else ob\n"
                 "    ob is not None and ob.is_compatible() and ob.load(verbose=False)\n")
    if device == "cpu":
        code += (f"print({_BUILDING + RECORDER_OP!r}, file=sys.stderr, flush=True)\n"
                 "from pytest_rlhfmem.record.cpu_recorder import load_recorder\nload_recorder()\n")
    from filelock import Timeout

    lock, t_wait = cache / "ds-ops.lock", time.perf_counter()
    try:
        with FileLock(str(lock), timeout=timeout):
            t0 = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, "-c", code], env=_worker_env(device, 1),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      timeout=max(1.0, timeout - (t0 - t_wait)))
            except subprocess.TimeoutExpired:
                what = ", ".join(ops + ([RECORDER_OP] if device == "cpu" else []))
                raise ScenarioError(f"building {what} (JIT, before the ranks start) ran past the {timeout:g} s "
                                    f"timeout: give a longer --timeout for a first build") from None
            seconds = time.perf_counter() - t0
    except Timeout:
        raise ScenarioError(f"waited the whole {timeout:g} s timeout for the JIT-build lock {lock}, held by another "
                            f"run building DeepSpeed's ops: run again when it is done, or give a longer "
                            f"--timeout") from None
    if proc.returncode != 0:
        raise ScenarioError(op_build_failure(proc.stderr.decode(errors="replace"), device))
    return seconds


def op_build_failure(stderr: str, device: str) -> str:
    """The one line of a failed JIT build, from the build script's ``stderr``: which op (the last
    ``rlhfmem: building OP`` line), the last line of its error, and what the build needs."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    op = next((ln[len(_BUILDING):] for ln in reversed(lines) if ln.startswith(_BUILDING)), "an op")
    last = next((ln for ln in reversed(lines) if not ln.startswith(_BUILDING)), "no error output")[:300].rstrip(".")
    needs = ("needs nvcc: set CUDA_HOME / install the CUDA toolkit (pip's torch brings neither)" if device == "cuda"
             else "needs a C++ compiler (c++, or $CXX) and ninja")
    what = RECORDER_OP if op == RECORDER_OP else f"DeepSpeed's {op}"
    return f"building {what} (JIT, before the ranks start) failed: {last}; {needs}"


def command_env(device: str) -> dict:
    """The environment of a run's processes, this one's plus what the device needs: on CPU DeepSpeed's CPU
    accelerator and no visible CUDA device. A user's command (``rlhfmem capture``) runs in it as it is."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif device == REHEARSAL_DEVICE:  # DeepSpeed's CUDA accelerator on the simulated device; a real GPU stays out
        env["DS_ACCELERATOR"] = "cuda"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _sim_cuda_library() -> str:
    """The simulated CUDA device's library, built once (``cbuild.py``: cached under its lock). Raises
    :class:`ScenarioError` (one line) when it cannot be built here."""
    from ..simcuda.build import SIM_SOURCE, FakeCudaUnavailable, library_path

    try:
        return str(library_path(SIM_SOURCE))
    except FakeCudaUnavailable as exc:
        raise ScenarioError(f"device {REHEARSAL_DEVICE}: the simulated CUDA device: {exc}") from None


def _worker_env(device: str, threads: int) -> dict:
    """The recipes' ranks: :func:`command_env` with ``threads`` OpenMP threads and the hubs offline (the
    recipes build their models from configs with random weights: nothing to download)."""
    env = command_env(device)
    env["OMP_NUM_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def run_scenario(scenario: Scenario, device: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                 snapshot_dir: str | Path | None = None, work_dir: str | Path | None = None,
                 capture: bool = True, cuda_emulation: str = "on", nodes: Nodes | None = None,
                 kill_leftovers: bool = False) -> dict:
    """Run ``scenario`` once; returns the scenario result (see :func:`aggregate`). Never raises for a
    failed run: the result's ``status`` is ``failed`` and ``failure`` says which rank, phase and why.
    Raises :class:`ScenarioError` before launching for a scenario this device cannot run.
    ``capture=False`` runs the bare iteration (timed, nothing recorded): the capture-overhead baseline.
    ``cuda_emulation`` (``on``/``off``): the CPU capture's CUDA emulation (``record/emulation.py``).
    ``nodes``: torchrun's multi-node options (:class:`Nodes`; docs/multi-node.md). With ``nnodes`` > 1 this call
    is one node's agent: ``work_dir`` must be shared by every node; node rank 0 waits for the other agents and
    returns the scenario result, any other node its own agent's outcome (``role: agent``, no figures).
    ``kill_leftovers``: stop the run's processes that outlive it (:func:`run_process_group`); listed either way
    (``result["leftover_processes"]``)."""
    from .colossalchat import CPU_STRATEGIES
    from .deepspeed_chat import STRATEGY_SETTINGS

    _check_framework_installed(scenario.framework)
    try:  # a bad $RLHFMEM_CPU_FP16_KERNELS is one line here, not a traceback in every worker's log
        fp16_answer()
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None
    device = resolve_device(device, (nodes or Nodes()).local_world_size(scenario.world_size))  # GPUs of this node
    if scenario.get("rollout_engine") and code_device(device) == "cuda":
        raise ScenarioError("override rollout_engine=True: the colocated engine is a stand-in run on the CPU "
                            "route or the fake-CUDA route's simulated device; on a GPU the real engine's own mappings "
                            "are not recorded yet")
    if code_device(device) == "cuda":  # a bad $RLHFMEM_HISTORY_* is one line here, not a traceback in every rank
        try:
            history_settings()
        except ValueError as exc:
            raise ScenarioError(str(exc)) from None
    if device == REHEARSAL_DEVICE and scenario.framework != "deepspeed-chat":
        raise ScenarioError(f"device {REHEARSAL_DEVICE} runs deepspeed-chat only (the fake-CUDA route's DeepSpeed "
                            f"stand-ins replace what needs a GPU); {scenario.framework} runs on cpu or cuda")
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
    nodes = nodes or Nodes()
    nodes.check(scenario.world_size, work_dir)
    try:  # a --work-dir the user made is never removed, and must hold nothing (owned.py)
        work, created = claim_work_dir(work_dir, "rlhfmem-", shared=nodes.multi_node)
    except WorkDirError as exc:
        raise ScenarioError(str(exc)) from None
    if nodes.multi_node:
        _check_fresh_work(work, nodes)
    t0 = time.perf_counter()
    try:  # kept in the result: JIT builds' time; the lock's wait and the builds count against the timeout
        with interruptible():
            op_build_s = round(prebuild_ops(device, jit_ops(scenario, device), timeout), 3)
    except (ScenarioError, RunInterrupted) as exc:
        remove_work(work, created)  # nothing ran in it yet
        if isinstance(exc, RunInterrupted):
            exc.note(None, {}, removed=created)
        raise
    mine = {"op_build_s": op_build_s, "work_dir_created": created}
    timeout_left = max(1.0, timeout - (time.perf_counter() - t0))
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args(scenario.world_size),
           "--max-restarts=0", "--monitor-interval=0.5", f"--log-dir={work / TORCHRUN_LOG_DIR}",
           "-m", REHEARSAL_WORKER if device == REHEARSAL_DEVICE else "pytest_rlhfmem.rlhf.worker",
           "--scenario", json.dumps(scenario.to_dict()),
           "--out-dir", str(work), "--device", device]
    if snapshot_dir:
        cmd += ["--snapshot-dir", str(snapshot_dir)]
    if not capture:
        cmd.append("--no-capture")
    cmd += ["--cuda-emulation", cuda_emulation]
    log_path = work / "launcher.log"
    env = _worker_env(device, scenario.get("threads", 1))
    if device == REHEARSAL_DEVICE:  # built once here, not by every rank
        env[SIM_LIBRARY_ENV] = _sim_cuda_library()
    if not nodes.multi_node:
        returncode, timed_out = run_process_group(cmd, log_path, env, timeout_left, work,
                                                  kill_leftovers=kill_leftovers)
        return aggregate(scenario, device, work, returncode, timed_out, timeout, time.perf_counter() - t0,
                         log_path) | mine
    deadline = time.monotonic() + timeout + 30.0  # another agent's own timeout, its SIGTERM grace and report
    returncode, timed_out = _run_agent(cmd, env, timeout_left, work, nodes, kill_leftovers)
    if nodes.node_rank != 0:
        return _agent_result(scenario, device, nodes, returncode, timed_out, work) | {"op_build_s": op_build_s}
    agents = _await_agents(work, nodes, scenario.world_size, deadline)
    return aggregate(scenario, device, work, returncode, timed_out, timeout, time.perf_counter() - t0,
                     work / "node0" / "launcher.log", agents=agents, nodes=nodes) | mine


def finish_work(result: dict, keep: bool = False) -> Path | None:
    """After a run's result is used (its JSON and traces written): remove its work directory
    (``result["work_dir"]``: the ranks' files, the launcher log) unless ``keep``; a failed run's is always
    kept, its log and the ranks' files say what went wrong. A directory the run did not create
    (``result["work_dir_created"]`` false or absent: a ``--work-dir`` that existed) keeps everything but the
    run's own files (:func:`~pytest_rlhfmem.owned.remove_work`). Returns the directory kept (for the caller to
    print), or ``None`` when it was removed or there was none."""
    wd = result.get("work_dir")
    if not wd or not Path(wd).is_dir():
        return None
    if keep or result.get("status") != "ok":
        return Path(wd)
    remove_work(wd, bool(result.get("work_dir_created")))
    return None


TORCHRUN_LOG_DIR = "torchelastic"  # torchrun's --log-dir under the work directory: its per-run tree, error files
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
INTERRUPT_GRACE_S = 5.0  # after SIGINT/SIGTERM/SIGHUP: torchrun's time to stop its workers before SIGKILL


class RunInterrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached this process during a run; every process of the run was stopped before
    this was raised (torchrun's group SIGTERM, then after :data:`INTERRUPT_GRACE_S` SIGKILL to every process
    group of the run still alive). A ``KeyboardInterrupt``, so pytest ends its session as on Ctrl-C.

    ``signum``: the signal. ``phases``: ``{rank: phase}`` each rank was in (from its progress file; ranks that
    had not started recording are absent). ``work``: the run's work directory, kept (its launcher log and
    ranks' files), or ``None``. ``exit_status``: ``128 + signum`` (130 SIGINT, 143 SIGTERM, 129 SIGHUP), what a
    shell reports for a process the signal ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.phases, self.work, self.removed = signum, {}, None, False
        self.figures: dict[int, str] = {}

    def note(self, work: Path | None, phases: dict[int, str], figures: dict[int, str] | None = None,
             removed: bool = False) -> RunInterrupted:
        """Where the run was when it stopped: its work directory, each rank's phase and figures so far
        (:func:`rank_figures`)."""
        self.work, self.phases, self.figures, self.removed = work, phases, figures or {}, removed
        return self

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        where = ("; ".join(f"rank {r} in phase {p!r}" + (f": {self.figures[r]}" if r in self.figures else "")
                           for r, p in sorted(self.phases.items()))
                 or "no rank had reported its phase")
        work = (f"work directory kept: {self.work}" if self.work else
                "work directory removed" if self.removed else "")
        return f"interrupted by {name}: every process of the run was stopped ({where})" + (f"; {work}" if work else "")


@contextmanager
def interruptible() -> Iterator[None]:
    """While inside (in the main thread): SIGINT, SIGTERM and SIGHUP raise :class:`RunInterrupted` instead of
    ending this process with the run's processes left behind. A signal this process ignores (``nohup``'s
    SIGHUP) stays ignored; the handlers are restored on leaving. Elsewhere than the main thread: no change
    (Python runs signal handlers in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise RunInterrupted(signum)

    old = {}
    for s in INTERRUPT_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


PROGRESS_EVERY_S = 60.0  # how often a long run's progress line is printed (run_process_group's on_progress)


def run_process_group(cmd: list[str], log_path: Path, env: dict[str, str], timeout: float, work: Path,
                      cwd: str | Path | None = None, on_progress: Callable[[float], None] | None = None,
                      progress_every_s: float = PROGRESS_EVERY_S, kill_leftovers: bool = False) -> tuple[int, bool]:
    """Run ``cmd`` (a torchrun line or a user's command) in its own session, stdout and stderr to
    ``log_path``; at ``timeout`` seconds terminate the whole group (SIGTERM, then SIGKILL after 15 s).
    Afterwards kill any worker group still alive (each rank announces its pid in ``work``'s progress
    files; torchrun starts each worker in a session of its own, found here as the command's descendants):
    a pid is signalled only when that process carries this call's token in its environment
    (:func:`~pytest_rlhfmem.owned.is_run_process`), never on a file's word.
    Returns ``(returncode, timed_out)``; raises ``OSError`` when ``cmd`` cannot start, and
    :class:`RunInterrupted` (after stopping every process the same way, SIGKILL after
    :data:`INTERRUPT_GRACE_S`) when SIGINT, SIGTERM or SIGHUP reaches this process meanwhile.
    ``on_progress(elapsed_s)``, when given, is called every ``progress_every_s`` seconds while the command runs
    (a long run says where it is: :func:`progress_line`). Processes of the run still alive after all that (a
    daemon the program double-forked) are listed in ``work/LEFTOVERS`` (``owned.py``), and stopped when
    ``kill_leftovers``; otherwise left running, as they are the program's."""
    timed_out = False
    t0 = time.monotonic()
    started_wall = time.time()
    token, since = new_token(), None
    with open(log_path, "wb") as log, interruptible():
        proc = None
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=run_env(env, token), cwd=cwd)
            since = start_ticks(proc.pid)  # every process of the run started at or after its launcher
            step = progress_every_s if on_progress is not None else timeout
            while True:
                left = timeout - (time.monotonic() - t0)
                try:
                    proc.wait(timeout=max(0.0, min(left, step)))
                    break
                except subprocess.TimeoutExpired:
                    if left <= step:  # that wait ran to the timeout itself, not to a progress line
                        raise
                    on_progress(time.monotonic() - t0)
        except subprocess.TimeoutExpired:
            timed_out = True
            _note_alive_at_timeout(work, log_path.parent, token, since)
            _terminate(proc, 15.0)
            clear_stale_batons(env, started_wall)
        except RunInterrupted as exc:
            for s in INTERRUPT_SIGNALS:  # a second Ctrl-C must not cut the clean-up short
                if signal.getsignal(s) is not signal.SIG_IGN:
                    signal.signal(s, signal.SIG_IGN)
            if proc is not None:
                _terminate(proc, INTERRUPT_GRACE_S)
            _kill_leftover_workers(work, token, since)
            clear_stale_batons(env, started_wall)
            raise exc.note(work, rank_phases(work), rank_figures(work)) from None
    _kill_leftover_workers(work, token, since)
    _note_leftovers(log_path.parent, token, since, kill_leftovers)
    return proc.returncode, timed_out


BATON_SETTLE_S = 2.0  # how long a lock must outlast the killed run to be its: a live load releases it within this


def clear_stale_batons(env: dict[str, str], since: float, settle_s: float = BATON_SETTLE_S) -> list[Path]:
    """After the run's processes were killed (a timeout, a signal): remove the ``lock`` files of torch's JIT-build
    directories (``torch/utils/cpp_extension.py: _jit_compile``'s ``FileBaton``, which every load of a JIT op takes
    for a moment, DeepSpeed's ``shm_comm`` in every CPU rank) created since ``since`` (wall-clock seconds: the run's
    start) that are stale: still there ``settle_s`` seconds later, and no process builds in that directory (ninja
    and its compilers run with the build directory as their working directory). A rank killed while holding one
    leaves it, and every later load of that op waits on it for ever (a next run hung at ``FileBaton.wait``); a lock
    another run holds in that moment is its own (removing it would make its ``release()`` fail) and is kept.
    ``env``: the run's environment (its ``$TORCH_EXTENSIONS_DIR``, else torch's default under ``~/.cache``).
    Returns the files removed."""
    root = Path(env.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    fresh = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            st = lock.stat()
            if lock.is_file() and st.st_size == 0 and st.st_mtime >= since - 1.0:
                fresh.append((lock, (st.st_ino, st.st_mtime_ns)))  # a lock released and taken again is new
        except OSError:
            pass
    if fresh:
        time.sleep(settle_s)
    building = _build_directories() if fresh else set()
    removed = []
    for lock, ident in fresh:
        try:
            st = lock.stat()
            if (st.st_ino, st.st_mtime_ns) == ident and lock.parent.resolve() not in building:
                lock.unlink()
                removed.append(lock)
        except OSError:
            pass
    return removed


def _build_directories() -> set[Path]:
    """The working directories of every process this user can see (``/proc/<pid>/cwd``): a JIT build's ninja and
    compilers run in its build directory while its loader holds the baton."""
    dirs = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                dirs.add(Path(os.readlink(proc / "cwd")).resolve())
            except OSError:
                pass
    return dirs


def _note_leftovers(out: Path, token: str, since: int | None, kill: bool) -> None:
    """The run's processes still alive once its command ended and its ranks were stopped: written to
    ``out/LEFTOVERS`` (``[{"pid", "cmdline", "stopped"}]``) for the result, and stopped when ``kill``."""
    left = run_processes(token, since)
    if not left:
        return
    if kill:
        stop_processes([p for p, _ in left], token, since)
    (out / LEFTOVERS).write_text(json.dumps([{"pid": p, "cmdline": c[:300], "stopped": kill} for p, c in left]))


ALIVE_AT_TIMEOUT = "alive-at-timeout.json"  # in the work directory: the ranks whose process outlived the timeout


def _progress_pids(work: Path, token: str, since: int | None) -> dict[int, int]:
    """``{rank: pid}`` from ``work``'s progress files, only for a pid that is a live process of this run
    (:func:`~pytest_rlhfmem.owned.is_run_process`: its environment carries ``token``, it started at or after
    ``since``); a stale, planted or garbled file names nothing."""
    pids = {}
    for p in work.glob("progress-rank*.json"):
        try:
            prog = json.loads(p.read_text())
            rank, pid = int(prog["rank"]), prog["pid"]
        except (ValueError, KeyError, TypeError, OSError):
            continue
        if is_run_process(pid, token, since):
            pids[rank] = pid
    return pids


def _note_alive_at_timeout(work: Path, out: Path, token: str, since: int | None) -> None:
    """At the timeout, before anything is killed: write the ranks whose process is still running
    (:func:`_progress_pids`) to ``out/ALIVE_AT_TIMEOUT`` (``out``: the directory of the launcher's log, one per
    node's agent), so a rank that wrote its result and then never exited is named (:func:`aggregate`), not the
    launcher."""
    (out / ALIVE_AT_TIMEOUT).write_text(json.dumps(sorted(_progress_pids(work, token, since))))


def progress_line(work: Path, elapsed_s: float, label: str) -> str:
    """One line on a run in progress, from its ranks' progress files in ``work`` (written at each phase change:
    ``record/rank.py: RankCapture.progress``): ``"<label>: 120 s, rank 0 in phase 'train' (12,345 device events
    recorded by then), host RSS 1.20 GiB"`` (the events and RSS as of the phase's start); before any rank
    records, says so."""
    parts = []
    for p in sorted(work.glob("progress-rank*.json")):
        try:
            prog = json.loads(p.read_text())
        except (ValueError, OSError):
            continue
        rows = prog.get("device_rows")
        parts.append(f"rank {prog.get('rank')} in phase {prog.get('phase')!r}"
                     + (f" ({rows:,} device events recorded by then)" if rows is not None else "")
                     + (f", host RSS {format_size(int(prog['host_rss']))}" if prog.get("host_rss") else ""))
    return f"{label}: {elapsed_s:.0f} s, " + ("; ".join(parts) if parts else "no rank has started recording yet")


def rank_figures(work: Path) -> dict[int, str]:
    """``{rank: "peak reserved 4.00 MiB, peak allocated 2.00 MiB (simulated), host RSS 1.20 GiB"}`` from the ranks'
    progress files in ``work``: what each held by its last report (a phase change, or its heartbeat every few
    seconds: ``record/rank.py``); ranks without figures are absent."""
    out = {}
    for p in work.glob("progress-rank*.json"):
        try:
            prog = json.loads(p.read_text())
            rank = int(prog["rank"])
        except (ValueError, KeyError, TypeError, OSError):
            continue
        parts = [f"{k.replace('_', ' ')} {format_size(int(prog[k]))}" for k in PROGRESS_PEAKS
                 if prog.get(k) is not None]
        if parts and prog.get("simulated"):
            parts[-1] += " (simulated)"
        if prog.get("host_rss"):
            parts.append(f"host RSS {format_size(int(prog['host_rss']))}")
        if parts:
            out[rank] = ", ".join(parts)
    return out


def rank_phases(work: Path) -> dict[int, str]:
    """``{rank: phase}`` from the ranks' progress files in ``work`` (``record/rank.py``: written at each phase
    change): where each rank was when the run stopped."""
    phases = {}
    for p in work.glob("progress-rank*.json"):
        try:
            prog = json.loads(p.read_text())
            phases[int(prog["rank"])] = prog["phase"]
        except (ValueError, KeyError, TypeError, OSError):
            pass
    return phases


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


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (children, theirs, ...), from ``/proc/<pid>/stat``'s parent pid: torchrun's
    workers run in sessions of their own, out of reach of a signal to torchrun's group."""
    parent = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            parent[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parent.items() if pp == p} - found
        found |= kids
        todo.extend(kids)
    return found


def _terminate(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to ``proc``'s group (torchrun forwards it to its workers' groups), ``grace`` seconds to exit, then
    SIGKILL to its group and to the group of every descendant (each worker leads a session of its own)."""
    tree = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    own = os.getpgrp()
    for pid in [proc.pid, *sorted(tree | _descendants(proc.pid))]:
        try:
            group = os.getpgid(pid)
            os.killpg(group, signal.SIGKILL) if group != own else os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()


def _kill_leftover_workers(work: Path, token: str, since: int | None) -> None:
    """Every worker runs in its own session (torchrun's choice): kill the group of any rank of this run still
    alive (:func:`_progress_pids`), or the rank alone where it does not lead its group."""
    for pid in _progress_pids(work, token, since).values():
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# the device peaks so far in a rank's progress file (record/rank.py: RankCapture.progress): measured on CUDA, simulated
# ("simulated": true) on CPU and cuda-sim
PROGRESS_PEAKS = ("peak_reserved", "peak_allocated")


def _exit_hang_failure(ranks: list[dict], work: Path, timeout: float) -> dict:
    """Every rank wrote its result without an exception, yet the launcher was still running at the timeout:
    name the first rank whose process had not exited (``ALIVE_AT_TIMEOUT``), with its phase at exit and its
    peaks; else the launcher itself (rank ``None``, phase ``exit``). The figures are complete either way."""
    alive = []
    for p in [*work.glob(ALIVE_AT_TIMEOUT), *work.glob(f"node*/{ALIVE_AT_TIMEOUT}")]:  # one per node's agent
        try:
            alive += json.loads(p.read_text())
        except (OSError, ValueError):
            pass
    res = next((r for r in ranks if r["rank"] in alive), None)
    if res is None:
        return {"rank": None, "phase": "exit", "error": "LauncherHang",
                "message": f"every rank wrote its result and exited, but the launcher had not exited by the "
                           f"{timeout:g} s timeout; it was killed (the figures are complete)"}
    others = [r for r in alive if r != res["rank"]]
    return {"rank": res["rank"], "phase": res.get("exit_phase") or "exit", "error": "ExitHang",
            "message": f"wrote its result, then had not exited by the {timeout:g} s timeout; its process group was "
                       f"killed (the figures are complete)" + (f"; also still running: ranks {others}" if others
                                                               else ""),
            "memory_so_far": {k: res["total"][k] for k in ("peak_reserved", "peak_allocated")},
            "simulated": res["simulated"]}


def _exit_status_failure(ranks: list[dict], returncode: int | None, logs: list[Path]) -> dict:
    """Every rank wrote its result without an exception, yet the command's exit status is non-zero
    (``sys.exit(3)``, an exit code set by a library): name the rank torchrun reports as the root cause
    (its ``rank : R (local_rank: L)`` line), else the only rank, with its phase at exit and its peaks."""
    rank = ranks[0]["rank"] if len(ranks) == 1 else None
    for log_path in logs if rank is None else ():  # one log per node's agent
        m = log_path.exists() and re.search(r"Root Cause.*?rank\s*:\s*(\d+)", log_path.read_text(errors="replace"),
                                            re.S)
        if m:
            rank = int(m.group(1))
            break
    res = next((r for r in ranks if r["rank"] == rank), ranks[0])
    return {"rank": rank, "phase": res.get("exit_phase"), "error": "ExitStatus",
            "message": f"exited with code {returncode} with no uncaught exception (sys.exit or an exit status "
                       f"set by the program)",
            "memory_so_far": {k: res["total"][k] for k in ("peak_reserved", "peak_allocated")},
            "simulated": res["simulated"]}


def torchrun_failures(logs: list[Path]) -> tuple[dict[int, int], int | None]:
    """torchrun's own account of a failed run, from its ``ChildFailedError`` report in the agents' ``logs``
    (``torch/distributed/elastic/multiprocessing/errors/__init__.py``: the ``Failures:`` and ``Root Cause
    (first observed failure):`` blocks, one ``rank : R (local_rank: L)`` / ``exitcode : C`` pair per failed
    worker). Returns ``({rank: exitcode}, root cause rank)``: a negative exit code is the signal that ended the
    worker (``-9``: SIGKILL); ``({}, None)`` when no log has the report."""
    codes, root = {}, None
    pair = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
    for log_path in logs:
        if not log_path.exists():
            continue
        text = log_path.read_text(errors="replace")
        at = text.rfind("Root Cause (first observed failure):")
        for m in pair.finditer(text):
            codes[int(m.group(1))] = int(m.group(2))
            if at >= 0 and m.start() > at and root is None:
                root = int(m.group(1))
    return codes, root


def _exit_description(code: int | None) -> tuple[str | None, str]:
    """``(signal name or None, words)`` for a worker's exit code as torchrun reports it."""
    if code is None:
        return None, ""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return name, f"killed by {name} (signal {-code})"
    return None, f"exited with code {code}"


def culprit_order(failure: dict) -> tuple:
    """Sort key of a run's failures, the culprit first: a rank killed by a signal other than SIGTERM with no
    result of its own (SIGKILL from the OOM killer or a user, SIGSEGV, SIGABRT: no peer's failure causes
    those); then the earliest exception (a peer's "connection reset" comes after its cause); then a rank
    that died without a result, torchrun's root cause first; ranks torchrun stopped with SIGTERM (bystanders
    of another rank's failure) last."""
    sig, root = failure.get("signal"), failure.get("root_cause", False)
    return (0 if sig and sig != "SIGTERM" else 1, 1 if sig == "SIGTERM" and not root else 0,
            failure.get("time") is None, failure.get("time") or 0.0, not root, failure["rank"] is None,
            failure["rank"] or 0)


def aggregate(scenario: Scenario, device: str, work: Path, returncode: int | None, timed_out: bool,
              timeout: float, wall_s: float, log_path: Path, agents: dict[int, dict | None] | None = None,
              nodes: Nodes | None = None, ranks_run: tuple[int, ...] | None = None) -> dict:
    """The scenario result: per metric the maximum over ranks (the budget is per GPU), per phase too,
    plus every rank's own result. ``status`` is ``ok`` only if every rank finished. ``ranks_run``: the ranks that
    ran (default all of ``scenario.world_size``; the fake-CUDA route runs rank 0 alone on a fake process group),
    named in the result when not all.

    A multi-node run (``nodes``): ``work`` is the shared directory holding every node's ranks, ``agents`` the
    other nodes' agent reports (:func:`_await_agents`; ``None`` for one that sent none); the run failed if any
    agent did, and the failures of every node are ordered by their time as one run's."""
    agents = agents or {}
    logs = [log_path] + [Path(a["log"]) for _, a in sorted(agents.items()) if a and a.get("log")]
    silent = sorted(n for n, a in agents.items() if a is None)  # agents that sent no report
    if returncode == 0 and not timed_out:  # this node's agent was fine: another node's outcome decides
        bad = [a for a in agents.values() if a and (a["returncode"] != 0 or a["timed_out"])]
        returncode, timed_out = (bad[0]["returncode"], bad[0]["timed_out"]) if bad else (returncode, timed_out)
    launchers = ""
    if nodes is not None:
        codes = {nodes.node_rank: returncode} | {n: (a["returncode"] if a else "no report") for n, a in agents.items()}
        launchers = " (agents' exit codes: " + ", ".join(f"node {n}: {c}" for n, c in sorted(codes.items())) + ")"
    expected = tuple(range(scenario.world_size)) if ranks_run is None else ranks_run
    codes, root_rank = torchrun_failures(logs) if returncode != 0 else ({}, None)
    if not codes and returncode is not None and returncode < 0 and len(expected) == 1:
        codes = {expected[0]: returncode}  # one process, no torchrun: its exit status is the rank's own
    ranks, failures = [], []
    for r in expected:
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
            sig, died = _exit_description(codes.get(r)) if not timed_out else (None, "")
            root = r == root_rank and not timed_out
            why = (f"hung: no result after the {timeout:g} s timeout; the process group was killed" if timed_out
                   else f"{died or 'exited'} without a result"
                        + ("; torchrun's first observed failure" if root else "")
                        + f" (launcher exit code {returncode}){launchers}")
            peaks = {k: prog[k] for k in PROGRESS_PEAKS if k in prog}  # at the start of its last phase
            so_far = peaks | {"host_rss": prog.get("host_rss")}
            failures.append({"rank": r, "phase": prog.get("phase", "startup"),
                             "error": "Hang" if timed_out else "Crash", "message": why,
                             "memory_so_far": so_far, **({"signal": sig} if sig else {}),
                             **({"simulated": bool(prog.get("simulated"))} if peaks else {}),
                             **({"root_cause": True} if root else {})})
    if ranks and not failures and returncode != 0 and not timed_out and len(ranks) == len(expected):
        failures.append(_exit_status_failure(ranks, returncode, logs))
    if ranks and not failures and timed_out and len(ranks) == len(expected):
        failures.append(_exit_hang_failure(ranks, work, timeout))
    if silent and not failures:  # every rank finished, yet an agent never said how it ended
        failures.append({"rank": None, "phase": None, "error": "NoReport",
                         "message": f"node {silent[0]}'s agent wrote no report (node{silent[0]}/agent.json in "
                                    f"{work}) before the deadline{launchers}"})
    failures.sort(key=culprit_order)  # the culprit first, then the bystanders
    ok = not failures and returncode == 0 and len(ranks) == len(expected)
    first = ranks[0] if ranks else {}
    # device figures (simulated on CPU), host figures (measured), the CPU-only host estimate (host.py)
    names = METRIC_NAMES + HOST_METRIC_NAMES + HOST_IO_NAMES + HOST_SWAP_NAMES + ("host_rss_outside_device",) + \
        ENGINE_SIZE_NAMES
    metrics = {m: max((r["total"].get(m) or 0) for r in ranks) for m in names} if ranks else {}
    for m in ("host_rss_outside_device",) + ENGINE_SIZE_NAMES:  # only where a rank has them
        if not any(m in r["total"] for r in ranks):
            metrics.pop(m, None)
    phase_names = [p["phase"] for p in first.get("phases", [])]
    phases = {}
    for name in phase_names:
        per = [p for r in ranks for p in r["phases"] if p["phase"] == name]
        phases[name] = {m: max((p.get(m) or 0) for p in per) for m in names + ("wall_s",)}
    peak_rank = max(ranks, key=lambda r: r["total"]["peak_reserved"]) if ranks else {}
    iterations, iteration_errors = iteration_summary(ranks)
    if ok and iterations:
        metrics.update(growth(iterations))  # bytes per iteration from iteration 2 on (>= 3 iterations)
    log_tail = ""
    if not ok:  # each node's agent's log, the first node's first
        log_tail = "\n".join(p.read_bytes()[-3000:].decode(errors="replace") for p in logs if p.exists())
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
        **({"ranks_run": list(expected)} if ranks_run is not None else {}),
        "versions": first.get("versions", {}),
        "threads": first.get("threads"),
        "metrics": metrics,
        "phases": phases,
        "peak_phase": peak_rank.get("peak_phase"),
        "wall_s": round(wall_s, 3),
        "iteration_wall_s": max((r["wall_s"] for r in ranks), default=None),
        **({"iterations": iterations} if iterations else {}),
        **({"capacity": first["capacity"]} if first.get("capacity") else {}),  # bytes the replay ran against
        **({"iterations_error": iteration_errors} if iteration_errors else {}),
        "ranks": ranks,
        "work_dir": str(work),
        "log_tail": log_tail,
        **({"leftover_processes": left} if (left := _leftovers(work)) else {}),
        **({"nodes": nodes.describe() | {"agents": {nodes.node_rank: {"returncode": returncode}} | agents}}
           if nodes is not None else {}),
    }


def iteration_summary(ranks: list[dict]) -> tuple[list[dict], str | None]:
    """The scenario's per-iteration rows (``iterations.py: merge_ranks``: per iteration the maximum over ranks) from
    the ranks that recorded iterations, and the first rank's reason where its rows could not be derived (else
    ``None``)."""
    rows, errors = [], []
    for r in ranks:
        it = r.get("iterations")
        if isinstance(it, dict):
            errors.append(f"rank {r.get('rank')}: {it.get('error')}")
        elif it:
            rows.append(it)
    return merge_ranks(rows), (errors[0] if errors else None)


def _leftovers(work: Path) -> list[dict]:
    """The run's processes that outlived it (``LEFTOVERS``, one file per node's agent), or ``[]``."""
    out = []
    for p in [*work.glob(LEFTOVERS), *work.glob(f"node*/{LEFTOVERS}")]:
        try:
            out += json.loads(p.read_text())
        except (OSError, ValueError):
            pass
    return out


def leftover_warning(result: dict) -> str | None:
    """One line on the processes a run left behind (``result["leftover_processes"]``), or ``None``."""
    left = result.get("leftover_processes") or []
    if not left:
        return None
    stopped = all(p.get("stopped") for p in left)
    listed = "; ".join(f"pid {p['pid']} ({p['cmdline'][:80]})" for p in left[:5]) + (" ..." if len(left) > 5 else "")
    return (f"the command left {len(left)} process(es) running after it ended: {listed}; "
            + ("stopped (--kill-leftovers)" if stopped else "left running: rerun with --kill-leftovers (the "
               "fixtures: --rlhfmem-kill-leftovers) to stop them"))


RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")  # torch/distributed/elastic/rendezvous/registry.py


@dataclass(frozen=True)
class Nodes:
    """torchrun's multi-node options (``torch/distributed/run.py``, torch 2.13), passed through to the agent
    this call starts: one agent per node, each starting ``nproc_per_node`` ranks, ``nnodes x nproc_per_node``
    ranks in all (the scenario's world size). The default, one node with no rendezvous option, launches
    ``torchrun --standalone``.

    ``nnodes``: a fixed node count (an elastic ``MIN:MAX`` range gives no fixed world size). ``node_rank``: this
    agent's node, ``0 .. nnodes - 1``; torchrun uses it with the ``static`` backend (global rank = node rank x
    nproc-per-node + local rank), ``c10d`` orders the nodes itself (as they join). Here it also says which
    agent aggregates: node rank 0 waits for every node's agent and writes the result. ``rdzv_*``,
    ``master_addr``, ``master_port``, ``local_addr``: torchrun's options of the same names, unchanged."""

    nnodes: int = 1
    nproc_per_node: int | None = None  # None: world size / nnodes
    node_rank: int = 0
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None

    @classmethod
    def parse(cls, nnodes: str | int | None = None, nproc_per_node: str | int | None = None, **options) -> Nodes:
        """From the command line's strings; raises :class:`ScenarioError` (one line naming the option and its
        allowed values) for an elastic range, ``auto``/``gpu``, a non-positive count or an unknown backend."""
        def count(name: str, value: str | int | None) -> int | None:
            if value is None:
                return None
            try:
                n = int(value)
            except ValueError:
                n = 0
            if n < 1:
                raise ScenarioError(f"--{name} {value!r}: a fixed count, an integer >= 1, is needed (an elastic "
                                    f"MIN:MAX range, auto, cpu or gpu give no fixed world size for the scenario)")
            return n

        nodes = cls(nnodes=count("nnodes", nnodes) or 1, nproc_per_node=count("nproc-per-node", nproc_per_node),
                    **{k: v for k, v in options.items() if v is not None})
        if nodes.rdzv_backend is not None and nodes.rdzv_backend not in RDZV_BACKENDS:
            raise ScenarioError(f"--rdzv-backend {nodes.rdzv_backend!r}: one of {', '.join(RDZV_BACKENDS)}")
        return nodes

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def local_world_size(self, world_size: int) -> int:
        """The ranks this node's agent starts (its GPUs to find): ``nproc_per_node``, else ``world_size /
        nnodes``."""
        return self.nproc_per_node or max(1, world_size // self.nnodes)

    def check(self, world_size: int, work_dir: str | Path | None) -> None:
        """Before launching: raises :class:`ScenarioError` (one line) when ``nnodes x nproc_per_node`` is not
        ``world_size``, the node rank is out of range, a multi-node run has no shared ``work_dir``, or a
        rendezvous backend other than ``static`` has no endpoint."""
        per_node, rest = divmod(world_size, self.nnodes)
        nproc = self.nproc_per_node or (per_node if not rest else None)
        if nproc is None or nproc * self.nnodes != world_size:
            raise ScenarioError(f"--nnodes {self.nnodes} x --nproc-per-node {self.nproc_per_node or '?'} ranks do not "
                                f"make the scenario's world size {world_size}: give --world-size = nnodes x "
                                f"nproc-per-node")
        if not 0 <= self.node_rank < self.nnodes:
            raise ScenarioError(f"--node-rank {self.node_rank}: one of 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.multi_node and not work_dir:
            raise ScenarioError(f"--nnodes {self.nnodes} needs --work-dir: a directory every node shares (each rank "
                                f"writes its result there; the node-rank-0 agent reads them all)")
        if self.multi_node and (self.rdzv_backend or "static") != "static" and not self.rdzv_endpoint:
            raise ScenarioError(f"--rdzv-backend {self.rdzv_backend} needs --rdzv-endpoint HOST:PORT (the same on "
                                f"every node)")

    def torchrun_args(self, world_size: int) -> list[str]:
        """torchrun's node and rendezvous options: ``--standalone`` for one node without a rendezvous option,
        else every option given, under torchrun's own names."""
        nproc = self.local_world_size(world_size)
        given = {"rdzv-backend": self.rdzv_backend, "rdzv-endpoint": self.rdzv_endpoint, "rdzv-id": self.rdzv_id,
                 "rdzv-conf": self.rdzv_conf, "master-addr": self.master_addr, "master-port": self.master_port,
                 "local-addr": self.local_addr}
        if (self.rdzv_backend or "static") == "static" and self.multi_node:
            given["node-rank"] = self.node_rank  # c10d and etcd order the nodes themselves (and warn of it)
        given = {k: v for k, v in given.items() if v is not None}
        if not self.multi_node and not given:
            return ["--standalone", f"--nproc-per-node={nproc}"]
        return [f"--nnodes={self.nnodes}", f"--nproc-per-node={nproc}"] + [f"--{k}={v}" for k, v in given.items()]

    def describe(self) -> dict:
        """The options as the result records them (``result["nodes"]``)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def _check_fresh_work(work: Path, nodes: Nodes) -> None:
    """A multi-node run's shared work directory must hold no other run's rank files: the node-rank-0 agent
    would read them as this run's. Raises :class:`ScenarioError` naming one."""
    stale = sorted([*work.glob("result-rank*.json"), *work.glob("progress-rank*.json"), *work.glob("node*/agent.json")])
    if stale:
        raise ScenarioError(f"--work-dir {work}: holds another run's files ({stale[0].relative_to(work)}); give each "
                            f"multi-node run an empty directory that every node shares")


def _run_agent(cmd: list[str], env: dict[str, str], timeout: float, work: Path, nodes: Nodes,
               kill_leftovers: bool = False) -> tuple[int, bool]:
    """One node's torchrun agent of a multi-node run: its log and, once it exits, its report
    (``node<R>/agent.json``: exit code, timed out, host) in the shared ``work``. Only this agent's own workers
    are killed afterwards (those whose environment carries its token): the progress files name the pids of
    every node's ranks, and a pid means nothing on another host."""
    agent_dir = work / f"node{nodes.node_rank}"
    agent_dir.mkdir(parents=True, exist_ok=True)
    returncode, timed_out = run_process_group(cmd, agent_dir / "launcher.log", env, timeout, work,
                                              kill_leftovers=kill_leftovers)
    report = {"node_rank": nodes.node_rank, "returncode": returncode, "timed_out": timed_out,
              "host": socket.gethostname(), "log": str(agent_dir / "launcher.log")}
    tmp = agent_dir / "agent.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.replace(agent_dir / "agent.json")
    return returncode, timed_out


def _await_agents(work: Path, nodes: Nodes, world_size: int, deadline: float, grace: float = 30.0) -> dict:
    """Node rank 0, after its own agent exited: every other node's report (``node<R>/agent.json``), or
    ``None`` for a node that sent none by ``deadline`` (``time.monotonic()``). Once every rank has a result, or
    none ever started, waits at most ``grace`` seconds more. Returns ``{node_rank: report or None}``."""
    others = [n for n in range(nodes.nnodes) if n != nodes.node_rank]
    t_grace = time.monotonic() + grace
    while True:
        reports = {n: work / f"node{n}" / "agent.json" for n in others}
        if all(p.exists() for p in reports.values()):
            break
        ranks_done = all((work / f"result-rank{r}.json").exists() for r in range(world_size))
        never_started = not any(work.glob("progress-rank*.json"))
        if time.monotonic() > deadline or ((ranks_done or never_started) and time.monotonic() > t_grace):
            break
        time.sleep(0.2)
    return {n: (json.loads(p.read_text()) if p.exists() else None) for n, p in reports.items()}


def _agent_result(scenario: Scenario, device: str, nodes: Nodes, returncode: int, timed_out: bool,
                  work: Path) -> dict:
    """What an agent of node rank > 0 returns: its own launcher's outcome; the scenario's figures are in the
    node-rank-0 agent's result. ``work_dir`` is ``None``: the shared directory is node rank 0's to remove."""
    ok = returncode == 0 and not timed_out
    log = work / f"node{nodes.node_rank}" / "launcher.log"
    return {"schema": 1, "scenario": scenario.to_dict(), "scenario_id": scenario.id, "role": "agent",
            "status": "ok" if ok else "failed", "device": device, "simulated": device == "cpu",
            "world_size": scenario.world_size, "nodes": nodes.describe(),
            "failure": None if ok else {"rank": None, "phase": None, "error": "Hang" if timed_out else "LaunchError",
                                        "message": f"node rank {nodes.node_rank}'s agent: launcher exit code "
                                                   f"{returncode}; the node-rank-0 agent's result names the rank "
                                                   f"that failed first"},
            "failures": [], "work_dir": None, "shared_work_dir": str(work),
            "log_tail": "" if ok or not log.exists() else log.read_bytes()[-3000:].decode(errors="replace")}
