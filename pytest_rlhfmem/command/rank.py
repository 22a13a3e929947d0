"""``rlhfmem capture``: each process of the user's command that imports torch is recorded as a rank (started by
``bootstrap/sitecustomize.py`` when torch finishes importing), through the per-rank capture the recipes use
too (``pytest_rlhfmem/record/rank.py``: :class:`~pytest_rlhfmem.record.rank.RankCapture`)."""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

from ..hardware import REHEARSAL_DEVICE, code_device
from ..record.rank import ROOT_PHASE, RankCapture


@dataclass(frozen=True)
class CommandIdentity:
    """Stands where a recipe's ``Scenario`` stands in results: the user's ``id`` and command."""

    id: str
    command: tuple[str, ...]
    world_size: int

    def to_dict(self) -> dict:
        return {"kind": "command", "id": self.id, "command": list(self.command), "world_size": self.world_size}


ENV_DIR = "RLHFMEM_CAPTURE_DIR"  # work directory of the capture; its presence turns the bootstrap on
ENV_DEVICE = "RLHFMEM_CAPTURE_DEVICE"  # cpu | cuda | cuda-sim | cuda-rehearsal
ENV_ID = "RLHFMEM_CAPTURE_ID"
ENV_COMMAND = "RLHFMEM_CAPTURE_COMMAND"  # JSON list
ENV_WORLD_SIZE = "RLHFMEM_CAPTURE_WORLD_SIZE"
ENV_TORCHRUN = "RLHFMEM_CAPTURE_TORCHRUN"  # "1": only torchrun's workers (LOCAL_RANK set) are ranks
ENV_SNAPSHOT_DIR = "RLHFMEM_CAPTURE_SNAPSHOT_DIR"
ENV_CUDA_EMULATION = "RLHFMEM_CAPTURE_CUDA_EMULATION"  # "on" (default) | "off"

_command_capture: RankCapture | None = None


def start_command_capture() -> None:
    """Called once torch is imported in a process of the user's command. Records it as rank ``$RANK``
    (0 without torchrun) unless it is torchrun's agent (under torchrun only workers, which have
    ``LOCAL_RANK``, are ranks) or another process already claimed that rank (a spawned DataLoader worker
    inherits the environment: the first process of a rank wins, by an exclusive claim file)."""
    global _command_capture
    env = os.environ
    out = env.get(ENV_DIR)
    if not out or _command_capture is not None:
        return
    if env.get(ENV_TORCHRUN) == "1" and "LOCAL_RANK" not in env:
        if env.get(ENV_DEVICE) in ("cuda-sim", REHEARSAL_DEVICE):  # the launcher's own process asks torch.cuda too
            from ..simcuda.torch_cuda import install  # (accelerate launch: device_count() picks its launcher)

            install()
        return
    rank = int(env.get("RANK", "0"))
    try:
        fd = os.open(Path(out) / f"claim-rank{rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    device = env.get(ENV_DEVICE, "cpu")
    description, extra = {}, None
    if device in ("cuda-sim", REHEARSAL_DEVICE):  # the simulated device: torch.cuda answered first
        from ..simcuda.torch_cuda import SCALAR_SITES, install

        description["torch_cuda_answered"] = install()
        from ..simcuda.distributed import collective_counts, install as install_distributed

        description["torch_distributed_answered"] = install_distributed()  # nccl, and gloo on device tensors
        extra = lambda: {"scalar_answers": SCALAR_SITES.sites,  # noqa: E731 - file:line names: not compared
                         **({"collectives": collective_counts()} if collective_counts() else {})}
    if code_device(device) == "cuda":  # the CUDA route (on a GPU, or rehearsed on the simulated device)
        _start_cuda(int(env.get("LOCAL_RANK", "0")))
    world_size = int(env.get("WORLD_SIZE", env.get(ENV_WORLD_SIZE, "1")))
    ident = CommandIdentity(env.get(ENV_ID, "command"), tuple(json.loads(env.get(ENV_COMMAND, "[]"))), world_size)
    cap = RankCapture(ident, device, Path(out), rank, world_size, root=ROOT_PHASE,
                      snapshot_dir=env.get(ENV_SNAPSHOT_DIR) or None,
                      cuda_emulation=env.get(ENV_CUDA_EMULATION, "on"), description=description, extra=extra)
    cap.progress("startup")
    cap.start()
    _command_capture = cap
    _install_exit_hooks(cap)


def _start_cuda(local_rank: int) -> None:
    """CUDA state first (``torch.cuda.init``), on this rank's device: the caching allocator must exist before memory
    history is switched on, and the context must not land on device 0 for every rank. One device per rank (run.py
    refuses more ranks than devices before starting any): never two NCCL ranks on one GPU. Raises
    ``RuntimeError`` for a local rank without a device of its own."""
    import torch

    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"rlhfmem capture: local rank {local_rank} has no CUDA device of its own "
                           f"({torch.cuda.device_count()} visible): run at most that many ranks per machine")
    torch.cuda.set_device(local_rank)
    torch.cuda.init()


def _install_exit_hooks(cap: RankCapture) -> None:
    """Remember an uncaught exception (sys.excepthook) and finish the capture at interpreter exit
    (atexit: after the user's own exit handlers, before torch's)."""
    import atexit
    import sys

    errors: list[dict] = []
    previous = sys.excepthook

    def excepthook(tp, value, tb) -> None:  # noqa: ANN001
        errors.append(cap.error_from(value, "".join(traceback.format_exception(tp, value, tb))))
        previous(tp, value, tb)

    sys.excepthook = excepthook

    def at_exit() -> None:
        try:
            cap.finish(None, errors[0] if errors else None)
        except Exception:  # noqa: BLE001 - never turn the user's exit into a traceback of ours
            traceback.print_exc()

    atexit.register(at_exit)
