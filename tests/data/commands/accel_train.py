"""A Hugging Face Accelerate training loop as a GPU runner writes it, with no rlhfmem import: ``Accelerator()``
prepares a small MLP, AdamW and a DataLoader; ``accelerator.backward``; run with

    accelerate launch --num_processes 2 accel_train.py [--batch N] [--steps N] [--cpu]

(``--cpu`` for the CPU route: Accelerate's ``cpu=True``, backend gloo). Each process draws its own batches from the
shared dataset (Accelerate shards the DataLoader); prints ``FIGURES {...}`` (json) per process: its losses and
the parameters' sum after the last step, rounded.
"""

import argparse
import json

import torch
from accelerate import Accelerator

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--cpu", action="store_true")
args = p.parse_args()

accelerator = Accelerator(cpu=args.cpu)
torch.manual_seed(0)
h = args.hidden
model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h), torch.nn.GELU(),
                            torch.nn.Linear(h, 16))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
n = args.batch * args.steps * accelerator.num_processes
data = torch.utils.data.TensorDataset(torch.randn(n, h, generator=g), torch.randint(0, 16, (n,), generator=g))
loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)
model, opt, loader = accelerator.prepare(model, opt, loader)

losses = []
for x, y in loader:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
with torch.no_grad():
    total = sum(q.float().sum() for q in model.parameters()).item()
print("FIGURES " + json.dumps({"rank": accelerator.process_index, "device": str(accelerator.device),
                               "losses": [round(v, 5) for v in losses], "param_sum": round(total, 4)}), flush=True)
accelerator.end_training()
