"""Wall time of ``rlhfmem advise``'s whole sweep on a large synthetic trace, one process vs both cores.

    python -m benchmarks.advise_sweep [--events 1000000] [--phases 8] [--max-flushes 3] [--json out.json]

The trace is the replay benchmark's training-like mix (``replay_throughput.synthetic_trace``) cut into
``--phases`` recipe phases (init, generate, infer_*, train_*) with phase_end marks, and a large
activation per inference phase that is freed at its end, so flushes have something to release. It is
saved as a result JSON with its trace file (the advisor's real input path: file loading included) and
advised with ``--processes 1`` and ``--processes 2``. Target (issue 13): the whole sweep within 60 s on
this 2-core machine. Every candidate is replayed by the compiled core (``memory/replay_engine.py``) unless
it cannot be; the rank's columns reach the two worker processes by fork. Also printed: the input loading
alone (``load_inputs``: the trace file, the program's events, columns and boundaries), which runs in one
process before the sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.replay_throughput import synthetic_trace

from pytest_rlhfmem.advise import advise, load_inputs
from pytest_rlhfmem.memory.trace import ALLOC, FREE, PHASE, PHASE_END, Event, Trace
from pytest_rlhfmem.memory.trace_io import save_trace

PHASES = ("init", "generate", "infer_actor", "infer_reference", "infer_reward", "infer_critic", "train_actor",
          "train_critic")


def phased_trace(n_events: int, phases: int) -> Trace:
    base = synthetic_trace(n_events).events
    names = [PHASES[i % len(PHASES)] + ("" if i < len(PHASES) else f"_{i}") for i in range(phases)]
    out: list[Event] = []
    per = len(base) // phases
    big = 1 << 50
    for k, name in enumerate(names):
        out.append(Event(PHASE, name=name))
        chunk = base[k * per:(k + 1) * per if k + 1 < phases else len(base)]
        if name.startswith("infer") or name == "generate":
            out.append(Event(ALLOC, big + k, (64 + 16 * k) << 20))
            out.extend(chunk)
            out.append(Event(FREE, big + k, (64 + 16 * k) << 20))
        else:
            out.extend(chunk)
        out.append(Event(PHASE_END, name=name))
    return Trace(events=out)


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the pool's workers)."""
    me, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + ch.ru_utime + ch.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--phases", type=int, default=8)
    ap.add_argument("--max-flushes", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--processes", default="2,1", help="comma-separated process counts to time (default 2,1)")
    args = ap.parse_args()
    trace = phased_trace(args.events, args.phases)
    out = {"events": len(trace.events), "phases": args.phases, "cpus": os.cpu_count(),
           "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as d:
        tf = save_trace(Path(d) / "trace-rank0.rlhftrace", trace)
        rp = Path(d) / "result.json"
        rp.write_text(json.dumps({"scenario_id": "synthetic/1M", "capture": "synthetic",
                                  "ranks": [{"rank": 0, "trace_file": str(tf)}]}))
        t0 = time.perf_counter()
        load_inputs(rp)
        out["load_inputs_seconds"] = round(time.perf_counter() - t0, 2)
        print(f"load_inputs alone: {out['load_inputs_seconds']:.1f} s", flush=True)
        for procs in (int(p) for p in args.processes.split(",")):
            cpu0 = _cpu_s()
            t0 = time.perf_counter()
            doc = advise(rp, max_flushes=args.max_flushes, processes=procs)
            dt = time.perf_counter() - t0
            cpu = _cpu_s() - cpu0
            s = doc["scenarios"][0]
            out[f"processes_{procs}"] = {"seconds": round(dt, 2), "cpu_seconds": round(cpu, 2),
                                         "replays": s["replays"], "recommendation": s["recommendation"]["text"]}
            # On a loaded machine wall time measures the other tenants; CPU seconds / processes is what an
            # idle machine of this speed would take (perfect balance assumed).
            print(f"processes={procs}: wall {dt:.1f} s, CPU {cpu:.1f} s (idle-machine estimate {cpu / procs:.1f} s) "
                  f"for {s['replays']} replays of {len(trace.events)} events; {s['recommendation']['text']}",
                  flush=True)
    out["loadavg_after"] = os.getloadavg()
    print(f"load average before/after: {out['loadavg_before']} / {out['loadavg_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
