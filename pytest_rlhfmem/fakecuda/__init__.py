"""The fake-CUDA route: what a GPU run would allocate, recorded on a CPU-only machine (simulated).

A PPO iteration at the study's scale (OPT-1.3b + OPT-350m, 4 ranks, 512 tokens) does not fit this
machine's memory as real CPU tensors. Under ``torch._subclasses.fake_tensor.FakeTensorMode`` tensors
on ``device="cuda"`` carry shapes and dtypes but no storage, so the recipe runs unchanged at full scale
while a dispatcher-level recorder notes every CUDA storage created and freed. The trace is replayed
through the allocator model like any CPU capture; every figure from it is *simulated* and labelled
``fake-cuda-simulated``.

Pieces, in the order a run uses them:

- ``simcuda/build.py`` (the simulated device's package): a small shared library (``simcuda/csrc/fake_cuda.cpp``:
  c10's test ``FakeGuardImpl`` for CUDA and CUDA hooks with ``hasCUDA() = true``) built with g++ and loaded
  before ``import torch``. Importing this package never imports torch, so the worker can load the library first.
- ``recorder.py``: :class:`FakeCudaRecorder` (the recipe's ``rec``) and the dispatch mode that records
  storages, answers ``.item()`` and adds the cuBLAS workspace.
- ``standins.py``: what a CPU build lacks for DeepSpeed's CUDA code paths (device calls, FusedAdam; the
  streams and events are ``simcuda/streams.py``'s), each stand-in named.
- ``worker.py``: one simulated rank in a fresh process; ``run.py`` starts it.
"""
