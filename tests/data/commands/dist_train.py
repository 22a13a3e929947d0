"""A data-parallel training loop as a GPU runner writes it, with no rlhfmem import: DDP or FSDP2 (``fully_shard``)
over a small MLP, AdamW, cross-entropy on random data, under torchrun:

    torchrun --nproc-per-node 2 dist_train.py --mode ddp|fsdp2 [--batch N] [--steps N] [--device cuda|cpu]

``--device cuda`` (as written for the GPU runner: backend nccl, ``torch.cuda.set_device(LOCAL_RANK)``); ``cpu`` for
the CPU route (backend gloo). Each rank draws its own batches (seeded by its rank); the model starts from one seed on
every rank. After the last step the ranks' parameters are compared (an all-gather of their sum): data parallelism
keeps them equal. Prints ``FIGURES {...}`` (json) per rank: the losses and the parameters' sum, rounded.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=("ddp", "fsdp2"), default="ddp")
p.add_argument("--device", default="cuda", help="cuda (as written for the GPU runner); cpu for the CPU route")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--hidden", type=int, default=256)
args = p.parse_args()

dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
if args.device == "cuda":
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
else:
    dev = torch.device("cpu")

torch.manual_seed(0)
h = args.hidden
model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h), torch.nn.GELU(),
                            torch.nn.Linear(h, 16)).to(dev)
if args.mode == "ddp":
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(model, device_ids=[local_rank] if dev.type == "cuda" else None)
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

g = torch.Generator().manual_seed(1 + rank)
losses = []
for _ in range(args.steps):
    x = torch.randn(args.batch, h, generator=g).to(dev)
    y = torch.randint(0, 16, (args.batch,), generator=g).to(dev)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())

with torch.no_grad():
    params = [q.full_tensor() if hasattr(q, "full_tensor") else q for q in model.parameters()]
    total = torch.stack([q.float().sum() for q in params]).sum().reshape(1)
    sums = [torch.empty_like(total) for _ in range(world)]
    dist.all_gather(sums, total)
assert all(torch.equal(s, sums[0]) for s in sums), f"the ranks' parameters differ: {[s.item() for s in sums]}"
print("FIGURES " + json.dumps({"rank": rank, "losses": [round(v, 5) for v in losses],
                               "param_sum": round(total.item(), 4)}), flush=True)
dist.destroy_process_group()
