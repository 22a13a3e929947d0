"""The study's DeepSpeed-Chat Table 1 at the study's scale, without a GPU (fake-CUDA route, simulated).

OPT-1.3b actor/reference + OPT-350m critic/reward, LoRA dim 128, batch 2, prompt 256 + answer 256, fp16,
4 ranks (rank 0 simulated on a fake process group), strategies none / ZeRO-2 / ZeRO-3 / ZeRO-3 + offload
/ all, each with flush none and after-inference. Each strategy runs ONCE with the after-inference flush
marks; the flush-none figures replay the same trace without the policy's flush marks (a simulated run's
allocations do not depend on the allocator). Prints the Table-1-shaped result beside Zhou et al.'s
numbers, with the phase of each peak, and the time per strategy (each strategy's line as it finishes, and
a block at the end: process and iteration wall and CPU time), and writes every result JSON to --out.

    python -m studies.study_scale [--strategies none,zero2] [--out DIR] [--jobs 2] [--tensors sim|fake]

``--tensors sim`` (default): the simulated CUDA device (``simcuda/csrc/sim_cuda.cpp``); ``fake``:
``FakeTensorMode`` with the dispatcher recorder. Figures are simulated (the allocator model replaying
the recorded device trace), in GiB (2**30 bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pytest_rlhfmem.fakecuda.run import FakeCudaRunError, run_fake_cuda
from pytest_rlhfmem.rlhf.scenario import Scenario

# Zhou et al., Table 1, DeepSpeed-Chat OPT (GB): reserved, frag, allocated -> reserved, frag with empty_cache
STUDY = {
    "none": (18.8, 0.2, 18.2, 19.4, 0.1),
    "zero2": (14.5, 0.6, 12.8, 14.3, 0.1),
    "zero3": (17.3, 3.7, 12.0, 13.7, 0.3),
    "zero3-offload": (15.4, 4.0, 9.8, 11.7, 0.3),
    "all": (11.8, 6.2, 5.4, 5.9, 0.1),
}
GIB = 2**30
# What run_1.3b.sh ran on the study's DeepSpeed beyond the pair's defaults (configs.STUDY_SCRIPT_SETTINGS): the
# Hybrid Engine's inference kernels injected into OPT, which DeepSpeed 0.19.8 does not do with the pinned transformers
# 5.23.0 (5.24.0 made it: constraints/README.md), and the fake-CUDA route runs as stand-ins
# (fakecuda/inference_kernels.py). The default of --overrides.
SCRIPTS_OVERRIDES = {"hybrid_engine_kernels": True}


def study_scenario(strategy: str, flush: str, models: str = "opt-1.3b", overrides: dict | None = None) -> Scenario:
    return Scenario("deepspeed-chat", models, strategy, flush, 4, dict(overrides or {}))


def run_strategy(strategy: str, out: Path, models: str, overrides: dict, timeout: float,
                 tensors: str = "sim", sdpa: str | None = None, record_stream: str | None = None) -> dict[str, dict]:
    sc = study_scenario(strategy, "after-inference", models, overrides)
    t0 = time.perf_counter()
    try:
        res = run_fake_cuda(sc, work_dir=out, without_flush=True, timeout=timeout, tensors=tensors, sdpa=sdpa,
                            record_stream=record_stream)
    except FakeCudaRunError as exc:
        res = {sc.id: {"status": "failed", "error": {"message": str(exc)[-2000:]}}}
    r = res.get(sc.id, {})
    print(f"{strategy}: {time_line(r, time.perf_counter() - t0)}", flush=True)
    return res


SUMMARY_KEYS = ("status", "total", "peak_phase", "phases", "process_wall_s", "process_cpu_s", "host_rss_peak",
                "adjustments", "placement", "recipe", "capture", "capture_description", "flushes", "tensors", "route")


def write_summary(out: Path, results: dict[str, dict]) -> None:
    """``out/summary.json``: the figures of every result by scenario id (small enough to keep with the docs)."""
    (out / "summary.json").write_text(json.dumps(
        {k: {kk: v.get(kk) for kk in SUMMARY_KEYS} for k, v in sorted(results.items())}, indent=1) + "\n")


def load_run(directory: Path) -> dict[str, dict]:
    """The results one ``--out directory`` holds, by scenario id: its result JSONs, or without them its
    ``summary.json`` (what ``docs/study-runs/`` keeps of a run)."""
    out = {}
    for f in sorted(directory.glob("deepspeed-chat__*.json")):
        r = json.loads(f.read_text())
        out[r.get("scenario_id", f.stem)] = r
    if not out and (directory / "summary.json").exists():
        out = json.loads((directory / "summary.json").read_text())
    return out


def time_line(r: dict, wall: float | None = None) -> str:
    """The time one strategy took: the worker process's wall time and CPU time (CPU time is what an
    unloaded core would take), and the iteration's, with its generate phase."""
    gen = next((p["wall_s"] for p in r.get("phases", []) if p["phase"] == "generate"), None)
    parts = [f"{r.get('tensors', 'fake')} tensors, {r.get('status', 'no result')}",
             f"process wall {r.get('process_wall_s', wall or 0):.0f} s",
             f"process CPU {r['process_cpu_s']:.0f} s" if r.get("process_cpu_s") is not None else "process CPU -",
             f"iteration wall {r.get('wall_s', 0):.0f} s",
             f"iteration CPU {r['iteration_cpu_s']:.0f} s" if r.get("iteration_cpu_s") is not None else "",
             f"generate wall {gen:.0f} s" if gen is not None else "",
             f"host RSS peak {r.get('host_rss_peak', 0) / GIB:.2f} GiB"]
    return ", ".join(p for p in parts if p)


def table(results: dict[str, dict], strategies: list[str], models: str, overrides: dict) -> str:
    def g(x: float | None) -> str:
        return "-" if x is None else f"{x / GIB:.1f}"

    rows = ["| strategy | reserved | frag. | allocated | peak phase | reserved, flush | frag., flush | "
            "peak phase, flush | study (GB) | wall s | route |", "|" + "---|" * 11]
    for s in strategies:
        a = results.get(study_scenario(s, "none", models, overrides).id, {})
        b = results.get(study_scenario(s, "after-inference", models, overrides).id, {})
        st = STUDY.get(s)
        study = f"{st[0]}/{st[1]}/{st[2]} -> {st[3]}/{st[4]}" if st else "-"
        if a.get("status") != "ok" or b.get("status") != "ok":
            err = (b.get("error") or a.get("error") or {}).get("message", "no result")
            rows.append(f"| {s} | failed: {err.splitlines()[0][:80] if err else ''} |||||||| {study} | - | - |")
            continue
        ta, tb = a["total"], b["total"]
        rows.append(f"| {s} | {g(ta['peak_reserved'])} | {g(ta['fragmentation_at_peak'])} | {g(ta['peak_allocated'])} "
                    f"| {a['peak_phase']} | {g(tb['peak_reserved'])} | {g(tb['fragmentation_at_peak'])} "
                    f"| {b['peak_phase']} | {study} | {b.get('process_wall_s', b.get('wall_s', 0)):.0f} "
                    f"| {b.get('route', 'fake-cuda')} |")
    return "\n".join(rows)


def phase_table(results: dict[str, dict], strategies: list[str], models: str, overrides: dict) -> str:
    """Per phase: peak reserved / peak allocated (GiB) for each strategy and flush policy, and the
    process cost (wall time, host RSS peak)."""
    rows = []
    for s in strategies:
        for flush in ("none", "after-inference"):
            r = results.get(study_scenario(s, flush, models, overrides).id)
            if not r or r.get("status") != "ok":
                continue
            cells = " ".join(f"{p['phase']}={p['peak_reserved'] / GIB:.2f}/{p['peak_allocated'] / GIB:.2f}"
                             for p in r["phases"])
            rows.append(f"{s:14s} flush-{flush:16s} {cells}")
        r = results.get(study_scenario(s, "after-inference", models, overrides).id)
        if r and r.get("status") == "ok":
            walls = " ".join(f"{p['phase']}={p['wall_s']:.0f}s" for p in r["phases"])
            rows.append(f"{s:14s} cost: process {r.get('process_wall_s', 0):.0f} s, host RSS peak "
                        f"{r.get('host_rss_peak', 0) / GIB:.2f} GiB; {walls}")
    return "per phase, peak reserved/allocated GiB:\n" + "\n".join(rows)


def times(results: dict[str, dict], strategies: list[str], models: str, overrides: dict) -> str:
    """Time per strategy (one worker process each)."""
    rows = []
    for s in strategies:
        r = results.get(study_scenario(s, "after-inference", models, overrides).id)
        if r:
            rows.append(f"{s:14s} {time_line(r)}")
    return "time per strategy:\n" + "\n".join(rows)


def finding_checks(results: dict[str, dict], models: str, overrides: dict) -> dict[str, tuple[bool, str]]:
    """The study's DeepSpeed-Chat findings, each checked on the simulated figures (reported, never used to tune
    anything): ``{finding: (reproduced, figures)}``; a finding whose strategies did not all run is absent.

    - ``zero3_above_zero2``: ZeRO-3 reserves more than ZeRO-2 while allocating less (flush none);
    - ``flush_cut``: the after-inference flush cuts ZeRO-3, ZeRO-3 + offload and all by a fifth or more;
    - ``frag_after_flush``: with it, fragmentation at their peaks is under 0.5 GB;
    - ``none_rises``: ``none`` rises slightly (0 to 10 %) with the flush."""
    def get(s: str, flush: str) -> dict | None:
        r = results.get(study_scenario(s, flush, models, overrides).id)
        return r["total"] | {"peak_phase": r["peak_phase"]} if r and r.get("status") == "ok" else None

    out: dict[str, tuple[bool, str]] = {}
    z2, z3 = get("zero2", "none"), get("zero3", "none")
    if z2 and z3:
        ok = z3["peak_reserved"] > z2["peak_reserved"] and z3["peak_allocated"] < z2["peak_allocated"]
        out["zero3_above_zero2"] = (ok, f"reserved {z3['peak_reserved'] / GIB:.2f} vs {z2['peak_reserved'] / GIB:.2f} "
                                        f"GiB, allocated {z3['peak_allocated'] / GIB:.2f} vs "
                                        f"{z2['peak_allocated'] / GIB:.2f}; peaks in {z3['peak_phase']} / "
                                        f"{z2['peak_phase']}")
    pairs = [(s, get(s, "none"), get(s, "after-inference")) for s in ("zero3", "zero3-offload", "all")]
    if all(a and b for _, a, b in pairs):
        cuts = [(s, 1 - b["peak_reserved"] / a["peak_reserved"], b) for s, a, b in pairs]
        out["flush_cut"] = (all(c >= 0.2 for _, c, _ in cuts),
                            ", ".join(f"{s} {-c:+.1%} ({b['peak_phase']})" for s, c, b in cuts))
        frags = [(s, b["fragmentation_at_peak"] or 0) for s, _, b in pairs]
        out["frag_after_flush"] = (all(f < 0.5e9 for _, f in frags),
                                   ", ".join(f"{s} {f / GIB:.2f} GiB" for s, f in frags))
    a, b = get("none", "none"), get("none", "after-inference")
    if a and b:
        d = b["peak_reserved"] / a["peak_reserved"] - 1
        out["none_rises"] = (0 < d < 0.1, f"{d:+.1%}; peak phase {a['peak_phase']} -> {b['peak_phase']}")
    return out


FINDINGS = {
    "zero3_above_zero2": "1. ZeRO-3 reserves more than ZeRO-2 while allocating less",
    "flush_cut": "2. flush after inference cuts ZeRO-3, ZeRO-3 + offload and all by a fifth or more",
    "frag_after_flush": "3. with that flush, fragmentation at their peaks < 0.5 GB",
    "none_rises": "4. none rises slightly with the flush",
}


def findings(results: dict[str, dict], models: str, overrides: dict) -> str:
    """The findings of :func:`finding_checks`, one line each."""
    checks = finding_checks(results, models, overrides)
    return "findings (simulated):\n" + "\n".join(
        f"{FINDINGS[k]}: {'REPRODUCED' if ok else 'NOT reproduced'} ({text})" for k, (ok, text) in checks.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="study_scale.py")
    ap.add_argument("--strategies", default=",".join(STUDY))
    ap.add_argument("--models", default="opt-1.3b")
    ap.add_argument("--overrides", default=json.dumps(SCRIPTS_OVERRIDES),
                    help="scenario overrides JSON (default: the study's scripts, %(default)s; '{}' runs DeepSpeed "
                         "0.19.8's own Hybrid Engine, which injects no kernel into OPT with the pinned transformers "
                         "5.23.0)")
    ap.add_argument("--out", default="study-scale-results")
    ap.add_argument("--jobs", type=int, default=1, help="strategies run at once (each uses one core)")
    ap.add_argument("--tensors", choices=("sim", "fake"), default="sim",
                    help="sim: the simulated CUDA device (simcuda/csrc/sim_cuda.cpp; default, several times "
                         "faster); fake: FakeTensorMode with the dispatcher recorder (the route's first form)")
    ap.add_argument("--sdpa", choices=("math", "efficient"), default=None,
                    help="--tensors sim only: the attention kernel modelled (math keeps the score matrix, the "
                         "default; efficient: memory-efficient attention's output and logsumexp). Results are named "
                         "by scenario id: give each setting its own --out")
    ap.add_argument("--record-stream", choices=("immediate", "until-sync"), default=None,
                    help="--tensors sim only: when a freed block used on another stream (Tensor.record_stream) "
                         "returns to its pool: immediate (default) or until the host next waits for that stream. "
                         "Give each setting its own --out")
    ap.add_argument("--timeout", type=float, default=7200.0)
    ap.add_argument("--from", dest="from_dirs", default=None,
                    help="comma-separated result directories of earlier runs: print their table, run nothing")
    args = ap.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    if args.record_stream and args.tensors != "sim":
        print("rlhfmem: error: --record-stream is modelled on the simulated CUDA device: it needs --tensors sim",
              file=sys.stderr)
        return 2
    if args.sdpa and args.tensors != "sim":
        print("rlhfmem: error: --sdpa chooses the simulated CUDA device's attention kernel: it needs --tensors sim",
              file=sys.stderr)
        return 2
    unknown = [s for s in strategies if s not in STUDY]
    if unknown:
        print(f"rlhfmem: error: --strategies: unknown {', '.join(unknown)}; valid: {', '.join(STUDY)}", file=sys.stderr)
        return 2
    overrides = json.loads(args.overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    if args.from_dirs:
        for d in args.from_dirs.split(","):
            results.update(load_run(Path(d)))
        print(table(results, strategies, args.models, overrides))
        print(phase_table(results, strategies, args.models, overrides))
        print(findings(results, args.models, overrides))
        print(times(results, strategies, args.models, overrides))
        return 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for res in pool.map(lambda s: run_strategy(s, out, args.models, overrides, args.timeout, args.tensors,
                                                   args.sdpa, args.record_stream), strategies):
            results.update(res)
    write_summary(out, results)
    print(f"DeepSpeed-Chat, {args.models}, 4 ranks (rank 0), overrides {overrides or 'none'}, {args.tensors} tensors"
          f"{', attention ' + args.sdpa if args.sdpa else ''}"
          f"{', record_stream ' + args.record_stream if args.record_stream else ''}: SIMULATED (the recorded device "
          "trace replayed through the allocator model), GiB")
    print(table(results, strategies, args.models, overrides))
    print(phase_table(results, strategies, args.models, overrides))
    print(findings(results, args.models, overrides))
    print(times(results, strategies, args.models, overrides))
    print(f"total wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
