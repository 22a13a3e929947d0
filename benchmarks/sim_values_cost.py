"""What values cost on the simulated CUDA device: one program, captured on the CPU route and on the simulated
device with values.

    python -m benchmarks.sim_values_cost [--runs 3] [--json out/sim_values_cost.json]

The program is ``tests/data/commands/hf_generate_ppo.py`` (a generate + PPO loop, four models, bf16 autocast):
``--device cpu`` on the CPU route (the script's tensors on the CPU, ``--device cpu`` passed to it) and as written
for a GPU on ``--device cuda-sim`` with values on (the default; without values its generation loop cannot end:
its stopping criteria read device values). For each: the wall time
of the whole capture (launch, the program, the replay) and the rank's host peak RSS, best and median of
``--runs`` runs made alternately so that machine load hits every side alike; the device figures of each (peak
reserved and allocated, simulated). The target of issue 37: values on at most 1.5x the CPU route's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pytest_rlhfmem.command.run import recorder_library, run_command, sim_cuda_library
from pytest_rlhfmem.units import format_size

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests/data/commands/hf_generate_ppo.py")
SIDES = {  # name -> (device, extra arguments of the script, sim_values)
    "CPU route (--device cpu)": ("cpu", ["--device", "cpu"], None),
    "cuda-sim, values on": ("cuda-sim", [], "on"),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    recorder_library()  # built once, as the CLI does before launching
    sim_cuda_library()
    times: dict[str, list[float]] = {k: [] for k in SIDES}
    rss: dict[str, list[int]] = {k: [] for k in SIDES}
    device: dict[str, dict] = {}
    for _ in range(a.runs):
        for name, (where, extra, values) in SIDES.items():
            with tempfile.TemporaryDirectory(prefix="rlhfmem-bench-") as work:
                t0 = time.perf_counter()
                r = run_command([sys.executable, SCRIPT, *extra], "hf-generate-ppo", device=where, timeout=1800,
                                work_dir=work, sim_values=values)
                times[name].append(time.perf_counter() - t0)
                if r["status"] != "ok":
                    print(f"{name}: {r.get('failure')}", file=sys.stderr)
                    return 1
                rss[name].append(int(r["metrics"].get("host_peak_rss") or 0))
                device[name] = {k: r["metrics"][k] for k in ("peak_reserved", "peak_allocated")}
    base = min(times["CPU route (--device cpu)"])
    print("| program run | capture wall time, best / median (s) | vs CPU route | host peak RSS, best | "
          "peak reserved / allocated (simulated) |")
    print("|---|---|---|---|---|")
    for name in SIDES:
        print(f"| {name} | {min(times[name]):.1f} / {statistics.median(times[name]):.1f} | "
              f"{min(times[name]) / base:.2f}x | {format_size(min(rss[name]))} | "
              f"{format_size(device[name]['peak_reserved'])} / {format_size(device[name]['peak_allocated'])} |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"times_s": times, "host_peak_rss": rss, "device": device}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
