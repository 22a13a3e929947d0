"""``torch.distributed`` on the simulated CUDA device: the process group a GPU program asks for, by its name.

A CPU-only torch has no NCCL: ``init_process_group("nccl")`` fails ("Distributed package doesn't have NCCL built in"),
and a ``gloo`` group given the device's tensors reads device addresses as host memory. :func:`install` (called in
every rank of ``rlhfmem capture --device cuda-sim``, once torch is imported: ``command/rank.py``) makes both work:

- ``nccl`` (alone, or as ``cuda:nccl`` in a ``cuda:nccl,cpu:gloo`` spec, or the default backend of
  ``init_process_group()`` without one): ``torch.distributed.is_nccl_available()`` is true and
  ``ProcessGroupNCCL(store, rank, size, options)`` makes the device's NCCL backend (``csrc/sim_dist.cpp``:
  ``SimBackend`` of kind NCCL), registered for the CUDA device as ``BackendType.NCCL``. Its device memory follows
  ProcessGroupNCCL.cpp of the pinned torch (2.13.0, git cf30153c): what it allocates itself, on the caller's stream
  (an ``all_gather`` list's flattened output, a ``reduce_scatter`` list's flattened input, ``barrier``'s 1-element
  tensor), which tensors an asynchronous collective keeps until ``wait()`` (TensorShelf; TORCH_NCCL_AVOID_RECORD_STREAMS
  is the default there), and its errors; NCCL's own buffers are outside the caching allocator and not modelled
  (docs/fidelity.md, "Process groups on the simulated CUDA device").
- ``gloo`` on device tensors: after a group is made, its CUDA backend (the CPU one, reused) is wrapped
  (``route_cuda_to_host``: kind GLOO): gloo copies device tensors through pinned host memory on a GPU, so no device
  memory is added; the work keeps its tensors until it is destroyed, as gloo's does.

Values: with the device's values on (:func:`~.library.values_on`, the default of a capture) each collective runs a
ProcessGroupGloo (store prefix :data:`HOST_STORE_PREFIX`) on host views of the device tensors, so results are real;
with values off nothing moves (shapes and the allocations above only), so a program that reads what a collective
returned (DDP's parameter check, ``all_gather_object``) needs values on.

One simulated device per local rank: ``torch.cuda.device_count()`` is ``$LOCAL_WORLD_SIZE`` and
``torch.cuda.set_device`` is honoured (``torch_cuda.py``); each rank's log is its own process's.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import Any

from .library import SimCudaUnavailable, values_on

ENV_LIBRARY = "RLHFMEM_SIM_DIST_LIBRARY"  # the built extension (build.py: dist_library_path), set by the launcher
HOST_STORE_PREFIX = "rlhfmem-host/"  # the host transport's keys, beside the group's own in its store
# torch.cuda.nccl.version() on the device (torch's own asks torch._C._nccl_version, absent from a CPU build): no NCCL
# runs, the device's process group follows ProcessGroupNCCL.cpp with NCCL's features (AVG: 2.10, PREMUL_SUM: 2.11);
# 2.27.5 is the NCCL of torch's CUDA 12.9 builds (.ci/docker/ci_commit_pins/nccl-cu12.txt, torch 2.8)
NCCL_VERSION = (2, 27, 5)
# ProcessGroupNCCL.hpp: kProcessGroupNCCLDefaultTimeout (torch.distributed.constants.default_pg_nccl_timeout, which a
# CPU build leaves None: init_process_group("nccl") then warns "NCCL support is not compiled")
NCCL_DEFAULT_TIMEOUT = timedelta(minutes=10)

_ext: Any = None  # the loaded extension (csrc/sim_dist.cpp), once a process group needed it
_library: str | None = None  # its path, as install() was given it (None: $RLHFMEM_SIM_DIST_LIBRARY, else built)


class Options:
    """``ProcessGroupNCCL.Options`` as the pinned torch's binding makes them (``init_process_group(pg_options=...)``):
    the fields ``_new_process_group_helper`` sets or reads. The device's NCCL takes its timeout from ``_timeout``
    (default ``torch.distributed``'s default process group timeout); the rest is kept, not used."""

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream
        self._timeout: timedelta | None = None
        self.global_ranks_in_group: list[int] = []
        self.group_name = ""
        self.group_desc = ""
        self.split_from: Any = None
        self.split_color = 0
        self.backend = "nccl"


class _ProcessGroupNCCLType(type):
    """``isinstance(x, ProcessGroupNCCL)`` is true of the device's NCCL backends; calling the class makes one."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return _ext is not None and isinstance(obj, _ext.ProcessGroupNCCL)  # none exists before the extension

    def __call__(cls, store: Any, rank: int, size: int, options: Any = None) -> Any:  # noqa: D102
        return make_nccl(store, rank, size, options)


class ProcessGroupNCCL(metaclass=_ProcessGroupNCCLType):
    """What ``torch.distributed.ProcessGroupNCCL`` names on the simulated device: ``ProcessGroupNCCL(store, rank,
    size, options)`` returns a ``torch._C._distributed_c10d.Backend`` (the extension's ``ProcessGroupNCCL``), as
    the pinned torch's constructor does. ``Options``: :class:`Options`."""

    Options = Options


def make_nccl(store: Any, rank: int, size: int, options: Any = None) -> Any:
    """The device's NCCL backend for group rank ``rank`` of ``size`` on ``store`` (the group's prefix store), with its
    host transport (a ProcessGroupGloo under :data:`HOST_STORE_PREFIX`: every member must call this, as every member
    of a NCCL group constructs it). Raises what ProcessGroupGloo raises when the rendezvous fails."""
    import torch
    import torch.distributed as dist

    from torch.distributed.constants import default_pg_timeout

    timeout = getattr(options, "_timeout", None) or default_pg_timeout
    host = dist.ProcessGroupGloo(dist.PrefixStore(HOST_STORE_PREFIX, store), rank, size, timeout)
    ranks = list(getattr(options, "global_ranks_in_group", None) or [])
    global_rank = int(ranks[rank]) if ranks else rank
    return extension().ProcessGroupNCCL(host, rank, size, values_on(), torch.cuda.device_count(), global_rank)


def route_gloo(pg: Any) -> bool:
    """Wrap ``pg``'s CUDA backend when it is gloo (``csrc/sim_dist.cpp: route_cuda_to_host``); returns whether it
    did. A group without a CUDA backend, or whose CUDA backend is the device's NCCL or another backend, is left."""
    import torch

    if not pg._device_types or torch.device("cuda") not in pg._device_types:
        return False
    rank = int(os.environ.get("RANK", 0))
    return bool(extension().route_cuda_to_host(pg, values_on(), torch.cuda.device_count(), rank))


def extension() -> Any:
    """The extension (``csrc/sim_dist.cpp``), loaded at its first use: ``$RLHFMEM_SIM_DIST_LIBRARY`` (the launcher
    builds it for a torchrun command) or the path :func:`install` was given, else built here (``build.py:
    dist_library_path``, about 20 s once, then cached; a single-process program that makes a process group).
    Raises :class:`~.library.SimCudaUnavailable` (one line) when it cannot be built or loaded."""
    global _ext
    if _ext is None:
        from ..cbuild import load_extension
        from .build import FakeCudaUnavailable, dist_library_path

        try:
            path = _library or os.environ.get(ENV_LIBRARY) or str(dist_library_path())
        except FakeCudaUnavailable as exc:
            raise SimCudaUnavailable(f"the simulated CUDA device's process group: {exc}") from None
        _ext = load_extension(path, SimCudaUnavailable, "the simulated CUDA device's process group")
    return _ext


def install(library: str | None = None) -> list[str]:
    """Give ``torch.distributed`` the device's process groups (see the module); the extension is loaded when the
    program first makes a group (:func:`extension`; ``library``: its path). Call once torch is imported, before the
    program makes a process group. Returns the names answered (recorded in the result); ``[]`` where torch has no
    ``torch.distributed``."""
    global _library
    import torch.distributed as dist

    if not dist.is_available():
        return []
    _library = library
    import torch.cuda.nccl

    torch.cuda.nccl.version = lambda: NCCL_VERSION
    install_storage_resize()
    install_record_stream()
    c10d = dist.distributed_c10d
    c10d._NCCL_AVAILABLE = True
    if c10d.default_pg_nccl_timeout is None:
        dist.constants.default_pg_nccl_timeout = c10d.default_pg_nccl_timeout = NCCL_DEFAULT_TIMEOUT
    c10d.ProcessGroupNCCL = ProcessGroupNCCL
    dist.ProcessGroupNCCL = ProcessGroupNCCL
    helper = c10d._new_process_group_helper
    if not getattr(helper, "_rlhfmem_routes_gloo", False):
        @functools.wraps(helper)
        def new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
            pg, store = helper(*args, **kwargs)
            if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER:
                route_gloo(pg)
            return pg, store

        new_process_group_helper._rlhfmem_routes_gloo = True  # type: ignore[attr-defined]
        c10d._new_process_group_helper = new_process_group_helper
    return ["torch.distributed: is_nccl_available, ProcessGroupNCCL (nccl on the simulated device); gloo groups' "
            "CUDA backend on host views", f"torch.cuda.nccl.version: {NCCL_VERSION}",
            "UntypedStorage.resize_ of device storages", "Tensor.record_stream with the device's streams: immediate"]


def install_storage_resize() -> None:
    """``torch.UntypedStorage.resize_`` of a device storage, which a CPU build refuses ("built without USE_CUDA"):
    the device's (``csrc/sim_cuda.cpp: rlhfmem_sim_cuda_resize_storage``, as ``resize_bytes_cuda``: 0 bytes frees
    the block; a new size allocates on the storage's device, copies the old contents, frees the old block). FSDP2
    frees and re-allocates its unsharded parameters so (``_fsdp_param.py``: ``free_storage``, ``alloc_storage``).
    Raises ``RuntimeError`` ("Trying to resize storage that is not resizable") as PyTorch does."""
    import ctypes

    import torch

    from .library import library

    resize = library().rlhfmem_sim_cuda_resize_storage
    resize.argtypes, resize.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64
    original = torch.UntypedStorage.resize_
    if getattr(original, "_rlhfmem_device", False):
        return

    def resize_(self: Any, size: int) -> Any:
        if self.device.type != "cuda":
            return original(self, size)
        if resize(self._cdata, int(size)) != 0:
            raise RuntimeError("Trying to resize storage that is not resizable")
        return self

    resize_._rlhfmem_device = True  # type: ignore[attr-defined]
    torch.UntypedStorage.resize_ = resize_


def install_record_stream() -> None:
    """``Tensor.record_stream(stream)`` of a device tensor with the device's stream stand-in (``streams.py``; torch's
    binding accepts only a ``torch.Stream``: "unknown parameter type"): DeepSpeed's ZeRO-3 calls it when it frees a
    partitioned parameter (``partition_parameters.py: free_param``), FSDP on its streams. A command's capture models
    ``record_stream`` by its ``immediate`` bound (``library.py: RECORD_STREAM_MODES``): the block is reusable at its
    free, so the call changes no figure. Other tensors and streams: torch's own."""
    import torch

    original = torch.Tensor.record_stream
    if getattr(original, "_rlhfmem_device", False):
        return

    def record_stream(self: Any, stream: Any) -> None:
        if self.is_cuda and not isinstance(stream, torch.Stream):
            return None
        return original(self, stream)

    record_stream._rlhfmem_device = True  # type: ignore[attr-defined]
    torch.Tensor.record_stream = record_stream


def collective_counts() -> dict[str, int]:
    """The collectives the device's process groups ran in this process, by name (``all_reduce``, ``barrier``, ...;
    empty before :func:`install` or without any)."""
    return dict(_ext.collective_counts()) if _ext is not None else {}
