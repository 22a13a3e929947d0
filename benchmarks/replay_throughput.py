"""Throughput of ``rlhfmem replay FILE --free-running --json``, in events/s (alloc + free events), on this machine.

    python -m benchmarks.replay_throughput [--events 1000000] [--repeat 2] [--json out/replay.json]

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
  (``recorded_summary`` + ``agreement`` + the JSON object + ``json.dumps``), so the bound is named;
- ``expandable_segments:True`` (the advisor's what-if; the Python model replays it), and the real GPU
  snapshots of ../shared/snapshots (or $RLHFMEM_SNAPSHOTS_DIR; never committed here);
- the pickle's READER (issue 22): the whole command on the same 1M-event pickle with the compiled snapshot
  reader (``memory/csrc/snapshot_reader.cpp``, the default) and with Python's unpickler
  (``RLHFMEM_SNAPSHOT_READER=python``, the path before it), compiled engine both times.

``--pickle-only`` times just the synthetic pickle (both readers, compiled engine).
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

from pytest_rlhfmem.memory.replay import (
    agreement, allocator_config, load_columns_for_replay, recorded_summary, replay, replay_json,
)
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
    def load():  # as the command reads its input (cli.py): the columns and the settings they were recorded with
        cols, recorded = load_columns_for_replay(str(path))
        return cols, allocator_config(recorded.allocator_settings, alloc_conf=conf, source=recorded.source)

    t_load, (cols, config) = best(load, repeat)
    t_replay, result = best(lambda: replay(cols, config=config, mode="free-running", record_series=False,
                                           engine=engine), repeat)

    def metrics() -> str:
        rec = recorded_summary(cols)
        agree = agreement(rec, result, cols.has_segment_events())
        return json.dumps(replay_json(str(path), "free-running", config, cols, result, rec, agree), indent=2)

    t_metrics, _ = best(metrics, repeat)
    n = cols.count(ALLOC, FREE)
    total = t_load + t_replay + t_metrics
    return {"events": n, "engine": result.engine, "load_s": round(t_load, 3), "replay_s": round(t_replay, 3),
            "metrics_s": round(t_metrics, 3), "events_per_s_in_process": round(n / total),
            "bound_by": max(("load", t_load), ("replay", t_replay), ("metrics", t_metrics), key=lambda x: x[1])[0]}


def whole_command(path: Path, n: int, conf: str | None, engine: str, repeat: int, reader: str = "compiled") -> dict:
    """Wall time of ``rlhfmem replay`` in a subprocess; ``reader``: the pickle's reader (``python``: Python's
    unpickler, as before the compiled reader)."""
    cmd = [sys.executable, "-m", "pytest_rlhfmem.cli", "replay", str(path), "--free-running", "--json",
           "--engine", engine]
    if conf:
        cmd += ["--alloc-conf", conf]
    env = dict(os.environ)
    env.pop("RLHFMEM_SNAPSHOT_READER", None)
    if reader == "python":
        env["RLHFMEM_SNAPSHOT_READER"] = "python"
    walls, cpus, used = [], [], None
    for _ in range(repeat):
        r0 = os.times()
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        walls.append(time.perf_counter() - t0)
        r1 = os.times()
        cpus.append(r1.children_user + r1.children_system - r0.children_user - r0.children_system)
        if p.returncode != 0:
            raise SystemExit(f"replay failed: {p.stderr.strip()}")
        used = json.loads(p.stdout).get("snapshot_reader")
    out = {"whole_command_s": [round(w, 3) for w in walls],
           "whole_command_events_per_s": [round(n / w) for w in walls],
           "whole_command_cpu_s": [round(c, 3) for c in cpus]}
    if used is not None:
        out["snapshot_reader"] = used
    return out


def reader_rows(pickle_path: Path, n: int, repeat: int) -> dict:
    """The whole command on ``pickle_path`` with each reader (compiled engine)."""
    rows = {}
    for reader in ("python", "compiled"):
        row = {"events": n, "engine": "compiled", "reader": reader}
        row.update(whole_command(pickle_path, n, None, "compiled", repeat, reader))
        rows[f"synthetic pickle, {reader} reader"] = row
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--python-engine", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the Python engine (slow: about 10 s a run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--pickle-only", action="store_true",
                    help="only the synthetic pickle's whole command, with each reader (compiled engine)")
    a = ap.parse_args()
    out: dict = {"loadavg_before": os.getloadavg()}
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = synthetic_trace(a.events)
        rlhftrace = save_trace(Path(tmp) / "synthetic.rlhftrace", trace)
        sim = replay(trace, record_series=False, record_events=True)
        pickle_path = write_snapshot(Path(tmp) / "synthetic.pickle",
                                     Trace(events=sim.events or [], capture=trace.capture), sim.segments)
        n_pickle = sum(e.action in (ALLOC, FREE) for e in trace.events)
        rows.update(reader_rows(pickle_path, n_pickle, a.repeat))
        if a.pickle_only:
            return report(out, rows, a.json)
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
    return report(out, rows, a.json)


def report(out: dict, rows: dict, json_path: str | None) -> int:
    out["rows"] = rows
    out["loadavg_after"] = os.getloadavg()
    print(f"{'workload':46s} {'events':>9s} {'engine':>8s} {'load s':>7s} {'replay s':>8s} {'metrics s':>9s} "
          f"{'bound':>7s} {'in-process ev/s':>15s}  whole command s (ev/s) [cpu s]")
    for k, v in rows.items():
        whole = ", ".join(f"{s:.2f} ({e:,d})" + (f" [{c:.2f}]" if c is not None else "")
                          for s, e, c in zip(v.get("whole_command_s", []), v.get("whole_command_events_per_s", []),
                                             v.get("whole_command_cpu_s", [None] * 99)))
        if "load_s" not in v:
            print(f"{k:46s} {v['events']:>9,d} {v['engine']:>8s} {'-':>7s} {'-':>8s} {'-':>9s} {'-':>7s} {'-':>15s}  "
                  f"{whole or '-'}")
            continue
        print(f"{k:46s} {v['events']:>9,d} {v['engine']:>8s} {v['load_s']:>7.2f} {v['replay_s']:>8.2f} "
              f"{v['metrics_s']:>9.2f} {v['bound_by']:>7s} {v['events_per_s_in_process']:>15,d}  {whole or '-'}")
    print(f"load average before/after: {out['loadavg_before']} / {out['loadavg_after']}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
