"""A training step whose forward runs through a dependency, ``rlhfmem_probe`` (tests/data/upgrade_probe/): the cell
``rlhfmem deps-diff`` records under two dependency sets in tests/test_deps_diff.py. Phases generate, forward, train;
no other import of the project than its marks."""

import torch

import pytest_rlhfmem as rlhfmem
import rlhfmem_probe

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = torch.randn(64, 256)
with rlhfmem.phase("generate"), torch.no_grad():
    target = model(batch)
with rlhfmem.phase("forward"):
    loss = (rlhfmem_probe.forward(model, batch) - target).pow(2).mean()
with rlhfmem.phase("train"):
    loss.backward()
    opt.step()
print(f"rlhfmem_probe {rlhfmem_probe.__version__}: loss {loss.item():.4f}")
