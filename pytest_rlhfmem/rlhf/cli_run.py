"""``rlhfmem run``: one PPO iteration of one scenario, with the per-phase table."""

from __future__ import annotations

import argparse

from ..memory.host import format_rss
from ..units import format_size
from .scenario import ALGORITHMS, DEVICES, FLUSH_POLICIES, FRAMEWORKS


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run one PPO iteration in fresh torchrun workers and print per-phase memory")
    r.add_argument("--framework", default="deepspeed-chat", help=f"one of: {', '.join(FRAMEWORKS)}")
    r.add_argument("--models", default="tiny-opt", help="model pair (tiny-opt, tiny-gpt2, opt-1.3b, ...)")
    r.add_argument("--strategy", default="none", help="memory strategy (none, zero1, zero2, zero3, ...)")
    r.add_argument("--flush", default="none", help=f"one of: {', '.join(FLUSH_POLICIES)}")
    r.add_argument("--algorithm", default="ppo", help=f"one of: {', '.join(ALGORITHMS)}")
    r.add_argument("--group-size", type=int, default=None, help="GRPO: samples per prompt (>= 2)")
    r.add_argument("--world-size", type=int, default=2)
    r.add_argument("--device", default="auto", help=f"one of: {', '.join(DEVICES)}")
    r.add_argument("--batch-size", type=int, default=None)
    r.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default=None,
                   help="model precision (default: the recipe's GPU precision, fp16 for DeepSpeed-Chat, on any CPU; "
                        "ColossalChat's CPU runs fp32); a non-default dtype is part of the scenario id")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is killed as hung")
    r.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the result here")
    r.add_argument("--snapshot-dir", default=None, help="save each rank's trace as a memory_viz snapshot")
    add_measurement_arguments(r)
    add_keep_work_argument(r)
    r.set_defaults(func=_run)


def add_measurement_arguments(p: argparse.ArgumentParser) -> None:
    """``--cuda-emulation`` and ``--time-rounds``: the same switches for ``rlhfmem run`` and ``rlhfmem capture``
    (and the same meaning as the plugin's ``--rlhfmem-cuda-emulation`` / ``--rlhfmem-time-rounds``)."""
    p.add_argument("--cuda-emulation", choices=("on", "off"), default="on",
                   help="CPU runs: emulate CUDA's own allocations in the capture (default on; see docs/fidelity.md)")
    p.add_argument("--time-rounds", type=int, default=1, metavar="N",
                   help="run N times: the time is their median with its spread (memory figures: the first run's)")


def add_keep_work_argument(parser: argparse.ArgumentParser) -> None:
    """``--keep-work`` of ``rlhfmem run`` and ``rlhfmem capture``."""
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the run's work directory (ranks' files, launcher log); by default it is "
                             "removed after a run that succeeded, and kept, its path printed, after a failure")


def finish_runs(results: list[dict], keep: bool) -> None:
    """Each run's work directory removed (:func:`~.launch.finish_work`); the kept ones printed."""
    from .launch import finish_work

    for r in results:
        kept = finish_work(r, keep)
        if kept:
            print(f"work directory kept: {kept}")


def phase_table(result: dict) -> list[str]:
    """Per phase: the device figures (peak reserved, peak allocated, fragmentation, cudaMalloc), the host
    figures (peak RSS, pinned; measured) and time, max over ranks."""
    rows = [("phase", "peak reserved", "peak allocated", "fragmentation", "cudaMalloc", "|",
             "host peak RSS (anon growth)", "host pinned", "time")]
    for name, p in result["phases"].items():
        rows.append((name, format_size(p["peak_reserved"]), format_size(p["peak_allocated"]),
                     format_size(p["fragmentation_at_peak"]) if p["fragmentation_at_peak"] else "-",
                     str(p["cuda_malloc_count"]), "|", format_rss(p),
                     format_size(p.get("host_pinned_peak")), f"{p['wall_s']:.2f} s"))
    m = result["metrics"]
    from ..timing import time_figure

    tf = time_figure(result)
    rows.append(("iteration", format_size(m["peak_reserved"]), format_size(m["peak_allocated"]),
                 format_size(m["fragmentation_at_peak"]), str(m["cuda_malloc_count"]),
                 "|", format_rss(m), format_size(m.get("host_pinned_peak")),
                 tf.text() if tf else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def _run(args: argparse.Namespace) -> int:
    from ..errors import CliError
    from .launch import run_scenario
    from ..timing import run_rounds
    from .scenario import Scenario, ScenarioError

    overrides = {"batch_size": args.batch_size} if args.batch_size else {}
    if args.dtype:
        overrides["dtype"] = args.dtype
    if args.group_size is not None:
        overrides["group_size"] = args.group_size
    try:
        scenario = Scenario(args.framework, args.models, args.strategy, args.flush, args.world_size, overrides,
                            args.algorithm)
        if args.device not in DEVICES:
            raise ScenarioError(f"unknown device {args.device!r}; valid: {', '.join(DEVICES)}")
        result, rounds = run_rounds(lambda snapshots: run_scenario(
            scenario, device=args.device, timeout=args.timeout, snapshot_dir=snapshots,
            cuda_emulation=args.cuda_emulation), args.time_rounds, args.snapshot_dir)
    except ScenarioError as exc:
        raise CliError(str(exc)) from None
    label = ("simulated: CPU allocation trace replayed through the CUDA caching allocator model"
             if result["simulated"] else "measured: CUDA caching allocator")
    print(f"{scenario.id} on {result['device']} x{scenario.world_size} ({label})")
    host = result.get("host") or {}
    print(f"host figures measured, not simulated: peak RSS by {host.get('rss_method')}; "
          f"anonymous RSS: {host.get('anon_method')}; "
          f"pinned: {host.get('pinned_method')}")
    if args.json_out:
        from ..memory.trace_io import write_result_json

        write_result_json(args.json_out, result, [result])  # each rank's trace beside it, for rlhfmem advise
    finish_runs(rounds, args.keep_work)
    if result["status"] != "ok":
        from ..results import IterationResult

        print("FAILED: " + IterationResult(result).describe_failure())
        return 1
    for line in phase_table(result):
        print(line)
    print(f"peak reserved reached in phase: {result['peak_phase']}")
    return 0
