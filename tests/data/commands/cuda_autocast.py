"""A plain CUDA script: two fp32 Linear layers (1024 -> 4096 -> 1024, no bias) run under bf16 autocast
without autograd. CUDA autocast casts each fp32 weight to bf16 once and keeps the copy in its cast cache
until the outermost autocast block exits (aten/src/ATen/autocast_mode.cpp: cached_cast, clear_cache).

    python cuda_autocast.py
"""

import json

import torch

net = torch.nn.Sequential(torch.nn.Linear(1024, 4096, bias=False), torch.nn.Linear(4096, 1024, bias=False)).cuda()
x = torch.randn(8, 1024, device="cuda")
with torch.no_grad():
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = net(x)
        inside = torch.cuda.memory_allocated()
    after = torch.cuda.memory_allocated()
print("FIGURES " + json.dumps({"dtype": str(y.dtype), "before": before, "inside": inside, "after": after}))
