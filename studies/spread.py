"""Run-to-run spread of the simulated figures: each CPU-matrix scenario N times, min/max per metric.

    python -m studies.spread --runs 3 --json out/spread.json
    python -m studies.spread --strategies zero2-offload,lora,hydra --flush none   # host figures too
    python -m studies.spread --strategies none --algorithm grpo --group-size 2 --flush none
    python -m studies.spread --framework colossalchat --strategies none,grad-ckpt \
        --flush none,after-inference,after-training,after-both     # in the colossalai tox environment

Used to set the default budget tolerances (pytest_rlhfmem/budgets.py: DEFAULT_TOLERANCES).
"""

import argparse
import json
import sys
from itertools import product
from pathlib import Path

from pytest_rlhfmem.rlhf.launch import run_scenario
from pytest_rlhfmem.rlhf.scenario import Scenario

METRICS = ("peak_reserved", "peak_allocated", "fragmentation_at_peak", "cuda_malloc_count", "alloc_retries",
           "host_peak_rss", "host_pinned_peak")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--framework", default="deepspeed-chat")
    ap.add_argument("--models", default="tiny-opt")
    ap.add_argument("--strategies", default="none,zero1,zero2,zero3,zero3-offload,grad-ckpt,all")
    ap.add_argument("--flush", default="none,after-inference")
    ap.add_argument("--algorithm", default="ppo")
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = {}
    for strategy, flush in product(a.strategies.split(","), a.flush.split(",")):
        s = Scenario(a.framework, a.models, strategy, flush, 2, {"group_size": a.group_size} if a.group_size else {},
                     a.algorithm)
        runs = [run_scenario(s, device="cpu") for _ in range(a.runs)]
        bad = [r for r in runs if r["status"] != "ok"]
        if bad:
            print(s.id, "FAILED", bad[0]["failure"], file=sys.stderr)
            continue
        row = {}
        for m in METRICS:
            vals = [r["metrics"][m] for r in runs]
            lo, hi = min(vals), max(vals)
            row[m] = {"min": lo, "max": hi, "spread_pct": round(100.0 * (hi - lo) / hi, 3) if hi else 0.0}
        row["wall_s"] = [r["wall_s"] for r in runs]
        out[s.id] = row
        print(s.id, {m: (row[m]["min"], row[m]["max"], row[m]["spread_pct"]) for m in METRICS}, flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
