"""Timings: what capture, replay, advise and the API cost, and the prepared GPU check (``gpu_check.py``).

Run each as a module from the checkout's root (``python -m benchmarks.replay_throughput --repeat 2``); the GPU check
also runs as a script (``python benchmarks/gpu_check.py``), as ``.ci/gpu-check`` calls it on the device machine.
The studies are in ``studies/``, the generators of the README's and docs' tables in ``doctables/``."""
