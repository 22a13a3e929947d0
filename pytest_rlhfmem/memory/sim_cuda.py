"""The simulated CUDA device's side in Python: its allocation log, read as recorder rows.

``fakecuda/csrc/sim_cuda.cpp`` (built and loaded before ``import torch`` by :mod:`.device_libs`) makes
``device="cuda"`` work on a CPU-only torch build: real ATen tensors with the CUDA dispatch keys, storages
with a size and no memory, outputs computed by the ops' meta kernels. Its allocator logs every allocation
and free (bytes, the stream set from Python, microseconds of ``steady_clock``); :class:`SimCudaRows` reads
that log in the CPU allocation recorder's row format, so :class:`~.capture.Recorder` turns it into a trace
exactly as it turns a CPU capture into one (phase marks, placement annotations), without the CPU route's
CUDA emulation: the device runs CUDA's own code paths and adds the cuBLAS workspace itself.

Host tensors are real and never enter the trace; a move to the device is a device allocation at that
moment. Figures do not depend on values (no value is ever computed on the device).
"""

from __future__ import annotations

import ctypes
import os
import time

ENV_LIBRARY = "RLHFMEM_SIM_CUDA_LIBRARY"  # the built library's path, set by the launcher for every rank
ENV_SDPA = "RLHFMEM_SIM_CUDA_SDPA"  # scaled_dot_product_attention's backend on the device (SDPA_BACKENDS)
# SDPBackend's values (torch/nn/attention/__init__.py); a GPU picks by dtype, head size, mask and architecture
# (sdp_utils.cpp), the simulated device by this setting: math unless set.
SDPA_BACKENDS = {"math": 0, "efficient": 2}
BACKEND = "rlhfmem simulated CUDA device (meta kernels, logging allocator; all threads)"
SCALAR_KINDS = ("bool", "int", "float", "other")


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
    lib.rlhfmem_sim_cuda_reduce_stagings.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_index_sorts.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_attention_backwards.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_attention_backwards_unmodelled.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_scalar_answers.restype = ctypes.c_int64
    lib.rlhfmem_sim_cuda_set_workspace_bytes.argtypes = [ctypes.c_int64]
    lib.rlhfmem_sim_cuda_set_stream.argtypes = [ctypes.c_int64]
    lib.rlhfmem_sim_cuda_set_sdp_backend.argtypes = [ctypes.c_int64]
    return lib


def sdpa_backend(name: str | None = None) -> str:
    """The attention backend a run models: ``name``, else ``$RLHFMEM_SIM_CUDA_SDPA``, else ``math``. Raises
    ``ValueError`` naming the allowed values for any other name."""
    name = name or os.environ.get(ENV_SDPA) or "math"
    if name not in SDPA_BACKENDS:
        raise ValueError(f"scaled_dot_product_attention backend {name!r} (${ENV_SDPA}): allowed values are "
                         f"{', '.join(SDPA_BACKENDS)}")
    return name


def load_before_torch(path: str) -> None:
    """Load the built library at ``path`` (and torch's libc10/libtorch_cpu it links) into this process,
    before torch is imported; sets ``$RLHFMEM_SIM_CUDA_LIBRARY`` for :func:`library`."""
    from .device_libs import _torch_dir

    torch_lib = _torch_dir() / "lib"
    for dep in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(str(torch_lib / dep), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    os.environ[ENV_LIBRARY] = path


class _Rows(list):
    def tolist(self) -> list:
        return list(self)


class SimCudaRows:
    """The device's allocation log as recorder rows ``(time_ns, ptr, size, kind, on_main)`` (kind 0 an
    allocation, 1 a free, 2 a mark whose ``ptr`` is the mark's index), the interface
    :class:`~.capture.Recorder` uses for its CPU allocation recorder: ``install``, ``start``, ``mark``,
    ``rows``, ``stop``. A mark sits between the device events logged before and after it."""

    backend = BACKEND

    def __init__(self, workspace_bytes: int | None = None, sdpa: str | None = None) -> None:
        self.lib = library()
        if workspace_bytes is not None:
            self.lib.rlhfmem_sim_cuda_set_workspace_bytes(int(workspace_bytes))
        self.sdpa = sdpa_backend(sdpa)
        self.lib.rlhfmem_sim_cuda_set_sdp_backend(SDPA_BACKENDS[self.sdpa])
        self._start = 0
        self._marks: list[tuple[int, int, int]] = []  # (event index, time_ns, mark index)
        self.streams: dict[int, int] = {}  # address -> stream, for blocks allocated on a side stream

    def install(self) -> bool:
        return True

    def start(self) -> None:
        self._start = self.lib.rlhfmem_sim_cuda_event_count()

    def mark(self, k: int) -> None:
        self._marks.append((self.lib.rlhfmem_sim_cuda_event_count(), time.monotonic_ns(), k))

    def events(self) -> list[tuple[int, int, int, int, int]]:
        """The log since :meth:`start`: ``(action, addr, size, stream, time_us)``, action 1 alloc, 2 free."""
        import numpy as np

        n = self.lib.rlhfmem_sim_cuda_event_count() - self._start
        cols = [np.zeros(max(n, 1), dtype=np.int64 if i != 1 else np.uint64) for i in range(5)]
        got = self.lib.rlhfmem_sim_cuda_events(self._start, n, *[c.ctypes.data_as(ctypes.c_void_p) for c in cols])
        return list(zip(*(c[:got].tolist() for c in cols)))

    def rows(self) -> _Rows:
        out = _Rows()
        marks = iter(self._marks)
        nxt = next(marks, None)
        for i, (action, addr, size, stream, t_us) in enumerate(self.events(), start=self._start):
            if stream:
                self.streams[addr] = stream
            while nxt is not None and nxt[0] <= i:
                out.append((nxt[1], nxt[2], 0, 2, True))
                nxt = next(marks, None)
            out.append((t_us * 1000, addr, size, 0 if action == 1 else 1, True))
        while nxt is not None:
            out.append((nxt[1], nxt[2], 0, 2, True))
            nxt = next(marks, None)
        return out

    def stop(self) -> _Rows:
        return self.rows()

    def describe(self) -> dict:
        """The capture description: what the device adds and answers (results and budgets carry it)."""
        answers = {k: self.lib.rlhfmem_sim_cuda_scalar_answers(i) for i, k in enumerate(SCALAR_KINDS)}
        return {"simulated_cuda_device": {
            "kernels": "meta (outputs' shapes, strides and dtypes; no values)",
            "scaled_dot_product_attention": self.sdpa,
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
