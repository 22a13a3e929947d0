"""The simulated device's caching allocator, as the process's own ``torch.cuda`` sees it: its statistics and its
memory history, read from the device's allocation log alone (whatever recorder, if any, is running).

:class:`DeviceMemory` feeds the device's log (``simcuda/csrc/sim_cuda.cpp``: every allocation and free since the
library loaded, and each ``torch.cuda.empty_cache()``) through the allocator model
(``memory/allocator.py: CachingAllocatorModel``, PyTorch's ``DeviceCachingAllocator``) as the program runs, and
answers what ``c10/cuda/CUDACachingAllocator.cpp`` answers:

- ``memory_stats()``: the model's statistics (bytes and counts) at the moment of the call;
- the memory history, as PyTorch 2.6-2.13 keep it (``NativeCachingAllocator::recordHistory``,
  ``DeviceCachingAllocator::recordHistory``, ``RingBuffer``, ``record_trace``): while recording, each allocator
  action (``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``/``segment_free``,
  ``segment_map``/``segment_unmap``, ``snapshot``) is one entry in a ring buffer of ``max_entries`` (``1`` for
  ``enabled="state"``) that overwrites its oldest entry when full, minus ``skip_actions``; every
  ``_record_memory_history`` call sets the buffer's size, and a call that disables recording or passes
  ``clear_history`` empties it. ``record_function`` scopes (``USER_SCOPE``) become ``external_annotations`` (START
  and END, the current device, the allocator's clock) in a second ring buffer of the same size that every
  ``_record_memory_history`` call empties (the callback is the device library's, as ``memory_snapshot.cpp``'s
  ``_initRecordAnnotations``). ``time_us`` is microseconds since the epoch, as a real snapshot's;
- ``_snapshot()``: segments (the model's, in ``torch.cuda.memory._snapshot()`` form), ``device_traces`` (the
  ring buffer in order, at the current device's index), ``external_annotations`` and ``allocator_settings``, and
  like PyTorch it records a ``snapshot`` entry first when recording.

Where the simulated history differs from a GPU's (docs/fidelity.md, "The simulated device's memory history"):
addresses are the model's (a tensor's ``data_ptr()`` is the device's own address), entries carry no stack frames
(``frames`` is empty where a context was asked for), two stamps never share a microsecond (the device's clock
advances 1 us per stamp), ``compile_context`` is ``"N/A"`` and ``user_metadata`` empty.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

from ..memory.allocator import AllocatorConfig, CachingAllocatorModel
from ..memory.driver_va import ABOVE_LAST, SegmentPlacement
from ..memory.events import CAPTURE_SIM_CUDA_SIMULATED
from .library import LOG_EMPTY_CACHE, read_log, workspace_addresses

ENABLED = ("state", "all")  # _record_memory_history's enabled (None: off)
CONTEXTS = ("state", "alloc", "all")  # its context (None: no stacks)
STACKS = ("python", "all")
TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "snapshot",
                 "segment_map", "segment_unmap")  # skip_actions' allowed names (parseTraceEntryAction)
# kRoundUpPowerOfTwoIntervals keys of allocator_settings["roundup_power2_divisions"], in MiB
ROUNDUP_KEYS = tuple(str(1 << i) for i in range(16))
SNAPSHOT_NOTE = "simulated: rlhfmem's simulated CUDA device, its log replayed through the CUDA caching allocator model"


class RingBuffer:
    """``c10/cuda/CUDACachingAllocator.cpp``'s ``RingBuffer<T>`` (the memory history's trace and annotations): up
    to ``max_entries`` entries; once full, each insert overwrites the oldest (``alloc_trace_next``), and
    :meth:`entries` returns them oldest first (``getEntries``: ``rotate_copy`` at ``alloc_trace_next``). Setting a
    smaller size keeps the entries already held (PyTorch's does too); :meth:`clear` empties it."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._next = 0
        self.max_entries = 1

    def set_max_entries(self, n: int) -> None:
        self.max_entries = max(1, int(n))

    def insert(self, item: Any) -> None:
        if len(self._items) < self.max_entries:
            self._items.append(item)
            return
        if self._next >= len(self._items):  # shrunk below the position: PyTorch writes past its vector (UB)
            self._next = 0
        self._items[self._next] = item
        self._next += 1
        if self._next == self.max_entries:
            self._next = 0

    def entries(self) -> list[Any]:
        return self._items[self._next:] + self._items[:self._next]

    def clear(self) -> None:
        self._items, self._next = [], 0


def _locked(method: Callable) -> Callable:
    """Run ``method`` holding the device's ``mutex``, as every public entry of ``DeviceCachingAllocator`` holds its
    ``std::recursive_mutex mutex``: ``torch.cuda.memory_stats()`` from a second thread (a rank's progress heartbeat)
    while the main thread allocates must not feed the same log events twice (a block freed twice: ``KeyError``)."""

    @functools.wraps(method)
    def locked(self: DeviceMemory, *args: Any, **kwargs: Any) -> Any:
        with self.mutex:
            return method(self, *args, **kwargs)

    return locked


class DeviceMemory:
    """The simulated device's caching allocator and memory history (see the module docstring); one per process.
    ``lib``: the loaded device library (``library.py: library()``); ``device()``: the current CUDA device's index
    (``torch.cuda.current_device``), which annotations and the snapshot's ``device_traces`` are keyed by. Every
    public method holds ``mutex`` (a re-entrant lock, as the allocator's): any thread may call them."""

    def __init__(self, lib: ctypes.CDLL, device: Any = None) -> None:
        self.lib = lib
        self.mutex = threading.RLock()  # DeviceCachingAllocator::mutex
        self.device = device or (lambda: 0)
        self.placement = SegmentPlacement.from_env()  # as the device's log replays: the capture's placement
        self.model = CachingAllocatorModel(AllocatorConfig(segment_placement=self.placement))
        for name in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
            setattr(self.model, f"on_{name}", self._segment_observer(name))
        self.epoch_offset_us = int(lib.rlhfmem_sim_cuda_epoch_offset_us())
        self._fed = 0  # log events fed, counted from the library's load
        self._annotations_read = 0  # the library's annotations seen
        self._blocks: dict[int, Any] = {}  # device address -> the model's block
        self._now_us = 0  # the stamp of the log event being fed
        # the memory history (NativeCachingAllocator / DeviceCachingAllocator state)
        self.recording = False
        self.context: str | None = None
        self.skip: frozenset[str] = frozenset()
        self.trace = RingBuffer()
        self.annotations = RingBuffer()
        self._callback_on = False

    # -- the log, fed through the model --------------------------------------------------------------
    @_locked
    def update(self) -> Any:
        """Feed the log written since the last call; returns the model's statistics (``AllocatorStats``)."""
        events = read_log(self.lib, self._fed)
        if events:
            workspaces = workspace_addresses(self.lib) if self.model.driver is not None else frozenset()
            model, blocks = self.model, self._blocks
            for action, addr, size, stream, t in events:
                self._now_us = t
                if action == 1:
                    if addr in workspaces:
                        model.cublas_handle_created()
                    block = blocks[addr] = model.malloc(size, stream)
                    self._entry("alloc", block.address, size, stream)
                elif action == 2:
                    block = blocks.pop(addr, None)
                    if block is not None:
                        self._entry("free_requested", block.address, block.requested_size, stream)
                        self._entry("free_completed", block.address, block.requested_size, stream)
                        model.free(block)
                elif action == LOG_EMPTY_CACHE:
                    model.release_cached_blocks()
            self._fed += len(events)
        self._read_annotations()
        return self.model.stats

    def _segment_observer(self, action: str) -> Any:
        def observe(address: int, size: int, stream: int) -> None:
            self._entry(action, address, size, stream)
        return observe

    def _entry(self, action: str, addr: int, size: int, stream: int) -> None:
        """``DeviceCachingAllocator::record_trace``: one history entry while recording, unless skipped."""
        if not self.recording or action in self.skip:
            return
        entry = {"action": action, "addr": addr, "size": size, "stream": stream,
                 "time_us": self._now_us + self.epoch_offset_us, "compile_context": "N/A", "user_metadata": ""}
        if self.context is not None:  # PyTorch gathers a context; the device has no stack to give
            entry["frames"] = []
        self.trace.insert(entry)

    def _read_annotations(self) -> None:
        n = int(self.lib.rlhfmem_sim_cuda_annotation_count())
        name = ctypes.create_string_buffer(4096)
        stage, dev, t = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        for i in range(self._annotations_read, n):
            length = self.lib.rlhfmem_sim_cuda_annotation(i, name, len(name), ctypes.byref(stage), ctypes.byref(dev),
                                                          ctypes.byref(t))
            if length > len(name):
                name = ctypes.create_string_buffer(int(length))
                self.lib.rlhfmem_sim_cuda_annotation(i, name, len(name), ctypes.byref(stage), ctypes.byref(dev),
                                                     ctypes.byref(t))
            if self.recording:  # recordAnnotation: only while the history records
                self.annotations.insert({"name": name.raw[:length].decode(errors="replace"),
                                         "stage": "START" if stage.value == 0 else "END",
                                         "device": dev.value, "time_us": t.value + self.epoch_offset_us})
        self._annotations_read = n

    # -- torch.cuda.memory ------------------------------------------------------------------------------
    @_locked
    def record_history(self, enabled: str | None, context: str | None, stacks: str, max_entries: int,
                       clear_history: bool = False, compile_context: bool = False,
                       global_record_annotations: bool = False, skip_actions: list[str] | None = None) -> None:
        """``torch._C._cuda_record_memory_history``, which ``torch.cuda.memory._record_memory_history`` calls with
        its string form: checked as ``memory_snapshot.cpp`` checks it (``RuntimeError``), then
        ``NativeCachingAllocator::recordHistory``."""
        if enabled is not None and enabled not in ENABLED:
            raise RuntimeError("expected state to be 'state', 'all', or None")
        if context is not None and context not in CONTEXTS:
            raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None")
        if stacks not in STACKS:
            raise RuntimeError("expected stacks to be 'python', or 'all'")
        self._record(enabled is not None, int(max_entries) if enabled == "all" else 1, context, clear_history,
                     global_record_annotations, skip_actions)

    @_locked
    def record_history_legacy(self, enabled: bool, record_context: bool = True, trace_alloc_max_entries: int = 1,
                              trace_alloc_record_context: bool = False, record_context_cpp: bool = False,
                              clear_history: bool = False, compile_context: bool = False,
                              global_record_annotations: bool = False, skip_actions: list[str] | None = None) -> None:
        """``torch._C._cuda_record_memory_history_legacy`` (``_record_memory_history(True, ...)``)."""
        context = "alloc" if trace_alloc_record_context else ("state" if record_context else None)
        self._record(bool(enabled), int(trace_alloc_max_entries), context, clear_history, global_record_annotations,
                     skip_actions)

    def _record(self, on: bool, max_entries: int, context: str | None, clear: bool, global_annotations: bool,
                skip_actions: list[str] | None) -> None:
        for a in skip_actions or ():
            if a not in TRACE_ACTIONS:  # parseTraceEntryAction
                raise RuntimeError(f"skip_actions: unknown trace entry action {a!r}; allowed: "
                                   f"{', '.join(TRACE_ACTIONS)}")
        self.update()  # what happened before the call is recorded under the settings before it
        if on and not self._callback_on:  # setRecordFunctionCallbacks: added once, kept while enabled
            self.lib.rlhfmem_sim_cuda_set_annotations(1, 1 if global_annotations else 0)
            self._callback_on = True
        elif not on and self._callback_on:
            self.lib.rlhfmem_sim_cuda_set_annotations(0, 0)
            self._callback_on = False
        self.recording = on  # NativeCachingAllocator::recordHistory
        self.annotations.set_max_entries(max_entries)
        self.annotations.clear()
        self.skip = frozenset(skip_actions or ())  # DeviceCachingAllocator::recordHistory
        self.trace.set_max_entries(max_entries)
        self.context = context if on else None
        if not on or clear:
            self.trace.clear()

    @_locked
    def snapshot(self, pool: tuple | None = None) -> dict:
        """``torch._C._cuda_memorySnapshot(pool)``, which ``torch.cuda.memory._snapshot()`` (``None``) and
        ``memory_snapshot()`` (``(0, 0, include_traces)``) call: the allocator now, in PyTorch's dict
        (``_memory_snapshot_pickled``); a ``snapshot`` entry is recorded first, as ``DeviceCachingAllocator::snapshot``
        does while recording. ``include_traces`` False leaves ``device_traces`` empty."""
        include_traces = not (isinstance(pool, tuple) and len(pool) > 2 and not pool[2])
        st = self.update()
        if self.recording:
            self._now_us = int(self.lib.rlhfmem_sim_cuda_stamp_us())
            self._entry("snapshot", 0, st.allocated_bytes, 0)  # total_active: allocated, held blocks included
        index = int(self.device())
        traces: list[list[dict]] = [[] for _ in range(index + 1)]
        traces[index] = self.trace.entries() if include_traces else []
        settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
                    "expandable_segments": False, "pinned_num_register_threads": 1,
                    "release_lock_on_cudamalloc": False, "pinned_use_cuda_host_register": False,
                    "roundup_power2_divisions": {k: 0 for k in ROUNDUP_KEYS},
                    "graph_capture_record_stream_reuse": False,
                    "rlhfmem_capture": CAPTURE_SIM_CUDA_SIMULATED, "rlhfmem_note": SNAPSHOT_NOTE}
        if self.placement.kind != ABOVE_LAST:  # a replay of the snapshot places new segments as the device did
            from ..memory.allocator import SEGMENT_PLACEMENT_KEY

            settings[SEGMENT_PLACEMENT_KEY] = self.placement.spec()
        return {"segments": self.model.snapshot_segments(index), "device_traces": traces,
                "allocator_settings": settings, "external_annotations": self.annotations.entries()}

    @_locked
    def memory_stats(self) -> dict:
        """``torch.cuda.memory_stats()``: the keys the project and common profiling scripts read (bytes, counts),
        plus ``rlhfmem.simulated``."""
        st = self.update()
        return {
            "allocated_bytes.all.current": st.allocated_bytes, "allocated_bytes.all.peak": st.peak_allocated_bytes,
            "active_bytes.all.current": st.allocated_bytes, "active_bytes.all.peak": st.peak_allocated_bytes,
            "reserved_bytes.all.current": st.reserved_bytes, "reserved_bytes.all.peak": st.peak_reserved_bytes,
            "requested_bytes.all.current": st.requested_bytes,
            "inactive_split_bytes.all.current": st.inactive_split_bytes,
            "num_alloc_retries": st.num_alloc_retries, "num_ooms": st.num_ooms,
            "num_device_alloc": st.num_device_alloc, "num_device_free": st.num_device_free,
            "allocation.all.allocated": st.num_allocs, "allocation.all.freed": st.num_frees,
            "rlhfmem.simulated": 1,
        }

    @_locked
    def reset_peaks(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: each peak to its current value."""
        st = self.update()
        st.peak_allocated_bytes = st.allocated_bytes
        st.peak_reserved_bytes = st.reserved_bytes
