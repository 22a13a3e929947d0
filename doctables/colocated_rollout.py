"""A colocated rollout engine beside a real DeepSpeed-Chat iteration (docs/colocated-rollout.md), simulated: one
PPO iteration (tiny OPT, ZeRO-2, world size 1) recorded on the CPU, then replayed with the vLLM stand-in
(``pytest_rlhfmem/rollout/engine.py``) engine off, never sleeping, and asleep at levels 1 and 2 with and without the
trainer's flush before each wake-up, at two device capacities. Every figure is the allocator model's (simulated).

    python -m doctables.colocated_rollout
"""

import sys
import tempfile

from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.memory.trace_io import load_trace
from pytest_rlhfmem.rlhf.launch import run_scenario
from pytest_rlhfmem.rlhf.scenario import Scenario
from pytest_rlhfmem.rollout import ColocatedEngine, colocated_trace

MIB = 2**20
CAPACITIES = (128 * MIB, 160 * MIB)  # simulated devices sized to the tiny iteration
UTILIZATION = 0.72  # vLLM's gpu_memory_utilization
WEIGHTS = 2 * MIB  # the engine's copy of tiny OPT's actor
ACTIVATIONS = 1 * MIB  # the engine's forward temporaries (its profile run's peak above the weights)
ROWS = [("engine off", None), ("never sleeps", (None, False)), ("sleep 1, no flush", (1, False)),
        ("sleep 1, flush before wake-up", (1, True)), ("sleep 2, no flush", (2, False)),
        ("sleep 2, flush before wake-up", (2, True))]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        r = run_scenario(Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1), device="cpu", work_dir=tmp)
        if r["status"] != "ok":
            print(r["failure"], file=sys.stderr)
            return 1
        trace = load_trace(r["ranks"][0]["trace_file"])
    head = " | ".join(f"{c // MIB} MiB: engine mapped / peak used / retries / OOMs" for c in CAPACITIES)
    print(f"| engine (gpu_memory_utilization {UTILIZATION}) | trainer peak reserved | {head} |")
    print("|---|---|" + "---|" * len(CAPACITIES))
    for label, setting in ROWS:
        cells, trainer_peak = [], None
        for cap in CAPACITIES:
            if setting is None:
                t, mapped = trace, 0
            else:
                level, flush = setting
                engine = ColocatedEngine(WEIGHTS, UTILIZATION, level, flush, ACTIVATIONS)
                t, info = colocated_trace(trace, engine, cap)
                mapped = info["engine_mapped_bytes"]
            res = replay(t, capacity=cap)
            trainer_peak = res.total.peak_reserved if trainer_peak is None else trainer_peak
            cells.append(f"{mapped / MIB:.0f} MiB / {res.peak_device_used / MIB:.0f} MiB / {res.total.alloc_retries}"
                         f" / {res.total.ooms}")
        print(f"| {label} | {trainer_peak / MIB:.0f} MiB | " + " | ".join(cells) + " |")
    print("\nsimulated: the allocator model replaying a CPU-recorded trace with the engine stand-in's mappings; "
          "trainer peak reserved at the first capacity")
    base = replay(trace)
    print(f"\nsimulated, after training (engine off): reserved {base.final_reserved / MIB:.0f} MiB, allocated "
          f"{base.final_allocated / MIB:.0f} MiB. gpu_memory_utilization 0.30 to 0.95 where the wake-up fails without "
          "the flush and fits with it (sleep level 1):")
    for cap in CAPACITIES:
        window = []
        for k in range(66):
            util = round(0.30 + 0.01 * k, 2)
            ooms = [replay(colocated_trace(trace, ColocatedEngine(WEIGHTS, util, 1, flush, ACTIVATIONS), cap)[0],
                           capacity=cap).total.ooms for flush in (False, True)]
            if ooms[0] and not ooms[1]:
                window.append(f"{util:.2f}")
        print(f"- {cap // MIB} MiB: {', '.join(window) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
