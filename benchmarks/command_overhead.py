"""What ``rlhfmem capture`` costs on a user's command: the command alone vs the same command captured.

    python -m benchmarks.command_overhead [--runs 3] [--json out/command_overhead.json]

For each command (CPU, this machine): wall time of the bare command (``subprocess.run``), wall time of
``run_command`` (the same command with every rank recorded, traces replayed through the allocator model,
ranks gathered; the recorder library already built), and the ranks' own time from torch's import to their
exit, captured. Best of ``--runs`` (and the medians, with each side's range); the commands run
alternately so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pytest_rlhfmem.command.run import recorder_library, run_command

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
COMMANDS = {
    "plain loop (tests/data/commands/plain_train.py)": [sys.executable,
                                                        str(REPO / "tests/data/commands/plain_train.py")],
    "tiny PPO, torchrun x2 (examples/tiny_ppo.py)": [*TORCHRUN, str(REPO / "examples/tiny_ppo.py")],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default=None, help="substring of the command names to run")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    recorder_library()  # built once, as the CLI does before launching
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    rows = {}
    print(f"{'command':50s} {'bare':>8s} {'captured':>9s} {'overhead':>9s} {'ranks, captured':>16s} "
          f"{'trace events':>13s}")
    for name, cmd in COMMANDS.items():
        if a.only and a.only not in name:
            continue
        bare, cap, ranks, events = [], [], [], 0
        for _ in range(a.runs):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **env})
            bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = run_command(cmd, id=name, device="cpu", env=env)
            cap.append(time.perf_counter() - t0)
            assert res["status"] == "ok", res.get("failure")
            ranks.append(res["iteration_wall_s"])
            events = sum(r["events"] for r in res["ranks"])
        row = {"bare_s": round(min(bare), 2), "captured_s": round(min(cap), 2),
               "overhead_pct": round(100 * (min(cap) / min(bare) - 1), 1), "ranks_captured_s": round(min(ranks), 2),
               "trace_events": events, "bare_runs_s": [round(x, 2) for x in bare],
               "captured_runs_s": [round(x, 2) for x in cap],
               "overhead_median_pct": round(100 * (statistics.median(cap) / statistics.median(bare) - 1), 1)}
        rows[name] = row
        print(f"{name:50s} {row['bare_s']:>6.2f} s {row['captured_s']:>7.2f} s {row['overhead_pct']:>+8.1f}% "
              f"{row['ranks_captured_s']:>14.2f} s {events:>13d}", flush=True)
        print(f"{'':50s} medians {statistics.median(bare):.2f} s / {statistics.median(cap):.2f} s "
              f"({row['overhead_median_pct']:+.1f}%); bare runs {_spread(bare)}, captured runs {_spread(cap)}",
              flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f} s"


if __name__ == "__main__":
    sys.exit(main())
