"""Runs out of host memory inside phase `generate`, after allocating: a real allocation failure (PyTorch's
CPU allocator refuses 1 PiB) to be named OOM with its rank, phase and memory so far."""

import torch

import pytest_rlhfmem as rlhfmem

weights = torch.zeros(1024, 1024)  # 4 MiB
with rlhfmem.phase("generate"):
    kv_cache = torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: "DefaultCPUAllocator: can't allocate memory"
