"""Load the CPU allocation recorder (``csrc/cpu_alloc_recorder.cpp``), JIT-built once and cached.

It wraps PyTorch's CPU allocator so that every allocation and free, from every thread (gloo's and
DeepSpeed's included), lands in one ordered buffer with the recipe's markers. Built by the project's one build
function (``cbuild.py: build_library``, a Python extension of the installed torch) and cached.

``rlhfmem capture`` builds it once in the launcher and hands the built library to every rank in
``$RLHFMEM_RECORDER_LIBRARY``: a rank then loads it directly (torch must be imported first), without a build.
"""

from __future__ import annotations

from pathlib import Path

from ..cbuild import build_library, load_extension, torch_abi_flags

SOURCE = Path(__file__).with_name("csrc") / "cpu_alloc_recorder.cpp"
_ext = None


def _load_module(path: str):
    """Import the built extension at ``path``. Raises ``RuntimeError``."""
    return load_extension(path, RuntimeError, "the CPU allocation recorder")


def load_recorder():
    """The extension module (``install``, ``start``, ``mark``, ``stop``). Raises ``RuntimeError`` (one line) if it
    cannot be built or loaded here (no compiler, an unusable build cache): a CPU capture then fails saying so,
    never measuring another way."""
    global _ext
    import os

    built = os.environ.get("RLHFMEM_RECORDER_LIBRARY")
    if _ext is None and built:
        _ext = _load_module(built)
    if _ext is None:
        try:
            path = build_library(SOURCE, RuntimeError, ("-O2", "-shared", "-fPIC", *torch_abi_flags()),
                                 python_module=True)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot build the CPU allocation recorder: {exc}") from None
        _ext = _load_module(str(path))
    return _ext
