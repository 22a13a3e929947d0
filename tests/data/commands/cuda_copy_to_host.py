"""A host buffer filled from the device: ``h.copy_(d)`` into a buffer that held 7.0, and ``d.cpu()``. Prints
``HOST {json}``: the distinct values each holds afterwards (what host code reading them decides on)."""

import json

import torch

d = torch.ones(1 << 16, device="cuda")
h = torch.full((1 << 16,), 7.0)
h.copy_(d)
print("HOST " + json.dumps({"copy_": sorted(set(h.tolist())), "cpu": sorted(set(d.cpu().tolist()))}))
