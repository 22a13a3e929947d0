"""``torch.cuda`` for a user's script on the simulated CUDA device (``rlhfmem capture --device cuda-sim``).

The device itself is C++ (``fakecuda/csrc/sim_cuda.cpp``: tensors, kernels, allocator). A CPU-only torch's
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

import contextlib
import itertools
import types
from typing import Any

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


class Stream:
    """A CUDA stream: an id the device tags allocations with while it is current."""

    _ids = itertools.count(1)

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.stream_id = next(Stream._ids)
        self.device = _device()
        self.priority = priority

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        return event if event is not None else Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Event:
    """A CUDA event: records and waits do nothing; ``elapsed_time`` is 0.0 ms (no GPU time exists)."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class ScalarSites:
    """Where the script asked a device tensor for a value (``.item()``, ``bool()``, ``int()``, ``float()``,
    ``.tolist()``): ``"file:line call"`` of the caller -> ``{"call", "dtype", "answer", "count"}``. The simulated device
    has no values; the C++ answers by dtype (false, 1.0, 2**62; 0 for int8/uint8) and counts by dtype, this
    names the lines, so a reader sees which branch of the script took a fixed answer."""

    def __init__(self) -> None:
        self.sites: dict[str, dict] = {}

    def install(self, torch: Any) -> None:
        import sys

        for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
            original = getattr(torch.Tensor, name)

            def wrapper(t: Any, *a: Any, _original: Any = original, _name: str = name, **k: Any) -> Any:
                value = _original(t, *a, **k)
                if getattr(t, "is_cuda", False):
                    f = sys._getframe(1)
                    site = f"{f.f_code.co_filename}:{f.f_lineno} {_name}"
                    entry = self.sites.setdefault(site, {"call": _name, "dtype": str(t.dtype).replace("torch.", ""),
                                                         "answer": value if _name != "tolist" else "list",
                                                         "count": 0})
                    entry["count"] += 1
                return value

            wrapper.__name__ = name
            setattr(torch.Tensor, name, wrapper)


def _device() -> Any:
    import torch

    return torch.device("cuda", 0)


SCALAR_SITES = ScalarSites()


def install(get_rec: Any) -> list[str]:
    """Answer ``torch.cuda``'s Python functions for the simulated device; ``get_rec()`` returns the rank's
    :class:`~pytest_rlhfmem.memory.capture.Recorder` (its ``row_source`` the device's log) once recording
    runs. Call before the recorder intercepts ``empty_cache`` (a no-op here; the recorder marks the flush).
    Returns the names replaced (recorded in the result)."""
    import torch

    from ..memory.sim_cuda import ENV_RECORD_STREAM, drop_python_gpu_kernels, library, record_stream_mode

    if record_stream_mode() != "immediate":  # its stand-ins log no host waits: delays would never end
        raise ValueError(f"${ENV_RECORD_STREAM}={record_stream_mode()}: modelled on the fake-CUDA route only "
                         "(benchmarks/study_scale.py --record-stream); a command's capture supports: immediate")
    lib = library()
    live, history = LiveAllocator(get_rec), History(get_rec)
    default = Stream()
    default.stream_id = 0
    current = {"stream": default}

    @contextlib.contextmanager
    def stream(s: Any):
        if s is None:
            yield
            return
        old = current["stream"]
        current["stream"] = s
        lib.rlhfmem_sim_cuda_set_stream(s.stream_id)
        try:
            yield
        finally:
            current["stream"] = old
            lib.rlhfmem_sim_cuda_set_stream(old.stream_id)

    def stat(key: str):
        def f(device: Any = None) -> int:
            return live.memory_stats()[key]
        return f

    props = types.SimpleNamespace(name=DEVICE_NAME, total_memory=TOTAL_MEMORY, major=8, minor=6,
                                  multi_processor_count=82, is_integrated=False, is_multi_gpu_board=False)

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
        "synchronize": noop_fn(), "Stream": Stream, "Event": Event, "stream": stream,
        "current_stream": lambda device=None: current["stream"], "default_stream": lambda device=None: default,
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
    SCALAR_SITES.install(torch)
    names.append("Tensor.item/__bool__/__int__/__float__/tolist: call sites counted")
    dropped = drop_python_gpu_kernels()  # a CUDA build's only
    if dropped:
        names.append(f"torch._native CUDA kernels removed ({', '.join(dropped)}): the device's kernels run instead")
    return names
