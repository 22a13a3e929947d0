"""``rlhfmem advise INPUT``: the subcommand's arguments, and the run that prints, and writes, its reports."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CliError
from ..memory.allocator import AllocatorConfigError
from ..units import parse_size
from .candidates import DEFAULT_MAX_FLUSHES
from .inputs import AdviseInputError
from .ranking import advise
from .rendering import markdown, text_lines


def add_advise_parser(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    """Add ``advise`` to ``rlhfmem``'s subcommands (``sub``: its ``add_subparsers()``)."""
    a = sub.add_parser("advise", help="from one trace: the flush points and allocator settings that cut the peak")
    a.add_argument("input", metavar="INPUT", help="a result JSON (rlhfmem run --json, --rlhfmem-json) naming its "
                   "ranks' traces, or a torch.cuda.memory._dump_snapshot() pickle")
    a.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the JSON report here")
    a.add_argument("--md", dest="md_out", default=None, metavar="OUT", help="write a markdown report here")
    a.add_argument("--budget", default=None, metavar="SIZE", help="e.g. '48 MiB': the cheapest change that fits")
    a.add_argument("--capacity", default=None, metavar="SIZE", help="device memory assumed by "
                   "garbage_collection_threshold candidates (default: --budget, else the no-flush peak)")
    a.add_argument("--max-flushes", type=int, default=DEFAULT_MAX_FLUSHES, metavar="K",
                   help=f"largest flush set searched (default {DEFAULT_MAX_FLUSHES})")
    a.add_argument("--setting", action="append", default=[], metavar="CONF",
                   help="an extra PYTORCH_CUDA_ALLOC_CONF to evaluate (repeatable), e.g. max_split_size_mb:128")
    a.add_argument("--top", type=int, default=8, help="rows printed per scenario (default 8)")
    a.add_argument("--processes", type=int, default=None, help="replay processes (default: 2, or 1 on 1 core)")
    a.set_defaults(func=_cli)


def _cli(args) -> int:  # noqa: ANN001
    try:
        budget = parse_size(args.budget) if args.budget else None
        capacity = parse_size(args.capacity) if args.capacity else None
    except ValueError as exc:
        raise CliError(f"--budget/--capacity: {exc}") from None
    if args.max_flushes < 0:
        raise CliError(f"--max-flushes {args.max_flushes}: must be >= 0")
    try:
        doc = advise(args.input, max_flushes=args.max_flushes, budget=budget, capacity=capacity,
                     processes=args.processes, settings=tuple(args.setting))
    except (AdviseInputError, AllocatorConfigError) as exc:
        raise CliError(str(exc)) from None
    for line in text_lines(doc, args.top):
        print(line)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    if args.md_out:
        Path(args.md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md_out).write_text(markdown(doc, args.top))
    return 0
