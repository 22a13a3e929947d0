"""CPU wall time per scenario and the capture overhead (captured vs bare iteration).

    python -m benchmarks.capture_overhead [--strategies none,zero3] [--runs 1] [--json out/capture.json]

For each scenario (tiny OPT, 2 CPU ranks): the launcher's wall time (process start to results), the
iteration's own wall time (slowest rank, engines built to last step), with the allocation recorder on
and off, and the overhead of capture on the iteration time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pytest_rlhfmem.rlhf.launch import run_scenario
from pytest_rlhfmem.rlhf.scenario import Scenario


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategies", default="none,zero1,zero2,zero3,zero3-offload,grad-ckpt,all")
    ap.add_argument("--models", default="tiny-opt")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = {}
    print(f"{'scenario':52s} {'wall captured':>14s} {'iter captured':>14s} {'iter bare':>10s} {'overhead':>9s}")
    for strategy in a.strategies.split(","):
        s = Scenario("deepspeed-chat", a.models, strategy, "none", 2)
        cap = [run_scenario(s, device="cpu") for _ in range(a.runs)]
        bare = [run_scenario(s, device="cpu", capture=False) for _ in range(a.runs)]
        if any(r["status"] != "ok" for r in cap + bare):
            print(s.id, "FAILED", file=sys.stderr)
            continue
        it_cap = min(r["iteration_wall_s"] for r in cap)
        it_bare = min(r["iteration_wall_s"] for r in bare)
        row = {"wall_s_captured": min(r["wall_s"] for r in cap), "iteration_s_captured": it_cap,
               "iteration_s_bare": it_bare, "overhead_pct": round(100 * (it_cap / it_bare - 1), 1)}
        rows[s.id] = row
        print(f"{s.id:52s} {row['wall_s_captured']:>12.1f} s {it_cap:>12.2f} s {it_bare:>8.2f} s "
              f"{row['overhead_pct']:>+8.1f}%", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
