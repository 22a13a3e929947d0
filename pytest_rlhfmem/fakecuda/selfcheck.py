"""One small training step recorded by both routes, for the tests: the fake-CUDA recorder and the CPU
allocator recorder must see the same tensors.

    python -m pytest_rlhfmem.fakecuda.selfcheck fake|cpu

prints a JSON list of ``[action, size]`` device events (``alloc``/``free``, requested bytes) of: build
a tiny OPT causal LM (the ``tiny-opt`` pair's actor, fp32), one forward on ``[2, 16]`` token ids, the LM
loss, backward, and an AdamW step (foreach off). The fake route builds on ``cpu`` (host: not recorded)
and moves the model with ``.to("cuda")``, as DeepSpeed does; the CPU route records from the start, so
the test compares everything after the parameters exist. The cuBLAS workspace is reported apart.
"""

from __future__ import annotations

import json
import sys


def _step(device: str, rec) -> None:
    import torch

    from ..rlhf.models import MODEL_PAIRS, build_causal_lm

    torch.manual_seed(0)
    cfg = dict(MODEL_PAIRS["tiny-opt"].actor.config)
    from ..rlhf.models import ModelSpec

    spec = ModelSpec("opt", {**cfg, "dropout": 0.0, "attention_dropout": 0.0}, "tiny")
    model = build_causal_lm(spec)
    model.config._attn_implementation = "eager"  # one attention kernel on both routes
    if device == "cuda":
        model.to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = torch.randint(3, 1024, (2, 16), device=device)
    with rec.phase("step"):
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out


def main(route: str) -> list:
    if route == "fake":
        from ..simcuda import build

        build.load()
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from . import standins
        from .recorder import FakeCudaRecorder

        torch.set_num_threads(1)
        rec = FakeCudaRecorder()
        standins.install(rec, deepspeed=False)
        with FakeTensorMode(allow_non_fake_inputs=True):
            rec.start()
            _step("cuda", rec)
            trace = rec.stop()
        workspace = rec.adjustments.get("cublas_workspace", {}).get("count", 0)
    else:
        import torch

        from ..record.recorder import Recorder

        torch.set_num_threads(1)
        rec = Recorder("cpu", cuda_emulation=None)  # the raw CPU recorder: the fake route's own adjustments
        rec.start()                                  # (cuBLAS workspaces) are the documented difference
        _step("cpu", rec)
        trace = rec.stop()
        workspace = 0
    events, started = [], False
    for e in trace.events:
        if e.action == "phase":
            started = True
        elif started and e.action in ("alloc", "free"):
            events.append([e.action, e.size])
    return [events, workspace]


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
    sys.stdout.flush()
    import os

    os._exit(0)
