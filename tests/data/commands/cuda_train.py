"""A plain CUDA training loop that reads no device value until its end: bf16 autocast, backward, AdamW, three
steps, then empty_cache. Its allocations do not depend on values, so the simulated device gives the same
allocation sequence with and without values (tests/test_sim_values.py)."""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _step in range(3):
    batch = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = (model(batch).float() - batch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.empty_cache()
print(f"loss {loss.item():.4f}")
