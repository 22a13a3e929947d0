"""Build and load the CUDA device libraries of a CPU-only torch build (``fakecuda/csrc/``).

- ``fake_cuda.cpp`` (:data:`SOURCE`): CUDA device guard + hooks, for the recipes' fake-CUDA route
  (``FakeTensorMode`` on top);
- ``sim_cuda.cpp`` (:data:`SIM_SOURCE`): the same plus a simulated CUDA device (allocator that logs, meta
  kernels), for ``rlhfmem capture --device cuda-sim`` (``memory/sim_cuda.py``).

Never imports torch: a library must be loaded before ``import torch`` (torch creates its CUDA hooks
object once, during import). The build takes a few seconds with plain g++ against the installed torch's
headers and is cached under ``$XDG_CACHE_HOME/pytest-rlhfmem`` (default ``~/.cache``), keyed by the
source and the torch installation.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "fakecuda" / "csrc"
SOURCE = CSRC / "fake_cuda.cpp"  # the recipes' route: FakeTensorMode on top
SIM_SOURCE = CSRC / "sim_cuda.cpp"  # a user's script: the simulated device


class FakeCudaUnavailable(RuntimeError):
    """The fake-CUDA library cannot be built or loaded here; the message says why."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise FakeCudaUnavailable("torch is not installed")
    return Path(spec.origin).parent


def library_path(source: Path = SOURCE) -> Path:
    """Build ``source`` if no cached build matches; return the library's path. Raises
    :class:`FakeCudaUnavailable`."""
    torch_dir = _torch_dir()
    version_file = torch_dir / "version.py"
    key = hashlib.sha256(source.read_bytes() + str(torch_dir).encode()
                         + (version_file.read_bytes() if version_file.exists() else b"")).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pytest-rlhfmem"
    out = cache / f"{source.stem}_{key}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = ["g++", "-O1", "-shared", "-fPIC", "-std=c++20", "-w",
           f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include/torch/csrc/api/include'}",
           str(source), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}",
           "-o", str(tmp)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FakeCudaUnavailable(f"cannot run g++: {exc}") from None
    if proc.returncode != 0:
        raise FakeCudaUnavailable(f"g++ failed building {source.name}: {proc.stderr.strip()[-2000:]}")
    tmp.replace(out)  # atomic: concurrent builders each write their own tmp
    return out


def load(source: Path = SOURCE) -> Path:
    """Load the library built from ``source`` into this process, before torch. Raises
    :class:`FakeCudaUnavailable` if torch is already imported (the hooks would be ignored) or the build
    fails. Returns the library's path (``ctypes.CDLL(path)`` reaches its ``extern "C"`` functions)."""
    if "torch" in sys.modules:
        raise FakeCudaUnavailable("torch is already imported in this process: the fake CUDA hooks must be "
                                  "loaded first (run the fake-CUDA route in a fresh process)")
    path = library_path(source)
    torch_lib = _torch_dir() / "lib"
    for dep in ("libc10.so", "libtorch_cpu.so"):  # resolve the library's symbols from torch's own copies
        ctypes.CDLL(str(torch_lib / dep), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path
