"""One rank's capture, from the recorder's start to its result file: the per-rank layer below both runs.

The recipes' worker (``rlhf/worker.py``), every rank of ``rlhfmem capture`` (``command/rank.py``) and the
fake-CUDA route's worker (``fakecuda/worker.py``) are its callers: :class:`RankCapture` starts recording
(the allocation recorder, the host meter, the public API's active handle), names the failure of a rank
(:meth:`RankCapture.error_from`), replays the trace (:func:`rank_result`: CPU through the allocator model,
CUDA anchored to the real trace) and writes the rank's files.

Files written in ``out_dir`` (read by ``rlhf/launch.py: aggregate``): ``progress-rank<R>.json`` at the
start and at each phase change (pid, phase, host RSS: what a hung or killed rank leaves behind),
``result-rank<R>.json`` at the end (also after an exception, with its phase and the memory up to it) and
``trace-rank<R>.rlhftrace`` (the program's own trace, for ``rlhfmem advise``).
"""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .memory.host import current_rss

# An allocation failure's message: CUDA's (torch.OutOfMemoryError), PyTorch's CPU allocator's
# (c10/core/impl/alloc_cpu.cpp: "DefaultCPUAllocator: can't allocate memory", "not enough memory").
OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")
ROOT_PHASE = "run"  # the window of allocations outside every phase (rlhfmem capture)


RESULT_SCHEMA = 1


def versions() -> dict:
    """Versions of the packages that decide the allocation sequence."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "transformers", "peft", "colossalai", "pytest-rlhfmem"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def rank_result(scenario, rank: int, world_size: int, device: str, rec, trace, recipe_info: dict | None,
                error: dict | None, threads: int, wall_s: float) -> dict:
    """Replay (CPU: free-running through the model; CUDA: anchored to the real trace, real peaks from
    memory_stats) and assemble this rank's result."""
    from .memory.replay import ANCHORED, FREE_RUNNING, replay
    from .memory.trace import CAPTURE_CUDA, SIMULATED_CAPTURES

    is_cuda = trace.capture == CAPTURE_CUDA
    result = replay(trace, mode=ANCHORED if is_cuda else FREE_RUNNING)
    wall = {p.name: round(p.wall_s, 6) for p in rec.phases}
    phases = []
    for w in result.phases:
        d = w.to_dict()
        d["wall_s"] = wall.get(w.phase, 0.0)
        cuda = next((p.cuda_stats for p in rec.phases if p.name == w.phase and p.cuda_stats), None)
        if cuda:  # the real allocator's own figures win over anything derived
            d.update({k: v for k, v in cuda.items() if k != "inactive_split_bytes"})
        phases.append(d)
    total = result.total.to_dict()
    if is_cuda and phases:
        for k in ("peak_reserved", "peak_allocated"):
            total[k] = max(total[k], *(p[k] for p in phases))
    coll = result.collector
    series = coll.series.downsample() if coll.series is not None else None
    if series is not None:
        series["phase_starts"] = coll.phase_starts()
    return {
        "schema": RESULT_SCHEMA,
        "scenario": scenario.to_dict(),
        "scenario_id": scenario.id,
        "rank": rank,
        "world_size": world_size,
        "device": device,
        "capture": trace.capture,
        "capture_backend": rec.backend,
        # what the capture emulated (a Recorder's CUDA emulation; other recorders describe themselves or nothing)
        "capture_description": rec.capture_description() if hasattr(rec, "capture_description") else {},
        "cuda_emulation_report": report.to_dict() if (report := getattr(rec, "emulation_report", None)) else None,
        "simulated": trace.capture in SIMULATED_CAPTURES,
        "status": "failed" if error else "ok",
        "error": error,
        "versions": versions(),
        "threads": threads,
        "wall_s": round(wall_s, 6),
        "total": total,
        "phases": phases,
        "peak_phase": result.peak_phase,
        "final_requested": result.final_requested,
        "flushes": result.flushes,
        "cuda_frees_outside_flushes": result.cuda_frees_outside_flushes,
        "requested_at_phase_end": result.requested_at_phase_end,
        "events": sum(1 for e in trace.events if e.action in ("alloc", "free")),
        "host_bytes_annotated": rec.host_bytes_annotated,
        "frees_on_other_threads": dict(zip(("count", "bytes", "largest"), rec.frees_on_other_threads)),
        "recipe": recipe_info or {},
        "series": series,
    }



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
    # per-run records that are not part of the comparable description (e.g. the simulated CUDA device's
    # .item() call sites, which name files): a callable returning a dict merged into the result at finish
    extra: Any = None
    rec: Any = None
    _t0: float = 0.0
    _progress: Path = field(init=False)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self._progress = self.out_dir / f"progress-rank{self.rank}.json"

    def progress(self, phase: str) -> None:
        _write_json(self._progress, {"rank": self.rank, "pid": os.getpid(), "phase": phase,
                                     "host_rss": current_rss(), "time": time.time()})

    def start(self):
        """Start recording and make the recorder the public API's active handle; returns it (the
        recipes' ``rec``). On CPU the allocation recorder wraps PyTorch's CPU allocator from here on."""
        from . import api
        from .memory.capture import Recorder
        from .memory.emulation import parse_switch
        from .memory.host import HostMemory

        row_source = None
        if self.device == "cuda-sim" and self.capture:  # the simulated CUDA device's own log
            from .memory.sim_cuda import SimCudaRows

            row_source = SimCudaRows(parse_switch("on").workspace_bytes)
        self.rec = Recorder(self.device if self.capture else "off", on_phase=self.progress, root=self.root,
                            cuda_emulation=parse_switch(self.cuda_emulation), row_source=row_source)
        self.rec.host = HostMemory(self.device, root=self.root)  # measured host figures per window (memory/host.py)
        self._t0 = time.perf_counter()
        self.rec.host.start()
        self.rec.start()
        self.rec.intercept_empty_cache()
        api._activate(self.rec)
        return self.rec

    def error_from(self, exc: BaseException, tb: str | None = None) -> dict:
        """A structured error: phase (innermost open one), type (``OOM`` for out-of-memory), message."""
        from .hostcpu import dtype_failure

        is_oom = "OutOfMemoryError" in type(exc).__name__ or any(s in str(exc).lower() for s in OOM_MESSAGES)
        no_kernel = dtype_failure(str(exc), None)
        kind = "OOM" if is_oom else ("DtypeUnsupported" if no_kernel else type(exc).__name__)
        return {"phase": self.rec.current_phase if self.rec else "startup", "time": time.time(),
                "type": kind, "message": (no_kernel + ": " if no_kernel else "") + str(exc)[:2000],
                "traceback": (tb or traceback.format_exc())[-4000:]}

    def finish(self, info: dict | None, error: dict | None) -> dict:
        """Stop, replay (CPU: through the allocator model; CUDA: the real trace), write the rank's result
        (and its memory_viz snapshot with ``snapshot_dir``); returns the result dict."""
        from . import api
        from .hostcpu import host_cpu_profile
        from .memory.host import attach_host

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
        if callable(self.extra):
            result.update(self.extra())
        result["host_cpu"] = host_cpu_profile(self.threads)  # what of the host could move a figure
        attach_host(result, rec.host)
        if self.capture:  # the program's own trace, for `rlhfmem advise` and the flush cost
            from .memory.flushes import flush_cost
            from .memory.trace_io import SUFFIX, save_trace

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
    from .memory.replay import ANCHORED, FREE_RUNNING, replay
    from .memory.trace import CAPTURE_CUDA, Trace, write_snapshot

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

