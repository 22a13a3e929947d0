"""The one build function for every C++ library of the project, each built once and cached.

- ``memory/csrc/replay_core.cpp``, ``memory/csrc/snapshot_reader.cpp``: self-contained (no torch);
- ``simcuda/csrc/fake_cuda.cpp``, ``simcuda/csrc/sim_cuda.cpp``: the device libraries, linked against the
  installed torch's ``libc10``/``libtorch_cpu`` (``torch=True``; never imports torch);
- ``record/csrc/cpu_alloc_recorder.cpp``, ``simcuda/csrc/sim_dist.cpp``: Python extension modules of torch
  (``python_module=True``; the caller passes torch's ABI flags, :func:`torch_abi_flags`).

The cache key is the source (and the ``.h`` files beside it), the flags, the compiler binary (path, size,
mtime) and, for a library linked against torch, the torch installation (its directory and ``version.py``), so
a new compiler, torch or source builds again. The library lands in :func:`cache_dir` as ``<stem>_<key>.so``;
concurrent builders wait on one file lock per source, and the library appears atomically (written beside, then
renamed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock

CXXFLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17")
BUILD_TIMEOUT_S = 600  # a Python extension of torch (torch/extension.h) takes ~1 min on one slow core


ENV_CACHE_DIR = "RLHFMEM_CACHE_DIR"


def cache_dir() -> Path:
    """Where built libraries are cached: ``$RLHFMEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pytest-rlhfmem`` (default
    ``~/.cache/pytest-rlhfmem``). Sessions that change ``HOME`` (pytester's) pin it to share one cache."""
    pinned = os.environ.get(ENV_CACHE_DIR)
    if pinned:
        return Path(pinned)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pytest-rlhfmem"


def torch_dir(unavailable: type[Exception]) -> Path:
    """The installed torch's package directory, found without importing torch. Raises ``unavailable``."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise unavailable("torch is not installed")
    return Path(spec.origin).parent


def build_library(source: Path, unavailable: type[Exception], flags: Sequence[str] = CXXFLAGS, *,
                  torch: bool = False, python_module: bool = False) -> Path:
    """Build ``source`` with ``$CXX`` (default ``g++``) if no cached build matches; return the library's path
    (``<cache>/<stem>_<key>.so``).

    ``torch``: compile against the installed torch's headers and link ``libc10``/``libtorch_cpu`` (rpath to
    torch's ``lib/``). ``python_module``: also Python's headers, ``libtorch``/``libtorch_python``, and
    ``-DTORCH_EXTENSION_NAME=<stem>_<key>`` so that the file imports as a module of its own name (implies
    ``torch``). Raises ``unavailable`` (one line) without a compiler or torch, or when the build fails (the
    compiler's last 2,000 characters)."""
    cxx = shutil.which(os.environ.get("CXX") or "g++")
    if cxx is None:
        raise unavailable(f"no C++ compiler ({os.environ.get('CXX') or 'g++'} not on PATH)")
    real = os.path.realpath(cxx)
    st = os.stat(real)
    cmd_flags = list(flags)
    key_material = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    if torch or python_module:
        tdir = torch_dir(unavailable)
        version = tdir / "version.py"
        key_material += str(tdir).encode() + (version.read_bytes() if version.exists() else b"")
        cmd_flags += [f"-I{tdir / 'include'}", f"-I{tdir / 'include/torch/csrc/api/include'}"]
        libs = ["-lc10", "-ltorch_cpu"]
        if python_module:
            cmd_flags += [f"-I{sysconfig.get_path('include')}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
            libs += ["-ltorch", "-ltorch_python"]
        link = [f"-L{tdir / 'lib'}", *libs, f"-Wl,-rpath,{tdir / 'lib'}"]
    else:
        link = []
    if python_module:  # an extension module is built for this Python's ABI
        key_material += sys.version.encode()
    key = hashlib.sha256(key_material + " ".join(cmd_flags + link).encode()
                         + f"{real}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    name = f"{source.stem}_{key}"
    cache = cache_dir()
    out = cache / f"{name}.so"
    if out.exists():
        return out
    if python_module:
        cmd_flags.append(f"-DTORCH_EXTENSION_NAME={name}")
    unusable = (f"the build cache {cache} cannot hold {source.name}'s build ({{}}): give ${ENV_CACHE_DIR} a "
                f"writable directory with room")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(cache / f"{source.stem}.lock"))
        lock.acquire()
    except OSError as exc:  # a file in its place, no permission, a full or read-only file system
        raise unavailable(unusable.format(exc.strerror or exc)) from None
    try:
        if out.exists():  # another process built it while this one waited
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        # a first build takes seconds to a minute: say what and why, once, before the compiler starts, and how
        # long it took once it is done
        print(f"rlhfmem: building {source.name} with {os.path.basename(cxx)} (no cached build for this source, "
              f"compiler{' and torch' if torch or python_module else ''}; cached in {cache} from now on)",
              file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            proc = subprocess.run([cxx, *cmd_flags, str(source), *link, "-o", str(tmp)], capture_output=True,
                                  text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise unavailable(f"cannot run {cxx}: {exc}") from None
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            if "No space left on device" in proc.stderr:
                raise unavailable(unusable.format("No space left on device"))
            lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            raise unavailable(f"{cxx} failed building {source.name}: {' / '.join(lines[-3:])[-600:]}")
        try:
            tmp.replace(out)
        except OSError as exc:
            raise unavailable(unusable.format(exc.strerror or exc)) from None
        took = time.monotonic() - started
        print(f"rlhfmem: built {source.name} in {took:.1f} s", file=sys.stderr, flush=True)
        _log_build(cache, source.name, took)
    finally:
        lock.release()
    return out


BUILD_LOG = "builds.log"  # one line per build: epoch time, source, seconds (what a session says it built)


def _log_build(cache: Path, name: str, seconds: float) -> None:
    try:
        with open(cache / BUILD_LOG, "a") as f:
            f.write(f"{time.time():.3f}\t{name}\t{seconds:.1f}\n")
    except OSError:
        pass  # the build itself is cached; only the pytest session's line about it is lost


def builds_since(since: float) -> list[tuple[str, float]]:
    """``(source, seconds)`` of every build into :func:`cache_dir` that finished at or after ``since`` (epoch
    seconds), by this process or any other (a run's ranks build too)."""
    try:
        lines = (cache_dir() / BUILD_LOG).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split("\t")
        try:
            if len(parts) == 3 and float(parts[0]) >= since:
                out.append((parts[1], float(parts[2])))
        except ValueError:
            continue
    return out


def torch_abi_flags() -> list[str]:
    """The flags a Python extension of the imported torch is compiled with (as ``torch.utils.cpp_extension``
    sets them): the C++ standard of its headers (C++17 before torch 2.9, C++20 since), its libstdc++ ABI
    (``torch._C._GLIBCXX_USE_CXX11_ABI``: 0 in torch 2.5's wheels) and, where torch names them, its pybind11
    ABI (``torch._C._PYBIND11_*``)."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    flags = [f"-std=c++{20 if (major, minor) >= (2, 9) else 17}",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, f"_PYBIND11_{name}", None)
        if value is not None:
            flags.append(f'-DPYBIND11_{name}="{value}"')
    return flags


def load_extension(path: str | Path, unavailable: type[Exception], what: str):
    """Import the Python extension built at ``path`` (``python_module=True``: its file name up to the first dot is
    its module name) and return the module. Raises ``unavailable`` naming ``what`` when it cannot be imported."""
    import importlib.machinery

    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        loader.exec_module(module)
    except ImportError as exc:
        raise unavailable(f"cannot load {what} {path}: {exc}") from exc
    return module
