"""One rank's capture, from the recorder's start to its result file: the recipes' worker and every rank
of ``rlhfmem capture`` go through :class:`RankCapture` (one capture path).

Files written in ``out_dir`` (read by ``rlhf/launch.py: aggregate``): ``progress-rank<R>.json`` at the
start and at each phase change (pid, phase, host RSS: what a hung or killed rank leaves behind) and
``result-rank<R>.json`` at the end (also after an exception, with its phase and the memory up to it).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# An allocation failure's message: CUDA's (torch.OutOfMemoryError), PyTorch's CPU allocator's
# (c10/core/impl/alloc_cpu.cpp: "DefaultCPUAllocator: can't allocate memory", "not enough memory").
OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")
ROOT_PHASE = "run"  # the window of allocations outside every phase (rlhfmem capture)


@dataclass(frozen=True)
class CommandIdentity:
    """Stands where a recipe's ``Scenario`` stands in results: the user's ``id`` and command."""

    id: str
    command: tuple[str, ...]
    world_size: int

    def to_dict(self) -> dict:
        return {"kind": "command", "id": self.id, "command": list(self.command), "world_size": self.world_size}


@dataclass
class RankCapture:
    """Capture one rank. ``identity``: a ``Scenario`` or :class:`CommandIdentity` (``.id``, ``.to_dict()``);
    ``device``: ``cpu`` (simulated) or ``cuda`` (measured); ``capture=False`` times phases, records
    nothing; ``root``: the window name for allocations outside every phase (``None`` for the recipes)."""

    identity: Any
    device: str
    out_dir: Path
    rank: int
    world_size: int
    capture: bool = True
    root: str | None = None
    snapshot_dir: str | None = None
    threads: int | None = None
    cuda_emulation: str = "on"  # CPU capture: memory/emulation.py's CUDA adjustments, "on" | "off"
    # what else shaped the capture, merged into the result's capture_description (e.g. the recipe's
    # answer to DeepSpeed's dtype checks, hostcpu.py); the same on every host, so budgets compare
    description: dict = field(default_factory=dict)
    rec: Any = None
    _t0: float = 0.0
    _progress: Path = field(init=False)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self._progress = self.out_dir / f"progress-rank{self.rank}.json"

    def progress(self, phase: str) -> None:
        _write_json(self._progress, {"rank": self.rank, "pid": os.getpid(), "phase": phase,
                                     "host_rss": _rss_bytes(), "time": time.time()})

    def start(self):
        """Start recording and make the recorder the public API's active handle; returns it (the
        recipes' ``rec``). On CPU the allocation recorder wraps PyTorch's CPU allocator from here on."""
        from .. import api
        from ..memory.capture import Recorder
        from ..memory.emulation import parse_switch
        from ..memory.host import HostMemory

        self.rec = Recorder(self.device if self.capture else "off", on_phase=self.progress, root=self.root,
                            cuda_emulation=parse_switch(self.cuda_emulation))
        self.rec.host = HostMemory(self.device, root=self.root)  # measured host figures per window (memory/host.py)
        self._t0 = time.perf_counter()
        self.rec.host.start()
        self.rec.start()
        self.rec.intercept_empty_cache()
        api._activate(self.rec)
        return self.rec

    def error_from(self, exc: BaseException, tb: str | None = None) -> dict:
        """A structured error: phase (innermost open one), type (``OOM`` for out-of-memory), message."""
        from ..hostcpu import dtype_failure

        is_oom = "OutOfMemoryError" in type(exc).__name__ or any(s in str(exc).lower() for s in OOM_MESSAGES)
        no_kernel = dtype_failure(str(exc), None)
        kind = "OOM" if is_oom else ("DtypeUnsupported" if no_kernel else type(exc).__name__)
        return {"phase": self.rec.current_phase if self.rec else "startup", "time": time.time(),
                "type": kind, "message": (no_kernel + ": " if no_kernel else "") + str(exc)[:2000],
                "traceback": (tb or traceback.format_exc())[-4000:]}

    def finish(self, info: dict | None, error: dict | None) -> dict:
        """Stop, replay (CPU: through the allocator model; CUDA: the real trace), write the rank's result
        (and its memory_viz snapshot with ``snapshot_dir``); returns the result dict."""
        from .. import api
        from ..hostcpu import host_cpu_profile
        from ..memory.host import attach_host
        from ..rlhf.worker import rank_result

        wall = time.perf_counter() - self._t0
        api._activate(None)
        rec = self.rec
        exit_phase = rec.current_phase
        rec.host.stop()
        trace = rec.stop()
        if self.threads is None:
            import torch

            self.threads = torch.get_num_threads()
        result = rank_result(self.identity, self.rank, self.world_size, self.device, rec, trace, info, error,
                             self.threads, wall)
        result["phases"] = merge_windows(result["phases"], rec.phases, self.root, wall)
        result["exit_phase"] = exit_phase  # where the program was when it ended (an exit status names it)
        result["capture_description"] = {**result["capture_description"], **self.description}
        result["host_cpu"] = host_cpu_profile(self.threads)  # what of the host could move a figure
        attach_host(result, rec.host)
        if self.capture:  # the program's own trace, for `rlhfmem advise` and the flush cost
            from ..advise import flush_cost
            from ..memory.trace_io import SUFFIX, save_trace

            result["trace_file"] = str(save_trace(self.out_dir / f"trace-rank{self.rank}{SUFFIX}", trace))
            result["flush_cost"] = flush_cost(trace, measured_flush_s=rec.flush_times)
        if self.snapshot_dir and self.capture:
            result["snapshot"] = str(_write_snapshot(trace, self.snapshot_dir, self.identity.id, self.rank))
        _write_json(self.out_dir / f"result-rank{self.rank}.json", result)
        return result


def merge_windows(windows: list[dict], records: list, root: str | None, wall_s: float) -> list[dict]:
    """One row per phase name, in order of first appearance: a name's windows (repeats, or resumptions
    after a nested phase) merge as peaks = max (fragmentation and inactive split taken at the max peak
    reserved), counts and times = sum. ``wall_s``: the sum of that name's phase records (the root
    window's is the rank's whole wall time). On CUDA, when every occurrence of a name carries the real
    allocator's ``memory_stats()`` figures, those win: peaks max, counts summed."""
    rows: dict[str, dict] = {}
    for w in windows:
        r = rows.get(w["phase"])
        if r is None:
            rows[w["phase"]] = dict(w)
            continue
        if w["peak_reserved"] > r["peak_reserved"]:
            for k in ("peak_reserved", "fragmentation_at_peak", "inactive_split_at_peak"):
                r[k] = w.get(k)
        for k in ("peak_allocated", "max_fragmentation"):
            r[k] = max(r.get(k) or 0, w.get(k) or 0)
        for k in ("cuda_malloc_count", "cuda_free_count", "alloc_retries", "ooms", "events", "time_s"):
            if k in w:
                r[k] = (r.get(k) or 0) + (w.get(k) or 0)
        r["end_us"] = w.get("end_us", r.get("end_us"))
    walls: dict[str, float] = {}
    stats: dict[str, list] = {}
    for p in records:
        walls[p.name] = walls.get(p.name, 0.0) + p.wall_s
        stats.setdefault(p.name, []).append(getattr(p, "cuda_stats", None))
    for name, r in rows.items():
        r["wall_s"] = round(wall_s if name == root else walls.get(name, r.get("wall_s", 0.0)), 6)
        r["windows"] = sum(1 for w in windows if w["phase"] == name)
        real = stats.get(name, [])
        if real and all(real):  # CUDA: the real allocator's memory_stats() of every occurrence win
            for k in ("peak_reserved", "peak_allocated"):
                r[k] = max(st[k] for st in real)
            for k in ("cuda_malloc_count", "cuda_free_count", "alloc_retries", "ooms"):
                r[k] = sum(st[k] for st in real)
    return list(rows.values())


def _write_snapshot(trace, snapshot_dir: str, ident: str, rank: int) -> Path:  # noqa: ANN001
    from ..memory.replay import ANCHORED, FREE_RUNNING, replay
    from ..memory.trace import CAPTURE_CUDA, Trace, write_snapshot

    name = ident.replace("/", "__").replace(" ", "_") + f"__rank{rank}.pickle"
    if trace.capture == CAPTURE_CUDA:  # the real allocator's own snapshot
        note = "measured: CUDA memory history"
        out_trace, segments = trace, replay(trace, mode=ANCHORED, record_series=False).segments
    else:  # the replayed trace: addresses and segment events are the model's
        note = "simulated: CPU allocation trace replayed through the CUDA caching allocator model"
        sim = replay(trace, mode=FREE_RUNNING, record_series=False, record_events=True)
        out_trace, segments = Trace(events=sim.events or [], capture=trace.capture), sim.segments
    return write_snapshot(Path(snapshot_dir) / name, out_trace, segments, note=note)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------------
# rlhfmem capture: started by bootstrap/sitecustomize.py when torch finishes importing
# ---------------------------------------------------------------------------------------------------

ENV_DIR = "RLHFMEM_CAPTURE_DIR"  # work directory of the capture; its presence turns the bootstrap on
ENV_DEVICE = "RLHFMEM_CAPTURE_DEVICE"  # cpu | cuda
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
        return
    rank = int(env.get("RANK", "0"))
    try:
        fd = os.open(Path(out) / f"claim-rank{rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    device = env.get(ENV_DEVICE, "cpu")
    if device == "cuda":
        import torch

        # CUDA state first (torch.cuda.init), on this rank's device: the caching allocator must exist
        # before memory history is switched on, and the context must not land on device 0 for every rank.
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1))
        torch.cuda.init()
    world_size = int(env.get("WORLD_SIZE", env.get(ENV_WORLD_SIZE, "1")))
    ident = CommandIdentity(env.get(ENV_ID, "command"), tuple(json.loads(env.get(ENV_COMMAND, "[]"))), world_size)
    cap = RankCapture(ident, device, Path(out), rank, world_size, root=ROOT_PHASE,
                      snapshot_dir=env.get(ENV_SNAPSHOT_DIR) or None,
                      cuda_emulation=env.get(ENV_CUDA_EMULATION, "on"))
    cap.progress("startup")
    cap.start()
    _command_capture = cap
    _install_exit_hooks(cap)


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
