"""Build a self-contained C++ shared library once and cache it: the compiled replay core and the snapshot
reader (``csrc/replay_core.cpp``, ``csrc/snapshot_reader.cpp``; neither links against torch).

The cache key is the source, the flags and the compiler binary (path, size, mtime), so a new compiler or a
changed source builds again; concurrent builders wait on one file lock, and the library appears atomically.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock

CXXFLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17")


def build_library(source: Path, unavailable: type[Exception], flags: Sequence[str] = CXXFLAGS) -> Path:
    """Build ``source`` with ``$CXX`` (default ``g++``) if no cached build matches; return the library's path
    (``$XDG_CACHE_HOME/pytest-rlhfmem/<stem>_<key>.so``). Raises ``unavailable`` (one line) without a compiler
    or when the build fails."""
    cxx = shutil.which(os.environ.get("CXX") or "g++")
    if cxx is None:
        raise unavailable(f"no C++ compiler ({os.environ.get('CXX') or 'g++'} not on PATH)")
    real = os.path.realpath(cxx)
    st = os.stat(real)
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()
                         + f"{real}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pytest-rlhfmem"
    out = cache / f"{source.stem}_{key}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f"{source.stem}.lock")):
        if out.exists():  # another process built it while this one waited
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            proc = subprocess.run([cxx, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise unavailable(f"cannot run {cxx}: {exc}") from None
        if proc.returncode != 0:
            raise unavailable(f"{cxx} failed building {source.name}: {proc.stderr.strip()[-1000:]}")
        tmp.replace(out)
    return out
