"""A user's DeepSpeed ZeRO training script as a GPU runner writes it, with no rlhfmem import: the user's own
``deepspeed.initialize`` of a small MLP with ZeRO stage 2 or 3, bf16, AdamW, under torchrun (or DeepSpeed's own
launcher):

    torchrun --nproc-per-node 2 ds_train.py --stage 2|3 [--batch N] [--steps N] [--device cuda|cpu]

``--device cuda`` (the GPU runner: DeepSpeed's CUDA accelerator, backend nccl, ``torch.cuda.set_device``); ``cpu``
for the CPU route (``DS_ACCELERATOR=cpu``, backend gloo). The optimizer is PyTorch's AdamW (``"torch_adam": true``:
DeepSpeed's FusedAdam is a CUDA kernel compiled at first use, which needs nvcc). Each rank draws its own batches;
prints ``FIGURES {...}`` (json) per rank: the losses, rounded.
"""

import argparse
import json
import os

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, choices=(2, 3), default=2)
p.add_argument("--device", default="cuda", help="cuda (as written for the GPU runner); cpu for the CPU route")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--hidden", type=int, default=256)
args = p.parse_args()
if args.device == "cpu":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402 - after DS_ACCELERATOR
import torch  # noqa: E402

deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
rank = int(os.environ["RANK"])
if args.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

torch.manual_seed(0)
h = args.hidden
model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h), torch.nn.GELU(),
                            torch.nn.Linear(h, 16))
config = {
    "train_micro_batch_size_per_gpu": args.batch,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 1 << 18, "allgather_bucket_size": 1 << 18,
                          "stage3_prefetch_bucket_size": 1 << 16, "stage3_param_persistence_threshold": 1024},
    "steps_per_print": 1 << 30,
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

g = torch.Generator().manual_seed(1 + rank)
losses = []
for _ in range(args.steps):
    x = torch.randn(args.batch, h, generator=g).to(engine.device, torch.bfloat16)
    y = torch.randint(0, 16, (args.batch,), generator=g).to(engine.device)
    loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print("FIGURES " + json.dumps({"rank": rank, "losses": [round(v, 4) for v in losses]}), flush=True)
