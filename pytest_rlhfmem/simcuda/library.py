"""The simulated CUDA device's side in Python: its settings and its allocation log, read as recorder rows.

``simcuda/csrc/sim_cuda.cpp`` (built and loaded before ``import torch`` by :mod:`.build`) makes ``device="cuda"``
work on a CPU-only torch build: real ATen tensors with the CUDA dispatch keys, outputs made by the ops' meta
kernels, storages with a size and, with values on (:func:`values_mode`), host memory at the device address that
the ops' CPU kernels fill. Its allocator logs every allocation and free (bytes, the stream set from Python,
microseconds of ``steady_clock``); :class:`SimCudaRows` reads that log in the CPU allocation recorder's row format,
so :class:`~pytest_rlhfmem.record.recorder.Recorder` turns it into a trace exactly as it turns a CPU capture into
one (phase marks, placement annotations), without the CPU route's CUDA emulation: the device runs CUDA's own code
paths and adds the cuBLAS workspace itself.

Host tensors are real and never enter the trace; a move to the device is a device allocation at that
moment. Without values, figures do not depend on values (none is computed on the device).
"""

from __future__ import annotations

import ctypes
import os
import time

from ..memory.driver_va import ABOVE_LAST, SegmentPlacement

ENV_LIBRARY = "RLHFMEM_SIM_CUDA_LIBRARY"  # the built library's path, set by the launcher for every rank
ENV_VALUES = "RLHFMEM_SIM_CUDA_VALUES"  # "on": the device computes values (VALUES_MODES; unset: off)
VALUES_MODES = ("on", "off")
ENV_SDPA = "RLHFMEM_SIM_CUDA_SDPA"  # scaled_dot_product_attention's backend on the device (SDPA_BACKENDS)
# SDPBackend's values (torch/nn/attention/__init__.py); a GPU picks by dtype, head size, mask and architecture
# (sdp_utils.cpp), the simulated device by this setting: math unless set.
SDPA_BACKENDS = {"math": 0, "efficient": 2}
BACKEND = "rlhfmem simulated CUDA device (meta kernels, logging allocator; all threads)"
SCALAR_KINDS = ("bool", "int", "float", "other")
# When a freed block that ``Tensor.record_stream`` marked as used on another stream returns to its pool
# (CUDACachingAllocator.cpp: ``free`` -> ``insert_events`` records an event on each such stream; ``process_events``
# at a later malloc returns the block once they completed). The device has no time, so the two bounds:
# ``immediate`` (default: the other stream's work is done by the next malloc) and ``until-sync`` (held until the
# host next waits for that stream: ``torch.cuda.synchronize``, ``Stream``/``Event.synchronize``, ``empty_cache``,
# a value read on it such as ``.item()``).
ENV_RECORD_STREAM = "RLHFMEM_SIM_CUDA_RECORD_STREAM"
RECORD_STREAM_MODES = ("immediate", "until-sync")
LOG_RECORD_STREAM, LOG_SYNC = 3, 4  # the log's actions besides 1 alloc and 2 free (sim_cuda.cpp)
LOG_EMPTY_CACHE = 6  # torch.cuda.empty_cache() on the device (torch_cuda.py), which releases its cache (history.py)
FREE_REQUESTED_ACTION = 5  # delay_record_stream_frees' own: the program's free of a held block (not in the log)
ALL_STREAMS = -1


class SimCudaUnavailable(RuntimeError):
    """The simulated device's library is not loaded in this process."""


def library() -> ctypes.CDLL:
    """The loaded library (``$RLHFMEM_SIM_CUDA_LIBRARY``). Raises :class:`SimCudaUnavailable` when the
    variable is unset or the library does not answer (it was not loaded before torch)."""
    path = os.environ.get(ENV_LIBRARY)
    if not path:
        raise SimCudaUnavailable(f"${ENV_LIBRARY} is not set: the simulated CUDA device is not loaded")
    lib = ctypes.CDLL(path)
    lib.rlhfmem_sim_cuda_event_count.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_events.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_events.argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 5
    lib.rlhfmem_sim_cuda_workspaces.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_workspace_addresses.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_workspace_addresses.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.rlhfmem_sim_cuda_reduce_stagings.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_index_sorts.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_attention_backwards.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_attention_backwards_unmodelled.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_scalar_answers.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_set_workspace_bytes.argtypes = [ctypes.c_int64]
    lib.rlhfmem_sim_cuda_set_stream.argtypes = [ctypes.c_int64]
    lib.rlhfmem_sim_cuda_stream.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_set_sdp_backend.argtypes = [ctypes.c_int64]
    lib.rlhfmem_sim_cuda_log.argtypes = [ctypes.c_int64, ctypes.c_uint64, ctypes.c_int64]
    lib.rlhfmem_sim_cuda_set_values.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_set_values.argtypes = [ctypes.c_int]
    lib.rlhfmem_sim_cuda_values.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_values_skipped.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_values_skipped.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    lib.rlhfmem_sim_cuda_epoch_offset_us.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_stamp_us.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_set_annotations.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_set_annotations.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.rlhfmem_sim_cuda_annotation_count.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_annotation.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_annotation.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
    return lib


def read_log(lib: ctypes.CDLL, first: int = 0) -> list[tuple[int, int, int, int, int]]:
    """The device's log from its ``first``-th event (counted from the library's load) to now: ``(action, addr, size,
    stream, time_us)``, action 1 alloc, 2 free, 3 ``record_stream`` and 4 a host wait (logged under ``until-sync``),
    :data:`LOG_EMPTY_CACHE`; ``time_us`` on the device's clock (steady microseconds, one per stamp at least)."""
    import numpy as np

    n = max(lib.rlhfmem_sim_cuda_event_count() - first, 0)
    if not n:
        return []
    cols = [np.zeros(n, dtype=np.int64 if i != 1 else np.uint64) for i in range(5)]
    got = lib.rlhfmem_sim_cuda_events(first, n, *[c.ctypes.data_as(ctypes.c_void_p) for c in cols])
    return list(zip(*(c[:got].tolist() for c in cols)))


def workspace_addresses(lib: ctypes.CDLL) -> frozenset[int]:
    """The device addresses of the cuBLAS workspaces made so far (each allocated once, never freed)."""
    n = lib.rlhfmem_sim_cuda_workspaces()
    out = (ctypes.c_uint64 * max(n, 1))()
    got = lib.rlhfmem_sim_cuda_workspace_addresses(ctypes.cast(out, ctypes.c_void_p), n)
    return frozenset(out[:got])


def sdpa_backend(name: str | None = None) -> str:
    """The attention backend a run models: ``name``, else ``$RLHFMEM_SIM_CUDA_SDPA``, else ``math``. Raises
    ``ValueError`` naming the allowed values for any other name."""
    name = name or os.environ.get(ENV_SDPA) or "math"
    if name not in SDPA_BACKENDS:
        raise ValueError(f"scaled_dot_product_attention backend {name!r} (${ENV_SDPA}): allowed values are "
                         f"{', '.join(SDPA_BACKENDS)}")
    return name


def values_mode(name: str | None = None) -> str:
    """Whether the device computes values: ``name``, else ``$RLHFMEM_SIM_CUDA_VALUES``, else ``off`` (the library's
    default; ``rlhfmem capture --device cuda-sim`` and the fixtures turn it on: ``command/run.py``). Raises
    ``ValueError`` naming the allowed values.

    - ``on``: every device allocation is real host memory at its device address and every op also runs its CPU
      kernel on it (``sim_cuda.cpp``: "values mode"), so control flow that reads device values (a generation
      loop's stopping criteria, ``.item()``, boolean masks, ``nonzero``, sampling) follows the program; the
      allocation sequence is the value-free one. Costs the program's device memory in host memory, and its
      compute on the CPU.
    - ``off``: addresses and sizes only (the study's scale: OPT-1.3b on four ranks on a laptop); a value read
      gets a fixed answer by dtype (counted, its call site named), and an op whose output shape depends on
      values is refused."""
    name = name or os.environ.get(ENV_VALUES) or "off"
    if name not in VALUES_MODES:
        raise ValueError(f"simulated CUDA device values {name!r} (${ENV_VALUES}): allowed values are "
                         f"{', '.join(VALUES_MODES)}")
    return name


def load_before_torch(path: str) -> None:
    """Load the built library at ``path`` (and torch's libc10/libtorch_cpu it links) into this process,
    before torch is imported, with values on where :func:`values_mode` says so; sets
    ``$RLHFMEM_SIM_CUDA_LIBRARY`` for :func:`library`. Raises ``ValueError`` for a bad ``$RLHFMEM_SIM_CUDA_VALUES``
    and :class:`SimCudaUnavailable` when values cannot be switched on (the address range cannot be reserved)."""
    from .build import load_built

    mode = values_mode()
    load_built(path)
    os.environ[ENV_LIBRARY] = path
    if mode == "on":
        status = library().rlhfmem_sim_cuda_set_values(1)
        if status != 0:
            raise SimCudaUnavailable("the simulated CUDA device cannot compute values here: "
                                     + ("a device allocation exists already" if status == -1 else
                                        "its 16 TiB device address range cannot be reserved (mmap)")
                                     + f"; run with ${ENV_VALUES}=off")


def values_on(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the loaded device computes values (``lib``: :func:`library`'s, by default)."""
    return bool((lib or library()).rlhfmem_sim_cuda_values())


def values_not_computed(lib: ctypes.CDLL) -> dict[str, int]:
    """With values on: the ops whose outputs got no values because they have no CPU kernel (GPU-only kernels:
    memory-efficient attention, ...), ``{"aten::op.overload": calls}``; their outputs hold zeros. ``lib``:
    :func:`library`'s."""
    buf = ctypes.create_string_buffer(1 << 16)
    n = lib.rlhfmem_sim_cuda_values_skipped(buf, len(buf))
    pairs = (line.rsplit("=", 1) for line in buf.raw[:n].decode().splitlines())
    return {name: int(count) for name, count in pairs}


def drop_python_gpu_kernels() -> list[str]:
    """On a CUDA build of torch, after ``import torch``: remove the CUDA kernels that ``torch._native`` registered
    from Python for its GPU code generators (``torch/_native/registry.py``: the DSLs of
    ``torch._native.dsl_registry``, triton, cutedsl, helion: e.g. ``aten::bmm``'s triton outer product), so those
    ops reach the simulated device as on a CPU build (the device's library takes over the C++ CUDA kernels when it
    is loaded: ``simcuda/build.py: load_built``). Returns the DSLs whose overrides were removed (``[]`` on a
    CPU build, where nothing changes, and on a torch without ``torch._native``)."""
    import torch

    if torch.version.cuda is None:
        return []
    try:
        from torch._native import registry
    except ImportError:  # a torch before torch._native
        return []
    try:
        from torch._native.dsl_registry import dsl_registry

        names = list(dsl_registry.list_all_dsls())
    except (ImportError, AttributeError):  # no DSL registry: every CUDA override goes
        registry.deregister_op_overrides(disable_dispatch_keys=["CUDA"])
        return ["every CUDA override"]
    if names:
        registry.deregister_op_overrides(disable_dsl_names=names)
    return names


def record_stream_mode(name: str | None = None) -> str:
    """``name``, else ``$RLHFMEM_SIM_CUDA_RECORD_STREAM``, else ``immediate``; ``ValueError`` naming the allowed
    values otherwise."""
    name = name or os.environ.get(ENV_RECORD_STREAM) or "immediate"
    if name not in RECORD_STREAM_MODES:
        raise ValueError(f"record_stream mode {name!r} (${ENV_RECORD_STREAM}): allowed values are "
                         f"{', '.join(RECORD_STREAM_MODES)}")
    return name


def delay_record_stream_frees(events: list[tuple[int, int, int, int, int]],
                              ignored: frozenset[int] = frozenset()) -> list[tuple[int, tuple]]:
    """The log with each cross-stream block's free split in two: the program's free where it happened
    (action :data:`FREE_REQUESTED_ACTION`: the stats drop) and the block's return to its pool at the host
    synchronization that completes its streams' events: ``[(position, (action, addr, size, stream, time_us))]``,
    actions 1, 2 and 5, where ``position`` is the index in ``events`` of the event at which it takes effect (a
    delayed free: the sync's, with the sync's time).

    ``events``: ``(action, addr, size, stream, time_us)`` with action 1 alloc, 2 free, 3 ``record_stream`` of the
    block at ``addr`` on ``stream``, 4 a host wait for ``stream`` (``-1`` every stream). Follows
    CUDACachingAllocator.cpp: ``recordStream`` ignores the block's own stream; ``free`` of a block with other
    streams' uses holds it until an event on each completes (here: until the host waits for that stream, the
    ``until-sync`` bound); frees still held at the end come after the last event. ``ignored``: positions of host
    waits taken as not having happened (the flush policy's, for the run without it: ``SimCudaRows.rows``)."""
    stream_of: dict[int, int] = {}  # live block -> the stream it was allocated on
    uses: dict[int, set[int]] = {}  # live block -> other streams recorded on it
    held: dict[int, tuple[tuple, set[int]]] = {}  # freed block -> (its free event, streams not yet waited for)
    out: list[tuple[int, tuple]] = []
    for i, ev in enumerate(events):
        action, addr, _, stream, _ = ev
        if action == 1:
            stream_of[addr] = stream
            out.append((i, ev))
        elif action == 2:
            streams = uses.pop(addr, set())
            stream_of.pop(addr, None)
            if streams:
                held[addr] = (ev, streams)
                out.append((i, (FREE_REQUESTED_ACTION,) + ev[1:]))
            else:
                out.append((i, ev))
        elif action == LOG_RECORD_STREAM:
            if addr in stream_of and stream != stream_of[addr]:
                uses.setdefault(addr, set()).add(stream)
        elif action == LOG_SYNC and i not in ignored:
            for addr2 in list(held):
                free, streams = held[addr2]
                if stream == ALL_STREAMS:
                    streams.clear()
                else:
                    streams.discard(stream)
                if not streams:
                    out.append((i, free[:4] + (ev[4],)))  # at the sync's time
                    del held[addr2]
    end = events[-1][4] if events else 0
    out.extend((len(events), free[:4] + (end,)) for free, _ in held.values())
    return out


class _Rows(list):
    def tolist(self) -> list:
        return list(self)


class SimCudaRows:
    """The device's allocation log as recorder rows ``(time_ns, ptr, size, kind, on_main)`` (kind 0 an
    allocation, 1 a free, 2 a mark whose ``ptr`` is the mark's index, 3 the program's free of a block
    ``record_stream`` holds until a later sync: its kind-1 row comes there), the interface
    :class:`~.capture.Recorder` uses for its CPU allocation recorder: ``install``, ``start``, ``mark``,
    ``rows``, ``stop``. A mark sits between the device events logged before and after it."""

    backend = BACKEND

    def __init__(self, workspace_bytes: int | None = None, sdpa: str | None = None) -> None:
        self.lib = library()
        if workspace_bytes is not None:
            self.lib.rlhfmem_sim_cuda_set_workspace_bytes(int(workspace_bytes))
        self.sdpa = sdpa_backend(sdpa)
        # where the replays of this log place segments (``rlhfmem capture --segment-placement``): its trace, the live
        # torch.cuda answers and the capture description all read it here
        self.segment_placement = SegmentPlacement.from_env()
        self.lib.rlhfmem_sim_cuda_set_sdp_backend(SDPA_BACKENDS[self.sdpa])
        self._start = 0
        self._marks: list[tuple[int, int, int]] = []  # (event index, time_ns, mark index)
        self.streams: dict[int, int] = {}  # address -> stream, for blocks allocated on a side stream
        self.delayed_frees = 0  # frees moved to a later host wait (record_stream until-sync)
        self.flush_syncs: list[int] = []  # log positions (from start) of the flush policy's host waits

    def install(self) -> bool:
        return True

    def start(self) -> None:
        self._start = self.lib.rlhfmem_sim_cuda_event_count()

    def mark(self, k: int) -> None:
        self._marks.append((self.lib.rlhfmem_sim_cuda_event_count(), time.monotonic_ns(), k))

    def events(self, since: int = 0) -> list[tuple[int, int, int, int, int]]:
        """The log from its ``since``-th event after :meth:`start`: ``(action, addr, size, stream, time_us)``,
        action 1 alloc, 2 free (3, 4: ``record_stream`` and host waits, logged under ``until-sync``; 6
        ``empty_cache``, which the recorder's FLUSH marks stand for in its trace)."""
        return read_log(self.lib, self._start + since)

    def marks(self, since: int = 0) -> list[tuple[int, int]]:
        """The marks from the ``since``-th on: ``(events of the log before it, counted from :meth:`start`; the
        recorder's mark index)``."""
        return [(at - self._start, k) for at, _t, k in self._marks[since:]]

    def workspace_addresses(self) -> frozenset[int]:
        """The device addresses of the cuBLAS workspaces made so far (each allocated once, never freed): the
        trace names their ALLOCs :data:`~.events.CUBLAS_WORKSPACE`."""
        return workspace_addresses(self.lib)

    def flush_sync(self) -> None:
        """The flush policy's ``empty_cache()`` waits for every stream first (``release_cached_blocks`` begins with
        ``synchronize_and_free_events``), so held blocks return before it releases segments: a host wait in the
        log, remembered so that :meth:`rows` can leave it out for the run without the policy. Logged under
        ``until-sync`` only (nothing is held otherwise)."""
        if record_stream_mode() == "until-sync":
            self.flush_syncs.append(self.lib.rlhfmem_sim_cuda_event_count() - self._start)
            self.lib.rlhfmem_sim_cuda_log(LOG_SYNC, 0, ALL_STREAMS)

    def rows(self, without_flush_syncs: bool = False) -> _Rows:
        """The log as recorder rows (see the class); ``without_flush_syncs``: as if the flush policy's host waits
        (:meth:`flush_sync`) had not happened, a held block returning at the next other wait instead."""
        out = _Rows()
        marks = iter(self._marks)
        nxt = next(marks, None)
        events = self.events()
        placed = delay_record_stream_frees(events, frozenset(self.flush_syncs) if without_flush_syncs else frozenset())
        self.delayed_frees = sum(1 for _i, ev in placed if ev[0] == FREE_REQUESTED_ACTION)
        kinds = {1: 0, 2: 1, FREE_REQUESTED_ACTION: 3}  # recorder rows: 0 alloc, 1 free, 3 free requested
        for i, (action, addr, size, stream, t_us) in placed:
            i += self._start
            if stream:
                self.streams[addr] = stream
            while nxt is not None and nxt[0] <= i:
                out.append((nxt[1], nxt[2], 0, 2, True))
                nxt = next(marks, None)
            out.append((t_us * 1000, addr, size, kinds[action], True))
        while nxt is not None:
            out.append((nxt[1], nxt[2], 0, 2, True))
            nxt = next(marks, None)
        return out

    def stop(self) -> _Rows:
        return self.rows()

    def describe(self) -> dict:
        """The capture description: what the device adds and answers (results and budgets carry it)."""
        answers = {k: self.lib.rlhfmem_sim_cuda_scalar_answers(i) for i, k in enumerate(SCALAR_KINDS)}
        placement = self.segment_placement  # the default is not named: earlier budgets stay comparable
        values = values_on(self.lib)  # named only when on: value-free budgets stay comparable
        return {**({"segment_placement": placement.spec()} if placement.kind != ABOVE_LAST else {}),
                "simulated_cuda_device": {
            "kernels": ("meta (outputs' shapes, strides and dtypes), values by the CPU kernels on host memory"
                        if values else "meta (outputs' shapes, strides and dtypes; no values)"),
            **({"values": "on", "values_not_computed": values_not_computed(self.lib)} if values else {}),
            "scaled_dot_product_attention": self.sdpa,
            "record_stream": record_stream_mode(),
            "record_stream_delayed_frees": self.delayed_frees,
            # memory-efficient attention backwards: delta and workspace made (head dim <= 64), and those whose
            # workspace is not modelled (head dim > 64)
            "efficient_attention_backwards": self.lib.rlhfmem_sim_cuda_attention_backwards(),
            "efficient_attention_backward_workspaces_not_modelled":
                self.lib.rlhfmem_sim_cuda_attention_backwards_unmodelled(),
            "cublas_workspaces": self.lib.rlhfmem_sim_cuda_workspaces(),
            "reduction_staging_buffers": self.lib.rlhfmem_sim_cuda_reduce_stagings(),
            "index_put_sort_buffers": self.lib.rlhfmem_sim_cuda_index_sorts(),
            "scalar_answers": {k: v for k, v in answers.items() if v},
        }}
