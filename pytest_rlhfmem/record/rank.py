"""One rank's capture, from the recorder's start to its result file: the per-rank layer below both runs.

The recipes' worker (``rlhf/worker.py``), every rank of ``rlhfmem capture`` (``command/rank.py``) and the
fake-CUDA route's worker (``fakecuda/worker.py``) are its callers: :class:`RankCapture` starts recording
(the allocation recorder, the host meter, the public API's active handle), names the failure of a rank
(:meth:`RankCapture.error_from`), replays the trace (:func:`rank_result`: CPU through the allocator model,
CUDA anchored to the real trace) and writes the rank's files.

Files written in ``out_dir`` (read by ``rlhf/launch.py: aggregate``): ``progress-rank<R>.json`` at the
start and at each phase change (pid, phase, host RSS, the device peaks so far: measured on CUDA, simulated on
CPU and cuda-sim; what a hung or killed rank leaves behind),
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

from ..hardware import REHEARSAL_DEVICE, code_device
from .host import current_rss

# An allocation failure's message: CUDA's (torch.OutOfMemoryError), PyTorch's CPU allocator's
# (c10/core/impl/alloc_cpu.cpp: "DefaultCPUAllocator: can't allocate memory", "not enough memory").
OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")
ROOT_PHASE = "run"  # the window of allocations outside every phase (rlhfmem capture)
HEARTBEAT_S = 5.0  # how often a rank rewrites its progress file between phase changes (RankCapture._heartbeat)


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
                error: dict | None, threads: int, wall_s: float, capacity: int | None = None) -> dict:
    """Replay (CPU and simulated devices: free-running through the model against ``capacity`` bytes, ``None``
    unlimited: a colocated engine's scenario gives its card, ``rlhf/common.py: engine_card_bytes``; CUDA: anchored
    to the real trace, real peaks from memory_stats) and assemble this rank's result."""
    from ..memory.events import CUDA_HISTORY_CAPTURES
    from ..memory.replay import ANCHORED, FREE_RUNNING, replay
    from ..memory.trace import SIMULATED_CAPTURES

    is_cuda = trace.capture in CUDA_HISTORY_CAPTURES  # the CUDA route's trace (measured, or rehearsed)
    result = replay(trace, mode=ANCHORED if is_cuda else FREE_RUNNING, capacity=None if is_cuda else capacity)
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
    if result.external_peak or result.external_map_failures:  # a colocated engine's mappings (memory/events.py)
        total["engine_mapped_peak"] = result.external_peak  # bytes mapped outside the caching allocator at once
        total["peak_device_used"] = result.peak_device_used  # reserved + engine mapped, at its peak
    # each engine mapping the card could not back (a wake-up's OOM): name, bytes, phase, reserved, external, capacity
    failures = {"external_map_failures": result.external_map_failures} if result.external_map_failures else {}
    if is_cuda and phases:
        for k in ("peak_reserved", "peak_allocated"):
            total[k] = max(total[k], *(p[k] for p in phases))
    iterations = None
    if getattr(rec, "iteration_no", 0):  # a run of several iterations (iterations.py): the windows of each
        iterations = iteration_figures(trace, phases, rec)
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
        **({"capacity": capacity} if capacity is not None and not is_cuda else {}),  # bytes the replay ran against
        "total": total,
        "phases": phases,
        "peak_phase": result.peak_phase,
        **failures,
        "final_requested": result.final_requested,
        "flushes": result.flushes,
        "cuda_frees_outside_flushes": result.cuda_frees_outside_flushes,
        "requested_at_phase_end": result.requested_at_phase_end,
        "events": sum(1 for e in trace.events if e.action in ("alloc", "free")),
        "host_bytes_annotated": rec.host_bytes_annotated,
        "frees_on_other_threads": dict(zip(("count", "bytes", "largest"), rec.frees_on_other_threads)),
        "recipe": recipe_info or {},
        "series": series,
        **({"iterations": iterations} if iterations is not None else {}),
    }


def iteration_figures(trace, windows: list[dict], rec) -> list[dict] | dict:
    """This rank's per-iteration rows (``iterations.py: iteration_rows``) from the replay's windows (in trace order),
    the iteration of each (``rec.window_iterations``), the host meter's per-iteration peaks and the bytes each
    iteration's phases left allocated to the end of the trace (:func:`kept_by_iteration`). A trace whose windows
    the recorder did not mark one for one gives ``{"error": ...}`` instead of rows."""
    from ..iterations import iteration_rows

    host = getattr(getattr(rec, "host", None), "iterations", None)
    try:
        return iteration_rows(windows, rec.window_iterations, host, kept_by_iteration(trace, rec.window_iterations),
                              rec.iteration_no, getattr(rec, "recorder_bytes", None))
    except ValueError as exc:
        return {"error": f"per-iteration figures not derived: {exc}"}


def kept_by_iteration(trace, window_iterations: list[int]) -> dict[int, dict[str, int]]:
    """Per iteration (>= 1), per phase: the bytes (requested, as the trace's ALLOCs carry them) allocated in that
    iteration's windows of that phase and never freed before the trace ends. The i-th PHASE event opens the i-th
    window (``window_iterations[i]`` its iteration); an allocation before the first window belongs to no iteration."""
    from ..memory.events import ALLOC, FREE, PHASE

    live: dict[int, tuple[int, int, str]] = {}  # address -> (bytes, iteration, phase)
    w, it, phase = -1, 0, ""
    for e in trace.events:
        a = e.action
        if a == ALLOC:
            live[e.addr] = (e.size, it, phase)
        elif a == FREE:
            live.pop(e.addr, None)
        elif a == PHASE:
            w += 1
            it = window_iterations[w] if w < len(window_iterations) else it
            phase = e.name
    out: dict[int, dict[str, int]] = {}
    for size, k, name in live.values():
        if k >= 1:
            by = out.setdefault(k, {})
            by[name] = by.get(name, 0) + size
    return out



@dataclass
class RankCapture:
    """Capture one rank. ``identity``: a ``Scenario`` or :class:`CommandIdentity` (``.id``, ``.to_dict()``);
    ``device``: ``cpu`` (simulated), ``cuda`` (measured), ``cuda-sim`` (the simulated device's log, simulated) or
    ``cuda-rehearsal`` (the CUDA route's code on the simulated device: ``hardware.py: code_device``; simulated);
    ``capture=False`` times phases, records nothing; ``root``: the window name for allocations outside every phase
    (``None`` for the recipes)."""

    identity: Any
    device: str
    out_dir: Path
    rank: int
    world_size: int
    capture: bool = True
    root: str | None = None
    snapshot_dir: str | None = None
    threads: int | None = None
    cuda_emulation: str = "on"  # CPU capture: record/emulation.py's CUDA adjustments, "on" | "off"
    # what else shaped the capture, merged into the result's capture_description (e.g. the recipe's
    # answer to DeepSpeed's dtype checks, hostcpu.py); the same on every host, so budgets compare
    description: dict = field(default_factory=dict)
    # per-run records that are not part of the comparable description (e.g. the simulated CUDA device's
    # .item() call sites, which name files): a callable returning a dict merged into the result at finish
    extra: Any = None
    capacity: int | None = None  # bytes the simulated replay runs against (None: unlimited; rank_result)
    rec: Any = None
    _t0: float = 0.0
    _progress: Path = field(init=False)
    _lock: Any = field(init=False)  # progress() from the main thread (phases) and the heartbeat
    _stop_beat: Any = field(init=False)

    def __post_init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._stop_beat = threading.Event()
        self._cuda_index: int | None = None  # CUDA: the rank's device, read on the main thread at start()
        self.out_dir = Path(self.out_dir)
        self._progress = self.out_dir / f"progress-rank{self.rank}.json"

    def progress(self, phase: str) -> None:
        """Write ``progress-rank<R>.json``: pid, ``phase``, host RSS (bytes, measured) and time, plus the device
        figures so far, what a rank killed or hung later leaves as its device figures:

        - CUDA: the caching allocator's ``peak_reserved`` / ``peak_allocated`` (bytes, measured:
          ``torch.cuda.memory_stats()``'s ``reserved_bytes.all.peak`` / ``allocated_bytes.all.peak``, which the
          recorder never resets);
        - CPU and ``cuda-sim`` (recording): ``peak_reserved`` / ``peak_allocated`` (bytes, simulated, with
          ``"simulated": true``) of the trace recorded so far replayed through the allocator model, advanced by
          the rows since the last phase change (:meth:`~.recorder.Recorder.figures_so_far`), and
          ``device_rows``, the recorder rows they cover. An error there leaves the figures out (the progress
          file is written regardless), naming it in ``device_figures_error``."""
        with self._lock:
            self._write_progress(phase)

    def _write_progress(self, phase: str) -> None:
        prog = {"rank": self.rank, "pid": os.getpid(), "phase": phase, "host_rss": current_rss(), "time": time.time()}
        if code_device(self.device) == "cuda":
            prog |= _cuda_peaks(self._cuda_index)
        elif self.rec is not None and self.capture:
            try:
                so_far = self.rec.figures_so_far()
            except Exception as exc:  # noqa: BLE001 - the progress file must be written; the figures are extras
                so_far = None
                prog["device_figures_error"] = _one_line(exc)
            if so_far is not None:
                prog |= {"peak_reserved": so_far["peak_reserved"], "peak_allocated": so_far["peak_allocated"],
                         "simulated": True, "device_rows": so_far["rows"]}
        _write_json(self._progress, prog)

    def start(self):
        """Start recording and make the recorder the public API's active handle; returns it (the
        recipes' ``rec``). On CPU the allocation recorder wraps PyTorch's CPU allocator from here on."""
        from . import api
        from .recorder import Recorder
        from .emulation import parse_switch
        from .host import HostMemory

        row_source = None
        if self.device == "cuda-sim" and self.capture:  # the simulated CUDA device's own log
            from ..simcuda.library import SimCudaRows

            row_source = SimCudaRows(parse_switch("on").workspace_bytes)
        device = code_device(self.device)  # the rehearsal runs the CUDA route's code
        self.rec = Recorder(device if self.capture else "off", on_phase=self.progress, root=self.root,
                            cuda_emulation=parse_switch(self.cuda_emulation), row_source=row_source)
        self.rec.host = HostMemory(device, root=self.root)  # measured host figures per window (record/host.py)
        self._t0 = time.perf_counter()
        self.rec.host.start()
        self.rec.start()
        self.rec.intercept_empty_cache()
        self.rec.intercept_history()  # CUDA: the program's own history calls cannot stop or resize ours
        if device == "cuda":  # the heartbeat's thread starts on device 0 (cudaSetDevice is per host thread)
            self._cuda_index = _current_cuda_device()
        api._activate(self.rec)
        import threading

        threading.Thread(target=self._heartbeat, name="rlhfmem-progress", daemon=True).start()
        return self.rec

    def _heartbeat(self) -> None:
        """Every :data:`HEARTBEAT_S` seconds until the rank finishes: the progress file rewritten with the phase the
        rank is in and its figures so far, so a rank killed or hung long after its last phase change is named with
        where it was and what it held then (not its last phase change's)."""
        while not self._stop_beat.wait(HEARTBEAT_S):
            try:
                self.progress(self.rec.current_phase)
            except Exception:  # noqa: BLE001 - the next beat, or the phase change, writes it again
                pass

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
        (and its memory_viz snapshot with ``snapshot_dir``); returns the result dict.

        Guarded: an exception while stopping, replaying or writing (a wrapped CUDA memory history:
        :class:`~.recorder.HistoryWrapped`; a trace the model cannot follow; a full disk) still writes
        ``result-rank<R>.json``, a failure in phase ``finish`` with the exception's first line and the figures
        known so far (:func:`finish_failure_result`); an error of the program itself stays the rank's error,
        the finish failure beside it (``finish_error``)."""
        from . import api

        wall = time.perf_counter() - self._t0
        self._stop_beat.set()
        api._activate(None)
        rec = self.rec
        exit_phase = rec.current_phase
        stage: dict[str, Any] = {}
        try:
            return self._finish(info, error, wall, exit_phase, stage)
        except Exception as exc:  # noqa: BLE001 - every failure of the finish becomes a structured result
            failure = {"phase": "finish", "time": time.time(), "type": type(exc).__name__,
                       "message": _one_line(exc), "traceback": traceback.format_exc()[-4000:]}
            result = finish_failure_result(self.identity, self.rank, self.world_size, self.device, rec,
                                           stage.get("trace"), info, error or failure, self.threads, wall, exc)
            if error:
                result["finish_error"] = failure
            result["exit_phase"] = exit_phase
            result["capture_description"] = {**result["capture_description"], **self.description}
            try:
                from .host import attach_host

                attach_host(result, rec.host)
            except Exception:  # noqa: BLE001 - the host figures are extras here
                pass
            _write_json(self.out_dir / f"result-rank{self.rank}.json", result)
            return result

    def _finish(self, info: dict | None, error: dict | None, wall: float, exit_phase: str, stage: dict) -> dict:
        from ..hostcpu import host_cpu_profile
        from .host import attach_host

        rec = self.rec
        rec.host.stop()
        trace = stage["trace"] = rec.stop()
        if self.threads is None:
            import torch

            self.threads = torch.get_num_threads()
        result = rank_result(self.identity, self.rank, self.world_size, self.device, rec, trace, info, error,
                             self.threads, wall, self.capacity)
        result["phases"] = merge_windows(result["phases"], rec.phases, self.root, wall)
        history = getattr(rec, "history", None)
        if history is not None:  # CUDA: how the memory history was kept, and the clock the phases were cut by
            result["cuda_history"] = {"max_entries": history.max_entries, "context": history.context,
                                      "mark_clock": rec.mark_clock, "program_calls": history.user_calls,
                                      "program_calls_passed_on": history.forwarded}
        result["exit_phase"] = exit_phase  # where the program was when it ended (an exit status names it)
        result["capture_description"] = {**result["capture_description"], **self.description}
        if callable(self.extra):
            result.update(self.extra())
        result["host_cpu"] = host_cpu_profile(self.threads)  # what of the host could move a figure
        attach_host(result, rec.host)
        if self.capture:  # the program's own trace, for `rlhfmem advise` and the flush cost
            from ..memory.flushes import flush_cost
            from ..memory.trace_io import SUFFIX, save_trace

            result["trace_file"] = str(save_trace(self.out_dir / f"trace-rank{self.rank}{SUFFIX}", trace))
            result["flush_cost"] = flush_cost(trace, measured_flush_s=rec.flush_times)
        if self.snapshot_dir and self.capture:
            result["snapshot"] = str(_write_snapshot(trace, self.snapshot_dir, self.identity.id, self.rank))
        _write_json(self.out_dir / f"result-rank{self.rank}.json", result)
        return result


def _current_cuda_device() -> int | None:
    """The calling thread's current CUDA device, or ``None`` before CUDA is initialised (asking then would
    initialise it)."""
    try:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    except (ImportError, RuntimeError):
        return None


def _cuda_peaks(device: int | None = None) -> dict:
    """CUDA: the caching allocator's peaks so far on ``device`` (the rank's; ``None``: the calling thread's current
    device, which for any thread but the one that called ``torch.cuda.set_device`` is device 0: rank 1's heartbeat
    read device 0's empty statistics) in bytes, measured (never reset by the recorder), or ``{}`` where they cannot
    be read (CUDA not initialised yet)."""
    try:
        import torch

        stats = torch.cuda.memory_stats(device)
    except (ImportError, RuntimeError):
        return {}
    return {"peak_reserved": int(stats.get("reserved_bytes.all.peak", 0)),
            "peak_allocated": int(stats.get("allocated_bytes.all.peak", 0))}


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
            for k in ("peak_reserved", "peak_allocated"):  # only in stats taken after a peak reset (none now)
                if all(k in st for st in real):
                    r[k] = max(st[k] for st in real)
            for k in ("cuda_malloc_count", "cuda_free_count", "alloc_retries", "ooms"):
                if all(k in st for st in real):
                    r[k] = sum(st[k] for st in real)
    return list(rows.values())


def _one_line(exc: BaseException) -> str:
    """An exception as one line: its message's first line (the type's name when empty), at most 500 chars."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


def finish_failure_result(identity, rank: int, world_size: int, device: str, rec, trace, info: dict | None,
                          error: dict, threads: int | None, wall_s: float, exc: BaseException) -> dict:
    """A rank's result when its finish failed: the keys of :func:`rank_result` (``status`` ``failed``) with the
    figures known without a replay. Per phase: wall time and, on CUDA, the allocator's ``memory_stats()``
    counters. Total: on CUDA, a :class:`~.recorder.HistoryWrapped`'s ``memory_stats()`` peaks (bytes,
    since the process began or the program's last ``reset_peak_memory_stats()``), else ``None``. ``events``:
    the trace's allocations and frees when it was read, else the history entries the exception counted."""
    from ..memory.events import CAPTURE_CUDA_REHEARSAL
    from ..memory.trace import CAPTURE_CPU_SIMULATED, CAPTURE_CUDA, CAPTURE_SIM_CUDA_SIMULATED, SIMULATED_CAPTURES

    captures = {"cuda": CAPTURE_CUDA, "cuda-sim": CAPTURE_SIM_CUDA_SIMULATED, REHEARSAL_DEVICE: CAPTURE_CUDA_REHEARSAL}
    capture = (trace.capture if trace is not None else "none" if rec.device == "off"
               else captures.get(device, CAPTURE_CPU_SIMULATED))
    stats = getattr(exc, "stats", {}) or {}
    phases: dict[str, dict] = {}
    for p in rec.phases:
        row = phases.setdefault(p.name, {"phase": p.name, "peak_reserved": None, "peak_allocated": None,
                                         "wall_s": 0.0, "windows": 0})
        row["wall_s"] = round(row["wall_s"] + p.wall_s, 6)
        row["windows"] += 1
        for k, v in (p.cuda_stats or {}).items():
            if k in ("cuda_malloc_count", "cuda_free_count", "alloc_retries", "ooms"):
                row[k] = row.get(k, 0) + v
    try:
        description = rec.capture_description()
    except Exception:  # noqa: BLE001
        description = {}
    events = (sum(1 for e in trace.events if e.action in ("alloc", "free")) if trace is not None
              else int(getattr(exc, "entries", 0) or 0))
    return {
        "schema": RESULT_SCHEMA,
        "scenario": identity.to_dict(),
        "scenario_id": identity.id,
        "rank": rank,
        "world_size": world_size,
        "device": device,
        "capture": capture,
        "capture_backend": rec.backend,
        "capture_description": description,
        "cuda_emulation_report": None,
        "simulated": capture in SIMULATED_CAPTURES,
        "status": "failed",
        "error": error,
        "versions": versions(),
        "threads": threads,
        "wall_s": round(wall_s, 6),
        "total": {"peak_reserved": stats.get("peak_reserved"), "peak_allocated": stats.get("peak_allocated")},
        "phases": list(phases.values()),
        "peak_phase": None,
        "final_requested": None,
        "flushes": [],
        "cuda_frees_outside_flushes": None,
        "requested_at_phase_end": {},
        "events": events,
        "host_bytes_annotated": rec.host_bytes_annotated,
        "frees_on_other_threads": dict(zip(("count", "bytes", "largest"), rec.frees_on_other_threads)),
        "recipe": info or {},
        "series": None,
    }


def _write_snapshot(trace, snapshot_dir: str, ident: str, rank: int) -> Path:  # noqa: ANN001
    from ..memory.events import CUDA_HISTORY_CAPTURES
    from ..memory.replay import ANCHORED, FREE_RUNNING, replay
    from ..memory.trace import CAPTURE_CUDA, Trace, write_snapshot

    name = ident.replace("/", "__").replace(" ", "_") + f"__rank{rank}.pickle"
    if trace.capture in CUDA_HISTORY_CAPTURES:  # the allocator's own snapshot: a GPU's, or the rehearsal device's
        note = ("measured: CUDA memory history" if trace.capture == CAPTURE_CUDA else
                "simulated: the CUDA route's memory history on rlhfmem's simulated CUDA device (cuda-rehearsal)")
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

