"""Raises inside phase `train`, after allocating: a crash to be named with its rank and phase."""

import torch

import pytest_rlhfmem as rlhfmem

weights = torch.zeros(1024, 1024)  # 4 MiB
with rlhfmem.phase("train"):
    grads = torch.ones_like(weights)
    raise RuntimeError("boom in the training step")
