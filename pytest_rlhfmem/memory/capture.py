"""Capture one rank's device allocation trace, phases and flushes included.

- CUDA: PyTorch's memory history (``torch.cuda.memory._record_memory_history``) started before the
  first model is built, plus ``torch.cuda.memory_stats()`` read at every phase end (peak since
  ``reset_peak_memory_stats`` at the phase start). Figures are the real allocator's.
- CPU: a recording wrapper around PyTorch's CPU allocator (``cpu_recorder.py``) logs every allocation
  and free (pointer, requested bytes) from every thread, from before the first model is built, with
  markers (phase starts, flushes, placement annotations) in the same ordered buffer. Where it cannot be
  built, ``torch.profiler.profile(profile_memory=True)`` is the fallback; it sees only the main thread,
  so frees done on communication threads are missed (``capture_backend`` in every result says which).
  Either trace is replayed through the allocator model: every figure derived from it is *simulated*.

Placement annotations (the second trap of ``ARCHITECTURE.md``): on a CPU run a move to host is a no-op
and host-resident state (DeepSpeed's offloaded optimizer states, ColossalChat's reference/reward models
moved to CPU) sits in the same allocator as device tensors. The recipe says what is where:

- :meth:`Recorder.host_resident`: these tensors live in host memory; their allocations (and later frees)
  leave the device trace entirely.
- :meth:`Recorder.moved_to_host`: these device tensors move to host now: a free at this moment.
- :meth:`Recorder.moved_to_device`: these host tensors come back: an allocation at this moment.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable, Iterator

from . import emulation
from .allocator import SEGMENT_PLACEMENT_KEY
from .driver_va import ABOVE_LAST
from .events import CUBLAS_WORKSPACE
from .host import HostMemory
from .trace import (
    ALLOC, CAPTURE_CPU_SIMULATED, CAPTURE_CUDA, CAPTURE_SIM_CUDA_SIMULATED, FLUSH, FREE, FREE_REQUESTED, PHASE,
    PHASE_END, POOL_ENTER, POOL_EXIT, Event, Trace, trace_from_snapshot,
)

_MARK = "rlhfmem::mark::"
# recorder row kind (0 alloc, 1 free, 2 mark, 3 free requested: sim_cuda.SimCudaRows) -> cpu_events' item kind
ITEM_KIND = {0: 0, 1: 0, 2: 1, 3: 2}


def _name_workspaces(events: list[Event], workspaces: set[int] | frozenset[int]) -> list[Event]:
    """``events`` with the ALLOC of each cuBLAS workspace (its address in ``workspaces``; never freed, so one
    ALLOC each) named :data:`~.events.CUBLAS_WORKSPACE`."""
    if not workspaces:
        return events
    return [e._replace(name=CUBLAS_WORKSPACE) if e.action == ALLOC and e.addr in workspaces else e for e in events]


def _storages(tensors: Iterable) -> list[tuple[int, int]]:
    """(data pointer, bytes) of each distinct storage behind ``tensors`` (views share one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        ptr, n = s.data_ptr(), s.nbytes()
        if ptr and n:
            seen[ptr] = n
    return list(seen.items())


@dataclass
class PhaseRecord:
    name: str
    wall_s: float = 0.0
    cuda_stats: dict | None = None  # CUDA only: memory_stats() figures of this phase
    nested: bool = False  # a phase was nested inside this one (its CUDA stats would span the inner one)


@dataclass
class Recorder:
    """Records one rank. Use: ``start()`` before building models, ``phase(name)`` around each phase,
    ``flush(point)`` where the policy empties the cache, the placement calls, then ``stop()``.

    Phases nest: when an inner phase ends, the enclosing one resumes (a new window of the same name).
    With ``root`` set (``rlhfmem capture``), allocations outside every phase belong to a window of that
    name (``"run"``), so a trace with no phase marks is one window covering the whole run.
    """

    device: str  # "cpu" | "cuda" | "cuda-sim"
    on_phase: Callable[[str], None] | None = None  # called at each phase start (progress files)
    max_entries: int = 2_000_000
    phases: list[PhaseRecord] = field(default_factory=list)
    host_bytes_annotated: int = 0
    frees_on_other_threads: tuple = (0, 0, [])  # (count, bytes, largest): frees done by other threads
    _marks: list[tuple[str, object]] = field(default_factory=list)
    _prof: object = None
    _ext: object = None
    backend: str = ""
    _phase_marks_us: list[tuple[str, int, str]] = field(default_factory=list)  # CUDA: (kind, time_us, name)
    # CPU only: the CUDA emulation (memory/emulation.py) applied to the capture; None = off.
    cuda_emulation: emulation.EmulationSettings | None = field(default_factory=emulation.EmulationSettings)
    emulation_report: emulation.EmulationReport | None = None
    keep_raw_rows: bool = False  # keep the recorder rows (``raw_rows``) for re-deriving traces
    raw_rows: list | None = None
    _op_mode: object = None
    root: str | None = None  # the window of allocations outside every phase (None: recipes, no such window)
    _stack: list[PhaseRecord] = field(default_factory=list)  # open phases, innermost last
    _empty_cache: Callable[[], None] | None = None  # the original torch.cuda.empty_cache while intercepted
    error_phase: str | None = None  # the innermost phase an exception propagated out of
    host: HostMemory | None = None  # measured host figures (host.py), told of phases and host-resident buffers
    # "cuda-sim": the simulated CUDA device's log (memory/sim_cuda.py: SimCudaRows), read as recorder rows
    row_source: object = None
    flush_times: list[tuple[str, float]] = field(default_factory=list)  # CUDA: (point, seconds) per empty_cache

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.device == "off":  # a bare iteration: phases timed, nothing recorded (capture overhead)
            self.backend = "none"
            return
        if self.device == "cuda":
            import torch

            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=self.max_entries)
            torch.cuda.reset_peak_memory_stats()
            self.backend = "torch.cuda.memory._record_memory_history"
        elif self.row_source is not None:  # the simulated CUDA device: CUDA's code paths, no emulation
            self._ext = self.row_source
            self.backend = getattr(self.row_source, "backend", "row source")
            self.cuda_emulation = None
            self._ext.start()
        else:
            try:
                from .cpu_recorder import load_recorder

                ext = load_recorder()
                if not ext.install():
                    raise RuntimeError("the current CPU allocator cannot be wrapped")
                self._ext = ext
                self.backend = "rlhfmem CPU allocator recorder (all threads)"
                ext.start()
                if self.cuda_emulation is not None:
                    self._op_mode = emulation.marker_mode(self._mark)
                    self._op_mode.__enter__()
            except RuntimeError:
                from torch.profiler import ProfilerActivity, profile

                self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self._prof.__enter__()
                self.backend = "torch.profiler profile_memory (main thread only)"
        if self.root is not None:
            self._mark(PHASE, self.root)

    def stop(self) -> Trace:
        """Stop recording and return the device trace (phases, flushes, placement applied)."""
        self.restore_empty_cache()
        if self.device == "off":
            return Trace(events=[], capture="none", source="capture off")
        if self.device == "cuda":
            return self._stop_cuda()
        return self._stop_cpu()

    # -- markers ----------------------------------------------------------------------------------
    def _mark(self, kind: str, payload: object) -> None:
        if self.device == "off":
            return
        if self.device == "cuda":
            if kind in (PHASE, PHASE_END, FLUSH):
                self._phase_marks_us.append((kind, time.time_ns() // 1000, str(payload)))
            return
        k = len(self._marks)
        self._marks.append((kind, payload))
        if self._ext is not None:
            self._ext.mark(k)
            return
        from torch.profiler import record_function

        with record_function(f"{_MARK}{k}"):
            pass

    @property
    def current_phase(self) -> str:
        """The phase an exception is leaving, else the innermost open phase, else the root window, else
        the last phase (``"startup"`` before any)."""
        if self.error_phase is not None:
            return self.error_phase
        if self._stack:
            return self._stack[-1].name
        return self.root or (self.phases[-1].name if self.phases else "startup")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseRecord]:
        """Mark a phase; measures its wall time (seconds, nested phases included) and, on CUDA, its
        memory_stats() (a top-level phase with no phase nested in it; otherwise the trace's figures)."""
        rec = PhaseRecord(name)
        self.phases.append(rec)
        nested = bool(self._stack)
        if nested:
            self._stack[-1].cuda_stats = None
            self._stack[-1].nested = True
        self._stack.append(rec)
        if self.on_phase is not None:
            self.on_phase(name)
        if self.host is not None:
            self.host.begin_phase(name)
        cuda_stats = self.device == "cuda" and not nested
        if cuda_stats:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_stats()
        self._mark(PHASE, name)
        self.error_phase = None  # a phase began: an exception seen before was handled
        t0 = time.perf_counter()
        try:
            yield rec
        except BaseException:
            self.error_phase = self.error_phase or name  # the innermost phase the exception left
            raise
        finally:
            if cuda_stats and not rec.nested:
                import torch

                torch.cuda.synchronize()
                rec.cuda_stats = cuda_phase_stats(before, torch.cuda.memory_stats())
            rec.wall_s += time.perf_counter() - t0
            self._mark(PHASE_END, name)
            if self.host is not None:
                self.host.end_phase(name)
            self._stack.pop()
            resume = self._stack[-1].name if self._stack else self.root
            if resume is not None:  # the enclosing phase (or the root window) resumes
                self._mark(PHASE, resume)
                if self.on_phase is not None:
                    self.on_phase(resume)

    def flush(self, point: str) -> None:
        """The flush policy's ``torch.cuda.empty_cache()``: real on CUDA, a FLUSH event on CPU."""
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            (self._empty_cache or torch.cuda.empty_cache)()
            torch.cuda.synchronize()
            self.flush_times.append((point, time.perf_counter() - t0))  # measured: the cudaFree calls' cost
        elif self.row_source is not None and hasattr(self.row_source, "flush_sync"):
            self.row_source.flush_sync()  # the simulated device: empty_cache's wait for every stream first
        self._mark(FLUSH, point)

    @contextlib.contextmanager
    def mem_pool(self, pool_id: tuple[int, int]) -> Iterator[None]:
        """Allocations inside go to private pool ``pool_id`` (``torch.cuda.use_mem_pool``'s region): a
        POOL_ENTER/POOL_EXIT pair in a CPU trace; a CUDA snapshot carries ``segment_pool_id`` itself."""
        self._mark(POOL_ENTER, pool_id)
        try:
            yield
        finally:
            self._mark(POOL_EXIT, pool_id)

    def intercept_empty_cache(self) -> None:
        """Record every ``torch.cuda.empty_cache()`` call of the code under test (or a library) as a FLUSH
        named ``empty_cache@<file>:<line>`` of its caller (past wrappers that are themselves called
        ``empty_cache``, e.g. DeepSpeed's accelerator method and ``deepspeed.runtime.utils.empty_cache``), then
        run the real one (a no-op without CUDA).
        Patches ``torch.cuda.empty_cache`` and ``torch.cuda.memory.empty_cache``; ``stop()`` restores them.
        Code that bound the function before the patch (``from torch.cuda import empty_cache`` at import)
        is not seen: the capture bootstrap patches it as torch finishes importing, before user code."""
        import sys

        import torch

        if self.device == "off" or self._empty_cache is not None:
            return
        original = torch.cuda.memory.empty_cache

        def empty_cache() -> None:
            caller = sys._getframe(1)
            while caller.f_code.co_name == "empty_cache" and caller.f_back is not None:
                caller = caller.f_back
            original()
            self._mark(FLUSH, f"empty_cache@{caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}")

        empty_cache.__doc__ = original.__doc__
        empty_cache.__wrapped__ = original  # type: ignore[attr-defined]
        self._empty_cache = original
        torch.cuda.empty_cache = torch.cuda.memory.empty_cache = empty_cache

    def restore_empty_cache(self) -> None:
        if self._empty_cache is not None:
            import torch

            torch.cuda.empty_cache = torch.cuda.memory.empty_cache = self._empty_cache
            self._empty_cache = None

    def host_resident(self, tensors: Iterable) -> None:
        tensors = list(tensors)
        if self.host is not None:
            self.host.note_offloaded(tensors)
        st = _storages(tensors)
        self.host_bytes_annotated += sum(n for _, n in st)
        self._mark("host_resident", st)

    def moved_to_host(self, tensors: Iterable) -> None:
        self._mark("to_host", _storages(tensors))

    def moved_to_device(self, tensors: Iterable) -> None:
        self._mark("to_device", _storages(tensors))

    # -- CPU --------------------------------------------------------------------------------------
    def capture_description(self) -> dict:
        """What this capture emulated, for results and budgets: ``{"cuda_emulation": ...}`` on CPU."""
        if self.row_source is not None:
            return self.row_source.describe()
        if self.device != "cpu":
            return {}
        applied = self.cuda_emulation if self.backend.startswith("rlhfmem CPU") else None
        return emulation.capture_description(applied)

    def _stop_cpu(self) -> Trace:
        if self._ext is not None:
            if self._op_mode is not None:
                self._op_mode.__exit__(None, None, None)
                self._op_mode = None
            rows = self._ext.stop().tolist()
            self._ext = None
            if self.keep_raw_rows:
                self.raw_rows = rows
            return self.trace_from_rows(rows, self.cuda_emulation)
        from torch._C._profiler import _EventType

        prof = self._prof
        prof.__exit__(None, None, None)
        tree = prof.profiler.kineto_results.experimental_event_tree()
        items: list[tuple[int, int, int, int, int]] = []  # (time_ns, seq, kind 0=alloc 1=mark, a, b)
        stack = list(reversed(tree))
        seq = 0
        while stack:
            node = stack.pop()
            seq += 1
            if node.tag == _EventType.Allocation:
                f = node.extra_fields
                if f.alloc_size != 0 and str(f.device) == "cpu":
                    items.append((node.start_time_ns, seq, 0, f.ptr, f.alloc_size))
            elif node.name.startswith(_MARK):
                items.append((node.start_time_ns, seq, 1, int(node.name[len(_MARK):]), 0))
            stack.extend(reversed(node.children))
        items.sort()
        self._prof = None
        return Trace(events=self.cpu_events(items), capture=CAPTURE_CPU_SIMULATED, source=self.backend)

    def trace_from_rows(self, rows: list, cuda_emulation: emulation.EmulationSettings | None) -> Trace:
        """The device trace of recorder rows ``(time_ns, ptr, size, kind, on_main)``, CUDA-emulated as
        given (the benchmark re-derives traces from one run's ``raw_rows`` under several settings)."""
        if cuda_emulation is not None:
            rows, self.emulation_report = emulation.apply(rows, self._marks, cuda_emulation)
        # items (time_ns, seq, 0 data / 1 mark / 2 free requested, ptr or mark index, +size alloc / -size free)
        items = [(t, i, ITEM_KIND[kind], ptr, -size if kind == 1 else size)
                 for i, (t, ptr, size, kind, _main) in enumerate(rows)]
        self.frees_on_other_threads = self._foreign_frees(rows)
        events = self.cpu_events(items)
        if self.row_source is None:  # the emulation's cuBLAS workspaces are named, as the simulated device's
            workspaces = set(self.emulation_report.workspace_ptrs) if cuda_emulation is not None else set()
            events = _name_workspaces(events, workspaces)
            return Trace(events=events, capture=CAPTURE_CPU_SIMULATED, source=self.backend)
        streams = getattr(self.row_source, "streams", {})  # blocks of a side stream keep its pool
        if streams:
            events = [e._replace(stream=streams[e.addr])
                      if e.action in (ALLOC, FREE, FREE_REQUESTED) and e.addr in streams else e for e in events]
        events = _name_workspaces(events, self.row_source.workspace_addresses())
        placement = self.row_source.segment_placement  # a replay of this trace places segments as the capture did
        settings = {SEGMENT_PLACEMENT_KEY: placement.spec()} if placement.kind != ABOVE_LAST else None
        return Trace(events=events, capture=CAPTURE_SIM_CUDA_SIMULATED, source=self.backend,
                     allocator_settings=settings)

    def mark_kind(self, k: int) -> str:
        """The kind of the recorder's ``k``-th mark (PHASE, PHASE_END, FLUSH, POOL_ENTER, ...)."""
        return self._marks[k][0]

    def trace_so_far(self) -> Trace:
        """The device trace up to now, recording going on (the simulated CUDA device's memory-stat and
        snapshot answers replay it). Raises ``RuntimeError`` for any other recorder."""
        if self.row_source is None or self._ext is None:
            raise RuntimeError("trace_so_far: only a recorder on the simulated CUDA device can be read while running")
        return self.trace_from_rows(self._ext.rows(), None)

    def _foreign_frees(self, rows: list) -> tuple[int, int, list]:
        """Frees run by other threads (gloo's, DeepSpeed's): count, bytes, and the five largest with
        their phase. Their timing is the run-to-run nondeterminism of a CPU trace."""
        phase, out = "startup", []
        for _t, ptr, size, kind, main in rows:
            if kind == 2:
                mkind, payload = self._marks[ptr]
                if mkind == PHASE:
                    phase = str(payload)
            elif kind == 1 and not main:
                out.append((size, phase))
        out.sort(reverse=True)
        return len(out), sum(s for s, _ in out), [{"bytes": s, "phase": p} for s, p in out[:5]]

    def cpu_events(self, items: list[tuple[int, int, int, int, int]]) -> list[Event]:
        """Turn sorted profiler items into device events, applying the placement annotations."""
        out: list[Event | None] = []
        live: dict[int, int] = {}  # ptr -> index of its ALLOC in out
        host: set[int] = set()  # ptrs whose next free is a host free
        for t_ns, _seq, kind, a, b in items:
            t_us = t_ns // 1000
            if kind == 0:
                ptr, size = a, b
                if size > 0:
                    live[ptr] = len(out)
                    out.append(Event(ALLOC, ptr, size, 0, t_us))
                elif ptr in host:
                    host.discard(ptr)
                else:
                    live.pop(ptr, None)
                    out.append(Event(FREE, ptr, -size, 0, t_us))
                continue
            if kind == 2:  # the simulated device's record_stream: the block's FREE comes at a later sync
                out.append(Event(FREE_REQUESTED, a, b, 0, t_us))
                continue
            mkind, payload = self._marks[a]
            if mkind in (PHASE, PHASE_END, FLUSH):
                out.append(Event(mkind, 0, 0, 0, t_us, str(payload)))
            elif mkind in (POOL_ENTER, POOL_EXIT):
                out.append(Event(mkind, payload[0], payload[1], 0, t_us))  # type: ignore[index]
            elif mkind == "host_resident":
                for ptr, _n in payload:  # type: ignore[union-attr]
                    i = live.pop(ptr, None)
                    if i is not None:
                        out[i] = None
                    host.add(ptr)
            elif mkind == "to_host":
                for ptr, _n in payload:  # type: ignore[union-attr]
                    i = live.pop(ptr, None)
                    if i is not None:
                        out.append(Event(FREE, ptr, out[i].size, 0, t_us))  # type: ignore[union-attr]
                        host.add(ptr)
            elif mkind == "to_device":
                for ptr, n in payload:  # type: ignore[union-attr]
                    if ptr in host:
                        host.discard(ptr)
                        live[ptr] = len(out)
                        out.append(Event(ALLOC, ptr, n, 0, t_us))
        return [e for e in out if e is not None]

    # -- CUDA -------------------------------------------------------------------------------------
    def _stop_cuda(self) -> Trace:
        import torch

        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        return cuda_trace_with_marks(snap, self._phase_marks_us, device=torch.cuda.current_device())


def cuda_trace_with_marks(snap: dict, marks: list[tuple[str, int, str]], device: int = 0) -> Trace:
    """A recorded CUDA snapshot's trace with phase/flush marks merged in by ``time_us``.

    The memory history timestamps and ``marks`` are both wall-clock microseconds. Pure data handling:
    tested on recorded snapshots, no GPU needed.
    """
    trace = trace_from_snapshot(snap, device=device, source="torch.cuda.memory._snapshot")
    merged: list[Event] = []
    ms = sorted(marks, key=lambda m: m[1])
    j = 0
    for e in trace.events:
        while j < len(ms) and ms[j][1] <= e.time_us:
            merged.append(Event(ms[j][0], 0, 0, 0, ms[j][1], ms[j][2]))
            j += 1
        merged.append(e)
    merged.extend(Event(k, 0, 0, 0, t, n) for k, t, n in ms[j:])
    trace.events = merged
    trace.capture = CAPTURE_CUDA
    return trace


def cuda_phase_stats(before: dict, after: dict) -> dict:
    """One phase's real figures from two ``torch.cuda.memory_stats()`` dicts (bytes and counts).

    Peaks are valid because the phase began with ``reset_peak_memory_stats()``.
    """
    def d(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    return {
        "peak_reserved": int(after.get("reserved_bytes.all.peak", 0)),
        "peak_allocated": int(after.get("allocated_bytes.all.peak", 0)),
        "inactive_split_bytes": int(after.get("inactive_split_bytes.all.current", 0)),
        "cuda_malloc_count": d("num_device_alloc") if "num_device_alloc" in after else d("segment.all.allocated"),
        "cuda_free_count": d("num_device_free") if "num_device_free" in after else d("segment.all.freed"),
        "alloc_retries": d("num_alloc_retries"),
        "ooms": d("num_ooms"),
    }
