"""A plain PyTorch training loop, no rlhfmem import: under `rlhfmem capture` it is one window, `run`."""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _step in range(3):
    batch = torch.randn(64, 256)
    with torch.no_grad():
        target = model(batch)
    loss = (model(batch) - target.roll(1, 0)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.empty_cache()  # a no-op without CUDA; recorded as a flush under capture
print(f"loss {loss.item():.4f}")
