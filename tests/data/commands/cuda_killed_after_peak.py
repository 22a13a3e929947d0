"""Reaches its peak, frees it and empties the cache, then is killed (SIGKILL, as the OOM killer does) inside phase
`wait`: it leaves no result, only its progress file, whose device figures must be the peaks, not what is held when
it dies. Prints ``PEAKS {json}`` (torch.cuda's own max_memory_reserved/allocated) first."""

import json
import os
import signal

import torch

import pytest_rlhfmem as rlhfmem

with rlhfmem.phase("load"):
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.empty_cache()
    small = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
print("PEAKS " + json.dumps({"reserved": torch.cuda.max_memory_reserved(),
                             "allocated": torch.cuda.max_memory_allocated()}), flush=True)
with rlhfmem.phase("wait"):
    os.kill(os.getpid(), signal.SIGKILL)
