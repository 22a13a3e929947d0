"""Build and load the CUDA device libraries of a CPU-only torch build (``simcuda/csrc/``).

- ``fake_cuda.cpp`` (:data:`SOURCE`): CUDA device guard + hooks, for the recipes' fake-CUDA route
  (``FakeTensorMode`` on top);
- ``sim_cuda.cpp`` (:data:`SIM_SOURCE`): the same plus a simulated CUDA device (allocator that logs, meta
  kernels), for ``rlhfmem capture --device cuda-sim`` (``simcuda/library.py``);
- ``sim_dist.cpp`` (:data:`DIST_SOURCE`): the device's process group (``nccl``, and ``gloo`` on device tensors), a
  Python extension of torch loaded after ``import torch`` (``simcuda/distributed.py``): :func:`dist_library_path`.

On a CUDA build of torch (``lib/libtorch_cuda.so``, no GPU needed) :func:`load_built` loads libtorch_cuda itself,
between the library and its take-over of libtorch_cuda's CUDA registrations, so the device runs as on a CPU build.

Never imports torch: a library must be loaded before ``import torch`` (torch creates its CUDA hooks
object once, during import). The build (``cbuild.py: build_library``, the project's one) takes a few seconds
with g++ against the installed torch's headers and is cached, keyed by the sources and the torch installation.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

from ..cbuild import build_library, torch_abi_flags, torch_dir

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "fake_cuda.cpp"  # the recipes' route: FakeTensorMode on top
SIM_SOURCE = CSRC / "sim_cuda.cpp"  # a user's script: the simulated device
DIST_SOURCE = CSRC / "sim_dist.cpp"  # the device's process group: a Python extension of torch
DEVICE_CXXFLAGS = ("-O1", "-shared", "-fPIC", "-std=c++20", "-w")  # torch's headers: C++20, their warnings off


class FakeCudaUnavailable(RuntimeError):
    """The fake-CUDA library cannot be built or loaded here; the message says why."""


def library_path(source: Path = SOURCE) -> Path:
    """Build ``source`` (and the ``cuda_hooks.h`` beside it) against the installed torch if no cached build
    matches (``cbuild.py: build_library``); return the library's path. Raises :class:`FakeCudaUnavailable`."""
    return build_library(source, FakeCudaUnavailable, DEVICE_CXXFLAGS, torch=True)


def dist_library_path() -> Path:
    """Build the device's process group (:data:`DIST_SOURCE`, a Python extension of the installed torch: about 20 s
    of g++ once, then cached) and return its path. Imports torch (for its ABI flags: ``cbuild.torch_abi_flags``),
    so a launcher calls it, not a rank before torch. Raises :class:`FakeCudaUnavailable` (one line)."""
    return build_library(DIST_SOURCE, FakeCudaUnavailable, ("-O1", "-shared", "-fPIC", "-w", *torch_abi_flags()),
                         python_module=True)


def load(source: Path = SOURCE) -> Path:
    """Load the library built from ``source`` into this process, before torch. Raises
    :class:`FakeCudaUnavailable` if torch is already imported (the hooks would be ignored) or the build
    fails. Returns the library's path (``ctypes.CDLL(path)`` reaches its ``extern "C"`` functions)."""
    if "torch" in sys.modules:
        raise FakeCudaUnavailable("torch is already imported in this process: the fake CUDA hooks must be "
                                  "loaded first (run the fake-CUDA route in a fresh process)")
    path = library_path(source)
    load_built(path)
    return path


CUDA_BUILD_LIBRARY = "libtorch_cuda.so"  # present in a CUDA build of torch only


def cuda_build() -> bool:
    """Whether the installed torch is a CUDA build (its ``lib/`` holds ``libtorch_cuda.so``). Never imports torch."""
    return (torch_dir(FakeCudaUnavailable) / "lib" / CUDA_BUILD_LIBRARY).exists()


def load_built(path: Path | str, cuda_libraries: list[Path] | None = None) -> dict[str, int]:
    """Load a built device library (and torch's ``libc10.so``/``libtorch_cpu.so`` it links) into this process,
    before torch; on a CUDA build also ``libtorch_cuda.so``, in the order that leaves the library's device in
    charge (its registrations after libtorch_cuda's; ``sim_cuda.cpp``: "on a CUDA build of torch").

    Returns what the library took over from a CUDA build (empty on a CPU build, whose path is unchanged):
    ``{"cpu_build_cuda_kernels": ops with a CUDA kernel before libtorch_cuda, "cuda_kernels_to_meta": ...,
    "cuda_kernels_to_composite": ..., "autograd_cuda_to_composite": ...}`` (operator counts). Raises
    :class:`FakeCudaUnavailable` when a CUDA build's library cannot be loaded (``OSError``'s message).
    ``cuda_libraries``: the CUDA build's libraries to load in libtorch_cuda's place (default: the installed torch's
    ``libtorch_cuda.so`` where it exists, none on a CPU build)."""
    torch_lib = torch_dir(FakeCudaUnavailable) / "lib"
    for dep in ("libc10.so", "libtorch_cpu.so"):  # resolve the library's symbols from torch's own copies
        ctypes.CDLL(str(torch_lib / dep), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    if cuda_libraries is None:
        cuda_libraries = [torch_lib / CUDA_BUILD_LIBRARY] if cuda_build() else []
    if not cuda_libraries:
        return {}
    note = getattr(lib, "rlhfmem_sim_cuda_note_cpu_kernels", None)
    took: dict[str, int] = {}
    if note is not None:
        note.restype = ctypes.c_int64
        took["cpu_build_cuda_kernels"] = note()
    for cuda_lib in cuda_libraries:
        try:
            ctypes.CDLL(str(cuda_lib), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise FakeCudaUnavailable(f"cannot load {Path(cuda_lib).name} of this CUDA build of torch: {exc}") from None
    for prefix in ("rlhfmem_sim_cuda", "rlhfmem_fake_cuda"):
        take_over = getattr(lib, f"{prefix}_take_over", None)
        if take_over is not None:
            take_over.restype = ctypes.c_int64
            take_over()
    counts = getattr(lib, "rlhfmem_sim_cuda_taken_over", None)
    if counts is not None:
        counts.restype = ctypes.c_int64
        counts.argtypes = [ctypes.c_int]
        for i, key in enumerate(("cuda_kernels_to_meta", "cuda_kernels_to_composite", "autograd_cuda_to_composite")):
            took[key] = counts(i)
    return took
