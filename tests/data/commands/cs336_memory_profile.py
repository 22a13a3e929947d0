"""A plain CUDA memory-profiling script, written the way CS336 assignment-2 profiling scripts are
(``memory_profile`` in ``cs336_systems/nsys_profile.py`` of Wedsonlin/assignment2-systems): the model is
built on the host and moved with ``.to("cuda")``, inputs are drawn on the GPU, warm-up steps run, then the
memory history of ONE step is recorded and dumped. No seed, no rlhfmem import: ``rlhfmem capture --device
cuda-sim`` runs it unchanged. The model code is the project's rebuild (pytest_rlhfmem/fidelity/cs336_lm.py).

    python cs336_memory_profile.py --mode inference --context-length 128 --out snap.pickle
"""

import argparse
import contextlib

import torch

from pytest_rlhfmem.fidelity.cs336_lm import AdamW, TransformerLM, cross_entropy, lm_config

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="medium")
ap.add_argument("--context-length", type=int, default=128)
ap.add_argument("--batch-size", type=int, default=4)
ap.add_argument("--mode", choices=("inference", "training"), default="inference")
ap.add_argument("--warmups", type=int, default=5)
ap.add_argument("--autocast", choices=("none", "bf16"), default="none")
ap.add_argument("--out", default="memory_snapshot.pickle")
args = ap.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"device {device}: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
cfg = lm_config(args.size, args.context_length)
model = TransformerLM(cfg).to(device)
optimizer = AdamW(model.parameters())
shape = (args.batch_size, args.context_length)
inputs = torch.randint(0, cfg.vocab_size, (args.warmups, *shape), device=device)
step_inputs = torch.randint(0, cfg.vocab_size, (1, *shape), device=device)
if args.mode == "training":
    targets = torch.randint(0, cfg.vocab_size, (args.warmups, *shape), device=device)
    step_targets = torch.randint(0, cfg.vocab_size, (1, *shape), device=device)
amp = (torch.autocast(device_type=device, dtype=torch.bfloat16) if args.autocast == "bf16"
       else contextlib.nullcontext())

if args.mode == "inference":
    model.eval()
    with torch.inference_mode():
        for i in range(args.warmups):
            with amp:
                model(inputs[i])
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        with amp:
            model(step_inputs[0])
else:
    model.train()
    for i in range(args.warmups):  # the previous step's logits and loss stay referenced until reassigned
        with amp:
            logits = model(inputs[i])
            loss = cross_entropy(logits, targets[i])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if args.warmups:
        del logits, loss
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    with amp:
        logits = model(step_inputs[0])
        loss = cross_entropy(logits, step_targets[0])
    loss.backward()
    optimizer.step()
torch.cuda.synchronize()
torch.cuda.memory._dump_snapshot(args.out)
torch.cuda.memory._record_memory_history(enabled=None)
print(f"peak allocated {torch.cuda.max_memory_allocated()} B, peak reserved {torch.cuda.max_memory_reserved()} B")
