"""A user's DeepSpeed script with ZeRO-2 CPU offload: one training step of a small MLP under torchrun.

With ``RLHFMEM_EXAMPLE_DECLARE=1`` it adds the one line a DeepSpeed user adds on CPU,
``rlhfmem.deepspeed_offload(engine)`` (after ``deepspeed.initialize`` and after the first step), so the
fp32 master partition and Adam's states, which DeepSpeed keeps in host memory, leave the device trace.
"""

import os

import deepspeed
import torch

import pytest_rlhfmem as rlhfmem

DECLARE = os.environ.get("RLHFMEM_EXAMPLE_DECLARE") == "1"
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])  # 1.05M parameters, 4 MiB fp32
config = {
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                          "reduce_bucket_size": 1 << 20, "allgather_bucket_size": 1 << 20},  # elements
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
if DECLARE:
    rlhfmem.deepspeed_offload(engine)
with rlhfmem.phase("train"):
    x = torch.randn(8, 512)
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
if DECLARE:
    rlhfmem.deepspeed_offload(engine)  # Adam's states exist from the first step on
print(f"trained one step, loss {loss.item():.4f}, offload declared: {DECLARE}")
