"""``rlhfmem capture [options] -- COMMAND [ARGS...]``: any training command, measured rank by rank."""

from __future__ import annotations

import argparse
import sys

from ..memory.events import capture_label
from ..rlhf.cli_run import add_keep_work_argument, add_measurement_arguments, seconds
from ..rlhf.launch import DEFAULT_TIMEOUT_S
from ..rlhf.scenario import DEVICES


def add_capture_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "capture", help="run a training command (script, python -m MODULE, torchrun line) with every rank "
        "recorded and print per-phase memory",
        usage="rlhfmem capture [--world-size N | --nproc-per-node N] [--device auto|cpu|cuda|cuda-rehearsal|cuda-sim] "
              "[--json OUT] "
              "[--sdpa math|efficient] [--sim-values on|off] [--segment-placement SPEC] [--snapshot-dir DIR] "
              "[--timeout S] [--id ID] "
              "[--cuda-emulation on|off] [--time-rounds N] "
              "[--keep-work] [--kill-leftovers] -- COMMAND [ARGS...]")
    ws = c.add_mutually_exclusive_group()
    ws.add_argument("--world-size", type=int, default=None, help="ranks (wraps a plain command in torchrun)")
    ws.add_argument("--nproc-per-node", type=int, default=None, help="same as --world-size (one node)")
    c.add_argument("--device", default="auto", choices=(*DEVICES, "cuda-sim"),
                   help="auto = CUDA with one device per rank of this machine, CPU with the allocator model "
                        "(simulated) when there is no CUDA device; fewer CUDA devices than ranks, or cuda without "
                        "one, is refused before any rank starts; cuda-sim = a CUDA script, unchanged, on the "
                        "simulated CUDA device (no GPU; simulated); cuda-rehearsal = the same device under the GPU "
                        "route's own recorder (its memory history and snapshot; simulated, budgeted apart)")
    c.add_argument("--sdpa", default=None, choices=("math", "efficient"),
                   help="with --device cuda-sim or cuda-rehearsal: the kernel scaled_dot_product_attention runs (a GPU "
                        "picks by dtype, "
                        "head size, mask and architecture): math (the score matrix; default) or efficient "
                        "(memory-efficient attention: output and logsumexp only)")
    c.add_argument("--sim-values", default=None, choices=("on", "off"),
                   help="with --device cuda-sim or cuda-rehearsal: whether the simulated device computes values "
                        "(default on: each op "
                        "also runs its CPU kernel on host memory, so generation loops, masks and .item() follow the "
                        "program; costs its device memory in host memory and its compute on the CPU); off: shapes "
                        "and sizes only, for value-independent programs at a scale the host cannot compute")
    c.add_argument("--segment-placement", default=None, metavar="SPEC",
                   help="with --device cuda-sim or cuda-rehearsal: where the driver maps each cudaMalloc in the "
                        "replays: above-last "
                        "(default: each new segment above the previous one), first-fit, or first-fit:SIZE (the "
                        "lowest free range that fits, below which the CUDA context holds SIZE until the first "
                        "cuBLAS handle; 188MiB on the GPU of the wedson recordings: docs/allocator-model.md)")
    c.add_argument("--iterations", type=_whole, default=None, metavar="N",
                   help="the program runs N iterations ($RLHFMEM_ITERATIONS says N) and marks each with "
                        "rlhfmem.iteration(); a run that marks another number fails")
    c.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the result here")
    c.add_argument("--snapshot-dir", default=None, help="save each rank's trace as a memory_viz snapshot")
    c.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds before every process is killed and the run reported as hung (default "
                        f"{DEFAULT_TIMEOUT_S:.0f}); a run longer than a minute prints where each rank is, every minute")
    c.add_argument("--id", dest="capture_id", default=None, help="the result's id (budget entry key, what "
                   "rlhfmem diff pairs); default: the program without its arguments (the script's path or "
                   "-m's module; /xN for N ranks)")
    add_measurement_arguments(c)
    add_keep_work_argument(c)
    c.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND", help="after --: the command to run")
    c.set_defaults(func=_capture)


def _whole(text: str) -> int:
    """``--iterations``: a whole number >= 1 (argparse's one line otherwise)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed values are whole numbers >= 1")
    return int(text)


def _capture(args: argparse.Namespace) -> int:
    from ..errors import CliError
    from ..results import IterationResult
    from ..timing import run_rounds
    from ..rlhf.cli_run import (check_outputs, finish_runs, iteration_table, phase_table, warn_leftovers,
                                write_json_or_keep)
    from .run import SIMULATED_DEVICES, CommandError, default_id, plan_command, run_command
    from ..memory.driver_va import ENV_SEGMENT_PLACEMENT, SegmentPlacement
    from ..simcuda.library import ENV_SDPA

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise CliError("no command given: rlhfmem capture [options] -- COMMAND [ARGS...]")
    check_outputs(args)
    simulated_device = args.device in SIMULATED_DEVICES
    needs = f"it needs --device {' or '.join(SIMULATED_DEVICES)}, got --device {args.device}"
    if args.sdpa is not None and not simulated_device:
        raise CliError(f"--sdpa chooses the simulated CUDA device's attention kernel: {needs}")
    env = {ENV_SDPA: args.sdpa} if args.sdpa else {}
    if args.sim_values is not None and not simulated_device:
        raise CliError(f"--sim-values chooses whether the simulated CUDA device computes values: {needs}")
    if args.segment_placement is not None and not simulated_device:
        raise CliError(f"--segment-placement places the simulated CUDA device's segments: {needs}")
    if simulated_device:  # the flag, else $RLHFMEM_SEGMENT_PLACEMENT: checked here, not in every rank
        try:
            placement = (SegmentPlacement.from_env() if args.segment_placement is None
                         else SegmentPlacement.parse(args.segment_placement, "--segment-placement"))
        except ValueError as exc:
            raise CliError(str(exc)) from None
        env[ENV_SEGMENT_PLACEMENT] = placement.spec()
    try:
        ident = args.capture_id or default_id(cmd, plan_command(cmd, args.world_size, args.nproc_per_node)[1])
    except CommandError as exc:
        raise CliError(str(exc)) from None
    def once(snapshot_dir: str | None) -> dict:
        return run_command(cmd, ident, world_size=args.world_size, nproc_per_node=args.nproc_per_node,
                           device=args.device, timeout=args.timeout, snapshot_dir=snapshot_dir,
                           cuda_emulation=args.cuda_emulation, env=env or None, sim_values=args.sim_values,
                           kill_leftovers=args.kill_leftovers, iterations=args.iterations,
                           on_progress=lambda line: print(line, file=sys.stderr, flush=True))

    try:
        result, rounds = run_rounds(once, args.time_rounds, args.snapshot_dir)
    except CommandError as exc:
        raise CliError(str(exc)) from None
    label = capture_label(result.get("capture"), result["device"])  # a failed run's by its device
    placement = (result.get("capture_description") or {}).get("segment_placement")
    if placement:  # not the default: the figures depend on it (docs/allocator-model.md)
        label += f"; segments placed {placement}"
    print(f"{ident} on {result['device']} x{result['world_size']} ({label})")
    lost = write_json_or_keep(args.json_out, result) if args.json_out else None
    finish_runs(rounds, args.keep_work or lost is not None)
    warn_leftovers(rounds)
    if result["status"] != "ok":
        print("FAILED: " + IterationResult(result).describe_failure())
        print(f"command output: {result['log']}")
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
