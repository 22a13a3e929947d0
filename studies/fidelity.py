"""How far is a CPU figure from a GPU's? Public GPU-recorded workloads rerun on CPU, before/after each
CUDA emulation adjustment.

    python -m studies.fidelity [--workloads wedson_medium_128_inference,wedson_medium_256_training]
                                               [--warmups 5] [--json out/fidelity.json]

For each workload (``pytest_rlhfmem/fidelity/workloads.py``): ONE CPU run under the recorder with the op
markers on; its rows are turned into a device trace with no emulation, then with the adjustments of
``pytest_rlhfmem/record/emulation.py`` added one at a time (cumulative), each replayed through the
allocator model and compared with the GPU recording over the same window (the recorded step, after the
warm-ups). Simulated figures (CPU capture) beside recorded ones (GPU); sizes in bytes.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from pytest_rlhfmem.fidelity.workloads import WORKLOADS, capture, captured_figures, compare, recorded_figures
from pytest_rlhfmem.record.emulation import ADJUSTMENTS, EmulationSettings
from pytest_rlhfmem.shared_snapshots import missing_reason, snapshot_path

FIGURES = ("peak_reserved", "peak_allocated", "fragmentation_at_peak", "cuda_malloc_count", "reserved_at_start")


def variants() -> list[tuple[str, EmulationSettings | None]]:
    """No emulation, then each adjustment added in turn (cumulative)."""
    out: list[tuple[str, EmulationSettings | None]] = [("off", None)]
    for i in range(1, len(ADJUSTMENTS) + 1):
        out.append(("+ " + ADJUSTMENTS[i - 1], EmulationSettings(adjustments=ADJUSTMENTS[:i])))
    return out


def fmt(v) -> str:
    return "-" if v is None else f"{v:,}"


def run(name: str, warmups: int, dump: str | None = None, from_dump: str | None = None, **overrides) -> dict:
    workload = WORKLOADS[name]
    path = snapshot_path(workload.snapshot)
    reason = missing_reason(path)
    if reason:
        raise SystemExit(f"fidelity: error: {reason}")
    rec_fig = recorded_figures(path)
    markers_only = EmulationSettings(adjustments=())
    t0 = time.perf_counter()
    if from_dump:  # re-derive from a saved run's rows (same capture, later emulation code)
        import pickle

        from pytest_rlhfmem.record.recorder import Recorder

        with open(Path(from_dump) / f"{name}.rows.pickle", "rb") as f:
            saved = pickle.load(f)
        rec = Recorder("cpu", cuda_emulation=markers_only)
        rec._marks, rows, run_s, warmups = saved["marks"], saved["rows"], saved.get("run_s"), saved.get("warmups")
    else:
        _trace, rec, run_s = capture(workload, markers_only, warmups=warmups, keep_raw_rows=True, **overrides)
        rows = rec.raw_rows
    if dump:  # the raw recorder rows and markers, to re-derive traces without rerunning the workload
        import pickle

        Path(dump).mkdir(parents=True, exist_ok=True)
        with open(Path(dump) / f"{name}.rows.pickle", "wb") as f:
            pickle.dump({"rows": rows, "marks": rec._marks, "run_s": round(run_s, 1), "warmups": warmups}, f,
                        protocol=4)
    result = {"workload": name, "warmups": warmups, "cpu_run_s": run_s and round(run_s, 1), "variants": {},
              "from_dump": from_dump}
    for label, settings in variants():
        trace = rec.trace_from_rows(rows, settings)
        cmp = compare(rec_fig, captured_figures(trace))
        cmp["emulation_report"] = rec.emulation_report.to_dict() if settings else None
        result["variants"][label] = cmp
    result["total_s"] = round(time.perf_counter() - t0, 1)
    return result


def print_table(res: dict) -> None:
    print(f"\n{res['workload']}  (CPU run {res['cpu_run_s']} s with {res['warmups']} warm-ups; "
          f"captured = simulated from the CPU trace, recorded = GPU)")
    head = f"{'capture':28s}" + "".join(f"{f:>24s}" for f in FIGURES) + f"{'sizes matched':>15s}{'allocs':>14s}"
    print(head)
    first = next(iter(res["variants"].values()))
    print(f"{'GPU recording':28s}" + "".join(f"{fmt(first[f]['recorded']):>24s}" for f in FIGURES)
          + f"{'':>15s}{first['allocations']['recorded']:>14,}")
    for label, v in res["variants"].items():
        cells = "".join(f"{fmt(v[f]['captured']) + (' =' if v[f]['equal'] else ''):>24s}" for f in FIGURES)
        a = v["allocations"]
        print(f"{label:28s}{cells}{a['share_matched']:>15.2%}{a['captured']:>14,}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--warmups", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dump", default=None, metavar="DIR", help="also save each run's raw recorder rows here")
    ap.add_argument("--from-dump", default=None, metavar="DIR", help="no run: re-derive from rows saved by --dump")
    a = ap.parse_args()
    results = []
    for name in a.workloads.split(","):
        if name not in WORKLOADS:
            print(f"fidelity: error: workload {name!r}: allowed values are {', '.join(WORKLOADS)}", file=sys.stderr)
            return 2
        res = run(name, a.warmups, a.dump, a.from_dump)
        res["max_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        print_table(res)
        results.append(res)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
