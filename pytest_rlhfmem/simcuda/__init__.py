"""The simulated CUDA device: a CUDA device without a GPU, once.

A CPU-only (or GPU-less) torch build is told that CUDA exists; tensors on ``device="cuda"`` are real ATen
tensors with the CUDA dispatch keys whose storage comes from a logging allocator (an address and a size, no
memory), and whose kernels are their meta kernels. Every allocation and free lands in one log: the device trace
that the allocator model (``memory/``) replays. Used by a user's command (``rlhfmem capture --device cuda-sim``)
and by the recipes' fake-CUDA route on the device (``fakecuda/``).

Modules, bottom up:

- ``csrc/``: the C++ (``cuda_hooks.h``: the CUDA hooks and guard both libraries register; ``sim_cuda.cpp``: the
  device; ``fake_cuda.cpp``: hooks and guard only, for fake tensors);
- ``build.py``: build (``cbuild.py``, the project's one build function) and load, before ``import torch``;
- ``library.py``: the loaded library's settings and its allocation log, read as recorder rows (``SimCudaRows``);
- ``streams.py``: ``torch.cuda.Stream`` / ``Event`` stand-ins (ids only);
- ``torch_cuda.py``: ``torch.cuda``'s Python answers (availability, properties, memory statistics from the
  allocator model, memory history and snapshots) and the value-read call sites.

Importing this package never imports torch: the library must be loaded first.
"""
