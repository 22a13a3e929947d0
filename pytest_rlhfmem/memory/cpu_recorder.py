"""Load the CPU allocation recorder (``csrc/cpu_alloc_recorder.cpp``), JIT-built once and cached.

It wraps PyTorch's CPU allocator so that every allocation and free, from every thread (gloo's and
DeepSpeed's included), lands in one ordered buffer with the recipe's markers. Built with
``torch.utils.cpp_extension.load`` into torch's extension cache (about 16 s the first time).

``rlhfmem capture`` builds it once in the launcher and hands the built library to every rank in
``$RLHFMEM_RECORDER_LIBRARY``: a rank then loads it directly (torch must be imported first), without
importing ``torch.utils.cpp_extension`` (and setuptools) into the user's process.
"""

from __future__ import annotations

from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "cpu_alloc_recorder.cpp"
_ext = None


def load_recorder():
    """The extension module (``install``, ``start``, ``mark``, ``stop``). Raises ``RuntimeError`` if it
    cannot be built here (no compiler): callers fall back to torch.profiler."""
    global _ext
    import os

    built = os.environ.get("RLHFMEM_RECORDER_LIBRARY")
    if _ext is None and built:
        import importlib.machinery
        import importlib.util

        name = Path(built).name.split(".")[0]
        loader = importlib.machinery.ExtensionFileLoader(name, built)
        spec = importlib.util.spec_from_file_location(name, built, loader=loader)
        try:
            _ext = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            loader.exec_module(_ext)
        except ImportError as exc:
            _ext = None
            raise RuntimeError(f"cannot load the CPU allocation recorder {built}: {exc}") from exc
    if _ext is None:
        import hashlib

        from torch.utils.cpp_extension import load

        # The source's path is in the digest too: checkouts sharing torch's extension cache would otherwise
        # share one build directory whose build.ninja names another checkout's source, and rebuild in turn.
        digest = hashlib.sha1(SOURCE.read_bytes() + str(SOURCE.resolve()).encode()).hexdigest()[:10]
        try:
            _ext = load(f"rlhfmem_cpu_alloc_recorder_{digest}", [str(SOURCE)], extra_cflags=["-O2"], verbose=False)
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
            raise RuntimeError(f"cannot build the CPU allocation recorder: {exc}") from exc
    return _ext
