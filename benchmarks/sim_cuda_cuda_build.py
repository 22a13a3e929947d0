"""The simulated CUDA device on a CUDA build of torch (issue 35's device check), no GPU used.

    CUDA_VISIBLE_DEVICES= python -m benchmarks.sim_cuda_cuda_build [--compare-python CPU_BUILD_PYTHON] [--json OUT]

Runs, with this interpreter's torch, (1) ``rlhfmem capture --device cuda-sim`` of
``tests/data/commands/cs336_memory_profile.py --size small --mode inference --context-length 64`` and (2) the
fake-CUDA cell ``run_fake_cuda(Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1), tensors="sim")``, and
prints their figures (bytes; simulated). Each is held against ``--compare-python``'s run of the same (a CPU build's
interpreter) or, without it, against :data:`CPU_BUILD_FIGURES` (torch 2.13.0+cpu, DeepSpeed 0.19.8, transformers
5.23.0). Exit status 0 when every figure matches, 1 otherwise; on a CPU build it says so and checks the same.

Measured on the development machine (no GPU): torch 2.14.1+cu130 gave the CPU build's figures exactly for both
(cs336: 597,688,320 B reserved, 537,893,888 B allocated, 32 cudaMalloc, the same 644 allocation sizes in order;
cell: 85,983,232 / 48,329,728 / 14, its trace 12 events longer in train_critic, from 2.14's clamp/maximum backward
formulas, not from the build).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIGURES = ("peak_reserved", "peak_allocated", "cuda_malloc_count")
CPU_BUILD_FIGURES = {
    "cs336-small-inference-ctx64": {"peak_reserved": 597_688_320, "peak_allocated": 537_893_888,
                                    "cuda_malloc_count": 32},
    "deepspeed-chat/tiny-opt/zero2/x1": {"peak_reserved": 85_983_232, "peak_allocated": 48_329_728,
                                         "cuda_malloc_count": 14},
}
CELL = """
import json, sys
from pytest_rlhfmem.fakecuda.run import run_fake_cuda
from pytest_rlhfmem.rlhf.scenario import Scenario
s = Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1)
r = run_fake_cuda(s, tensors="sim", timeout=900)[s.id]
print("CELL " + json.dumps({"status": r["status"], "error": r.get("error"), "total": r.get("total"),
                            "torch": r["versions"]["torch"]}))
"""
PROBE = """
import json
from pytest_rlhfmem.simcuda.build import SIM_SOURCE, library_path, load_built
took = load_built(library_path(SIM_SOURCE))
import torch
from pytest_rlhfmem.simcuda.library import drop_python_gpu_kernels
print("PROBE " + json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "took": took,
                             "dropped": drop_python_gpu_kernels()}))
"""


def _env() -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def _line(out: str, tag: str) -> dict:
    line = next((ln for ln in out.splitlines() if ln.startswith(tag + " ")), None)
    if line is None:
        raise RuntimeError(f"no {tag} line: {out[-2000:]}")
    return json.loads(line[len(tag) + 1:])


def run_all(python: str) -> dict:
    """The probe and both runs with ``python``; figures in bytes."""
    env = _env()
    out: dict = {}
    p = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, env=env, timeout=900)
    out["probe"] = _line(p.stdout, "PROBE") if p.returncode == 0 else {"failed": p.stderr.strip()[-600:]}
    with tempfile.TemporaryDirectory(prefix="rlhfmem-sim-cuda-build-") as d:
        result = Path(d) / "cs336.json"
        cli = [python, "-c", "import sys; from pytest_rlhfmem.cli import main; sys.exit(main())"]  # `rlhfmem`
        cmd = [*cli, "capture", "--device", "cuda-sim", "--json", str(result),
               "--id", "cs336-small-inference-ctx64", "--", python,
               str(REPO / "tests/data/commands/cs336_memory_profile.py"), "--size", "small", "--mode", "inference",
               "--context-length", "64", "--out", str(Path(d) / "snap.pickle")]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=d, timeout=900)
        if result.exists():
            r = json.loads(result.read_text())
            out["cs336-small-inference-ctx64"] = {"status": r["status"], **{k: r["metrics"].get(k) for k in FIGURES}}
        else:
            out["cs336-small-inference-ctx64"] = {"status": f"failed: {(p.stderr or p.stdout).strip()[-600:]}"}
    p = subprocess.run([python, "-c", CELL], capture_output=True, text=True, env=env, timeout=900)
    try:
        c = _line(p.stdout, "CELL")
        out["deepspeed-chat/tiny-opt/zero2/x1"] = {"status": c["status"] if c["status"] != "failed" else
                                                   f"failed: {c['error']}",
                                                   **{k: (c["total"] or {}).get(k) for k in FIGURES}}
    except RuntimeError:
        out["deepspeed-chat/tiny-opt/zero2/x1"] = {"status": f"failed: {p.stderr.strip()[-600:]}"}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare-python", help="a CPU build's interpreter: its figures are the expected ones")
    ap.add_argument("--json", help="write both sides' figures here (bytes)")
    args = ap.parse_args(argv)
    got = run_all(sys.executable)
    expected = run_all(args.compare_python) if args.compare_python else CPU_BUILD_FIGURES
    print(f"torch here: {got['probe']}")
    ok = True
    for name, want in CPU_BUILD_FIGURES.items():
        want = {k: expected[name].get(k) for k in FIGURES} if args.compare_python else want
        have = got[name]
        same = have.get("status") == "ok" and all(have.get(k) == want[k] for k in FIGURES)
        ok = ok and same
        print(f"{name}: {'same' if same else 'DIFFERS'}: here {have}, expected {want} (simulated, bytes)")
    if args.json:
        Path(args.json).write_text(json.dumps({"here": got, "expected": expected}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
