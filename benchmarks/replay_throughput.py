"""Throughput of ``rlhfmem replay FILE --free-running --json``, in events/s (alloc + free events), on this machine.

    python benchmarks/replay_throughput.py [--events 1000000] [--repeat 2] [--json out/replay.json]

Workload: a deterministic 1,000,000-event synthetic trace (a training-like mix: many small activations
freed in mostly LIFO order, some large buffers, occasional empty_cache), in the two inputs the command
reads: a ``_dump_snapshot`` pickle (the replayed trace with its segment events, as ``rlhfmem run
--snapshot-dir`` writes one) and an ``.rlhftrace`` file (``memory/trace_io.py``, as every result saves its
ranks' traces). For each input and each replay engine (``compiled``: ``memory/csrc/replay_core.cpp``;
``python``: ``memory/allocator.py``; ``memory/replay_engine.py`` picks), measured:

- ``whole_command``: ``python -m pytest_rlhfmem.cli replay FILE --free-running --json --engine E`` in a
  subprocess, wall time including interpreter start, every one of ``--repeat`` runs (the figure of
  issue 9; target 1,000,000 events/s);
- in-process, best of ``--repeat``: ``load`` (pickle: unpickle, then the columns; .rlhftrace: read,
  decompress, columns), ``replay`` (the engine, as the command runs it) and ``metrics``
  (``recorded_summary_columns`` + ``agreement`` + the JSON object + ``json.dumps``), so the bound is named;
- ``expandable_segments:True`` (the advisor's what-if; the Python model replays it), and the real GPU
  snapshots of ../shared/snapshots (or $RLHFMEM_SNAPSHOTS_DIR; never committed here).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_rlhfmem.memory.allocator import AllocatorConfig
from pytest_rlhfmem.memory.replay import agreement, replay, replay_columns, replay_json
from pytest_rlhfmem.memory.replay_engine import load_columns_for_replay, recorded_summary_columns
from pytest_rlhfmem.memory.trace import ALLOC, FLUSH, FREE, Event, Trace, write_snapshot
from pytest_rlhfmem.memory.trace_io import save_trace
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


def best(fn, repeat: int) -> tuple[float, object]:
    t, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return t, out


def in_process(path: Path, repeat: int, conf: str | None, engine: str = "auto") -> dict:
    """load / replay / metrics seconds of one replay of ``path``, as the CLI runs it (free-running)."""
    t_load, (cols, recorded_config) = best(lambda: load_columns_for_replay(str(path)), repeat)
    config = AllocatorConfig.parse(conf) if conf else recorded_config
    t_replay, result = best(lambda: replay_columns(cols, config=config, mode="free-running", engine=engine), repeat)

    def metrics() -> str:
        rec = recorded_summary_columns(cols)
        agree = agreement(rec, result, cols.has_segment_events())
        return json.dumps(replay_json(str(path), "free-running", config, cols, result, rec, agree), indent=2)

    t_metrics, _ = best(metrics, repeat)
    n = cols.count(ALLOC, FREE)
    total = t_load + t_replay + t_metrics
    return {"events": n, "engine": result.engine, "load_s": round(t_load, 3), "replay_s": round(t_replay, 3),
            "metrics_s": round(t_metrics, 3), "events_per_s_in_process": round(n / total),
            "bound_by": max(("load", t_load), ("replay", t_replay), ("metrics", t_metrics), key=lambda x: x[1])[0]}


def whole_command(path: Path, n: int, conf: str | None, engine: str, repeat: int) -> dict:
    cmd = [sys.executable, "-m", "pytest_rlhfmem.cli", "replay", str(path), "--free-running", "--json",
           "--engine", engine]
    if conf:
        cmd += ["--alloc-conf", conf]
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        if p.returncode != 0:
            raise SystemExit(f"replay failed: {p.stderr.strip()}")
    return {"whole_command_s": [round(w, 3) for w in walls],
            "whole_command_events_per_s": [round(n / w) for w in walls]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--python-engine", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the Python engine (slow: about 10 s a run)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out: dict = {"loadavg_before": os.getloadavg()}
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = synthetic_trace(a.events)
        rlhftrace = save_trace(Path(tmp) / "synthetic.rlhftrace", trace)
        sim = replay(trace, record_series=False, record_events=True)
        pickle_path = write_snapshot(Path(tmp) / "synthetic.pickle",
                                     Trace(events=sim.events or [], capture=trace.capture), sim.segments)
        engines = ("compiled", "python") if a.python_engine else ("compiled",)
        for label, path in (("rlhftrace", rlhftrace), ("pickle", pickle_path)):
            for engine in engines:
                row = in_process(path, a.repeat, None, engine)
                row.update(whole_command(path, row["events"], None, engine, a.repeat))
                rows[f"synthetic {label} {engine}"] = row
        conf = "expandable_segments:True"
        row = in_process(rlhftrace, 1, conf)
        row.update(whole_command(rlhftrace, row["events"], conf, "auto", 1))
        rows[f"synthetic rlhftrace {conf}"] = row
    for name in ("eor_nn", "select_n_a", "cs336_ctx256_fwd", "codeloc_expandable_dev0_dev2", "slime_init_b"):
        p = snapshot_path(name)
        if not p.is_file():
            print(f"{name}: skipped, {p} not found")
            continue
        rows[name] = in_process(p, a.repeat, None)
    out["rows"] = rows
    out["loadavg_after"] = os.getloadavg()
    print(f"{'workload':46s} {'events':>9s} {'engine':>8s} {'load s':>7s} {'replay s':>8s} {'metrics s':>9s} "
          f"{'bound':>7s} {'in-process ev/s':>15s}  whole command s (ev/s)")
    for k, v in rows.items():
        whole = ", ".join(f"{s:.2f} ({e:,d})" for s, e in zip(v.get("whole_command_s", []),
                                                              v.get("whole_command_events_per_s", [])))
        print(f"{k:46s} {v['events']:>9,d} {v['engine']:>8s} {v['load_s']:>7.2f} {v['replay_s']:>8.2f} "
              f"{v['metrics_s']:>9.2f} {v['bound_by']:>7s} {v['events_per_s_in_process']:>15,d}  {whole or '-'}")
    print(f"load average before/after: {out['loadavg_before']} / {out['loadavg_after']}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
