"""A `backward` phase nested in `train`: when it ends, `train` resumes (two windows, one row)."""

import torch

import pytest_rlhfmem as rlhfmem

model = torch.nn.Linear(512, 512)
with rlhfmem.phase("train"):
    loss = model(torch.randn(256, 512)).square().mean()
    with rlhfmem.phase("backward"):
        loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
