"""Launch a user's training command with every rank recorded, enforce the timeout, gather the ranks.

The command runs as given (a script path gets this interpreter in front), in its own session, with
``bootstrap/`` first on ``PYTHONPATH`` so each rank starts recording when it imports torch. The ranks'
files and the failure handling are ``rlhf/launch.py``'s: :func:`~pytest_rlhfmem.rlhf.launch.aggregate`
turns them into the result (same schema as ``rlhfmem run``), a timeout kills every process group.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..hardware import REHEARSAL_DEVICE, code_device
from ..iterations import ENV_ITERATIONS
from ..owned import WorkDirError, claim_work_dir, remove_work
from ..record.recorder import history_settings
from ..rlhf.launch import (DEFAULT_TIMEOUT_S, TORCHRUN_LOG_DIR, aggregate, command_env, progress_line,
                           resolve_device, run_process_group)
from ..rlhf.scenario import ScenarioError
from ..simcuda.distributed import ENV_LIBRARY as ENV_SIM_DIST_LIBRARY
from ..simcuda.library import ENV_VALUES, values_mode
from ..simcuda.torch_cuda import ENV_DEVICES as ENV_SIM_DEVICES
from . import rank as R

BOOTSTRAP_DIR = Path(__file__).with_name("bootstrap")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding pytest_rlhfmem/
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
ACCELERATE_MODULE = "accelerate.commands.launch"  # `accelerate launch` as python -m: torchrun's agent inside


class CommandError(ValueError):
    """Bad input: a command that cannot run, or that ran without anything to measure. One line."""


def plan_command(command: Sequence[str] | str, world_size: int | None = None,
                 nproc_per_node: int | None = None) -> tuple[list[str], int, bool]:
    """``(argv, world_size, is_torchrun)`` for ``command`` (a list, or a string split like a shell).

    A ``.py`` path gets this interpreter in front. With ``world_size``/``nproc_per_node`` a plain Python
    command is wrapped in ``python -m torch.distributed.run --standalone --nproc-per-node N``; a torchrun
    line (``torchrun ...`` or ``python -m torch.distributed.run ...``) keeps its own ``--nproc-per-node``, an
    ``accelerate launch`` line (or ``python -m accelerate.commands.launch``; Accelerate runs torchrun's agent in its
    own process) its ``--num_processes`` (all machines' processes); both are launcher lines (``is_torchrun``: only
    the processes they start are ranks). Raises :class:`CommandError` for an empty command, a program or script
    that does not exist, a non-Python program, or a world size that disagrees with the launcher line's.
    """
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise CommandError("no command given: rlhfmem capture [options] -- COMMAND [ARGS...]")
    if world_size is not None and nproc_per_node is not None and world_size != nproc_per_node:
        raise CommandError(f"--world-size {world_size} and --nproc-per-node {nproc_per_node} disagree")
    n = nproc_per_node if nproc_per_node is not None else world_size
    if n is not None and n < 1:
        raise CommandError(f"world size must be a positive integer, got {n}")
    prog = argv[0]
    if prog.endswith(".py"):
        if not Path(prog).is_file():
            raise CommandError(f"command not found: {prog} (no such script)")
        argv = [sys.executable, *argv]
    elif shutil.which(prog) is None:
        raise CommandError(f"command not found: {prog}")
    is_torchrun = Path(argv[0]).name in ("torchrun",) or _module_of(argv) in TORCHRUN_MODULES
    if is_torchrun or _is_accelerate_launch(argv):
        own = _torchrun_nproc(argv)
        flag = "--num_processes" if _is_accelerate_launch(argv) else "--nproc-per-node"
        if n is not None and own is not None and own != n:
            raise CommandError(f"world size {n} disagrees with the launcher line's {flag} {own}")
        if own is None and n is not None:
            argv = argv[:_torchrun_args_start(argv)] + [f"{flag}={n}"] + argv[_torchrun_args_start(argv):]
        return argv, own or n or 1, True
    if not _is_python(argv[0]):
        raise CommandError(f"{prog} is not a Python program: give a script, python -m MODULE, or a torchrun line")
    if n is not None and n > 1:
        rest = argv[1:]  # a script and its arguments, or -m MODULE ... (torchrun takes both)
        if not rest or rest[0] == "-c":
            raise CommandError("torchrun runs a script or -m MODULE, not python -c: write the code to a file")
        argv = [argv[0], "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                "--max-restarts=0", *rest]
        return argv, n, True
    return argv, 1, False


def _is_python(prog: str) -> bool:
    name = Path(prog).name
    return name.startswith("python") or Path(prog).resolve() == Path(sys.executable).resolve()


def _module_of(argv: list[str]) -> str | None:
    return argv[2] if len(argv) > 2 and argv[1] == "-m" else None


def _is_accelerate_launch(argv: list[str]) -> bool:
    """``accelerate launch ...`` or ``python -m accelerate.commands.launch ...``."""
    return (Path(argv[0]).name == "accelerate" and len(argv) > 1 and argv[1] == "launch") or \
        _module_of(argv) == ACCELERATE_MODULE


def _torchrun_args_start(argv: list[str]) -> int:
    """Where a launcher line's own options begin (after ``torchrun``, ``python -m MODULE``, ``accelerate launch``)."""
    return 3 if _module_of(argv) in (*TORCHRUN_MODULES, ACCELERATE_MODULE) else 2 if _is_accelerate_launch(argv) else 1


def _torchrun_nproc(argv: list[str], per_node: bool = False) -> int | None:
    """The ``--nproc-per-node`` of a torchrun line (times ``--nnodes`` when a fixed integer, unless
    ``per_node``: the ranks of this machine); of an ``accelerate launch`` line its ``--num_processes`` (every
    machine's: divided by ``--num_machines`` when ``per_node``)."""
    if _is_accelerate_launch(argv):
        keys, machines = ("--num_processes", "--num-processes"), ("--num_machines", "--num-machines")
    else:
        keys, machines = ("--nproc-per-node", "--nproc_per_node"), ("--nnodes",)
    nproc, nnodes = None, 1
    for i, a in enumerate(argv):
        key, _, val = a.partition("=")
        if key in keys or key in machines:
            val = val or (argv[i + 1] if i + 1 < len(argv) else "")
            if key in machines:
                nnodes = int(val) if val.isdigit() else 1
            elif val.isdigit():
                nproc = int(val)
    if nproc is None:
        return None
    if _is_accelerate_launch(argv):
        return max(nproc // nnodes, 1) if per_node else nproc
    return nproc if per_node else nproc * nnodes


TORCHRUN_FLAGS = ("--standalone", "--no-python", "--no_python", "--run-path", "--run_path")  # take no value
# accelerate launch's options without a value (accelerate/commands/launch.py: action="store_true")
ACCELERATE_FLAGS = ("--cpu", "--multi_gpu", "--tpu", "--use_deepspeed", "--use_fsdp", "--use_megatron_lm", "--debug",
                    "--quiet", "-q", "--same_network", "--enable_cpu_affinity", "--dynamo_use_fullgraph",
                    "--dynamo_use_dynamic", "--dynamo_use_regional_compilation", "--use_parallelism_config",
                    "--tpu_cluster", "--tpu_use_sudo", "--downcast_bf16", "--fp8_use_autocast_during_eval")


def default_id(command: Sequence[str] | str, world_size: int = 1) -> str:
    """The id of a capture given none: what identifies the program, never its arguments (output
    directories, batch sizes, seeds are scratch or configuration: name configurations with ``--id``).

    The program is the script's path as given (made relative when it lies under the current directory),
    or ``-m``'s module; the interpreter, torchrun and torchrun's own options are skipped; ``python -c CODE``
    is ``python-c-`` and 8 hex digits of the code's SHA-1. More than one rank adds ``/x<N>``. So
    ``train.py out/run1 --batch 4`` and ``python train.py out/run2 --batch 8`` are both ``train.py``, and
    ``torchrun --nproc-per-node 2 train.py`` is ``train.py/x2``."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    i = 0
    if argv and not argv[0].endswith(".py") and (_is_python(argv[0]) or Path(argv[0]).name == "torchrun"):
        i = 1
    elif argv and _is_accelerate_launch(argv):
        i = 2
    program = None
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "--module") and i + 1 < len(argv):
            if argv[i + 1] in (*TORCHRUN_MODULES, ACCELERATE_MODULE):  # a launcher: its options follow
                i += 2
                continue
            program = argv[i + 1]
            break
        if a == "-c" and i + 1 < len(argv):
            import hashlib

            program = "python-c-" + hashlib.sha1(argv[i + 1].encode()).hexdigest()[:8]
            break
        if a.startswith("-"):  # an interpreter or torchrun option; a separate value follows unless =, a flag
            i += 1 if ("=" in a or a in TORCHRUN_FLAGS + ACCELERATE_FLAGS or not a.startswith("--")) else 2
            continue
        program = _shown_path(a)
        break
    program = program or shlex.join(argv)
    return program + (f"/x{world_size}" if world_size > 1 else "")


def _shown_path(path: str) -> str:
    p = Path(os.path.normpath(path))
    if p.is_absolute():
        try:
            return str(p.relative_to(Path.cwd()))
        except ValueError:
            return str(p)
    return str(p)


SIM_DEVICE = "cuda-sim"  # a CUDA script, unchanged, on the simulated CUDA device (simcuda/library.py)
# the devices whose ranks load the simulated CUDA device before torch: cuda-sim (its log recorded) and the rehearsal
# device (the CUDA route's recorder over it: hardware.py)
SIMULATED_DEVICES = (SIM_DEVICE, REHEARSAL_DEVICE)


@functools.lru_cache(maxsize=1)
def sim_cuda_library() -> str:
    """Build the simulated CUDA device's library once (``cbuild.py``: cached, under its file lock) and return its
    path. Raises :class:`CommandError` (one line) when it cannot be built here."""
    from ..simcuda.build import SIM_SOURCE, FakeCudaUnavailable, library_path

    try:
        return str(library_path(SIM_SOURCE))
    except FakeCudaUnavailable as exc:
        raise CommandError(f"the simulated CUDA device (cuda-sim, cuda-rehearsal): {exc}") from None


@functools.lru_cache(maxsize=1)
def sim_dist_library() -> str:
    """Build the simulated CUDA device's process group once (``simcuda/build.py: dist_library_path``, a Python
    extension of torch: imports torch here) and return its path. Raises :class:`CommandError` (one line)."""
    from ..simcuda.build import FakeCudaUnavailable, dist_library_path

    try:
        return str(dist_library_path())
    except FakeCudaUnavailable as exc:
        raise CommandError(f"the simulated CUDA device's process group: {exc}") from None


@functools.lru_cache(maxsize=1)
def recorder_library() -> str:
    """Build the CPU allocation recorder once (``cbuild.py``: cached, under its file lock) and return its shared
    library's path. Raises :class:`CommandError` (one line: why, and where the build cache is) where it cannot be
    built: no other backend measures a CPU capture in its place. Loads torch in this process, once per process."""
    from ..record.cpu_recorder import load_recorder

    try:
        return load_recorder().__file__
    except RuntimeError as exc:
        raise CommandError(f"device cpu: {exc}") from None


def run_command(command: Sequence[str] | str, id: str, world_size: int | None = None,  # noqa: A002
                nproc_per_node: int | None = None, device: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                snapshot_dir: str | Path | None = None, work_dir: str | Path | None = None,
                env: dict | None = None, cwd: str | Path | None = None, cuda_emulation: str = "on",
                sim_values: str | None = None, on_progress: Callable[[str], None] | None = None,
                kill_leftovers: bool = False, iterations: int | None = None) -> dict:
    """Run ``command`` once with every rank recorded; returns the result (``rlhfmem run``'s schema:
    ``scenario`` = ``{"kind": "command", "id", "command", "world_size"}``, ``scenario_id`` = ``id``).

    A crash, OOM or hang of any rank is a result with ``status`` ``failed`` and its rank, phase and
    memory so far (never an exception). ``env`` adds to this process's environment. ``cuda_emulation``
    (``on``/``off``) is the CPU capture's CUDA emulation (``record/emulation.py``), as for the recipes.
    ``on_progress(line)``, when given, gets a line every minute of a long run (elapsed seconds, each rank's phase:
    ``rlhf/launch.py: progress_line``). ``kill_leftovers``: stop the processes the command leaves behind (listed
    either way, ``result["leftover_processes"]``: ``launch.run_process_group``). ``sim_values`` (``on``/``off``;
    ``device="cuda-sim"`` only): whether the simulated device computes values (``simcuda/library.py: values_mode``);
    default ``on`` unless ``env`` or this environment sets ``$RLHFMEM_SIM_CUDA_VALUES``: a program's own control flow
    (stopping criteria, masks) needs
    values. Raises
    :class:`CommandError` (one line) for bad input: see :func:`plan_command`, an empty ``id``, a
    command that ended before any rank imported torch, or one whose ranks allocated no device memory
    (with a non-zero exit status: "exited with code N before its first allocation"; nothing was measured).

    ``iterations`` (a whole number >= 1): the iterations the program is asked to run, in ``$RLHFMEM_ITERATIONS``
    (``iterations.py``; the program reads it, or runs that many by its own arguments), and marks with
    ``rlhfmem.iteration()``; a finished run that marked another number raises :class:`CommandError` naming both.
    """
    if not id or not isinstance(id, str):
        raise CommandError("a capture needs an id (the budget entry's key), e.g. --id my-trainer/ppo")
    if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1):
        raise CommandError(f"iterations={iterations!r}: allowed values are whole numbers >= 1")
    argv, n, is_torchrun = plan_command(command, world_size, nproc_per_node)
    if device not in SIMULATED_DEVICES:  # one CUDA device per rank of this machine: refused before any rank starts
        try:
            device = resolve_device(device, (_torchrun_nproc(argv, per_node=True) or n) if is_torchrun else n)
        except ScenarioError as exc:
            raise CommandError(str(exc)) from None
    if code_device(device) == "cuda":  # a bad $RLHFMEM_HISTORY_* is one line here, not a traceback in every rank's log
        try:
            history_settings()
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    if cuda_emulation not in ("on", "off"):
        raise CommandError(f"cuda_emulation {cuda_emulation!r}: allowed values are on, off")
    extra = {**(env or {}), R.ENV_CUDA_EMULATION: cuda_emulation}
    if iterations is not None:
        extra[ENV_ITERATIONS] = str(iterations)
    if device in SIMULATED_DEVICES:
        values = sim_values or extra.get(ENV_VALUES) or os.environ.get(ENV_VALUES) or "on"
        try:
            extra[ENV_VALUES] = values_mode(values)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    elif sim_values is not None:
        raise CommandError(f"sim_values {sim_values!r} chooses whether the simulated CUDA device computes values: "
                           f"it needs device {' or '.join(SIMULATED_DEVICES)}, got {device}")
    try:  # a work directory the caller made is never removed, and must hold nothing (owned.py)
        work, created = claim_work_dir(work_dir, "rlhfmem-capture-")
    except WorkDirError as exc:
        raise CommandError(str(exc)) from None
    try:
        result = _run_in(work, argv, n, is_torchrun, id, device, timeout, snapshot_dir, extra, cwd,
                         on_progress, kill_leftovers) | {"work_dir_created": created}
    except CommandError:
        remove_work(work, created)  # nothing was measured; the message quotes the command's last output line
        raise
    marked = len(result.get("iterations") or [])
    if iterations is not None and result["status"] == "ok" and marked != iterations:
        raise CommandError(f"iterations={iterations} asked, but {shlex.join(argv)} marked {marked} iteration(s): "
                           "call rlhfmem.iteration() at the top of each step (import pytest_rlhfmem as rlhfmem) and "
                           f"run as many steps as ${ENV_ITERATIONS} says")
    return result


def _run_in(work: Path, argv: list[str], n: int, is_torchrun: bool, id: str, device: str,  # noqa: A002
            timeout: float, snapshot_dir: str | Path | None, env: dict | None, cwd: str | Path | None,
            on_progress: Callable[[str], None] | None = None, kill_leftovers: bool = False) -> dict:
    t0 = time.perf_counter()
    # the user's environment as it is (hubs online, their thread settings); on CPU CUDA hidden
    run_env = command_env("cpu" if device in SIMULATED_DEVICES else device)
    if device == SIM_DEVICE and "DS_ACCELERATOR" not in os.environ:
        run_env["DS_ACCELERATOR"] = "cuda"  # a GPU program's DeepSpeed: its CUDA accelerator, on the device
    run_env.update(env or {})
    if is_torchrun:  # torchrun sets these per worker; inherited ones would make its agent look like a rank
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            run_env.pop(k, None)
    library = recorder_library() if device == "cpu" else None
    run_env.update({
        "PYTHONPATH": os.pathsep.join([str(BOOTSTRAP_DIR), str(PACKAGE_ROOT)]
                                      + ([run_env["PYTHONPATH"]] if run_env.get("PYTHONPATH") else [])),
        R.ENV_DIR: str(work), R.ENV_DEVICE: device, R.ENV_ID: id, R.ENV_COMMAND: json.dumps(argv),
        R.ENV_WORLD_SIZE: str(n), R.ENV_TORCHRUN: "1" if is_torchrun else "0",
    })
    if snapshot_dir:
        Path(snapshot_dir).mkdir(parents=True, exist_ok=True)
        run_env[R.ENV_SNAPSHOT_DIR] = str(Path(snapshot_dir).resolve())
    if library:
        run_env["RLHFMEM_RECORDER_LIBRARY"] = library
    if device in SIMULATED_DEVICES:
        run_env["RLHFMEM_SIM_CUDA_LIBRARY"] = sim_cuda_library()
        # one simulated device per rank of this machine, seen by the launcher's own process too (accelerate launch
        # picks its multi-GPU launcher from torch.cuda.device_count())
        run_env[ENV_SIM_DEVICES] = str((_torchrun_nproc(argv, per_node=True) or n) if is_torchrun else n)
        if is_torchrun:  # its process groups: built once here, not in every rank (a single process builds its own)
            run_env[ENV_SIM_DIST_LIBRARY] = sim_dist_library()
    log_path = work / "command.log"
    try:
        tick = None if on_progress is None else (lambda s: on_progress(progress_line(work, s, f"capture {id}")))
        returncode, timed_out = run_process_group(_with_log_dir(argv, work) if is_torchrun else argv, log_path,
                                                  run_env, timeout, work, cwd=cwd, on_progress=tick,
                                                  kill_leftovers=kill_leftovers)
    except OSError as exc:
        raise CommandError(f"cannot run {shlex.join(argv)}: {exc.strerror or exc}") from None
    started = sorted(work.glob("claim-rank*"))
    if not started and not timed_out:
        tail = _last_line(log_path)
        if returncode != 0:
            raise CommandError(f"{shlex.join(argv)} exited with code {returncode} before its first allocation "
                               f"(torch was never imported){': ' + tail if tail else ''}")
        raise CommandError(f"{shlex.join(argv)} finished without importing torch: nothing to measure")
    ident = R.CommandIdentity(id, tuple(argv), n)
    result = aggregate(ident, device, work, returncode, timed_out, timeout, time.perf_counter() - t0, log_path)
    if (not timed_out and len(result["ranks"]) == n and not any(r["events"] for r in result["ranks"])
            # a rank whose own finish step failed (its trace never read, so no events) says why itself
            and not any((r.get("error") or {}).get("phase") == "finish" for r in result["ranks"])):
        # torch was imported, but no rank allocated a byte of device memory (simulated or real)
        tail = _last_line(log_path)
        if returncode != 0:
            raise CommandError(f"{shlex.join(argv)} exited with code {returncode} before its first allocation"
                               f"{': ' + tail if tail else ''}")
        raise CommandError(f"{shlex.join(argv)} imported torch but allocated no tensor memory: nothing to measure")
    result["command"] = argv
    result["log"] = str(log_path)
    return result


def _with_log_dir(argv: list[str], work: Path) -> list[str]:
    """A torchrun line with ``--log-dir`` under ``work`` (``rlhf/launch.py``'s ``TORCHRUN_LOG_DIR``), unless it
    names its own: without one torchrun makes a ``torchelastic_*`` tree in the temporary directory and never
    removes it (``torch/distributed/elastic/multiprocessing/api.py``: ``DefaultLogsSpecs``)."""
    if any(a.partition("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        return argv
    i = _torchrun_args_start(argv)
    flag = "--log_dir" if _is_accelerate_launch(argv) else "--log-dir"  # accelerate launch passes it to torchrun
    return [*argv[:i], f"{flag}={work / TORCHRUN_LOG_DIR}", *argv[i:]]


# a Python exception's last line as a rank prints it, torchrun's "[rankN]: " prefix dropped
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b:?.*)$")


def _last_line(path: Path) -> str:
    """The output line that says why the command ended: the last exception line a process printed (a launcher's
    own failure dump, torchrun's or Accelerate's, comes after it), else the last line."""
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = _EXCEPTION_LINE.match(ln)
        if m and not m.group(1).startswith(("torch.distributed.elastic", "ChildFailedError", "subprocess.")):
            return m.group(1)[:300]
    return lines[-1][:300] if lines else ""
