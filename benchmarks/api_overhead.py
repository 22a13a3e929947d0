"""Cost of the public API's marks when no capture is active (the production case), per call.

    python -m benchmarks.api_overhead [--calls 1000000] [--json out/api_overhead.json]

Times ``with rlhfmem.phase(name):``, ``rlhfmem.flush_point(name)`` and ``rlhfmem.host_resident(ts)``
against the same loop with an empty ``with`` of a shared null context and with ``pass``; best of 5
repeats of ``--calls`` calls each (``timeit``). Also checks that importing the API loaded neither torch
nor the recorder. For scale: one PPO phase of the tiny example is about a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import pytest_rlhfmem as rlhfmem

    heavy = [m for m in sys.modules
             if m == "torch" or m.startswith(("pytest_rlhfmem.memory", "pytest_rlhfmem.command"))]
    assert rlhfmem.active() is None and not heavy, heavy
    setup = "import contextlib, pytest_rlhfmem as rlhfmem; null = contextlib.nullcontext(); ts = [None]"
    cases = {
        "loop with pass (floor)": "pass",
        "with contextlib.nullcontext()": "with null:\n    pass",
        "with rlhfmem.phase(name)": "with rlhfmem.phase('generate'):\n    pass",
        "rlhfmem.flush_point(name)": "rlhfmem.flush_point('after-generate')",
        "rlhfmem.host_resident(tensors)": "rlhfmem.host_resident(ts)",
    }
    rows = {}
    print(f"{'call (no capture active)':34s} {'ns per call':>12s}")
    for name, stmt in cases.items():
        best = min(timeit.repeat(stmt, setup=setup, number=a.calls, repeat=5))
        rows[name] = round(best / a.calls * 1e9, 1)
        print(f"{name:34s} {rows[name]:>12.1f}")
    print(f"python {sys.version.split()[0]}, torch imported: {'torch' in sys.modules}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
