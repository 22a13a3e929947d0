"""A plain PyTorch training loop with a batch size and an output directory, no rlhfmem import: the arguments
change its memory (the batch) or nothing at all (the output directory), never its default capture id."""

import argparse
from pathlib import Path

import torch

ap = argparse.ArgumentParser()
ap.add_argument("out", help="where the checkpoint goes")
ap.add_argument("--batch", type=int, default=64)
a = ap.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _step in range(3):
    batch = torch.randn(a.batch, 512)
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
Path(a.out).mkdir(parents=True, exist_ok=True)
torch.save(model.state_dict(), Path(a.out) / "model.pt")
print(f"loss {loss.item():.4f}")
