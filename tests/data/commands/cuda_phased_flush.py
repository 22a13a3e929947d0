"""A CUDA loop with phase marks and a flush, as a GPU runner's user writes it: three steps of rollout (no_grad
forward), score and train phases, ``torch.cuda.empty_cache()`` after each rollout (the study's flush), a
side-stream forward in the score phase, and an allocation left alive across phases. No device value is read.

    python cuda_phased_flush.py [--steps N] [--batch B] [--fail-in PHASE]

``--fail-in PHASE`` raises inside that phase of the last step (``run``: before the first phase, in the capture's
root window), after its allocations: a program error to be named with its rank and phase.
"""

import argparse

import torch

import pytest_rlhfmem as rlhfmem

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--fail-in", default=None)
args = p.parse_args()


def maybe_fail(phase: str, step: int) -> None:
    if args.fail_in == phase and step == args.steps - 1:
        raise RuntimeError(f"boom in {phase}")


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
side = torch.cuda.Stream()
kept = []
maybe_fail("run", args.steps - 1)
for step in range(args.steps):
    batch = torch.randn(args.batch, 256, device="cuda")
    with rlhfmem.phase("rollout"):
        with torch.no_grad():
            rollout = [model(batch) for _ in range(4)]
        target = torch.stack(rollout).mean(0)
        del rollout
        maybe_fail("rollout", step)
    torch.cuda.empty_cache()  # the flush after inference
    with rlhfmem.phase("score"):
        with torch.cuda.stream(side), torch.no_grad():
            score = model(batch).sum(-1)
        torch.cuda.current_stream().wait_stream(side)
        kept.append(score)  # alive until the end
        maybe_fail("score", step)
    with rlhfmem.phase("train"):
        loss = (model(batch) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        maybe_fail("train", step)
print(f"steps {args.steps}")
