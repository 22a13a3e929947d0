"""Record the run-to-run spread of the iteration time per scenario, for comparisons timed in one round.

    python -m benchmarks.time_spread --strategies none,zero3 --flush none --runs 3 \
        [--world-size 2] [--out baselines/cpu/time_spread.yaml]

Runs each DeepSpeed-Chat tiny-OPT scenario ``--runs`` times in fresh process groups (as the suites do) and
writes, per scenario id, the number of runs, the median iteration time and the relative half-range
``(max - min) / 2 / median``: the interval ``timing.time_figure`` puts around a one-round time of that
scenario (``rlhfmem diff --time-spread FILE``; the plugin reads ``<baselines>/<profile>/time_spread.yaml``).
The spread is the machine's as much as the program's: record it on the machine (and load) that runs CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

import yaml

from pytest_rlhfmem.rlhf.launch import run_scenario
from pytest_rlhfmem.rlhf.scenario import Scenario
from pytest_rlhfmem.timing import rounds_spread


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategies", default="none")
    ap.add_argument("--flush", default="none")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", default="baselines/cpu/time_spread.yaml")
    args = ap.parse_args()
    out = Path(args.out)
    data = yaml.safe_load(out.read_text()) if out.exists() else None
    data = data or {"schema": 1, "notes": "", "entries": {}}
    for strategy in args.strategies.split(","):
        for flush in args.flush.split(","):
            sc = Scenario("deepspeed-chat", "tiny-opt", strategy, flush, args.world_size)
            times = []
            for _ in range(args.runs):
                r = run_scenario(sc, device="cpu", timeout=1800)
                if r["status"] == "ok":
                    times.append(r["iteration_wall_s"])
            if len(times) < 2:
                print(f"{sc.id}: fewer than 2 successful runs, not recorded")
                continue
            med, rel = rounds_spread(times)
            data["entries"][sc.id] = {"runs": len(times), "median_s": round(med, 3), "spread": round(rel, 3),
                                      "times_s": [round(t, 3) for t in times]}
            print(f"{sc.id}: {', '.join(f'{t:.2f}' for t in times)} s -> median {med:.2f} s +-{100 * rel:.0f}%")
    data["notes"] = (f"iteration-time spread, benchmarks/time_spread.py, {dt.date.today()}, "
                     f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
