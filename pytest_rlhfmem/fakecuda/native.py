"""Build and load ``csrc/fake_cuda.cpp`` (CUDA device guard + hooks for a CPU-only torch build).

Never imports torch: the library must be loaded before ``import torch`` (torch creates its CUDA hooks
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

SOURCE = Path(__file__).with_name("csrc") / "fake_cuda.cpp"


class FakeCudaUnavailable(RuntimeError):
    """The fake-CUDA library cannot be built or loaded here; the message says why."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise FakeCudaUnavailable("torch is not installed")
    return Path(spec.origin).parent


def library_path() -> Path:
    """Build the library if no cached build matches; return its path. Raises :class:`FakeCudaUnavailable`."""
    torch_dir = _torch_dir()
    version_file = torch_dir / "version.py"
    key = hashlib.sha256(SOURCE.read_bytes() + str(torch_dir).encode()
                         + (version_file.read_bytes() if version_file.exists() else b"")).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pytest-rlhfmem"
    out = cache / f"fake_cuda_{key}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = ["g++", "-O1", "-shared", "-fPIC", "-std=c++20", "-w",
           f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include/torch/csrc/api/include'}",
           str(SOURCE), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}",
           "-o", str(tmp)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FakeCudaUnavailable(f"cannot run g++: {exc}") from None
    if proc.returncode != 0:
        raise FakeCudaUnavailable(f"g++ failed building {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
    tmp.replace(out)  # atomic: concurrent builders each write their own tmp
    return out


def load() -> Path:
    """Load the library into this process, before torch. Raises :class:`FakeCudaUnavailable` if torch
    is already imported (the hooks would be ignored) or the build fails."""
    if "torch" in sys.modules:
        raise FakeCudaUnavailable("torch is already imported in this process: the fake CUDA hooks must be "
                                  "loaded first (run the fake-CUDA route in a fresh process)")
    path = library_path()
    torch_lib = _torch_dir() / "lib"
    for dep in ("libc10.so", "libtorch_cpu.so"):  # resolve the library's symbols from torch's own copies
        ctypes.CDLL(str(torch_lib / dep), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path
