"""``rlhfmem advise INPUT``: the subcommand's arguments, and the run that prints, and writes, its reports."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import CliError
from ..memory.allocator import AllocatorConfigError
from ..memory.replay_types import MAX_REPLAY_BYTES, ReplayError
from ..outputs import OutputError, check_file, keep
from ..units import format_size, parse_size
from .candidates import DEFAULT_MAX_FLUSHES
from .evaluation import ReplayWorkerDied
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
    a.add_argument("--budget", type=_size(2**63 - 1), default=None, metavar="SIZE",
                   help="e.g. '48 MiB': the cheapest change that fits")
    a.add_argument("--capacity", type=_size(MAX_REPLAY_BYTES), default=None, metavar="SIZE", help="device memory "
                   "assumed by garbage_collection_threshold candidates (default: --budget, else the no-flush peak)")
    a.add_argument("--max-flushes", type=_count(0, 10**6), default=DEFAULT_MAX_FLUSHES, metavar="K",
                   help=f"largest flush set searched (default {DEFAULT_MAX_FLUSHES})")
    a.add_argument("--setting", action="append", default=[], metavar="CONF",
                   help="an extra PYTORCH_CUDA_ALLOC_CONF to evaluate (repeatable), e.g. max_split_size_mb:128")
    a.add_argument("--top", type=_count(1, 10**6), default=8, help="rows printed per scenario (default 8)")
    a.add_argument("--processes", type=_count(1, 256), default=None,
                   help="replay processes (default: 2, or 1 on 1 core)")
    a.set_defaults(func=_cli)


def _count(low: int, high: int):  # noqa: ANN202 - an argparse type
    """argparse's ``type`` for an integer option in ``low..high``: one line naming the allowed range otherwise."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: {low} to {high}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{v} is out of range; allowed: {low} to {high}")
        return v
    return parse


def _size(high: int):  # noqa: ANN202 - an argparse type
    """argparse's ``type`` for a size option (``units.parse_size``: '48 MiB', '80 GB'), above 0 B and at most
    ``high`` bytes: one line naming the allowed range otherwise."""
    top = "2**63-1 bytes" if high == 2**63 - 1 else format_size(high)
    allowed = f"a size above 0 B and at most {top}, e.g. '48 MiB' (GB = 10**9 bytes, GiB = 2**30)"

    def parse(text: str) -> int:
        try:
            v = parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not 0 < v <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; allowed: {allowed}")
        return v
    return parse


def _cli(args) -> int:  # noqa: ANN001
    try:  # before the replays: a path that cannot be written is known now, not after minutes of work
        check_file(args.json_out, "--json")
        check_file(args.md_out, "--md")
    except OutputError as exc:
        raise CliError(str(exc)) from None
    try:
        doc = advise(args.input, max_flushes=args.max_flushes, budget=args.budget, capacity=args.capacity,
                     processes=args.processes, settings=tuple(args.setting))
    except (AdviseInputError, AllocatorConfigError, ReplayError, ReplayWorkerDied) as exc:
        raise CliError(str(exc)) from None
    for line in text_lines(doc, args.top):
        print(line)
    lost = [line for option, path, text in (("--json", args.json_out, lambda: json.dumps(doc, indent=1)),
                                            ("--md", args.md_out, lambda: markdown(doc, args.top)))
            if path and (line := _write_or_keep(option, path, text()))]
    for line in lost:
        print(line, file=sys.stderr)
    return 1 if lost else 0


def _write_or_keep(option: str, path: str, text: str) -> str | None:
    """Write ``text`` to ``path``; where that fails at the end, to a file of the temporary directory
    (``outputs.keep``). Returns ``None``, or the line that says where the text went."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        return None
    except OSError as exc:
        why = exc.strerror or exc
        return f"rlhfmem: {option} {path}: cannot be written ({why}); it is in {keep(text, Path(path).name)}"
