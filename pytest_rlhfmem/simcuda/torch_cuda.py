"""``torch.cuda`` for a user's script on the simulated CUDA device (``rlhfmem capture --device cuda-sim``).

The device itself is C++ (``simcuda/csrc/sim_cuda.cpp``: tensors, kernels, allocator). A CPU-only torch's
``torch.cuda`` Python functions still ask a CUDA runtime that is not there; :func:`install` answers them,
once torch is imported and before the user's code runs:

- availability and device queries: ``is_available`` True, one device (``get_device_properties``: an
  RTX 3090's 24 GiB, sm_86, 82 SMs, the GPU of the study and of the shared recordings);
- streams and events: ids only (allocations made under ``torch.cuda.stream(s)`` carry ``s``'s id),
  ``synchronize`` and ``elapsed_time`` do nothing / 0.0; nvtx marks and RNG seeding do nothing;
- memory statistics (``memory_allocated``, ``max_memory_reserved``, ``memory_stats``,
  ``reset_peak_memory_stats``, ``mem_get_info`` ...): the allocator model fed the device trace up to that
  call (:class:`LiveAllocator`); figures are simulated;
- ``torch.cuda.memory._record_memory_history`` / ``_snapshot`` / ``_dump_snapshot(path)``: the simulated
  allocator's snapshot in PyTorch's pickle format (``memory/trace.py: write_snapshot``), its trace from
  the point history was switched on; ``torch.cuda._memory_viz`` reads it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from .streams import DEFAULT_STREAM, Event, Stream, current_stream_of, device_stream

TOTAL_MEMORY = 24 * 2**30  # an RTX 3090's (sm_86): the GPU of the study and of shared/snapshots
DEVICE_NAME = "rlhfmem simulated CUDA device (RTX 3090 geometry)"


class LiveAllocator:
    """The allocator model fed the device's allocation log as the run goes: PyTorch's ``memory_stats()``
    figures at any point of a simulated run (bytes). Each query reads only the log's events and the
    recorder's marks since the previous one (a script asking after every layer stays linear in its
    allocations); the device's ``immediate`` ``record_stream`` logs only allocations and frees (:func:`install`
    refuses ``until-sync``), and a FLUSH mark (the script's ``empty_cache()``) empties the model's cache."""

    def __init__(self, get_rec: Any) -> None:
        self.get_rec = get_rec
        self.model: Any = None  # made at the first query, placing segments as the device's log says
        self._blocks: dict[int, Any] = {}
        self._fed = 0  # log events read, counted from the recorder's start
        self._marks_fed = 0

    def update(self) -> Any:
        from ..memory.events import FLUSH

        rec = self.get_rec()
        log = rec.row_source
        if self.model is None:
            from ..memory.allocator import AllocatorConfig, CachingAllocatorModel

            self.model = CachingAllocatorModel(AllocatorConfig(segment_placement=log.segment_placement))
        events, marks = log.events(self._fed), log.marks(self._marks_fed)
        workspaces = log.workspace_addresses() if self.model.driver is not None else frozenset()
        pending = iter(marks)
        mark = next(pending, None)
        for j, (action, addr, size, stream, _t) in enumerate(events, start=self._fed):
            while mark is not None and mark[0] <= j:  # a mark sits before the log event of its index
                if rec.mark_kind(mark[1]) == FLUSH:
                    self.model.empty_cache()
                mark = next(pending, None)
            if action == 1:
                if addr in workspaces:
                    self.model.cublas_handle_created()
                self._blocks[addr] = self.model.malloc(size, stream)
            elif action == 2 and addr in self._blocks:
                self.model.free(self._blocks.pop(addr))
        while mark is not None:
            if rec.mark_kind(mark[1]) == FLUSH:
                self.model.empty_cache()
            mark = next(pending, None)
        self._fed += len(events)
        self._marks_fed += len(marks)
        return self.model.stats

    def reset_peaks(self) -> None:
        st = self.update()
        st.peak_allocated_bytes = st.allocated_bytes
        st.peak_reserved_bytes = st.reserved_bytes

    def memory_stats(self) -> dict:
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


class History:
    """``_record_memory_history`` state: the trace position where it was switched on (None: off)."""

    def __init__(self, get_rec: Any) -> None:
        self.get_rec = get_rec
        self.since: int | None = None

    def record(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        on = enabled not in (None, False)
        if on and self.since is None:
            self.since = len(self.get_rec().trace_so_far().events)
        elif not on:
            self.since = None

    def snapshot(self) -> dict:
        """The simulated allocator now, as ``torch.cuda.memory._snapshot()`` returns it."""
        import pickle

        from ..memory.events import Trace
        from ..memory.replay import FREE_RUNNING, replay
        from ..memory.trace import write_snapshot

        trace = self.get_rec().trace_so_far()
        since = self.since or 0
        kw = {"capture": trace.capture, "allocator_settings": trace.allocator_settings}
        before = replay(Trace(events=trace.events[:since], **kw), mode=FREE_RUNNING, record_series=False,
                        record_events=True)
        now = replay(trace, mode=FREE_RUNNING, record_series=False, record_events=True)
        window = Trace(events=(now.events or [])[len(before.events or []):], **kw)
        import io
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as d:
            path = write_snapshot(Path(d) / "s.pickle", window, now.segments,
                                  note="simulated: a CUDA script on rlhfmem's simulated CUDA device, replayed "
                                       "through the CUDA caching allocator model")
            data = path.read_bytes()
        return pickle.load(io.BytesIO(data))  # noqa: S301 - our own file, just written

    def dump(self, filename: str = "dump_snapshot.pickle") -> None:
        import pickle

        snap = self.snapshot()
        with open(filename, "wb") as f:
            pickle.dump(snap, f)


class ScalarSites:
    """Where a program asked a device tensor for a value (``.item()``, ``bool()``, ``int()``, ``float()``,
    ``.tolist()``): a call site -> ``{<op_key>: the call, "dtype", "answer", "count"}``. The simulated device
    has no values; the C++ answers by dtype (false, 1.0, 2**62; 0 for int8/uint8) and counts by dtype, this
    names the lines, so a reader sees which branch of the program took a fixed answer.

    ``site(call)`` names the caller (default: ``"file:line call"`` of the frame that called); ``op_key`` names
    the call's field (``"call"``; the fake-CUDA route's results say ``"op"``); ``on_read(tensor)`` runs at each
    read (the fake-CUDA route: the host waits for the current stream); ``sites``: the dict to count into (default:
    a new one)."""

    def __init__(self, site: Callable[[str], str] | None = None, op_key: str = "call",
                 on_read: Callable[[Any], None] | None = None, sites: dict[str, dict] | None = None) -> None:
        self.sites: dict[str, dict] = {} if sites is None else sites
        self._site = site or _calling_line
        self._op_key = op_key
        self._on_read = on_read

    def install(self, torch: Any) -> None:
        """Wrap ``torch.Tensor``'s value reads to count their call sites on device tensors."""
        for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
            original = getattr(torch.Tensor, name)

            def wrapper(t: Any, *a: Any, _original: Any = original, _name: str = name, **k: Any) -> Any:
                value = _original(t, *a, **k)
                if getattr(t, "is_cuda", False):
                    if self._on_read is not None:
                        self._on_read(t)
                    entry = self.sites.setdefault(self._site(_name), {
                        self._op_key: _name, "dtype": str(t.dtype).replace("torch.", ""),
                        "answer": value if _name != "tolist" else "list", "count": 0})
                    entry["count"] += 1
                return value

            wrapper.__name__ = name
            setattr(torch.Tensor, name, wrapper)


def _calling_line(call: str) -> str:
    f = sys._getframe(2)  # _calling_line <- ScalarSites wrapper <- the program's line
    return f"{f.f_code.co_filename}:{f.f_lineno} {call}"


def device_properties() -> Any:
    """``torch.cuda.get_device_properties()`` of the simulated device: an RTX 3090's geometry (24 GiB, sm_86,
    82 SMs)."""
    return types.SimpleNamespace(name=DEVICE_NAME, total_memory=TOTAL_MEMORY, major=8, minor=6,
                                 multi_processor_count=82, is_integrated=False, is_multi_gpu_board=False)


SCALAR_SITES = ScalarSites()


def install(get_rec: Any) -> list[str]:
    """Answer ``torch.cuda``'s Python functions for the simulated device; ``get_rec()`` returns the rank's
    :class:`~pytest_rlhfmem.record.recorder.Recorder` (its ``row_source`` the device's log) once recording
    runs. Call before the recorder intercepts ``empty_cache`` (a no-op here; the recorder marks the flush).
    Returns the names replaced (recorded in the result)."""
    import torch

    from .library import ENV_RECORD_STREAM, drop_python_gpu_kernels, library, record_stream_mode, values_on

    if record_stream_mode() != "immediate":  # its stand-ins log no host waits: delays would never end
        raise ValueError(f"${ENV_RECORD_STREAM}={record_stream_mode()}: modelled on the fake-CUDA route only "
                         "(python -m studies.study_scale --record-stream); a command's capture supports: immediate")
    lib = library()
    live, history = LiveAllocator(get_rec), History(get_rec)

    def stat(key: str):
        def f(device: Any = None) -> int:
            return live.memory_stats()[key]
        return f

    props = device_properties()

    def noop_fn() -> Any:  # a distinct function per name: torch._dynamo refuses one object under two names
        def noop(*_: Any, **__: Any) -> None:
            return None
        return noop

    cuda = torch.cuda
    answers = {
        "_lazy_init": noop_fn(), "init": noop_fn(), "empty_cache": noop_fn(),
        "is_available": lambda: True, "is_initialized": lambda: True,
        "device_count": lambda: 1, "current_device": lambda: 0, "set_device": noop_fn(),
        "get_device_name": lambda device=None: DEVICE_NAME, "get_device_properties": lambda device=None: props,
        "get_device_capability": lambda device=None: (8, 6), "is_bf16_supported": lambda *a, **k: True,
        "synchronize": noop_fn(), "Stream": Stream, "Event": Event,
        "stream": lambda s: device_stream(lib, s),
        "current_stream": lambda device=None: current_stream_of(lib.rlhfmem_sim_cuda_stream()),
        "default_stream": lambda device=None: DEFAULT_STREAM,
        "manual_seed": noop_fn(), "manual_seed_all": noop_fn(), "seed": noop_fn(), "seed_all": noop_fn(),
        "memory_allocated": stat("allocated_bytes.all.current"),
        "max_memory_allocated": stat("allocated_bytes.all.peak"),
        "memory_reserved": stat("reserved_bytes.all.current"), "max_memory_reserved": stat("reserved_bytes.all.peak"),
        "memory_cached": stat("reserved_bytes.all.current"), "max_memory_cached": stat("reserved_bytes.all.peak"),
        "memory_stats": lambda device=None: live.memory_stats(),
        "reset_peak_memory_stats": lambda device=None: live.reset_peaks(),
        "reset_max_memory_allocated": lambda device=None: live.reset_peaks(),
        "reset_max_memory_cached": lambda device=None: live.reset_peaks(),
        "mem_get_info": lambda device=None: (TOTAL_MEMORY - live.update().reserved_bytes, TOTAL_MEMORY),
    }
    names = []
    for name, fn in answers.items():
        setattr(cuda, name, fn)
        if hasattr(cuda.memory, name):
            setattr(cuda.memory, name, fn)
        names.append(name)
    cuda.memory._record_memory_history = history.record
    cuda.memory._snapshot = history.snapshot
    cuda.memory._dump_snapshot = history.dump
    names += ["memory._record_memory_history", "memory._snapshot", "memory._dump_snapshot"]
    for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
        setattr(cuda.nvtx, name, noop_fn())
    names.append("nvtx")
    if not values_on(lib):  # with values on, every read gets the program's own value: nothing to name
        SCALAR_SITES.install(torch)
        names.append("Tensor.item/__bool__/__int__/__float__/tolist: call sites counted")
    dropped = drop_python_gpu_kernels()  # a CUDA build's only
    if dropped:
        names.append(f"torch._native CUDA kernels removed ({', '.join(dropped)}): the device's kernels run instead")
    return names
