"""Capture one rank's device allocation trace, phases and flushes included.

- CUDA: PyTorch's memory history (``torch.cuda.memory._record_memory_history``) started before the
  first model is built (:class:`CudaHistory`: its ring buffer sized by ``$RLHFMEM_HISTORY_MAX_ENTRIES``,
  no stack frames unless ``$RLHFMEM_HISTORY_CONTEXT`` asks), plus ``torch.cuda.memory_stats()`` counters
  read at every phase start and end. Peaks per phase come from the anchored replay of the whole trace,
  never from ``reset_peak_memory_stats()`` (that would reset the program's own ``max_memory_*``
  counters, and a program resetting them, as DeepSpeed's ``see_memory_usage`` does, would cut ours).
  Phase and flush marks are put on the allocator's own clock (``external_annotations``,
  :func:`cuda_trace_with_marks`). A trace whose ring buffer wrapped is refused (:class:`HistoryWrapped`),
  never replayed as if complete. Figures are the real allocator's.
- CPU: a recording wrapper around PyTorch's CPU allocator (``cpu_recorder.py``) logs every allocation
  and free (pointer, requested bytes) from every thread, from before the first model is built, with
  markers (phase starts, flushes, placement annotations) in the same ordered buffer. Where it cannot be
  built or loaded, the rank fails saying why: no other backend measures in its place (torch.profiler,
  once the fallback, sees the main thread only and gave other figures without a word). The trace is
  replayed through the allocator model: every figure derived from it is *simulated*.

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
import inspect
import os
import sys
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable, Iterator

from . import emulation
from ..memory.allocator import SEGMENT_PLACEMENT_KEY, AllocatorConfig
from ..memory.driver_va import ABOVE_LAST
from ..memory.events import CAPTURE_CUDA_REHEARSAL, CUBLAS_WORKSPACE, EXTERNAL_MAP, EXTERNAL_UNMAP
from .host import HostMemory
from ..memory.trace import (
    ALLOC, CAPTURE_CPU_SIMULATED, CAPTURE_CUDA, CAPTURE_SIM_CUDA_SIMULATED, FLUSH, FREE, FREE_REQUESTED, PHASE,
    SIMULATED_CAPTURES,
    PHASE_END, POOL_ENTER, POOL_EXIT, Event, Trace, trace_from_snapshot,
)

# CUDA: the record_function names of the phase/flush marks (``<prefix><index into Recorder._phase_marks_us>``)
# and of the bounds of the program's own history windows (CudaHistory), in the snapshot's external_annotations
CUDA_MARK = "rlhfmem::cuda_mark::"
USER_HISTORY_MARK = "rlhfmem::user_history::"
ENV_HISTORY_MAX_ENTRIES = "RLHFMEM_HISTORY_MAX_ENTRIES"  # the memory history's ring buffer, in entries
ENV_HISTORY_CONTEXT = "RLHFMEM_HISTORY_CONTEXT"  # stack frames recorded: none (default) | state | alloc | all
# About three entries per allocation (alloc, free_requested, free_completed) plus the segment events: the
# study's scale (1.65 M allocations per rank) needs about 5 M. PyTorch's ring buffer grows as it fills, so an
# unused capacity costs nothing; a full one holds each entry in the allocator (C++) and, at ``_snapshot()``,
# as a Python dict of about 0.4 KiB without frames (about 3.2 GiB of host memory for 8 M entries).
DEFAULT_HISTORY_MAX_ENTRIES = 8_000_000
HISTORY_CONTEXTS = ("none", "state", "alloc", "all")  # torch.cuda.memory._record_memory_history's context
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
    # CUDA: the memory history's ring buffer (entries) and stack context; None: history_settings() (environment)
    max_entries: int | None = None
    history_context: str | None = None
    history: CudaHistory | None = None  # CUDA: our memory history and the program's calls served from it
    phases: list[PhaseRecord] = field(default_factory=list)
    host_bytes_annotated: int = 0
    frees_on_other_threads: tuple = (0, 0, [])  # (count, bytes, largest): frees done by other threads
    _marks: list[tuple[str, object]] = field(default_factory=list)
    _ext: object = None
    backend: str = ""
    _phase_marks_us: list[tuple[str, int, str]] = field(default_factory=list)  # CUDA: (kind, wall time_us, name)
    mark_clock: str = ""  # CUDA: the clock the marks were merged by (mark_times)
    # CPU only: the CUDA emulation (record/emulation.py) applied to the capture; None = off.
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
    # "cuda-sim": the simulated CUDA device's log (simcuda/library.py: SimCudaRows), read as recorder rows
    row_source: object = None
    flush_times: list[tuple[str, float]] = field(default_factory=list)  # CUDA: (point, seconds) per empty_cache
    _so_far: SoFar | None = None  # CPU, cuda-sim: the figures so far, advanced at each progress file
    # iterations (iterations.py): the one running (0 before the first :meth:`iteration` mark: the setup), and the
    # iteration of each PHASE mark made, in order: the trace's windows are those marks, one each
    iteration_no: int = 0
    window_iterations: list[int] = field(default_factory=list)
    recorder_bytes: dict[int, int] = field(default_factory=dict)  # per iteration: own_bytes() at its end
    _op_marks: dict = field(default_factory=dict)  # each distinct (kind, payload) of the op marks, once

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.device == "off":  # a bare iteration: phases timed, nothing recorded (capture overhead)
            self.backend = "none"
            return
        if self.device == "cuda":
            self._start_cuda()
        elif self.row_source is not None:  # the simulated CUDA device: CUDA's code paths, no emulation
            self._ext = self.row_source
            self.backend = getattr(self.row_source, "backend", "row source")
            self.cuda_emulation = None
            self._ext.start()
        else:  # RuntimeError (one line) where the recorder cannot be built, loaded or installed
            from .cpu_recorder import load_recorder

            ext = load_recorder()
            if not ext.install():
                raise RuntimeError("the CPU allocation recorder cannot wrap the current CPU allocator (another "
                                   "wrapper installed first?): nothing would measure this rank's allocations")
            self._ext = ext
            self.backend = "rlhfmem CPU allocator recorder (all threads)"
            ext.start()
            if self.cuda_emulation is not None:
                self._op_mode = emulation.marker_mode(self._mark)
                self._op_mode.__enter__()
        if self.root is not None:
            self._mark(PHASE, self.root)
            if self.on_phase is not None:  # the root window is where the rank is now (its progress file says so)
                self.on_phase(self.root)

    def stop(self) -> Trace:
        """Stop recording and return the device trace (phases, flushes, placement applied). Raises
        :class:`HistoryWrapped` on CUDA when the memory history lost its first entries."""
        self.restore_empty_cache()
        if self.iteration_no:  # the last iteration ends here
            self.recorder_bytes[self.iteration_no] = self.own_bytes()
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
                if kind == PHASE:
                    self.window_iterations.append(self.iteration_no)
                self._mark_cuda(kind, str(payload))
            return
        if kind == PHASE:
            self.window_iterations.append(self.iteration_no)
        k = len(self._marks)
        if kind in (emulation.OP_BEGIN, emulation.OP_END):  # one per op: shared, so a mark costs its list slot
            mark = (kind, payload)
            self._marks.append(self._op_marks.setdefault(mark, mark))
        else:
            self._marks.append((kind, payload))
        if self._ext is not None:
            self._ext.mark(k)

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
        ``memory_stats()`` counters (:func:`cuda_phase_counters`; a top-level phase with no phase nested in it,
        otherwise the trace's figures). Peaks are the trace's (the replay's), on every device."""
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
            before = _cuda_memory_stats()  # counters only: the program's peak counters are left alone
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
                rec.cuda_stats = cuda_phase_counters(before, _cuda_memory_stats())
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

    def iteration(self) -> int:
        """Iteration ``k`` (1, 2, ...) of the training loop begins here; returns ``k``. What was recorded before the
        first mark is the setup (iteration 0). The window the program is in (the innermost open phase, else the root
        window) starts again here, so each window belongs to one iteration (``window_iterations``), and the host
        meter closes its iteration's peaks. Marks nothing in a capture that records nothing (``device`` off)."""
        if self.iteration_no:
            self.recorder_bytes[self.iteration_no] = self.own_bytes()
        self.iteration_no += 1
        if self.host is not None:
            self.host.begin_iteration(self.iteration_no)
        resume = self._stack[-1].name if self._stack else self.root
        if resume is not None:
            self._mark(PHASE, resume)
        return self.iteration_no

    def own_bytes(self) -> int:
        """Host memory (bytes) the recording itself holds now, which the program's host figures must not be charged
        with: the CPU allocation recorder's entries and live-pointer map (its ``own_bytes``) and the marks' list
        slots (8 bytes each; op marks are shared tuples). 0 for the other recorders (the simulated CUDA device's log
        and a GPU's memory history grow too, uncounted: docs/budgets.md, "Growth across iterations")."""
        ext = self._ext
        if ext is None or self.row_source is not None or not hasattr(ext, "own_bytes"):
            return 0
        return int(ext.own_bytes()) + 8 * len(self._marks) + 200 * len(self._op_marks)

    def flush(self, point: str) -> None:
        """The flush policy's ``torch.cuda.empty_cache()``: real on CUDA, a FLUSH event on CPU."""
        if self.device == "cuda":
            self._flush_cuda(point)
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

    def external_map(self, map_id: int, size: int, tag: str) -> None:
        """Another allocator of this process maps ``size`` bytes of the device now, outside the caching allocator (a
        colocated rollout engine's ``wake_up``: vLLM's ``CuMemAllocator``): an ``EXTERNAL_MAP`` event (``map_id``
        unique among the live mappings, ``tag`` its name; memory/events.py). CPU and simulated-device captures
        only: on CUDA the mapping is real and outside the memory history; raises ``RuntimeError`` there."""
        self._mark_external(EXTERNAL_MAP, map_id, size, tag)

    def external_unmap(self, map_id: int, size: int, tag: str) -> None:
        """The other allocator releases mapping ``map_id`` (``sleep``): an ``EXTERNAL_UNMAP`` event; as
        :meth:`external_map`."""
        self._mark_external(EXTERNAL_UNMAP, map_id, size, tag)

    def _mark_external(self, kind: str, map_id: int, size: int, tag: str) -> None:
        if self.device == "cuda":
            raise RuntimeError(f"{kind} {tag}: device memory outside the caching allocator is recorded on the CPU and "
                               "simulated devices only (on CUDA the real engine's mappings are not in the history)")
        self._mark(kind, (map_id, size, tag))

    @contextlib.contextmanager
    def engine_region(self) -> Iterator[None]:
        """Work a colocated rollout engine does in this process (its ``generate``, run here by a stand-in): device
        allocations made inside and freed inside are the engine's, not the trainer's, and leave the trace (its KV
        cache and weights are :meth:`external_map` mappings); those that outlive the region (the rollout handed to
        the trainer) stay. CPU and simulated-device captures."""
        self._mark("engine_enter", None)
        try:
            yield
        finally:
            self._mark("engine_exit", None)

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
        if self._op_mode is not None:
            self._op_mode.__exit__(None, None, None)
            self._op_mode = None
        rows = self._ext.stop().tolist()
        self._ext = None
        if self.keep_raw_rows:
            self.raw_rows = rows
        return self.trace_from_rows(rows, self.cuda_emulation)

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
        """Turn sorted recorder items into device events, applying the placement annotations."""
        stream = EventStream(self._marks)
        stream.feed(items)
        return [e for e in stream.out if e is not None]

    def figures_so_far(self) -> dict | None:
        """CPU and ``cuda-sim`` recording: the simulated device figures of the trace recorded up to now (bytes;
        :class:`SoFar`), advanced from the previous call by the rows since; ``None`` where nothing can be read
        while recording (CUDA, capture off) or before :meth:`start`."""
        if self.device not in ("cpu", "cuda-sim") or self._ext is None:
            return None
        if self._so_far is None:
            from ..memory.allocator import AllocatorConfig

            settings = None
            placement = getattr(self.row_source, "segment_placement", None)
            if placement is not None and placement.kind != ABOVE_LAST:
                settings = {SEGMENT_PLACEMENT_KEY: placement.spec()}
            workspaces = (lambda: self.row_source.workspace_addresses()) if self.row_source is not None else None
            self._so_far = SoFar(self._marks, AllocatorConfig.from_snapshot_settings(settings),
                                 self.cuda_emulation if self.row_source is None else None, workspaces)
        so_far = self._so_far
        if self.row_source is not None:  # the simulated device: its log as rows, rebuilt (record_stream's frees)
            rows = self._ext.rows().tolist()[so_far.rows_fed:]
        elif hasattr(self._ext, "rows_from"):
            from array import array

            flat = array("q", self._ext.rows_from(so_far.rows_fed))
            rows = list(zip(*[iter(flat)] * 5))
        else:  # a recorder built before rows_from existed
            return None
        so_far.feed(rows)
        return so_far.figures()

    # -- CUDA -------------------------------------------------------------------------------------
    def _start_cuda(self) -> None:
        """The memory history on the rank's device, before the first model is built (:class:`CudaHistory`)."""
        import torch
        from torch.autograd.profiler import record_function

        self.max_entries, self.history_context = history_settings(self.max_entries, self.history_context)
        self.history = CudaHistory(torch.cuda.memory, self.max_entries, self.history_context, record_function,
                                   device=torch.cuda.current_device())
        self.history.start()
        self.backend = "torch.cuda.memory._record_memory_history"

    def _mark_cuda(self, kind: str, name: str) -> None:
        """A phase or flush mark: its wall-clock time, and the same mark on the allocator's clock (an annotation)."""
        k = len(self._phase_marks_us)
        self._phase_marks_us.append((kind, time.time_ns() // 1000, name))
        if self.history is not None:
            self.history.mark(f"{CUDA_MARK}{k}")

    def _flush_cuda(self, point: str) -> None:
        """The policy's ``empty_cache()``, the original one (the program's are intercepted: one FLUSH mark per
        flush), between two synchronizations; its seconds are measured (the cudaFree calls' cost)."""
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        (self._empty_cache or torch.cuda.empty_cache)()
        torch.cuda.synchronize()
        self.flush_times.append((point, time.perf_counter() - t0))

    def intercept_history(self) -> None:
        """CUDA: serve the program's own ``torch.cuda.memory._record_memory_history``/``_snapshot`` calls from
        our recording (:class:`CudaHistory`), so they can neither stop nor resize it; ``stop()`` restores them."""
        if self.history is not None:
            self.history.intercept()

    def _stop_cuda(self) -> Trace:
        """The snapshot's trace with the marks merged. Raises :class:`HistoryWrapped` (recording stopped) when
        the history lost entries (:func:`history_lost`)."""
        import torch

        device = self.history.device if self.history.device is not None else torch.cuda.current_device()
        snap, allocs_made = self.history.stop()
        lost = history_lost(snap, device, self.history.max_entries, allocs_made)
        if lost:
            stats = torch.cuda.memory_stats(device)
            entries = len((snap.get("device_traces") or [[]] * (device + 1))[device])
            raise HistoryWrapped(lost, entries, {"peak_reserved": int(stats.get("reserved_bytes.all.peak", 0)),
                                                 "peak_allocated": int(stats.get("allocated_bytes.all.peak", 0))})
        trace = cuda_trace_with_marks(snap, self._phase_marks_us, device=device)
        self.mark_clock = mark_times(snap, self._phase_marks_us)[1]
        return trace


class EventStream:
    """:meth:`Recorder.cpu_events` fed in pieces: sorted items ``(time_ns, seq, kind, a, b)`` (kind 0 data: pointer
    ``a``, ``+size`` alloc / ``-size`` free in ``b``; 1 a mark: ``a`` indexes ``marks``; 2 a free requested) become
    device events in ``out``, the placement annotations applied (a ``host_resident`` annotation removes its
    tensor's ALLOC from ``out``: ``None`` in its place).

    :meth:`take` hands a reader (:class:`SoFar`) the events so far and empties ``out``. A ``host_resident``
    annotation of a tensor whose ALLOC was taken cannot remove it: it becomes a FREE at the annotation's time
    (counted in ``late_host_resident``), as :meth:`Recorder.moved_to_host` would; the whole-run derivation (one
    feed, nothing taken) removes it."""

    def __init__(self, marks: list) -> None:
        self.marks = marks
        self.out: list[Event | None] = []
        self.live: dict[int, int] = {}  # ptr -> index of its ALLOC in out
        self.taken: dict[int, int] = {}  # ptr -> bytes: live ALLOCs already taken by the reader
        self.host: set[int] = set()  # ptrs whose next free is a host free
        self.late_host_resident = 0
        self.engine: set[int] | None = None  # inside Recorder.engine_region: ptrs allocated there, still live

    def take(self) -> list[Event]:
        """The events since the last take; their live ALLOCs are remembered by size only."""
        out = self.out
        for ptr, i in self.live.items():
            self.taken[ptr] = out[i].size  # type: ignore[union-attr]
        self.live, self.out = {}, []
        return [e for e in out if e is not None]

    def _pop(self, ptr: int) -> tuple[int | None, int | None]:
        """(index in out, None) of ``ptr``'s live ALLOC, (None, bytes) when taken, (None, None) when not live."""
        i = self.live.pop(ptr, None)
        return (i, None) if i is not None else (None, self.taken.pop(ptr, None))

    def feed(self, items: Iterable[tuple[int, int, int, int, int]]) -> None:
        out, live, host, marks = self.out, self.live, self.host, self.marks
        for t_ns, _seq, kind, a, b in items:
            t_us = t_ns // 1000
            if kind == 0:
                ptr, size = a, b
                if size > 0:
                    live[ptr] = len(out)
                    out.append(Event(ALLOC, ptr, size, 0, t_us))
                    if self.engine is not None:
                        self.engine.add(ptr)
                elif ptr in host:
                    host.discard(ptr)
                elif self.engine is not None and ptr in self.engine and ptr in live:
                    self.engine.discard(ptr)  # the engine's own temporary: neither its ALLOC nor its FREE stays
                    out[live.pop(ptr)] = None
                else:
                    self._pop(ptr)
                    out.append(Event(FREE, ptr, -size, 0, t_us))
                continue
            if kind == 2:  # the simulated device's record_stream: the block's FREE comes at a later sync
                out.append(Event(FREE_REQUESTED, a, b, 0, t_us))
                continue
            mkind, payload = marks[a]
            if mkind in (PHASE, PHASE_END, FLUSH):
                out.append(Event(mkind, 0, 0, 0, t_us, str(payload)))
            elif mkind in (POOL_ENTER, POOL_EXIT):
                out.append(Event(mkind, payload[0], payload[1], 0, t_us))  # type: ignore[index]
            elif mkind in (EXTERNAL_MAP, EXTERNAL_UNMAP):
                out.append(Event(mkind, payload[0], payload[1], 0, t_us, payload[2]))  # type: ignore[index]
            elif mkind == "engine_enter":
                self.engine = set()
            elif mkind == "engine_exit":
                self.engine = None
            elif mkind == "host_resident":
                for ptr, _n in payload:  # type: ignore[union-attr]
                    i, taken = self._pop(ptr)
                    if i is not None:
                        out[i] = None
                    elif taken is not None:  # already replayed by the reader: it leaves the device now
                        out.append(Event(FREE, ptr, taken, 0, t_us))
                        self.late_host_resident += 1
                    host.add(ptr)
            elif mkind == "to_host":
                for ptr, _n in payload:  # type: ignore[union-attr]
                    i, taken = self._pop(ptr)
                    if i is not None or taken is not None:
                        size = out[i].size if i is not None else taken  # type: ignore[union-attr]
                        out.append(Event(FREE, ptr, size, 0, t_us))
                        host.add(ptr)
            elif mkind == "to_device":
                for ptr, n in payload:  # type: ignore[union-attr]
                    if ptr in host:
                        host.discard(ptr)
                        live[ptr] = len(out)
                        out.append(Event(ALLOC, ptr, n, 0, t_us))


class SoFar:
    """The simulated device figures of a CPU or ``cuda-sim`` capture up to now, while it runs: what the progress
    files carry, so that a rank killed later (SIGKILL, the OOM killer) leaves its device figures so far.

    Each :meth:`feed` takes only the recorder rows since the previous one and advances three stages kept alive
    between calls: the CUDA emulation (:class:`~.emulation.Emulator`: rows whose fate a later row could change
    wait for the next call), the placement annotations (:class:`EventStream`) and one
    :class:`~.allocator.CachingAllocatorModel` (``c10/cuda/CUDACachingAllocator.cpp``'s ``DeviceCachingAllocator``;
    free-running, unlimited capacity, as :func:`~.replay.replay` replays a CPU trace at the end, with the calls
    ``python_engine.replay_python`` makes per event). A call costs its new rows, never the whole trace.
    :meth:`figures`: ``peak_reserved`` and ``peak_allocated`` (bytes, simulated) of the rows fed and settled, equal
    to the end replay's peaks over the same rows, but where a ``host_resident`` annotation names a tensor
    allocated before an earlier call (:class:`EventStream`: freed at the annotation instead of never counted)."""

    def __init__(self, marks: list, config: AllocatorConfig, cuda_emulation: emulation.EmulationSettings | None,
                 workspaces: Callable[[], frozenset[int]] | None = None) -> None:
        from ..memory.allocator import CachingAllocatorModel

        self.emulator = emulation.Emulator(marks, cuda_emulation) if cuda_emulation is not None else None
        self.stream = EventStream(marks)
        self.model = CachingAllocatorModel(config, capacity=None)
        self.workspaces = workspaces  # cuda-sim: the device's cuBLAS workspace addresses (named, as in the trace)
        self.rows_fed = 0
        self._live: dict[int, object] = {}  # recorded address -> model block
        self._seq = 0

    def feed(self, rows: list) -> None:
        """Advance by the recorder ``rows`` since the last call (``(time_ns, ptr, size, kind, on_main)``)."""
        self.rows_fed += len(rows)
        if self.emulator is not None:
            self.emulator.feed(rows)
            rows = self.emulator.take(self.emulator.settled())
            names = frozenset(self.emulator.report.workspace_ptrs)
        else:
            names = self.workspaces() if self.workspaces is not None else frozenset()
        seq = self._seq
        items = [(t, seq + k, ITEM_KIND[kind], ptr, -size if kind == 1 else size)
                 for k, (t, ptr, size, kind, _main) in enumerate(rows)]
        self._seq += len(items)
        self.stream.feed(items)
        self._replay(self.stream.take(), names)

    def _replay(self, events: list[Event], workspaces: frozenset[int]) -> None:
        from ..memory.allocator import OutOfMemoryError

        model, live = self.model, self._live
        for ev in events:
            action = ev.action
            if action == ALLOC:
                if ev.addr in workspaces:  # the trace names it CUBLAS_WORKSPACE (_name_workspaces)
                    model.cublas_handle_created()
                try:
                    live[ev.addr] = model.malloc(ev.size, ev.stream)
                except OutOfMemoryError:
                    pass
            elif action == FREE:
                block = live.pop(ev.addr, None)
                if block is not None:
                    model.free(block)
            elif action == FREE_REQUESTED:
                block = live.get(ev.addr)
                if block is not None:
                    model.request_free(block)
            elif action == FLUSH:
                model.release_cached_blocks()
            elif action == POOL_ENTER:
                pool_id = (ev.addr, ev.size)
                if pool_id not in model.graph_pools:
                    model.create_or_incref_pool(pool_id)
                model.begin_allocate_to_pool(pool_id)
            elif action == POOL_EXIT:
                pool_id = (ev.addr, ev.size)
                model.end_allocate_to_pool(pool_id)
                model.release_pool(pool_id)

    def figures(self) -> dict:
        """``peak_reserved``, ``peak_allocated`` and ``allocated`` (now) so far (bytes, simulated) and ``rows``: the
        recorder rows they cover (rows the emulation holds back count with the next call)."""
        st = self.model.stats
        held = len(self.emulator.rows) if self.emulator is not None else 0
        return {"peak_reserved": st.peak_reserved_bytes, "peak_allocated": st.peak_allocated_bytes,
                "allocated": st.allocated_bytes, "rows": self.rows_fed - held}


def cuda_trace_with_marks(snap: dict, marks: list[tuple[str, int, str]], device: int = 0) -> Trace:
    """A recorded CUDA snapshot's trace with phase/flush marks merged in by time.

    ``marks``: ``(kind, wall-clock time_us, name)`` in the order made. Each mark's time is its time on the
    allocator's own clock where the snapshot's ``external_annotations`` carry it, else the wall clock
    (:func:`mark_times` says how; ``Trace.source`` names the clock used). A mark goes after every trace
    entry stamped earlier and before every entry stamped at its microsecond or later. Pure data handling:
    tested on recorded and synthetic snapshots, no GPU needed. Raises ``SnapshotError`` as
    :func:`~.trace.trace_from_snapshot`.

    The capture is ``cuda-memory-history`` (measured), or ``cuda-rehearsal-simulated`` where the snapshot names a
    simulated device as its maker (``allocator_settings["rlhfmem_capture"]``: the rehearsal device's,
    ``simcuda/history.py``): the device decides the label, the code is the same.
    """
    times, clock = mark_times(snap, marks)
    trace = trace_from_snapshot(snap, device=device, source=f"torch.cuda.memory._snapshot (phase marks: {clock})")
    merged: list[Event] = []
    ms = [(m[0], t, m[2]) for m, t in zip(marks, times)]
    j = 0
    for e in trace.events:
        while j < len(ms) and ms[j][1] <= e.time_us:
            merged.append(Event(ms[j][0], 0, 0, 0, ms[j][1], ms[j][2]))
            j += 1
        merged.append(e)
    merged.extend(Event(k, 0, 0, 0, t, n) for k, t, n in ms[j:])
    trace.events = merged
    maker = (snap.get("allocator_settings") or {}).get("rlhfmem_capture")
    trace.capture = CAPTURE_CUDA_REHEARSAL if maker in SIMULATED_CAPTURES else CAPTURE_CUDA
    return trace


def _cuda_memory_stats() -> dict:
    """``torch.cuda.memory_stats()`` once the device's work so far is done (a phase's start or end)."""
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_stats()


def cuda_phase_counters(before: dict, after: dict) -> dict:
    """One phase's allocator counters from two ``torch.cuda.memory_stats()`` dicts: cudaMalloc/cudaFree
    calls, allocation retries and OOMs during the phase (counts). No peaks: the recorder never calls
    ``reset_peak_memory_stats()`` (the program's own ``max_memory_*`` counters), so a phase's peaks come
    from the replay of the whole trace. A counter that went down (the program called
    ``reset_accumulated_memory_stats()`` inside the phase) is left out: the replay's count stands."""
    out = {}
    for key, names in (("cuda_malloc_count", ("num_device_alloc", "segment.all.allocated")),
                       ("cuda_free_count", ("num_device_free", "segment.all.freed")),
                       ("alloc_retries", ("num_alloc_retries",)), ("ooms", ("num_ooms",))):
        name = next((n for n in names if n in after), None)
        if name is None:
            continue
        delta = int(after.get(name, 0)) - int(before.get(name, 0))
        if delta >= 0:
            out[key] = delta
    return out


class HistoryWrapped(RuntimeError):
    """The CUDA memory history's ring buffer lost its first entries: the trace is partial. The message is
    one line naming the cause and the fix; ``stats``: what ``memory_stats()`` said at the end (bytes)."""

    def __init__(self, message: str, entries: int = 0, stats: dict | None = None) -> None:
        super().__init__(message)
        self.entries = entries
        self.stats = stats or {}


def history_settings(max_entries: int | None = None, context: str | None = None,
                     env: dict | None = None) -> tuple[int, str | None]:
    """The memory history's ``(max_entries, context)``: the given values, else ``$RLHFMEM_HISTORY_MAX_ENTRIES``
    (a positive integer; default :data:`DEFAULT_HISTORY_MAX_ENTRIES`) and ``$RLHFMEM_HISTORY_CONTEXT``
    (one of :data:`HISTORY_CONTEXTS`, default ``none``: no stack frames, which nothing here reads; ``state``,
    ``alloc`` or ``all`` as ``torch.cuda.memory._record_memory_history``'s ``context``, with Python frames).
    ``context`` comes back as ``None`` for ``none``. Raises ``ValueError`` (one line naming the variable, its
    value and the allowed values) for anything else."""
    env = os.environ if env is None else env
    if max_entries is None:
        raw = env.get(ENV_HISTORY_MAX_ENTRIES, "").strip().replace("_", "")
        try:
            max_entries = int(raw) if raw else DEFAULT_HISTORY_MAX_ENTRIES
        except ValueError:
            max_entries = 0
        if max_entries <= 0:
            raise ValueError(f"${ENV_HISTORY_MAX_ENTRIES}={env.get(ENV_HISTORY_MAX_ENTRIES)!r}: allowed values: a "
                             f"positive number of memory history entries (default {DEFAULT_HISTORY_MAX_ENTRIES})")
    if context is None:
        context = env.get(ENV_HISTORY_CONTEXT, "none").strip().lower() or "none"
        if context not in HISTORY_CONTEXTS:
            raise ValueError(f"${ENV_HISTORY_CONTEXT}={env.get(ENV_HISTORY_CONTEXT)!r}: allowed values: "
                             f"{', '.join(HISTORY_CONTEXTS)}")
    return max_entries, (None if context == "none" else context)


def history_lost(snap: dict, device: int, max_entries: int, allocs_made: int | None = None) -> str | None:
    """Why the memory history of ``device`` in ``snap`` (a ``torch.cuda.memory._snapshot()`` dict) is partial,
    as one line with the fix, or ``None`` when it is whole.

    PyTorch keeps the history in a ring buffer (``RingBuffer::insertEntries`` in
    ``c10/cuda/CUDACachingAllocator.cpp``): once it holds ``max_entries`` entries each new one overwrites the
    oldest, and ``getEntries`` returns the survivors in order, so nothing in the file says that entries were
    lost. Two signs that they were: the trace holds ``max_entries`` entries (full: the first may be gone), or
    it holds fewer ``alloc`` entries than the allocator made allocations since recording began
    (``allocs_made``: the growth of ``memory_stats()["allocation.all.allocated"]``; ``None``: not known)."""
    traces = snap.get("device_traces") or []
    entries = traces[device] if 0 <= device < len(traces) else []
    n = len(entries)
    fix = (f"rerun with ${ENV_HISTORY_MAX_ENTRIES}={2 * max(max_entries, n):_} (about 0.4 KiB of host memory per "
           "entry at the snapshot)")
    if n >= max_entries:
        return (f"CUDA memory history of device {device} filled its ring buffer of {max_entries:_} entries, so its "
                f"first entries (the start of the run) were overwritten and the trace is partial: {fix}")
    if allocs_made is not None:
        allocs = sum(1 for e in entries if e.get("action") == "alloc")
        if allocs < allocs_made:
            return (f"CUDA memory history of device {device} holds {allocs:_} allocations of the {allocs_made:_} the "
                    f"allocator made while recording (entries lost: the history was cleared, resized or wrapped), "
                    f"so the trace is partial: {fix}")
    return None


def mark_times(snap: dict, marks: list[tuple[str, int, str]]) -> tuple[list[int], str]:
    """Each mark's time (microseconds) on the allocator's own clock, and which clock that was.

    ``marks``: ``(kind, wall-clock time_us, name)`` in the order they were made; mark ``k`` was also recorded
    as ``torch.autograd.profiler.record_function("rlhfmem::cuda_mark::<k>")``, which memory history turns into
    START/END entries of the snapshot's ``external_annotations`` (``_initRecordAnnotations`` in
    ``torch/csrc/cuda/memory_snapshot.cpp``; ``recordAnnotation`` stamps them with ``getApproximateTime()``,
    the clock of the trace entries, and ``snapshot()`` converts both with one ``tsc_to_us``; torch >= 2.6).
    Where every mark has its START annotation, those times; where none has (an older torch, or annotations
    off), the wall clock (``time.time_ns()``: a skew against the allocator's clock misplaces marks by it);
    where some have (the annotation buffer was cleared by a later ``_record_memory_history`` call, or a mark
    was made on a thread without the annotation callback), the others are their wall-clock times shifted by
    the median offset between the two clocks over the marks that have both. Times are made non-decreasing
    in mark order (the marks were made in that order)."""
    found: dict[int, int] = {}
    for a in snap.get("external_annotations") or []:
        name = str(a.get("name", ""))
        if a.get("stage") != "START" or not name.startswith(CUDA_MARK):
            continue
        try:
            k = int(name[len(CUDA_MARK):])
        except ValueError:
            continue
        if 0 <= k < len(marks) and k not in found:
            found[k] = int(a.get("time_us") or 0)
    if not found:
        times = [m[1] for m in marks]
        clock = "wall clock (no external_annotations of the marks in the snapshot)" if marks else "no marks"
    elif len(found) == len(marks):
        times = [found[k] for k in range(len(marks))]
        clock = "allocator clock (external_annotations)"
    else:
        offsets = sorted(found[k] - marks[k][1] for k in found)
        off = offsets[len(offsets) // 2]
        times = [found.get(k, marks[k][1] + off) for k in range(len(marks))]
        clock = (f"allocator clock (external_annotations; {len(marks) - len(found)} of {len(marks)} marks from the "
                 f"wall clock shifted by {off} us)")
    for k in range(1, len(times)):
        times[k] = max(times[k], times[k - 1])
    return times, clock


_CONTEXT_RANK = {None: 0, "state": 1, "alloc": 2, "all": 3}


def _bound(fn: Callable | None, args: tuple, kwargs: dict) -> dict:
    """``fn``'s arguments as its signature binds them (defaults applied); only the keywords where it has no
    signature to read (a torch without the function, a builtin). Raises ``TypeError`` where it would."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return dict(kwargs)
    b = sig.bind(*args, **kwargs)
    b.apply_defaults()
    return dict(b.arguments)


class CudaHistory:
    """The rank's memory history on the real CUDA allocator, and the program's own history calls served
    from it.

    ``memory`` is ``torch.cuda.memory`` (a stand-in in unit tests); ``record_function`` is
    ``torch.autograd.profiler.record_function``. :meth:`start` calls ``_record_memory_history(enabled="all",
    context=..., stacks="python", max_entries=...)``. PyTorch has one history per process: a program's own
    ``_record_memory_history(enabled=None)`` would stop ours and its ``max_entries`` would resize our ring
    buffer (``recordHistory`` in ``CUDACachingAllocator.cpp``). :meth:`intercept` replaces
    ``torch.cuda.memory._record_memory_history`` and ``_snapshot`` (``_dump_snapshot`` and
    ``_memory_viz`` call ``_snapshot``) while the capture runs:

    - the program's call never stops or shrinks our recording. It opens or closes the program's window
      (a ``record_function`` mark on the allocator's clock); a request for more stack context than is
      recorded (``context``/``stacks``) or for a larger finite buffer is passed on, raised, never lowered.
      PyTorch then clears its annotation buffer: marks made before keep their wall-clock time, shifted
      (:func:`mark_times`);
    - the program's ``_snapshot()`` is the real one (segments as they are) with each device trace cut to the
      program's windows (entries between its enable and disable, since its last ``clear_history``; none
      before it first enabled) and to its last ``max_entries`` (one for ``enabled="state"``, as PyTorch keeps),
      and without our annotations. A window bound without its annotation (torch < 2.6, or cleared) is the
      recording's start (or end).
    """

    def __init__(self, memory: object, max_entries: int, context: str | None,
                 record_function: Callable | None = None, device: int | None = None) -> None:
        self.memory = memory
        self.device = device  # the rank's CUDA device (None: the current one)
        self.max_entries = max_entries
        self.context = context
        self.stacks = "python"
        self.record_function = record_function
        self.allocs_at_start: int | None = None
        self._real: dict[str, Callable] = {}  # the originals while intercepted
        self.windows: list[list] = []  # the program's windows: [start mark, stop mark or None]
        self.user_max_entries: int | None = None
        self.user_calls = 0
        self.forwarded = 0  # the program's calls passed on to PyTorch (each clears its annotation buffer)

    # -- ours ---------------------------------------------------------------------------------------
    def _original(self, name: str) -> Callable:
        return self._real.get(name) or getattr(self.memory, name)

    def _record(self, **kw: object) -> None:
        record = self._original("_record_memory_history")
        try:
            params = inspect.signature(record).parameters
        except (TypeError, ValueError):
            params = {}
        if params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kw = {k: v for k, v in kw.items() if k in params}
        record(**kw)

    def _allocations(self) -> int | None:
        try:
            return int(self.memory.memory_stats(self.device).get("allocation.all.allocated", 0))
        except Exception:  # noqa: BLE001 - a figure for the wrap check only
            return None

    def start(self) -> None:
        self._record(enabled="all", context=self.context, stacks=self.stacks, max_entries=self.max_entries)
        self.allocs_at_start = self._allocations()

    def mark(self, name: str) -> None:
        """A START/END annotation named ``name`` on the allocator's clock (nothing where it cannot)."""
        if self.record_function is None:
            return
        try:
            with self.record_function(name):
                pass
        except Exception:  # noqa: BLE001 - the wall-clock time of the mark stands
            pass

    def stop(self) -> tuple[dict, int | None]:
        """The real snapshot and the allocations made since :meth:`start`; recording stopped, the program's
        functions restored."""
        self.restore()
        allocs = self._allocations()
        try:
            snap = self._original("_snapshot")()
        finally:
            self._record(enabled=None)
        made = allocs - self.allocs_at_start if allocs is not None and self.allocs_at_start is not None else None
        return snap, made

    # -- the program's --------------------------------------------------------------------------------
    def intercept(self) -> None:
        if self._real:
            return
        for name, fn in (("_record_memory_history", self.user_record), ("_snapshot", self.user_snapshot)):
            self._real[name] = getattr(self.memory, name)
            setattr(self.memory, name, fn)

    def restore(self) -> None:
        for name, fn in self._real.items():
            setattr(self.memory, name, fn)
        self._real = {}

    def _bind(self, enabled: object, args: tuple, kwargs: dict) -> tuple[bool, str | None, str, int, bool]:
        """The program's call as (on, context, stacks, max_entries, clear_history), legacy form included. Raises
        ``TypeError`` for arguments the program's torch would refuse (its own function's signature)."""
        if isinstance(enabled, bool):  # _record_memory_history_legacy's arguments
            a = _bound(getattr(self.memory, "_record_memory_history_legacy", None), (enabled, *args), kwargs)
            context = ("alloc" if a.get("trace_alloc_record_context") else "state" if a.get("record_context", True)
                       else None)
            stacks = "all" if a.get("record_context_cpp") else "python"
            n = int(a.get("trace_alloc_max_entries", 1) or 1)
            return enabled, context, stacks, n, bool(a.get("clear_history", False))
        a = {"enabled": enabled} | _bound(self._real.get("_record_memory_history"), (enabled, *args), kwargs)
        on = a.get("enabled") not in (None, False)
        n = int(a.get("max_entries", sys.maxsize)) if a.get("enabled") == "all" else 1
        return on, a.get("context", "all"), a.get("stacks", "all"), n, bool(a.get("clear_history", False))

    def user_record(self, enabled: object = "all", *args: object, **kwargs: object) -> None:
        """The program's ``torch.cuda.memory._record_memory_history(...)``."""
        on, context, stacks, n, clear = self._bind(enabled, args, kwargs)
        self.user_calls += 1
        if clear:
            self.windows = []
        if not on:
            if self.windows and self.windows[-1][1] is None:
                self.windows[-1][1] = f"{USER_HISTORY_MARK}{self.user_calls}"
                self.mark(self.windows[-1][1])
            return
        grow = n if n != sys.maxsize and n > self.max_entries else self.max_entries
        more_context = _CONTEXT_RANK.get(context, 3) > _CONTEXT_RANK.get(self.context, 0)
        more_stacks = context is not None and stacks == "all" and self.stacks != "all"
        if more_context or more_stacks or grow != self.max_entries:
            self.context = context if more_context else self.context
            self.stacks = "all" if more_stacks else self.stacks
            self.max_entries = grow
            self._record(enabled="all", context=self.context, stacks=self.stacks, max_entries=self.max_entries)
            self.forwarded += 1
        self.user_max_entries = n if n != sys.maxsize else None
        if not self.windows or self.windows[-1][1] is not None:
            self.windows.append([f"{USER_HISTORY_MARK}{self.user_calls}", None])
            self.mark(self.windows[-1][0])

    def user_snapshot(self, *args: object, **kwargs: object) -> dict:
        """The program's ``torch.cuda.memory._snapshot(...)``: the real one, cut to the program's windows."""
        snap = self._original("_snapshot")(*args, **kwargs)
        annotations = snap.get("external_annotations") or []
        at = {a.get("name"): int(a.get("time_us") or 0) for a in annotations
              if a.get("stage") == "START" and str(a.get("name", "")).startswith(USER_HISTORY_MARK)}
        # a bound without its annotation (torch < 2.6, or cleared with the annotation buffer): the recording's
        # start, or its end
        spans = [(at.get(start, -1), at.get(stop, sys.maxsize) if stop is not None else sys.maxsize)
                 for start, stop in self.windows]
        keep = self.user_max_entries
        traces = []
        for entries in snap.get("device_traces") or []:
            inside = [e for e in entries if any(lo <= int(e.get("time_us") or 0) <= hi for lo, hi in spans)]
            if keep is not None:
                inside = inside[len(inside) - keep:] if keep < len(inside) else inside
            traces.append(inside)
        snap["device_traces"] = traces
        if "external_annotations" in snap:
            snap["external_annotations"] = [a for a in annotations
                                            if not str(a.get("name", "")).startswith("rlhfmem::")]
        return snap
