"""Wall time of a plain CUDA script that asks ``torch.cuda`` for memory figures after every step, captured on the
simulated CUDA device (``rlhfmem capture --device cuda-sim``): each ``memory_allocated()`` answers from the
allocator model fed the device's log so far (``simcuda/torch_cuda.py: LiveAllocator``).

    python -m benchmarks.sim_cuda_queries [--keep 20000] [--queries 2000]

The script makes ``--keep`` allocations first, then ``--queries`` steps of one allocation, one query, one free.
Measured here (2 cores, beside a test run; 2026-11-24): keep 20,000, queries 2,000: the whole capture 2.7 s (the
script's query loop 0.12 s) with queries reading only the log since the previous one; 2 min 14 s when each query
rebuilt the trace from the start (before commit "LiveAllocator reads the device log incrementally"; quadratic in
the run's allocations). The figures answered were the same at each of 300 queries of a script with
``empty_cache()`` calls and a side stream.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import sys
import time

import torch

keep = [torch.empty(1024, device="cuda") for _ in range({keep})]
t0 = time.perf_counter()
for _ in range({queries}):
    y = torch.empty(4096, device="cuda")
    torch.cuda.memory_allocated()
    del y
with open(sys.argv[1], "w") as f:
    f.write(f"{{time.perf_counter() - t0:.2f}} s")
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=int, default=20_000)
    ap.add_argument("--queries", type=int, default=2_000)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "queries.py"
        script.write_text(SCRIPT.format(keep=args.keep, queries=args.queries))
        rlhfmem = Path(sys.executable).with_name("rlhfmem")
        t0 = time.perf_counter()
        loop = Path(d) / "loop.txt"
        out = subprocess.run([str(rlhfmem), "capture", "--device", "cuda-sim", "--",
                              sys.executable, str(script), str(loop)], capture_output=True, text=True, cwd=d,
                             env=os.environ.copy())
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            print(out.stdout[-2000:], out.stderr[-2000:], sep="\n")
            return out.returncode
        took = loop.read_text()
    print(f"keep {args.keep}, queries {args.queries}: capture {wall:.1f} s wall; the script's query loop {took}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
