"""Throughput of ``rlhfmem replay FILE --json``, in events/s (alloc + free events), on this machine.

    python benchmarks/replay_throughput.py [--events 1000000] [--repeat 3] [--json out/replay.json]

Workload: a deterministic 1,000,000-event synthetic trace (a training-like mix: many small activations
freed in mostly LIFO order, some large buffers, occasional empty_cache), written as a
``_dump_snapshot`` pickle, as ``rlhfmem run --snapshot-dir`` writes one. Measured:

- ``whole_command``: ``python -m pytest_rlhfmem.cli replay FILE --free-running --json`` in a subprocess,
  wall time including interpreter start (the figure of issue 9; target 1,000,000 events/s);
- in-process, best of ``--repeat``: ``load`` (unpickle, then ``trace_from_snapshot``), ``replay`` (the
  allocator model and the metrics collector, series on, as the command runs it) and ``metrics``
  (``recorded_summary`` + ``agreement`` + the JSON object + ``json.dumps``), so the bound is named;
- the same for ``expandable_segments:True`` (the advisor's what-if), and the real GPU snapshots of
  ../shared/snapshots (or $RLHFMEM_SNAPSHOTS_DIR; never committed here).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_rlhfmem.memory.allocator import AllocatorConfig
from pytest_rlhfmem.memory.replay import agreement, recorded_summary, replay, replay_json
from pytest_rlhfmem.memory.trace import (
    ALLOC, FLUSH, FREE, Event, Trace, load_snapshot, trace_from_snapshot, write_snapshot,
)
from pytest_rlhfmem.shared_snapshots import snapshot_path


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


def n_events(trace: Trace) -> int:
    return sum(1 for e in trace.events if e.action in (ALLOC, FREE))


def best(fn, repeat: int) -> tuple[float, object]:
    t, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return t, out


def in_process(path: Path, repeat: int, conf: str | None) -> dict:
    """load / replay / metrics seconds of one replay of ``path``, as the CLI runs it (free-running)."""
    t_unpickle, snap = best(lambda: load_snapshot(path), repeat)
    t_convert, trace = best(lambda: trace_from_snapshot(snap, source=str(path)), repeat)
    t_load = t_unpickle + t_convert
    config = AllocatorConfig.parse(conf) if conf else None
    t_replay, result = best(lambda: replay(trace, config=config, mode="free-running"), repeat)
    cfg = config or AllocatorConfig()

    def metrics() -> str:
        rec = recorded_summary(trace)
        agree = agreement(rec, result, trace.has_segment_events())
        return json.dumps(replay_json(str(path), "free-running", cfg, trace, result, rec, agree), indent=2)

    t_metrics, _ = best(metrics, repeat)
    n = n_events(trace)
    total = t_load + t_replay + t_metrics
    return {"events": n, "load_s": round(t_load, 3), "unpickle_s": round(t_unpickle, 3),
            "trace_from_snapshot_s": round(t_convert, 3), "replay_s": round(t_replay, 3),
            "metrics_s": round(t_metrics, 3), "events_per_s_in_process": round(n / total),
            "bound_by": max(("load", t_load), ("replay", t_replay), ("metrics", t_metrics), key=lambda x: x[1])[0]}


def whole_command(path: Path, n: int, conf: str | None) -> dict:
    cmd = [sys.executable, "-m", "pytest_rlhfmem.cli", "replay", str(path), "--free-running", "--json"]
    if conf:
        cmd += ["--alloc-conf", conf]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"replay failed: {p.stderr.strip()}")
    return {"whole_command_s": round(wall, 3), "whole_command_events_per_s": round(n / wall)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = synthetic_trace(a.events)
        sim = replay(trace, record_series=False, record_events=True)
        path = write_snapshot(Path(tmp) / "synthetic.pickle", Trace(events=sim.events or [], capture=trace.capture),
                              sim.segments)
        for label, conf in (("synthetic", None), ("synthetic expandable_segments:True", "expandable_segments:True")):
            row = in_process(path, a.repeat, conf)
            row.update(whole_command(path, row["events"], conf))
            out[label] = row
    for name in ("eor_nn", "select_n_a", "cs336_ctx256_fwd", "codeloc_expandable_dev0_dev2", "slime_init_b"):
        p = snapshot_path(name)
        if not p.is_file():
            print(f"{name}: skipped, {p} not found")
            continue
        out[name] = in_process(p, a.repeat, None)
    print(f"{'workload':36s} {'events':>9s} {'load s':>7s} {'(unpickle)':>10s} {'replay s':>8s} {'metrics s':>9s} {'bound':>7s} "  # noqa: E501
          f"{'in-process ev/s':>15s} {'whole cmd s':>11s} {'whole ev/s':>10s}")
    for k, v in out.items():
        print(f"{k:36s} {v['events']:>9,d} {v['load_s']:>7.2f} {v['unpickle_s']:>10.2f} {v['replay_s']:>8.2f} {v['metrics_s']:>9.2f} "  # noqa: E501
              f"{v['bound_by']:>7s} {v['events_per_s_in_process']:>15,d} "
              f"{v.get('whole_command_s', float('nan')):>11.2f} {v.get('whole_command_events_per_s', 0):>10,d}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
