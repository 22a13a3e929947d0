"""A plain CUDA script: one fp16 scaled_dot_product_attention forward and backward, with the bytes
``torch.cuda.memory_allocated()`` reports around the forward (printed as ``FIGURES {json}``)."""

import json

import torch
import torch.nn.functional as F

q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
before = torch.cuda.memory_allocated()
out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
after = torch.cuda.memory_allocated()
out.sum().backward()
print("FIGURES " + json.dumps({"before": before, "after": after, "peak": torch.cuda.max_memory_allocated(),
                               "grads": [t.grad.shape == t.shape for t in (q, k, v)]}))
