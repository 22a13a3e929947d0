"""Load the CPU allocation recorder (``csrc/cpu_alloc_recorder.cpp``), JIT-built once and cached.

It wraps PyTorch's CPU allocator so that every allocation and free, from every thread (gloo's and
DeepSpeed's included), lands in one ordered buffer with the recipe's markers. Built by the project's one build
function (``cbuild.py: build_library``, a Python extension of the installed torch) and cached.

``rlhfmem capture`` builds it once in the launcher and hands the built library to every rank in
``$RLHFMEM_RECORDER_LIBRARY``: a rank then loads it directly (torch must be imported first), without a build.
"""

from __future__ import annotations

from pathlib import Path

from ..cbuild import build_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_alloc_recorder.cpp"
_ext = None


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


def _load_module(path: str):
    """Import the built extension at ``path`` (its file name up to the first dot is its module name). Raises
    ``RuntimeError``."""
    import importlib.machinery
    import importlib.util

    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        loader.exec_module(module)
    except ImportError as exc:
        raise RuntimeError(f"cannot load the CPU allocation recorder {path}: {exc}") from exc
    return module


def load_recorder():
    """The extension module (``install``, ``start``, ``mark``, ``stop``). Raises ``RuntimeError`` if it
    cannot be built here (no compiler): callers fall back to torch.profiler."""
    global _ext
    import os

    built = os.environ.get("RLHFMEM_RECORDER_LIBRARY")
    if _ext is None and built:
        _ext = _load_module(built)
    if _ext is None:
        try:
            path = build_library(SOURCE, RuntimeError, ("-O2", "-shared", "-fPIC", *torch_abi_flags()),
                                 python_module=True)
        except RuntimeError as exc:  # any build failure means: use the fallback
            raise RuntimeError(f"cannot build the CPU allocation recorder: {exc}") from exc
        _ext = _load_module(str(path))
    return _ext
