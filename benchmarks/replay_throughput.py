"""Replay throughput of the allocator model, in events/s (alloc + free events), on this machine.

    python benchmarks/replay_throughput.py [--events 1000000] [--json out/replay.json]

Two workloads: a 1,000,000-event synthetic trace (a training-like mix: many small activations freed in
LIFO order, some large buffers, occasional empty_cache) and the three real GPU snapshots of
../shared/snapshots (or $RLHFMEM_SNAPSHOTS_DIR; they are never committed here). Best of --repeat runs; metrics series on (the default replay).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.shared_snapshots import snapshot_path
from pytest_rlhfmem.memory.trace import ALLOC, FLUSH, FREE, Event, Trace, load_snapshot, trace_from_snapshot



def synthetic_trace(n_events: int, seed: int = 0) -> Trace:
    """A deterministic trace of ``n_events`` alloc/free events (plus rare FLUSH markers)."""
    rng = random.Random(seed)
    sizes = [512, 4096, 65536, 262144, 1 << 20, 3 << 20, 8 << 20, 24 << 20, 96 << 20]
    weights = [30, 20, 15, 10, 8, 7, 5, 4, 1]
    events: list[Event] = []
    live: list[tuple[int, int]] = []
    addr = 1 << 20
    while len(events) < n_events:
        if live and (len(live) > 400 or rng.random() < 0.48):
            i = len(live) - 1 - min(int(rng.expovariate(0.3)), len(live) - 1)  # mostly LIFO
            a, s = live.pop(i)
            events.append(Event(FREE, a, s))
        else:
            s = rng.choices(sizes, weights)[0] + rng.randrange(0, 4096)
            addr += 1 << 12
            live.append((addr, s))
            events.append(Event(ALLOC, addr, s))
        if rng.random() < 1e-4:
            events.append(Event(FLUSH, name="bench"))
    return Trace(events=events)


def measure(trace: Trace, repeat: int) -> float:
    n = sum(1 for e in trace.events if e.action in (ALLOC, FREE))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        replay(trace)
        best = min(best, time.perf_counter() - t0)
    return n / best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = {"synthetic": {"events": a.events, "events_per_s": round(measure(synthetic_trace(a.events), a.repeat))}}
    for name in ("eor_nn", "select_n_a", "cs336_ctx256_fwd"):
        p = snapshot_path(name)
        if not p.is_file():
            print(f"{name}: skipped, {p} not found")
            continue
        tr = trace_from_snapshot(load_snapshot(p))
        out[p.stem] = {"events": sum(1 for e in tr.events if e.action in (ALLOC, FREE)),
                       "events_per_s": round(measure(tr, a.repeat * 3))}
    for k, v in out.items():
        print(f"{k:24s} {v['events']:>9,d} events  {v['events_per_s']:>10,d} events/s")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
