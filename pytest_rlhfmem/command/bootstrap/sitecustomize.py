"""rlhfmem capture's bootstrap: ``rlhfmem capture`` puts this directory first on the ``PYTHONPATH`` of
the user's command, so every Python process it starts imports this module at startup (``site``).

It does two things, and nothing else until torch is imported:
1. chains to the ``sitecustomize`` this one shadows (the environment's own, if any);
   (with ``--device cuda-sim`` or ``cuda-rehearsal``, the simulated CUDA device's library is loaded right before torch
   executes)
2. when ``$RLHFMEM_CAPTURE_DIR`` is set, watches for ``import torch`` and, right after torch has finished
   importing, starts recording this rank (``pytest_rlhfmem.command.rank.start_command_capture``): before
   the user's code allocates anything or builds a model.
Not effective under ``python -S``, ``-E`` or ``-I`` (no site / environment).
"""

import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_to_shadowed_sitecustomize() -> None:
    mine = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
        del sys.modules["sitecustomize"]
        spec = importlib.util.find_spec("sitecustomize")
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
        if mine is not None:
            sys.modules["sitecustomize"] = mine


class _StartOnTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps torch's loader so the capture starts when ``torch`` is executed.

    It stays on ``sys.meta_path`` until torch executes: a library may ask for torch's spec without importing it
    (``importlib.util.find_spec("torch")``, as transformers does to see what is installed), and the import that
    follows gets a spec of its own."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname != "torch" or self._finding:
            return None
        self._finding = True  # the lookup below passes through sys.meta_path, this finder included
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        finder = self

        def exec_then_capture(module) -> None:  # noqa: ANN001
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            library = os.environ.get("RLHFMEM_SIM_CUDA_LIBRARY")
            if os.environ.get("RLHFMEM_CAPTURE_DEVICE") in ("cuda-sim", "cuda-rehearsal") and library:
                # the simulated CUDA device registers its hooks, kernels and allocator before torch starts
                from pytest_rlhfmem.simcuda.library import load_before_torch

                load_before_torch(library)
            exec_module(module)
            from pytest_rlhfmem.command.rank import start_command_capture

            start_command_capture()

        loader.exec_module = exec_then_capture
        return spec


_chain_to_shadowed_sitecustomize()
if os.environ.get("RLHFMEM_CAPTURE_DIR") and "torch" not in sys.modules:
    sys.meta_path.insert(0, _StartOnTorchImport())
