"""The four-line distributed CUDA program of issue 46, as a new user writes it, with its result printed:

    torchrun --nproc-per-node 2 dist_all_reduce.py BACKEND   # nccl or gloo

Prints ``RESULT {"rank": R, "device": "cuda:R", "first": ..., "sum": ...}`` per rank (json)."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group(sys.argv[1])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
print("RESULT " + json.dumps({"rank": dist.get_rank(), "device": str(t.device), "first": t[0].item(),
                              "sum": t.sum().item()}), flush=True)
