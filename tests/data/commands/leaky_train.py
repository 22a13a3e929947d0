"""A tiny RLHF-style trainer (generate / score / train) that marks its iterations, with an optional leak.

    python leaky_train.py [--steps N] [--leak] [--host-leak MIB]

Each step is ``rlhfmem.iteration()`` then three phases. ``--leak`` keeps every step's log-probs (``[64, 16384]``
fp32, 4 MiB) in a list "for logging" without ``.item()`` or ``.cpu()``: the leak of verl #630 / #1232 in miniature,
a list of per-step tensors kept alive. ``--host-leak MIB`` keeps MIB of host bytes per step instead (the step's
rollout records, verl #630's host memory climb); on the CPU route they are host memory, outside the device trace.
Without either the step's tensors are freed by the next step. The number of
steps defaults to ``$RLHFMEM_ITERATIONS`` (what ``rlhfmem_command(..., iterations=N)`` asks), else 4.
"""

import argparse
import os

import torch

import pytest_rlhfmem as rlhfmem

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=int(os.environ.get("RLHFMEM_ITERATIONS", "4")))
ap.add_argument("--leak", action="store_true")
ap.add_argument("--host-leak", type=int, default=0, metavar="MIB")
args = ap.parse_args()

torch.manual_seed(0)
HIDDEN, VOCAB, BATCH = 64, 16384, 64
policy = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 128), torch.nn.ReLU(), torch.nn.Linear(128, VOCAB))
opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
logged = []  # what a logging hook keeps
for _step in range(args.steps):
    rlhfmem.iteration()
    prompts = torch.randn(BATCH, HIDDEN)
    with rlhfmem.phase("generate"), torch.no_grad():
        actions = policy(prompts).argmax(-1)  # [B]
    with rlhfmem.phase("score"):
        logprobs = torch.log_softmax(policy(prompts), -1)  # [B, VOCAB]
        chosen = logprobs.gather(1, actions[:, None]).squeeze(1)  # [B]
        if args.leak:
            logged.append(logprobs.detach())  # the bug: 4 MiB of every step stays alive
        else:
            logged.append(float(chosen.mean()))
        if args.host_leak:
            logged.append(b"\x01" * (args.host_leak << 20))  # host bytes, written (resident)
    with rlhfmem.phase("train"):
        loss = -(chosen * torch.randn(BATCH)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del logprobs, chosen, loss, actions, prompts
print(f"{args.steps} steps, {len(logged)} logged")
