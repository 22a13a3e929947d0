"""A boolean mask on a CUDA tensor: the output's size depends on the values (``aten::nonzero``)."""

import torch

torch.manual_seed(0)
x = torch.randn(64, device="cuda")
kept = x[x > 0]
print(f"KEPT {kept.numel()} of {x.numel()}")
