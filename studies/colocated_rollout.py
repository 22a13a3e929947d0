"""A colocated rollout engine beside a study-scale DeepSpeed-Chat iteration (docs/colocated-rollout.md), simulated:
one recorded trace (the fake-CUDA route's simulated device, ``RLHFMEM_FAKECUDA_SAVE_TRACE=1``) replayed with the vLLM
stand-in (``pytest_rlhfmem/rollout/engine.py``: ``colocated_trace``) engine off, never sleeping, and asleep at levels
1 and 2 with and without the trainer's flush before each wake-up, at 24 GiB and 80 GiB cards. The engine's weights
are the pair's actor in fp16 (parameters counted on the meta device); its forward temporaries are not modelled (0).

    RLHFMEM_FAKECUDA_SAVE_TRACE=1 python -c "from pytest_rlhfmem.fakecuda.run import run_fake_cuda; \\
        from pytest_rlhfmem.rlhf.scenario import Scenario; \\
        run_fake_cuda(Scenario('deepspeed-chat', 'opt-1.3b', 'zero2', 'none', 4), work_dir='OUT', tensors='sim', \\
        keep_work=True)"
    python -m studies.colocated_rollout OUT/deepspeed-chat__opt-1.3b__zero2__flush-none__x4.rlhftrace \\
        --models opt-1.3b --utilization 0.9
"""

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM

from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.memory.trace_io import load_trace
from pytest_rlhfmem.rlhf.models import get_pair, hf_config
from pytest_rlhfmem.rollout import ColocatedEngine, EngineSettingsError, colocated_trace

GIB = 2**30
CAPACITIES = (24 * GIB, 80 * GIB)
ROWS = [("engine off", None), ("never sleeps", (None, False)), ("sleep 1, no flush", (1, False)),
        ("sleep 1, flush before wake-up", (1, True)), ("sleep 2, no flush", (2, False)),
        ("sleep 2, flush before wake-up", (2, True))]


def actor_fp16_bytes(models: str) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(get_pair(models).actor))
    return sum(p.numel() for p in model.parameters()) * 2


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("trace")
    a.add_argument("--models", default="opt-1.3b")
    a.add_argument("--utilization", type=float, default=0.9)
    args = a.parse_args(argv)
    trace = load_trace(args.trace)
    weights = actor_fp16_bytes(args.models)
    print(f"| engine (gpu_memory_utilization {args.utilization}, weights {weights / GIB:.2f} GiB) | "
          + " | ".join(f"{c // GIB} GiB: trainer peak reserved / engine mapped / peak used / retries / OOMs"
                       for c in CAPACITIES) + " |")
    print("|---|" + "---|" * len(CAPACITIES))
    for label, setting in ROWS:
        cells = []
        for cap in CAPACITIES:
            t, mapped = trace, 0
            if setting is not None:
                try:
                    t, info = colocated_trace(trace, ColocatedEngine(weights, args.utilization, setting[0],
                                                                     setting[1]), cap)
                except EngineSettingsError:  # kv_cache_bytes: vLLM raises "No available memory for the cache blocks"
                    cells.append("vLLM raises: no KV cache fits (the trainer's live tensors count)")
                    continue
                mapped = info["engine_mapped_bytes"]
            r = replay(t, capacity=cap)
            cells.append(f"{r.total.peak_reserved / GIB:.2f} / {mapped / GIB:.2f} / {r.peak_device_used / GIB:.2f} GiB"
                         f" / {r.total.alloc_retries} / {r.total.ooms}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nsimulated: the allocator model replaying the simulated device's trace with the engine stand-in's mappings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
