"""``torch.cuda`` for a program on the simulated CUDA device (``rlhfmem capture --device cuda-sim``, the rehearsal
device ``cuda-rehearsal``, the fake-CUDA route's ``sim`` tensors).

The device itself is C++ (``simcuda/csrc/sim_cuda.cpp``: tensors, kernels, allocator). A CPU-only torch's
``torch.cuda`` Python functions still ask a CUDA runtime that is not there; :func:`install` answers them,
once torch is imported and before the program's code runs:

- availability and device queries: ``is_available`` True, one device per local rank (``device_count()`` is
  ``$LOCAL_WORLD_SIZE``, 1 without torchrun; ``set_device`` honoured: :func:`device_selection`;
  ``get_device_properties`` alike for each: an RTX 3090's 24 GiB, sm_86, 82 SMs, the GPU of the study and of the
  shared recordings);
- streams and events: ids only (allocations made under ``torch.cuda.stream(s)`` carry ``s``'s id),
  ``synchronize`` and ``elapsed_time`` do nothing / 0.0; nvtx marks and RNG seeding do nothing;
- memory statistics (``memory_allocated``, ``max_memory_reserved``, ``memory_stats``,
  ``reset_peak_memory_stats``, ``mem_get_info`` ...) and the memory history (torch's ``_record_memory_history``,
  ``_snapshot``, ``_dump_snapshot`` and ``memory_snapshot`` run unchanged over ``torch._C``'s bindings, answered
  here): the device's caching allocator as ``history.py: DeviceMemory`` keeps it from the device's log alone,
  whatever recorder runs; figures are simulated;
- ``empty_cache()``: logged in the device's log (``library.py: LOG_EMPTY_CACHE``), where the allocator releases
  its cache;
- pinned host memory: the device pins nothing (a pinned tensor is ordinary host memory), so the host allocator's
  statistics (``host_memory_stats``, ``torch._C._cuda_hostMemoryStats``) are zeros and their resets do nothing.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from typing import Any

from .history import DeviceMemory
from .streams import DEFAULT_STREAM, Event, Stream, current_stream_of, device_stream

TOTAL_MEMORY = 24 * 2**30  # an RTX 3090's (sm_86): the GPU of the study and of shared/snapshots
DEVICE_NAME = "rlhfmem simulated CUDA device (RTX 3090 geometry)"
# the machine's device count where no $LOCAL_WORLD_SIZE says it (a launcher's own process: torchrun's agent,
# accelerate launch): the ranks per machine of the capture (command/run.py sets it)
ENV_DEVICES = "RLHFMEM_SIM_CUDA_DEVICES"


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


def device_selection(torch: Any) -> dict[str, Callable]:
    """``torch.cuda``'s device selection on the simulated device: one device per local rank, as torchrun gives each
    rank a GPU of its own (``device_count()`` is ``$LOCAL_WORLD_SIZE``, else :data:`ENV_DEVICES`, else 1: a launcher's
    process sees the machine's devices), and the current device is the
    device guard's (per thread, as ``cudaSetDevice``; ``csrc/cuda_hooks.h``), where new tensors land. ``set_device``
    of an index at or above the count raises ``RuntimeError`` ("invalid device ordinal", as CUDA does); a negative
    index is a no-op (``torch/cuda/__init__.py: set_device``). Also ``torch.cuda.device(i)``'s exchange."""

    get_index = getattr(torch._C, "_accelerator_getDeviceIndex", lambda: 0)  # the accelerator API: torch >= 2.6
    set_index = getattr(torch._C, "_accelerator_setDeviceIndex", lambda index: None)

    def device_count() -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get(ENV_DEVICES) or 1)

    def current_device() -> int:
        return get_index()

    def set_device(device: Any) -> None:
        index = torch.cuda._get_device_index(device)
        if index < 0:
            return
        if index >= device_count():
            raise RuntimeError(f"CUDA error: invalid device ordinal: device {index} of the simulated CUDA device's "
                               f"{device_count()} (one per local rank: $LOCAL_WORLD_SIZE)")
        set_index(index)

    def exchange_device(index: int) -> int:  # torch.cuda._exchange_device / _maybe_exchange_device
        if index < 0:
            return -1
        previous = current_device()
        set_device(index)
        return previous

    return {"device_count": device_count, "current_device": current_device, "set_device": set_device,
            "_exchange_device": exchange_device, "_maybe_exchange_device": exchange_device}


HOST_STAT_KEYS = ("allocations", "allocated_bytes", "active_requests", "active_bytes")  # host_memory_stats' own
HOST_STAT_FIELDS = ("current", "peak", "allocated", "freed")
DEVICE_MEMORY: DeviceMemory | None = None  # the process's device memory, once install() ran


def host_memory_stats_nested() -> dict:
    """``torch._C._cuda_hostMemoryStats()``: the pinned host allocator's statistics, all zero (nothing is pinned
    on the simulated device), in PyTorch's nested form (``torch/cuda/memory.py: host_memory_stats``)."""
    out: dict[str, Any] = {k: {f: 0 for f in HOST_STAT_FIELDS} for k in HOST_STAT_KEYS}
    out |= {"num_host_alloc": 0, "num_host_free": 0}
    return out


def install(count_scalar_reads: bool = True) -> list[str]:
    """Answer ``torch.cuda``'s Python functions for the simulated device, from the device itself (its log, fed
    through :class:`~.history.DeviceMemory`). Call before a recorder intercepts ``empty_cache`` (the recorder then
    marks the program's calls and runs this one). ``count_scalar_reads``: count the call sites of value reads
    (:data:`SCALAR_SITES`) when the device computes no values (False where the caller counts them itself: the
    fake-CUDA route's stand-ins). Returns the names replaced (recorded in the result). Raises ``ValueError`` for a
    ``record_stream`` mode the answers do not follow."""
    global DEVICE_MEMORY
    import torch

    from .library import ENV_RECORD_STREAM, LOG_EMPTY_CACHE, drop_python_gpu_kernels, library, record_stream_mode, \
        values_on

    if record_stream_mode() != "immediate":  # its stand-ins log no host waits: delays would never end
        raise ValueError(f"${ENV_RECORD_STREAM}={record_stream_mode()}: modelled on the fake-CUDA route only "
                         "(python -m studies.study_scale --record-stream); a command's capture supports: immediate")
    lib = library()
    memory = DEVICE_MEMORY = DeviceMemory(lib, device=lambda: torch.cuda.current_device())

    def stat(key: str):
        def f(device: Any = None) -> int:
            return memory.memory_stats()[key]
        return f

    props = device_properties()

    def noop_fn() -> Any:  # a distinct function per name: torch._dynamo refuses one object under two names
        def noop(*_: Any, **__: Any) -> None:
            return None
        return noop

    def empty_cache() -> None:
        lib.rlhfmem_sim_cuda_log(LOG_EMPTY_CACHE, 0, -1)

    cuda = torch.cuda
    answers = {
        "_lazy_init": noop_fn(), "init": noop_fn(), "empty_cache": empty_cache,
        "is_available": lambda: True, "is_initialized": lambda: True,
        **device_selection(torch),
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
        "memory_stats": lambda device=None: memory.memory_stats(),
        "reset_peak_memory_stats": lambda device=None: memory.reset_peaks(),
        "reset_max_memory_allocated": lambda device=None: memory.reset_peaks(),
        "reset_max_memory_cached": lambda device=None: memory.reset_peaks(),
        "mem_get_info": lambda device=None: (TOTAL_MEMORY - memory.update().reserved_bytes, TOTAL_MEMORY),
    }
    names = []
    for name, fn in answers.items():
        setattr(cuda, name, fn)
        if hasattr(cuda.memory, name):
            setattr(cuda.memory, name, fn)
        names.append(name)
    # the memory history below torch's own Python (_record_memory_history, _snapshot, _dump_snapshot,
    # memory_snapshot run unchanged), and the pinned host allocator's statistics: nothing is pinned
    bindings = {"_cuda_record_memory_history": memory.record_history,
                "_cuda_record_memory_history_legacy": memory.record_history_legacy,
                "_cuda_memorySnapshot": memory.snapshot,
                "_cuda_hostMemoryStats": host_memory_stats_nested, "_cuda_resetPeakHostMemoryStats": noop_fn(),
                "_cuda_resetAccumulatedHostMemoryStats": noop_fn()}
    for name, fn in bindings.items():
        setattr(torch._C, name, fn)
    names.append("torch._C." + ",".join(bindings))
    for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
        setattr(cuda.nvtx, name, noop_fn())
    names.append("nvtx")
    if count_scalar_reads and not values_on(lib):  # with values on, each read gets the program's value: nothing to name
        SCALAR_SITES.install(torch)
        names.append("Tensor.item/__bool__/__int__/__float__/tolist: call sites counted")
    dropped = drop_python_gpu_kernels()  # a CUDA build's only
    if dropped:
        names.append(f"torch._native CUDA kernels removed ({', '.join(dropped)}): the device's kernels run instead")
    return names
