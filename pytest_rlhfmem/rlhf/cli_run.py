"""``rlhfmem run``: one PPO iteration of one scenario, with the per-phase table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..iterations import describe_rows, growth
from ..memory.events import capture_label
from ..record.host import format_rss
from ..units import format_size
from .scenario import ALGORITHMS, DEVICES, FLUSH_POLICIES, FRAMEWORKS

if TYPE_CHECKING:
    from .launch import Nodes


def seconds(text: str) -> float:
    """argparse type of ``--timeout``: a finite number of seconds > 0 (raises ``ArgumentTypeError``, which
    argparse prints as one line naming the option)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed values are a number of seconds > 0")
    return value


def count(minimum: int, maximum: int | None = None):  # noqa: ANN201 - an argparse type
    """argparse type of an integer option in ``minimum .. maximum`` (``maximum`` None: no bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            allowed = f"an integer >= {minimum}" if maximum is None else f"an integer {minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"{text!r}: allowed values are {allowed}")
        return value

    parse.__name__ = "count"
    return parse


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run one PPO iteration in fresh torchrun workers and print per-phase memory")
    r.add_argument("--framework", default="deepspeed-chat", help=f"one of: {', '.join(FRAMEWORKS)}")
    r.add_argument("--models", default="tiny-opt", help="model pair (tiny-opt, tiny-gpt2, opt-1.3b, ...)")
    r.add_argument("--strategy", default="none", help="memory strategy (none, zero1, zero2, zero3, ...)")
    r.add_argument("--flush", default="none", help=f"one of: {', '.join(FLUSH_POLICIES)}")
    r.add_argument("--algorithm", default="ppo", help=f"one of: {', '.join(ALGORITHMS)}")
    r.add_argument("--group-size", type=int, default=None, help="GRPO: samples per prompt (>= 2)")
    r.add_argument("--world-size", type=int, default=None,
                   help="ranks in all (default: --nnodes x --nproc-per-node when given, else 2)")
    r.add_argument("--device", default="auto", help=f"one of: {', '.join(DEVICES)}")
    r.add_argument("--batch-size", type=count(1), default=None, help="prompts per rank (an integer >= 1; default: "
                   "the model pair's)")
    r.add_argument("--iterations", type=count(1), default=None,
                   help="iterations on the same engines (default 1): per-iteration figures and, from 3 on, their "
                        "growth per iteration; part of the scenario id")
    r.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default=None,
                   help="model precision (default: the recipe's GPU precision, fp16 for DeepSpeed-Chat, on any CPU; "
                        "ColossalChat's CPU runs fp32); a non-default dtype is part of the scenario id")
    r.add_argument("--timeout", type=seconds, default=900.0,
                   help="seconds (> 0) the whole run may take: the wait for DeepSpeed's op-build lock, the JIT "
                        "builds and the iteration; past it every process is killed and the run reported as hung")
    r.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the result here")
    r.add_argument("--snapshot-dir", default=None, help="save each rank's trace as a memory_viz snapshot")
    r.add_argument("--work-dir", default=None,
                   help="the ranks' files go here: a new or empty directory (default: a new temporary one). After a "
                        "run that succeeded the run's own files are removed, and the directory too if the run made "
                        "it, as --keep-work says; with --nnodes > 1 a directory every node shares")
    add_node_arguments(r)
    add_measurement_arguments(r)
    add_keep_work_argument(r)
    r.set_defaults(func=_run)


NODE_OPTIONS = ("nnodes", "nproc_per_node", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
                "master_addr", "master_port", "local_addr")


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """torchrun's multi-node options (``torch/distributed/run.py``), under its names, passed through to the one
    torchrun agent this command starts on this node (docs/multi-node.md)."""
    g = p.add_argument_group("multi-node (torchrun's options, passed through; docs/multi-node.md)")
    g.add_argument("--nnodes", default=None, help="nodes, one agent each (a fixed count: no MIN:MAX range)")
    g.add_argument("--nproc-per-node", default=None, help="ranks per node (default: world size / nnodes)")
    g.add_argument("--node-rank", type=count(0), default=None,
                   help="this node, 0..nnodes-1; node rank 0 waits for every rank and prints and writes the result")
    g.add_argument("--rdzv-backend", default=None, help="static (torchrun's default), c10d, etcd, etcd-v2")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="the same on every node")
    g.add_argument("--rdzv-id", default=None, help="the job's id, the same on every node")
    g.add_argument("--rdzv-conf", default=None, metavar="K=V,...")
    g.add_argument("--master-addr", default=None, help="static rendezvous: node rank 0's address")
    g.add_argument("--master-port", type=count(1, 65535), default=None, help="static rendezvous: node rank 0's port")
    g.add_argument("--local-addr", default=None, help="this node's address, as the others reach it")


def nodes_from_args(args: argparse.Namespace) -> tuple[Nodes, int]:
    """The :class:`~.launch.Nodes` of ``rlhfmem run``'s options and the world size they make with
    ``--world-size`` (default: nnodes x nproc-per-node, else 2). Raises :class:`ScenarioError` (one line) for
    an option torchrun would not take here."""
    from .launch import Nodes

    nodes = Nodes.parse(**{k: getattr(args, k) for k in NODE_OPTIONS})
    if args.world_size is not None:
        return nodes, args.world_size
    world_size = (nodes.nnodes * nodes.nproc_per_node if nodes.nproc_per_node else
                  2 if nodes.nnodes == 1 else nodes.nnodes)  # one rank per node by default
    return nodes, world_size


def add_measurement_arguments(p: argparse.ArgumentParser) -> None:
    """``--cuda-emulation`` and ``--time-rounds``: the same switches for ``rlhfmem run`` and ``rlhfmem capture``
    (and the same meaning as the plugin's ``--rlhfmem-cuda-emulation`` / ``--rlhfmem-time-rounds``)."""
    p.add_argument("--cuda-emulation", choices=("on", "off"), default="on",
                   help="CPU runs: emulate CUDA's own allocations in the capture (default on; see docs/fidelity.md)")
    p.add_argument("--time-rounds", type=count(1), default=1, metavar="N",
                   help="run N times: the time is their median with its spread (memory figures: the first run's)")


def add_keep_work_argument(parser: argparse.ArgumentParser) -> None:
    """``--keep-work`` and ``--kill-leftovers`` of ``rlhfmem run`` and ``rlhfmem capture``."""
    parser.add_argument("--kill-leftovers", action="store_true",
                        help="stop the processes the run leaves behind once it ended (a daemon the program "
                             "double-forked; found by the run's token in their environment); by default they are "
                             "named in a warning and left running")
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the run's work directory (ranks' files, launcher log); by default it is "
                             "removed after a run that succeeded, and kept, its path printed, after a failure")


def check_outputs(args: argparse.Namespace) -> None:
    """``--json`` and ``--snapshot-dir`` of ``rlhfmem run``/``capture``, before anything runs (``outputs.py``). Raises
    :class:`~pytest_rlhfmem.errors.CliError` (one line) for a path that cannot be written."""
    from ..errors import CliError
    from ..outputs import OutputError, check_dir, check_file

    try:
        check_file(args.json_out, "--json")
        check_dir(args.snapshot_dir, "--snapshot-dir")
    except OutputError as exc:
        raise CliError(str(exc)) from None


def write_json_or_keep(path: str, result: dict) -> str | None:
    """``--json``'s result with each rank's trace beside it (``trace_io.write_result_json``); where that fails at
    the end (the disk filled during the run), the result alone goes to a file of the temporary directory
    (``outputs.keep``; its traces stay in the run's work directory, which is then kept). Returns ``None`` when
    ``path`` was written, else the one line that says where the result is."""
    import json

    from ..memory.trace_io import write_result_json
    from ..outputs import keep

    try:
        write_result_json(path, result, [result])  # each rank's trace beside it, for rlhfmem advise
        return None
    except OSError as exc:
        why = exc.strerror or str(exc)
    kept = keep(json.dumps(result, indent=1), Path(path).name)
    return (f"rlhfmem: --json {path}: cannot be written ({why}); the result is in {kept}, its traces in the work "
            f"directory {result.get('work_dir')}")


def warn_leftovers(results: list[dict]) -> None:
    """A warning line on stderr for each run that left processes behind (``launch.leftover_warning``)."""
    from .launch import leftover_warning

    for r in results:
        line = leftover_warning(r)
        if line:
            print(f"rlhfmem: warning: {line}", file=sys.stderr)


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


def iteration_table(result: dict) -> list[str]:
    """A run of several iterations: its per-iteration rows (``iterations.py: describe_rows``; max over ranks) and
    its growth per iteration from iteration 2 on (three iterations or more); ``[]`` for one iteration."""
    rows = result.get("iterations") or []
    if not rows:
        return [f"per-iteration figures: {result['iterations_error']}"] if result.get("iterations_error") else []
    out = ["", *describe_rows(rows)]
    g = growth(rows)
    if g:
        label = "simulated" if result.get("simulated") else "measured"
        out.append(f"growth per iteration from iteration 2 ({label} device figures, measured host): "
                   + ", ".join(f"{k} {format_size(v)}" for k, v in g.items()))
    return out


def _run(args: argparse.Namespace) -> int:
    from ..errors import CliError
    from .launch import run_scenario
    from ..timing import run_rounds
    from .scenario import Scenario, ScenarioError

    check_outputs(args)
    overrides = {"batch_size": args.batch_size} if args.batch_size is not None else {}
    if args.dtype:
        overrides["dtype"] = args.dtype
    if args.group_size is not None:
        overrides["group_size"] = args.group_size
    if args.iterations is not None:
        overrides["iterations"] = args.iterations
    try:
        nodes, world_size = nodes_from_args(args)
        scenario = Scenario(args.framework, args.models, args.strategy, args.flush, world_size, overrides,
                            args.algorithm)
        if args.device not in DEVICES:
            raise ScenarioError(f"unknown device {args.device!r}; valid: {', '.join(DEVICES)}")
        if nodes.multi_node and args.time_rounds > 1:
            raise ScenarioError(f"--time-rounds {args.time_rounds} with --nnodes {nodes.nnodes}: one round per "
                                f"multi-node launch (every node's agent would have to start each round)")
        work_dirs = [args.work_dir]  # the first round's (its figures and traces are kept); then new temporary ones
        result, rounds = run_rounds(lambda snapshots: run_scenario(
            scenario, device=args.device, timeout=args.timeout, snapshot_dir=snapshots,
            cuda_emulation=args.cuda_emulation, work_dir=work_dirs.pop() if work_dirs else None, nodes=nodes,
            kill_leftovers=args.kill_leftovers),
            args.time_rounds, args.snapshot_dir)
    except ScenarioError as exc:
        raise CliError(str(exc)) from None
    if result.get("role") == "agent":  # a node of rank > 0: the node-rank-0 agent has the figures
        print(f"{scenario.id}: node rank {nodes.node_rank} of {nodes.nnodes}, agent {result['status']}; the "
              f"node-rank-0 agent prints and writes the result from {result['shared_work_dir']}")
        if result["status"] != "ok":
            print("FAILED: " + result["failure"]["message"] + ("\nlauncher log (tail):\n" + result["log_tail"][-1500:]
                                                               if result["log_tail"] else ""))
        return 0 if result["status"] == "ok" else 1
    label = capture_label(result.get("capture"), result["device"])  # a failed run's by its device
    where = f" ({nodes.nnodes} nodes x {scenario.world_size // nodes.nnodes})" if nodes.multi_node else ""
    print(f"{scenario.id} on {result['device']} x{scenario.world_size}{where} ({label})")
    host = result.get("host") or {}
    if host.get("rss_method"):  # no rank wrote its result: no method to name
        print(f"host figures measured, not simulated: peak RSS by {host.get('rss_method')}; "
              f"anonymous RSS: {host.get('anon_method')}; "
              f"pinned: {host.get('pinned_method')}")
    lost = write_json_or_keep(args.json_out, result) if args.json_out else None
    finish_runs(rounds, args.keep_work or lost is not None)
    warn_leftovers(rounds)
    if result["status"] != "ok":
        from ..results import IterationResult

        print("FAILED: " + IterationResult(result).describe_failure())
        return 1
    for line in phase_table(result):
        print(line)
    print(f"peak reserved reached in phase: {result['peak_phase']}")
    for line in iteration_table(result):
        print(line)
    if lost:
        print(lost, file=sys.stderr)
        return 1
    return 0
