"""Record what a CUDA run would allocate, from fake tensors: storages created and freed at the dispatcher.

Under ``FakeTensorMode`` a CUDA tensor has shape, dtype and a storage of known ``nbytes()`` but no
memory. :class:`FakeCudaRecorder` pushes a ``TorchDispatchMode`` above the fake mode that sees every
operator's outputs; each CUDA storage seen for the first time is an allocation of ``nbytes()`` bytes
(what ``c10::cuda::CUDACachingAllocator`` would be asked for), and a ``weakref.finalize`` on the storage
is its free, as ``torch.distributed._tools.mem_tracker`` tracks memory. Host (``cpu``) storages, and so
everything DeepSpeed's CPU offload keeps in host memory, never enter the trace.

What the dispatcher cannot show is added by name (``ADJUSTMENTS`` in every result):

- ``cublas_workspace``: cuBLAS's workspace, allocated through the caching allocator at a thread's first
  cuBLAS call on a stream and never freed (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
  ``getChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG``, default ``:4096:2:16:8`` = 8,519,680 B
  before Hopper). A forward and a backward each have their own thread (autograd's device thread).

Data-dependent Python control flow asks a fake tensor for its value (``.item()``, ``bool(t)``): there is
none, so fixed answers are given by dtype (:data:`SCALAR_ANSWERS`); every call site is counted and
reported, and figures that depend on such a branch follow the normal path only (no fp16 overflow,
gradient norm 1.0, no early stop).

The trace's ``capture`` is ``fake-cuda-simulated``: replayed through the allocator model, every figure
from it is simulated.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..record.recorder import PhaseRecord
from ..memory.events import CUBLAS_WORKSPACE
from ..memory.trace import ALLOC, CAPTURE_FAKE_CUDA_SIMULATED, FLUSH, FREE, PHASE, Event, Trace

aten = torch.ops.aten

DEFAULT_CUBLAS_WORKSPACE_CONFIG = ":4096:2:16:8"  # PyTorch's default before sm_90 (RTX 3090 is sm_86)

# Ops that call cuBLAS on CUDA (and so create the calling thread's workspace on first use).
CUBLAS_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                        aten.addbmm.default, aten.mv.default, aten.addmv.default, aten.dot.default,
                        aten._addmm_activation.default})

# .item() / bool(t) on a fake tensor: the answer given, by the tensor's dtype kind. Chosen so that
# DeepSpeed and transformers take their normal path: fp16 overflow flags (uint8/bool) say "no overflow",
# norms and loss scales (floating) are finite, and integer positions (e.g. a sequence's end index) are
# the largest index, which Python slicing clamps to the tensor's length.
SCALAR_ANSWERS = {"bool": False, "uint8": 0, "int8": 0, "float": 1.0, "int": 2**62}


def cublas_workspace_bytes(config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace for ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs).

    ``config`` None reads the environment, then PyTorch's default. Raises ``ValueError`` on a malformed
    value (the message quotes it).
    """
    cfg = config if config is not None else os.environ.get("CUBLAS_WORKSPACE_CONFIG", DEFAULT_CUBLAS_WORKSPACE_CONFIG)
    parts = cfg.split(":")
    if parts[0] != "" or len(parts) % 2 == 0 or len(parts) < 3:
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG {cfg!r}: expected ':SIZE_KiB:COUNT[:SIZE_KiB:COUNT...]'")
    try:
        nums = [int(x) for x in parts[1:]]
    except ValueError:
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG {cfg!r}: sizes and counts must be integers") from None
    return sum(nums[i] * 1024 * nums[i + 1] for i in range(0, len(nums), 2))


def _answer_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype in (torch.uint8, torch.int8):
        return str(dtype).replace("torch.", "")
    return "float" if dtype.is_floating_point or dtype.is_complex else "int"


def _caller(skip_libs: tuple[str, ...] = ()) -> str:
    """``file:line`` of the innermost frame outside torch (and outside ``skip_libs`` path fragments):
    where a Python branch asked for a value, or where a tensor was made."""
    f = sys._getframe(2)
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    while f is not None and (f.f_code.co_filename.startswith(torch_dir) or f.f_code.co_filename.startswith(here)
                             or any(s in f.f_code.co_filename for s in skip_libs)):
        f = f.f_back
    if f is None:
        return "?"
    name = f.f_code.co_filename
    for marker in ("site-packages/", "pytest_rlhfmem/"):
        if marker in name:
            name = name.split(marker, 1)[1]
            break
    return f"{name}:{f.f_lineno}"


class _StreamState(threading.local):
    stream: int = 0  # the current stream id of this thread (0 = the default stream)


def count_placement(placement: dict[str, int], tensors: Iterable) -> None:
    """Add the bytes of ``tensors`` the recipe declares host-resident to ``placement``, by where they are:
    ``annotated_host_bytes_on_cpu`` (as on a GPU machine) or ``annotated_host_bytes_on_cuda`` (the recipe and
    DeepSpeed disagree). A storage shared by several tensors counts once; ``None`` entries are skipped."""
    seen: set[int] = set()
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if id(st) in seen:
            continue
        seen.add(id(st))
        key = "annotated_host_bytes_on_cuda" if t.device.type == "cuda" else "annotated_host_bytes_on_cpu"
        placement[key] += st.nbytes()


@dataclass
class FakeCudaRecorder:
    """The recipe's ``rec`` for a fake-CUDA run: same interface as ``record.recorder.Recorder``.

    Use ``start()`` before building models (inside ``FakeTensorMode``), ``phase(name)`` around each
    phase, ``flush(point)``, then ``stop()`` for the :class:`~..memory.trace.Trace` (bytes; ``capture``
    ``fake-cuda-simulated``). Placement calls do not edit the trace: a fake run's host tensors are on
    ``cpu`` and never recorded; they are checked instead (``placement`` counts annotated bytes found on
    the device, which would mean the recipe and DeepSpeed disagree).
    """

    device: str = "cuda"
    cublas_workspace: int = field(default_factory=cublas_workspace_bytes)
    phases: list[PhaseRecord] = field(default_factory=list)
    host_bytes_annotated: int = 0
    frees_on_other_threads: tuple = (0, 0, [])
    backend: str = "fake CUDA tensors, dispatcher storage recorder (all threads)"
    events: list[Event] = field(default_factory=list)
    adjustments: dict[str, dict] = field(default_factory=dict)
    scalar_answers: dict[str, dict] = field(default_factory=dict)  # call site -> {op, dtype, answer, count}
    placement: dict[str, int] = field(default_factory=lambda: {"annotated_host_bytes_on_cpu": 0,
                                                               "annotated_host_bytes_on_cuda": 0})
    on_phase: object = None
    site_min_bytes: int = 1 << 20  # allocations this large keep their Python call site (``sites``)
    sites: dict[int, str] = field(default_factory=dict)  # address -> "file:line" of the allocating code
    _storages: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    _next_addr: int = 1 << 20
    _mode: TorchDispatchMode | None = None
    _active: bool = False
    _workspaces: set = field(default_factory=set)
    _stream: _StreamState = field(default_factory=_StreamState)
    _main_thread: int = field(default_factory=threading.get_ident)
    _other_frees: list = field(default_factory=lambda: [0, 0])

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin recording (the caller has entered ``FakeTensorMode``)."""
        self._mode = _RecordingMode(self)
        self._mode.__enter__()
        self._active = True

    def stop(self) -> Trace:
        """Stop recording; the trace holds every allocation and free seen until now."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._active = False
        self.frees_on_other_threads = (self._other_frees[0], self._other_frees[1], [])
        return Trace(events=list(self.events), capture=CAPTURE_FAKE_CUDA_SIMULATED, source=self.backend)

    # -- streams (driven by the stand-ins of standins.py) -----------------------------------------
    @property
    def current_stream(self) -> int:
        return self._stream.stream

    @contextlib.contextmanager
    def stream(self, stream_id: int) -> Iterator[None]:
        old = self._stream.stream
        self._stream.stream = stream_id
        try:
            yield
        finally:
            self._stream.stream = old

    # -- recording --------------------------------------------------------------------------------
    def _now(self) -> int:
        return time.perf_counter_ns() // 1000

    def _alloc(self, size: int, stream: int, name: str = "") -> int:
        addr = self._next_addr
        self._next_addr += 1
        self.events.append(Event(ALLOC, addr, size, stream, self._now(), name))
        return addr

    def _free(self, cell: list) -> None:
        if not self._active or cell[1] == 0:
            return
        self.events.append(Event(FREE, cell[0], cell[1], cell[2], self._now()))
        if threading.get_ident() != self._main_thread:
            self._other_frees[0] += 1
            self._other_frees[1] += cell[1]

    def track(self, t: torch.Tensor) -> None:
        """Record ``t``'s storage if it is a CUDA storage not seen before (or one that grew)."""
        if t.device.type != "cuda":
            return
        st = t.untyped_storage()
        cell = self._storages.get(st)
        size = st.nbytes()
        if cell is not None:
            if cell[1] != size:  # resize_: a new allocation replaces the old one
                self._free(cell)
                cell[0], cell[1] = (self._alloc(size, self.current_stream) if size else 0), size
            return
        cell = [self._alloc(size, self.current_stream) if size else 0, size, self.current_stream]
        if size >= self.site_min_bytes:
            self.sites[cell[0]] = _caller(skip_libs=("torch/", "transformers/modeling_utils.py"))
        self._storages[st] = cell
        weakref.finalize(st, self._free, cell)

    def live_by_site(self, top: int = 12) -> dict[str, list]:
        """At each phase end: the largest groups of live allocations (>= ``site_min_bytes``) by call site,
        ``[site, bytes, count]``, largest first. What holds the memory when a phase ends."""
        live: dict[int, int] = {}
        out: dict[str, list] = {}
        phase = None

        def summary() -> list:
            groups: dict[str, list] = {}
            for addr, size in live.items():
                g = groups.setdefault(self.sites.get(addr, "?"), [0, 0])
                g[0] += size
                g[1] += 1
            return [[k, v[0], v[1]] for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]]

        for e in self.events:
            if e.action == ALLOC and e.addr in self.sites:
                live[e.addr] = e.size
            elif e.action == FREE:
                live.pop(e.addr, None)
            elif e.action == PHASE:
                if phase is not None:
                    out[phase] = summary()
                phase = e.name
        if phase is not None:
            out[phase] = summary()
        return out

    def cublas_call(self) -> None:
        key = (threading.get_ident(), self.current_stream)
        if key in self._workspaces:
            return
        self._workspaces.add(key)
        self._alloc(self.cublas_workspace, self.current_stream, CUBLAS_WORKSPACE)  # named, as the device's
        adj = self.adjustments.setdefault("cublas_workspace", {"bytes_each": self.cublas_workspace, "count": 0,
                                                               "phases": []})
        adj["count"] += 1
        adj["phases"].append(self.phases[-1].name if self.phases else "startup")

    def answer(self, func, t: torch.Tensor):
        kind = _answer_kind(t.dtype)
        value = SCALAR_ANSWERS[kind]
        if func is aten.is_nonzero.default:
            value = bool(value)
        site = _caller()
        entry = self.scalar_answers.setdefault(site, {"op": str(func), "dtype": str(t.dtype).replace("torch.", ""),
                                                      "answer": value, "count": 0})
        entry["count"] += 1
        return value

    # -- the recipe's interface -------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseRecord]:
        rec = PhaseRecord(name)
        self.phases.append(rec)
        if callable(self.on_phase):
            self.on_phase(name)
        self.events.append(Event(PHASE, 0, 0, 0, self._now(), name))
        t0 = time.perf_counter()
        try:
            yield rec
        finally:
            rec.wall_s = time.perf_counter() - t0

    def flush(self, point: str) -> None:
        """``torch.cuda.empty_cache()`` at this point: a FLUSH event for the replay."""
        self.events.append(Event(FLUSH, 0, 0, 0, self._now(), point))

    def _placement(self, tensors: Iterable) -> None:
        count_placement(self.placement, tensors)

    def host_resident(self, tensors: Iterable) -> None:
        tensors = list(tensors)
        self._placement(tensors)
        self.host_bytes_annotated = self.placement["annotated_host_bytes_on_cpu"]

    def moved_to_host(self, tensors: Iterable) -> None:
        pass  # a fake run moves tensors for real (.to("cpu")): the trace already has the free

    def moved_to_device(self, tensors: Iterable) -> None:
        pass  # ... and the allocation of a move back


class _RecordingMode(TorchDispatchMode):
    """Sees each op above ``FakeTensorMode``: answers scalars, notes cuBLAS calls, records outputs."""

    def __init__(self, rec: FakeCudaRecorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default or func is aten.is_nonzero.default:
            return self.rec.answer(func, args[0])
        if func is aten.record_stream.default:
            return None
        if func is aten._pin_memory.default:  # NYI in FakeTensorMode: a host copy, outside the device trace
            return aten.empty_like.default(args[0])
        if func is aten.is_pinned.default:
            return False
        if func in CUBLAS_OPS and any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args):
            self.rec.cublas_call()
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.rec.track(t)
        if func is aten.resize_.default or func is aten.set_.source_Storage_storage_offset:
            self.rec.track(args[0])
        return out


def sim_device_recorder(on_phase: object = None):
    """The recipe's ``rec`` on the simulated CUDA device (``simcuda/csrc/sim_cuda.cpp``): a
    :class:`~pytest_rlhfmem.record.recorder.Recorder` reading the device's own allocation log (``simcuda/library.py``:
    ``SimCudaRows``), with the fake route's placement check. Create after the device's library is loaded
    and ``torch`` imported."""
    from ..record.recorder import Recorder
    from ..simcuda.library import SimCudaRows

    @dataclass
    class SimDeviceRecorder(Recorder):
        """Placement calls do not edit the trace: on the simulated device a host tensor is a real ``cpu``
        tensor, never in the device log, and a move is a real free or allocation in it. They are checked
        (``placement``: annotated bytes found on the device would mean the recipe and DeepSpeed disagree)."""

        placement: dict[str, int] = field(default_factory=lambda: {"annotated_host_bytes_on_cpu": 0,
                                                                   "annotated_host_bytes_on_cuda": 0})
        scalar_answers: dict[str, dict] = field(default_factory=dict)  # call site -> {op, dtype, answer, count}

        def host_resident(self, tensors: Iterable) -> None:
            count_placement(self.placement, tensors)
            self.host_bytes_annotated = self.placement["annotated_host_bytes_on_cpu"]

        def moved_to_host(self, tensors: Iterable) -> None:
            pass  # the device log already has the free

        def moved_to_device(self, tensors: Iterable) -> None:
            pass  # ... and the allocation of a move back

    return SimDeviceRecorder("cuda-sim", on_phase=on_phase, row_source=SimCudaRows(cublas_workspace_bytes()))
