"""``rlhfmem``: replay snapshots, run one PPO iteration, diff results, plot Figure 1.

Argument and input errors print one line ``rlhfmem: error: ...`` and exit 2; never a traceback. A reader that
closes the pipe early (``rlhfmem diff A B | head``) ends the command quietly with status 141. SIGINT, SIGTERM or
SIGHUP during ``run`` or ``capture`` stops every process of the run, prints one line (each rank's phase, the work
directory) and exits 128 + the signal's number (130, 143, 129).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import CliError
from .units import format_size

# --device-memory-gib: above 0 and at most the replay's bound (memory/replay_types.py: MAX_REPLAY_BYTES, 2**48
# bytes; not imported here, which keeps `rlhfmem --help` free of the replay's modules)
MAX_DEVICE_MEMORY_GIB = 2**18


def _device_memory_gib(text: str) -> float:
    """argparse's ``type`` for ``--device-memory-gib``: a finite number of GiB above 0 and at most 262144 (256 TiB,
    the replay's bound); one line naming the option and the allowed range otherwise."""
    allowed = f"a number of GiB above 0 and at most {MAX_DEVICE_MEMORY_GIB} (256 TiB)"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: {allowed}") from None
    if not math.isfinite(v) or not 0 < v <= MAX_DEVICE_MEMORY_GIB:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; allowed: {allowed}")
    return v


def _replay(args: argparse.Namespace) -> int:
    from .memory.allocator import AllocatorConfigError
    from .memory.replay import (
        ANCHORED, ReplayError, agreement, allocator_config, load_columns_for_replay, recorded_summary, replay,
        replay_json,
    )
    from .memory.trace import SnapshotError
    from .memory.trace_io import TraceFileError

    reader = None
    try:
        # an .rlhftrace file or a snapshot pickle (the compiled snapshot reader), as columns and recorded settings
        trace, recorded = load_columns_for_replay(args.snapshot, args.device)
        if recorded.reader != "rlhftrace":
            reader = recorded.reader
            if "unavailable" in reader:
                print(f"rlhfmem: note: {reader[len('python ('):-1]}; the pickle was read in Python", file=sys.stderr)
        # the driver's placement is not an allocator setting: --alloc-conf keeps the trace's, --segment-placement wins
        config = allocator_config(recorded.allocator_settings, args.torch_version, args.alloc_conf,
                                  args.segment_placement, recorded.source)
        capacity = int(args.device_memory_gib * 2**30) if args.device_memory_gib is not None else None
        result = replay(trace, config=config, mode=args.mode, capacity=capacity, record_series=False,
                        engine=args.engine)
    except (SnapshotError, AllocatorConfigError, ReplayError, TraceFileError) as exc:
        raise CliError(str(exc)) from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, AssertionError, OverflowError) as exc:
        # the model's own consistency checks: still one line, naming the file
        raise CliError(f"{args.snapshot}: cannot replay ({type(exc).__name__}: {exc})") from None
    rec = recorded_summary(trace)
    agree = agreement(rec, result, trace.has_segment_events())
    spread = _address_order_spread(args, trace, config) if args.address_orders else None
    origin = _peak_origin(args, trace, config, result.total.peak_reserved) if args.peak_origin else None
    if args.json:
        out = replay_json(args.snapshot, args.mode, config, trace, result, rec, agree)
        if reader is not None:
            out["snapshot_reader"] = reader
        if spread is not None:
            out["address_order_spread"] = spread
        if origin is not None:
            out["peak_origin"] = vars(origin) | {"fragmentation": origin.fragmentation}
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    t = result.total
    rows = [
        ("cudaMalloc count (segment_alloc)", len(rec.segment_allocs), len(result.segment_allocs)),
        ("segment_free batches", len(rec.segment_free_batches), len(result.segment_free_batches)),
        ("segment_map / segment_unmap", f"{len(rec.segment_maps)} / {len(rec.segment_unmaps)}",
         f"{len(result.segment_maps)} / {len(result.segment_unmaps)}"),
        ("peak reserved", format_size(rec.peak_reserved), format_size(t.peak_reserved)),
        ("final reserved", format_size(rec.final_reserved), format_size(result.final_reserved)),
        ("final allocated", format_size(rec.final_allocated), format_size(result.final_allocated)),
        ("peak allocated", "-", format_size(t.peak_allocated)),
        ("fragmentation at peak", "-", format_size(t.fragmentation_at_peak)),
        ("max fragmentation", "-", format_size(t.max_fragmentation)),
        ("alloc retries / OOMs", "-", f"{t.alloc_retries} / {t.ooms}"),
    ]
    print(f"{args.snapshot}: device {trace.device}, {len(trace)} events, replay {args.mode}"
          + (f", alloc-conf {config.source!r}" if args.alloc_conf is not None else "")
          + f", {result.engine} engine ({result.engine_reason})"
          + (f", pickle read by the {reader} reader" if reader is not None else ""))
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  {'recorded':>14}  {'simulated':>14}")
    for name, r, s in rows:
        print(f"{name:{w}}  {str(r):>14}  {str(s):>14}")
    sizes_rec = [s for _, s in rec.segment_allocs]
    sizes_sim = [s for _, s in result.segment_allocs]
    if agree["available"]:
        print(f"segment_alloc sizes matching in order: {agree['segment_allocs_matching']}/"
              f"{agree['segment_allocs_recorded']}; free batches equal: {agree['segment_free_batches_equal']}")
        if sizes_rec != sizes_sim:
            first = next((i for i, (a, b) in enumerate(zip(sizes_rec, sizes_sim)) if a != b),
                         min(len(sizes_rec), len(sizes_sim)))
            print(f"first divergence at cudaMalloc #{first}")
    else:
        print(f"agreement unavailable: {agree['reason']}")
    if args.mode == ANCHORED and args.alloc_conf is not None:
        print("note: --alloc-conf changes the decisions, so anchoring to recorded addresses mostly does not apply")
    if spread is not None:
        pr = spread["peak_reserved"]
        print(f"peak reserved under {spread['orders']} random cudaMalloc address orders (seed {spread['seed']}): "
              f"{format_size(pr['min'])} to {format_size(pr['max'])}; the model's order "
              f"({format_size(spread['model_order']['peak_reserved'])}) in {spread['model_order_share']:.0%} of them")
    if origin is not None:
        print(f"at the peak ({origin.phase}, free-running, before its {format_size(origin.segment_size)} cudaMalloc): "
              f"fragmentation {format_size(origin.fragmentation)}; free bytes by the phase that made their segment:")
        for phase, n in sorted(origin.free_by_segment_phase.items(), key=lambda kv: -kv[1]):
            live = format_size(origin.allocated_by_phase.get(phase, 0))
            print(f"  {phase:24s} {format_size(n):>12}   (live bytes this phase allocated: {live})")
    return 0


def _peak_origin(args: argparse.Namespace, trace, config, peak_reserved: int):  # noqa: ANN001, ANN202
    from .memory.peak_origin import peak_origin
    from .memory.replay import FREE_RUNNING

    if args.mode != FREE_RUNNING:
        raise CliError(f"{args.snapshot}: --peak-origin replays free-running: add --free-running")
    try:
        return peak_origin(trace.to_trace(), peak_reserved, config)
    except ValueError as exc:
        raise CliError(f"{args.snapshot}: --peak-origin: {exc}") from None


def _address_order_spread(args: argparse.Namespace, trace, config) -> dict:  # noqa: ANN001
    from .memory.address_order import address_order_spread

    try:
        return address_order_spread(trace.to_trace(), orders=args.address_orders, seed=0, config=config)
    except ValueError as exc:
        raise CliError(f"{args.snapshot}: --address-orders: {exc}") from None


def _diff(args: argparse.Namespace) -> int:
    from .report import ReportInputError, diff, load_side, parse_threshold, to_json, to_markdown, without_flush

    if args.time_spread is not None and not Path(args.time_spread).is_file():
        what = "no such file" if not Path(args.time_spread).exists() else "not a regular file"
        raise CliError(f"--time-spread {args.time_spread}: {what} (a time_spread.yaml: "
                       "baselines/<profile>/time_spread.yaml, written by benchmarks/time_spread.py)")
    try:
        threshold = parse_threshold(args.threshold)
        base, head = load_side(args.base), load_side(args.head)
        if args.ignore_flush:
            base, head = without_flush(base), without_flush(head)
        from .timing import load_spreads

        d = diff(base, head, threshold, load_spreads(args.time_spread, strict=True), allow_disjoint=args.allow_disjoint)
    except (ReportInputError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if args.format == "json":
        json.dump(to_json(d), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(to_markdown(d))
    return 1 if (args.fail_on_regression and d.regressed) else 0


def _deps_diff(args: argparse.Namespace) -> int:
    from .outputs import OutputError, check_file
    from .upgrade import deps_diff

    cell = args.cell[1:] if args.cell[:1] == ["--"] else args.cell
    try:
        for opt, path in (("--md", args.md), ("--json", args.json_out)):
            if path:
                check_file(path, opt)
    except OutputError as exc:
        raise CliError(str(exc)) from None
    md, report, regressed = deps_diff(args.base, args.head, cell, work=args.work_dir, envs_dir=args.envs_dir,
                                      extras=args.extras, threshold=args.threshold, timeout=args.timeout)
    sys.stdout.write(md)
    if args.md:
        Path(args.md).write_text(md)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    print(f"\nresults, distributions and logs: {report['work_dir']}")
    return 1 if (args.fail_on_regression and regressed) else 0


def _plot(args: argparse.Namespace) -> int:
    from .plot import load_result, plot_results
    from .report import ReportInputError

    if len(args.results) > 2:
        raise CliError("plot takes one result, or two to overlay")
    if not args.output.strip() or Path(args.output).name in ("", ".", ".."):
        raise CliError(f"-o/--output {args.output!r}: a file name is needed (e.g. -o figure1.png)")
    from .outputs import OutputError, check_file

    try:  # a directory, a path under a file or a place that cannot be written: before the results are read
        check_file(args.output, "-o/--output")
    except OutputError as exc:
        raise CliError(str(exc)) from None
    try:
        results = [load_result(p, args.scenario) for p in args.results]
    except ReportInputError as exc:
        raise CliError(str(exc)) from None
    labels = args.labels.split(",") if args.labels else [
        (r.get("scenario") or {}).get("flush", r["scenario_id"])
        if len({(x.get("scenario") or {}).get("flush") for x in results}) == len(results) else r["scenario_id"]
        for r in results]
    if len(labels) != len(results):
        raise CliError(f"--labels needs {len(results)} comma-separated names")
    try:
        out = plot_results(list(zip(labels, results)), args.output)
    except ReportInputError as exc:  # matplotlib missing: one line naming the `plot` extra
        raise CliError(str(exc)) from None
    print(out)
    return 0


class Parser(argparse.ArgumentParser):
    """argparse's parser with the project's error form: one line ``rlhfmem: error: argument --X: ...`` and exit
    status 2 (argparse's own prints the usage first). Subcommands' parsers are of this class too."""

    def error(self, message: str):  # noqa: ANN201 - argparse's signature (NoReturn)
        self.exit(2, f"rlhfmem: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="rlhfmem", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay a CUDA memory snapshot through the allocator model")
    r.add_argument("snapshot", help="a torch.cuda.memory._dump_snapshot() pickle or an .rlhftrace file")
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--anchored", dest="mode", action="store_const", const="anchored",
                      help="new segments take the recorded addresses (default)")
    mode.add_argument("--free-running", dest="mode", action="store_const", const="free-running",
                      help="synthetic addresses; cudaMalloc fails only past --device-memory-gib")
    r.set_defaults(mode="anchored")
    r.add_argument("--alloc-conf", default=None, metavar="STR",
                   help="PYTORCH_CUDA_ALLOC_CONF to replay under (default: the recorded settings)")
    r.add_argument("--device", type=int, default=None, help="device index (default: the device with most events)")
    r.add_argument("--torch-version", default=None, metavar="X.Y",
                   help="the PyTorch whose allocator behaviours to model (2.8-2.10 differ: docs/allocator-model.md); "
                        "default: read from the snapshot's allocator_settings, else the newest modelled")
    r.add_argument("--device-memory-gib", type=_device_memory_gib, default=None, metavar="GIB",
                   help="device capacity, above 0 and at most 262144 GiB (default: inferred from the trace's oom "
                        "entries, else unlimited; an expandable segment's address space is 1 1/8 of it, else of "
                        "80 GiB)")
    r.add_argument("--json", action="store_true", help="print one JSON object: recorded, simulated, agreement")
    r.add_argument("--address-orders", type=int, default=0, metavar="N",
                   help="also replay under N seeded random placements of new segments (the driver's choice; "
                        "best fit breaks ties by address) and print the spread of peak reserved")
    r.add_argument("--segment-placement", default=None, metavar="SPEC",
                   help="with --free-running: where the driver maps each new segment: above-last (the model's "
                        "default), first-fit or first-fit:SIZE (lowest free range; SIZE held by the CUDA context "
                        "until the first cuBLAS handle); default: the trace's own (docs/allocator-model.md)")
    r.add_argument("--peak-origin", action="store_true",
                   help="with --free-running: break the peak's fragmentation down by the phase that made each "
                        "segment (the model's state just before the peak's cudaMalloc)")
    r.add_argument("--engine", choices=("auto", "compiled", "python"), default="auto",
                   help="allocator model: auto (compiled core when it supports the replay, default), or one of them")
    r.set_defaults(func=_replay)

    d = sub.add_parser("diff", help="per-PR memory diff of two result or budget files")
    d.add_argument("base", help="session result (--rlhfmem-json), run result (rlhfmem run --json) or budget YAML")
    d.add_argument("head", help="the same kinds as BASE")
    d.add_argument("--format", choices=("md", "json"), default="md")
    d.add_argument("--threshold", default="5%", help="relative change that counts (default 5%%)")
    d.add_argument("--fail-on-regression", action="store_true", help="exit 1 when anything regressed")
    d.add_argument("--allow-disjoint", action="store_true",
                   help="accept two sides with no scenario id in common (every row then new or missing)")
    d.add_argument("--ignore-flush", action="store_true",
                   help="pair scenarios that differ only in flush policy (e.g. flush-none vs flush-after-inference)")
    d.add_argument("--time-spread", default=None, metavar="YAML", help="recorded run-to-run time spreads "
                   "(baselines/<profile>/time_spread.yaml) for results timed in one round")
    d.set_defaults(func=_diff)

    u = sub.add_parser("deps-diff", help="one cell under two dependency sets (a dependency upgrade): the per-phase "
                       "diff, the phase that moved and the packages that changed")
    u.add_argument("--base", required=True, metavar="ENV", help="the old set: an interpreter, a virtual environment's "
                   "directory, or a constraints file (.txt: an environment is built for it once)")
    u.add_argument("--head", required=True, metavar="ENV", help="the new set, as --base")
    u.add_argument("--work-dir", default=None, help="results, traces, distributions, logs (default: a new temporary "
                   "directory, printed)")
    u.add_argument("--envs-dir", default=None, help="where constraints files' environments are built (default: "
                   "$RLHFMEM_CACHE_DIR/deps-envs)")
    u.add_argument("--extras", default="deepspeed", help="this package's extras installed in a built environment "
                   "(default deepspeed; '' for none)")
    u.add_argument("--threshold", default="5%", help="relative change that counts (default 5%%)")
    u.add_argument("--timeout", type=float, default=None, help="seconds each side's run may take")
    u.add_argument("--md", default=None, metavar="OUT", help="also write the markdown report here")
    u.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the JSON report here")
    u.add_argument("--fail-on-regression", action="store_true", help="exit 1 when anything regressed")
    u.add_argument("cell", nargs=argparse.REMAINDER, metavar="-- run|capture ARGS",
                   help="after --: the rlhfmem run or capture arguments of the cell to record")
    u.set_defaults(func=_deps_diff)

    pl = sub.add_parser("plot", help="Figure 1 of the study for one result, or two (one panel each)")
    pl.add_argument("results", nargs="+", metavar="RESULT.json")
    pl.add_argument("--scenario", default=None, help="scenario id when a session file holds several; in a "
                    "second file the scenario differing only in flush policy matches, to overlay policies")
    pl.add_argument("--labels", default=None, help="comma-separated legend names")
    pl.add_argument("-o", "--output", required=True, help="PNG to write")
    pl.set_defaults(func=_plot)

    from .rlhf.cli_run import add_run_parser  # noqa: PLC0415 (keeps `replay` free of torch imports)
    add_run_parser(sub)
    from .command.cli import add_capture_parser  # noqa: PLC0415 - `rlhfmem capture -- COMMAND`
    add_capture_parser(sub)
    from .advise import add_advise_parser  # noqa: PLC0415
    add_advise_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"rlhfmem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # rlhf/launch.py's RunInterrupted: the run's processes are already stopped
        if hasattr(exc, "exit_status"):
            print(f"rlhfmem: {exc}", file=sys.stderr)
            return exc.exit_status
        return 130
    except BrokenPipeError:  # `rlhfmem diff ... | head`: the reader left; say nothing more, as cat would
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a writer the pipe killed


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again (Python's documented
    recipe for SIGPIPE, ``signal`` module docs: "Note on SIGPIPE")."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
