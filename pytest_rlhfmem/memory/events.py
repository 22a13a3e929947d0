"""The trace's types: what every other module of ``memory/`` reads and writes.

A :class:`Trace` is a list of :class:`Event` in time order plus the device state before the first
event (:class:`SegmentState`); the ``*`` constants are the event actions and the ``CAPTURE_*`` labels
say how a trace was obtained. The formats that read and write traces (``trace.py``: snapshot pickles;
``trace_io.py``: ``.rlhftrace`` files), the recorders (``record/``) and the replay engines all build on
this module, which imports nothing above the allocator model's pool id. Sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .allocator import DEFAULT_POOL

# Event actions. ALLOC/FREE carry the REQUESTED size; SEGMENT_* the segment size.
ALLOC = "alloc"
FREE = "free"  # free_completed: the moment the block went back to its pool
# free_requested, kept only where it is not followed at once by its free_completed: the program freed a block
# that other streams still use (``Tensor.record_stream``). PyTorch's stats drop here (allocated, requested);
# the block stays out of its pool, unusable and unmerged, until its FREE (CUDACachingAllocator.cpp: ``free``
# -> ``insert_events``; ``process_events`` -> ``free_block``). addr and size as FREE's.
FREE_REQUESTED = "free_requested"
SEGMENT_ALLOC = "segment_alloc"
SEGMENT_FREE = "segment_free"
SEGMENT_MAP = "segment_map"  # expandable segments: pages mapped (addr, size of the pages)
SEGMENT_UNMAP = "segment_unmap"
OOM = "oom"  # a failed malloc: addr = the device's free bytes then (cudaMemGetInfo), size = rounded request
# Private pools: allocations between POOL_ENTER and POOL_EXIT go to the pool (addr, size) = its
# MempoolId_t, as inside ``with torch.cuda.use_mem_pool(pool)`` or a CUDA-graph capture. After POOL_EXIT
# the pool stays held (by its MemPool object or graph) until a POOL_RELEASE (the MemPool is destroyed).
POOL_ENTER = "pool_enter"
POOL_EXIT = "pool_exit"
POOL_RELEASE = "pool_release"
# Device memory mapped OUTSIDE the caching allocator: another allocator of the same process maps physical
# memory the trainer's caching allocator cannot see or release (a colocated rollout engine's weights and KV cache:
# vLLM's CuMemAllocator, vllm/device_allocator/cumem.py, cuMemCreate + cuMemMap at load and at ``wake_up``, unmapped
# and released at ``sleep``; SGLang's torch_memory_saver the same at ``resume``/``pause``). addr = the mapping's id
# (unique among the live ones), size = its bytes, name = its tag (``weights``, ``kv_cache``, ``cuda_graph``). The
# caching allocator's cudaMalloc (and page mapping) then fails past capacity minus these bytes; an EXTERNAL_MAP the
# device cannot back is an OOM of that allocator (vLLM raises; nothing releases the trainer's cached blocks for it).
EXTERNAL_MAP = "external_map"
EXTERNAL_UNMAP = "external_unmap"
PHASE = "phase"  # a phase begins (name); the previous one ends
PHASE_END = "phase_end"  # a phase's code is done (name); what follows until the next PHASE is between phases
FLUSH = "flush"  # torch.cuda.empty_cache() at this point (name says which policy point)
# The name of the ALLOC of a cuBLAS handle's workspace (CublasHandlePool.cpp: the handle is created just before):
# the simulated CUDA device names its workspaces; a first-fit replay gives the CUDA context's range back at the
# first (driver_va.py). Other ALLOCs carry no name.
CUBLAS_WORKSPACE = "cublas-workspace"
SEGMENT_ACTIONS = (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP)  # the allocator's own decisions

# How a trace was obtained: part of every result, budget and report.
CAPTURE_CUDA = "cuda-memory-history"
CAPTURE_CPU_SIMULATED = "cpu-trace-simulated"
CAPTURE_FAKE_CUDA_SIMULATED = "fake-cuda-simulated"  # fake CUDA tensors recorded at the dispatcher (fakecuda/)
# a user's CUDA script on the simulated CUDA device (simcuda/csrc/sim_cuda.cpp, simcuda/library.py)
CAPTURE_SIM_CUDA_SIMULATED = "sim-cuda-simulated"
# the CUDA route's own code (its memory history, snapshot and anchored replay) run on the simulated CUDA device: the
# rehearsal device cuda-rehearsal, whose snapshots name the device (allocator_settings["rlhfmem_capture"])
CAPTURE_CUDA_REHEARSAL = "cuda-rehearsal-simulated"
SIMULATED_CAPTURES = (CAPTURE_CPU_SIMULATED, CAPTURE_FAKE_CUDA_SIMULATED, CAPTURE_SIM_CUDA_SIMULATED,
                      CAPTURE_CUDA_REHEARSAL)
CUDA_HISTORY_CAPTURES = (CAPTURE_CUDA, CAPTURE_CUDA_REHEARSAL)  # a CUDA memory history's trace: replayed anchored
# How each capture's figures are labelled wherever they are printed (rlhfmem run / capture): measured or simulated
CAPTURE_LABELS = {
    CAPTURE_CUDA: "measured: CUDA caching allocator",
    CAPTURE_CPU_SIMULATED: "simulated: CPU allocation trace replayed through the CUDA caching allocator model",
    CAPTURE_SIM_CUDA_SIMULATED: "simulated: the program's CUDA allocations on the simulated CUDA device, replayed "
                                "through the CUDA caching allocator model",
    CAPTURE_FAKE_CUDA_SIMULATED: "simulated: fake CUDA tensors' allocations replayed through the CUDA caching "
                                 "allocator model",
    CAPTURE_CUDA_REHEARSAL: "simulated: the CUDA route rehearsed on the simulated CUDA device (its memory history, "
                            "replayed anchored through the CUDA caching allocator model)",
}
DEVICE_CAPTURES = {"cpu": CAPTURE_CPU_SIMULATED, "cuda": CAPTURE_CUDA, "cuda-sim": CAPTURE_SIM_CUDA_SIMULATED,
                   "cuda-rehearsal": CAPTURE_CUDA_REHEARSAL}  # what a run on each device captures


def capture_label(capture: str | None, device: str | None = None) -> str:
    """The words that say how a result's figures were obtained (:data:`CAPTURE_LABELS`): by its ``capture``, or
    for a run that failed before it captured, by its ``device``."""
    return CAPTURE_LABELS.get(capture or DEVICE_CAPTURES.get(device or "", ""), f"capture {capture!r}")
CAPTURE_SYNTHETIC = "synthetic"


class Event(NamedTuple):
    action: str
    addr: int = 0
    size: int = 0
    stream: int = 0
    time_us: int = 0
    name: str = ""


@dataclass
class SegmentState:
    """A segment that existed before the trace began, with the blocks then allocated.

    ``live_blocks`` are ``(address, block size, requested size)``; ``pool_id`` its ``segment_pool_id``.
    """

    address: int
    total_size: int
    stream: int
    is_small: bool
    live_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    pool_id: tuple[int, int] = DEFAULT_POOL


@dataclass
class Trace:
    """Device allocation events in time order, with the state they started from.

    ``final_segments`` is the recorded end state (a snapshot's ``segments``), ``None`` for captured
    CPU traces. ``capture`` is one of ``CAPTURE_*``.
    """

    events: list[Event]
    initial_segments: list[SegmentState] = field(default_factory=list)
    final_segments: list[dict] | None = None
    allocator_settings: dict | None = None
    capture: str = CAPTURE_SYNTHETIC
    source: str = ""
    device: int = 0  # the device whose trace this is (a snapshot holds one trace per device)

    def has_segment_events(self) -> bool:
        return any(e.action in SEGMENT_ACTIONS for e in self.events)

