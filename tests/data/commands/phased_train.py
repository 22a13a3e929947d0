"""plain_train.py with three phase marks, each entered once per step (three steps)."""

import torch

import pytest_rlhfmem as rlhfmem

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _step in range(3):
    batch = torch.randn(64, 256)
    with rlhfmem.phase("generate"):
        with torch.no_grad():
            target = model(batch)
    with rlhfmem.phase("score"):
        loss = (model(batch) - target.roll(1, 0)).pow(2).mean()
    with rlhfmem.phase("train"):
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
torch.cuda.empty_cache()
print(f"loss {loss.item():.4f}")
