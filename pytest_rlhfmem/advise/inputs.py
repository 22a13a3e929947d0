"""``rlhfmem advise``'s input: each scenario's ranks, one recorded trace each, and where a flush can go in them.

INPUT is a result JSON (``rlhfmem run --json``, a session's ``--rlhfmem-json``, ``rlhfmem capture``) whose
ranks name their ``.rlhftrace`` files, or a ``torch.cuda.memory._dump_snapshot()`` pickle (one rank per
device with events). Each rank becomes a :class:`RankInput`: the program's own events (alloc, free, phase
marks: ``memory/flushes.program_events``), the same with the recorded flushes, its flush boundaries, and
both as columns for the compiled replay core.

Boundaries are where a flush can go: after each phase's code (the ``phase_end`` mark the recorder writes,
exactly where the recipes' phase step, ``rlhf/common.py: PhaseSteps``, calls ``empty_cache``); in a trace without
phase ends (older results), at the next phase's start; in a trace without phases (a user's snapshot), at the moment of
least live memory in each of 8 equal slices of the trace (where a flush can release the most). A flush
after the last event cannot change anything, so it is never a boundary: a capture of a script that marks
no phases (one window, ``run``) has no flush boundary at all (``MARKS_HINT`` says what to add).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..memory.columns import TraceColumns, columns_from_trace
from ..memory.events import ALLOC, CAPTURE_CUDA, EXTERNAL_MAP, FLUSH, FREE, FREE_REQUESTED, PHASE, PHASE_END, Event, \
    Trace
from ..memory.flushes import program_events
from ..memory.trace import SnapshotError, load_snapshot, trace_from_snapshot
from ..memory.trace_io import TraceFileError, load_trace, resolve_trace_path
from ..report import ReportInputError, read_results

WINDOWS = 8  # boundaries of a trace without phases
POLICY_FLUSH_PREFIX = "after-"  # the flush policy's FLUSH names: after-<phase> (rlhf/common.py PhaseSteps)


MARKS_HINT = ("no phase marks: the whole program is one window (run), so no flush placement can be advised; "
              "mark its phases (import pytest_rlhfmem as rlhfmem; with rlhfmem.phase(\"generate\"): ...) and "
              "capture again to get flush-placement advice")


def is_unmarked(b: Boundaries) -> bool:
    """Whether a rank's trace marks no phase of its own (at most one phase, no phase ends)."""
    return b.kind != "phase-end" and len(b.phase_starts) <= 1


class AdviseInputError(ValueError):
    """An input the advisor cannot use; the message is one line naming the file and what is wrong."""


@dataclass
class Boundaries:
    """Where a flush can go in one rank's program events: name -> insertion index (before that event)."""

    positions: dict[str, int]
    kind: str  # "phase-end" | "phase-start" | "window"
    phase_starts: dict[str, int] = field(default_factory=dict)  # phase -> index of its (last) PHASE event


def find_boundaries(events: list[Event]) -> Boundaries:
    """The flush boundaries of ``events`` (the module docstring says the three kinds)."""
    ends = [(i, e.name) for i, e in enumerate(events) if e.action == PHASE_END]
    starts = [(i, e.name) for i, e in enumerate(events) if e.action == PHASE]
    phase_starts = {name: i for i, name in starts}
    positions: dict[str, int] = {}

    def put(name: str, pos: int) -> None:
        key, n = name, 2
        while key in positions:
            key, n = f"{name}#{n}", n + 1
        positions[key] = pos

    if ends:
        for i, name in ends:
            put(name, i + 1)
        return Boundaries(positions, "phase-end", phase_starts)
    if starts:
        for k, (_i, name) in enumerate(starts):
            if k + 1 < len(starts):  # after the last phase is after the last event: a flush there changes nothing
                put(name, starts[k + 1][0])
        return Boundaries(positions, "phase-start", phase_starts)
    # No phases: the least-live-memory moment in each of WINDOWS equal slices.
    n = len(events)
    live: dict[int, int] = {}
    cur = 0
    level = [0] * n
    for i, e in enumerate(events):
        if e.action == ALLOC:
            live[e.addr] = e.size
            cur += e.size
        elif e.action in (FREE, FREE_REQUESTED):  # a held block's bytes leave the live level at its request
            cur -= live.pop(e.addr, 0)
        level[i] = cur
    for w in range(WINDOWS):
        lo, hi = n * w // WINDOWS, n * (w + 1) // WINDOWS
        if hi <= lo:
            continue
        i = min(range(lo, hi), key=lambda j: (level[j], -j))
        if 2 <= i + 1 < n:  # a flush before the first or after the last event changes nothing
            put(f"event {i + 1}", i + 1)
    return Boundaries(positions, "window", {})


@dataclass
class RankInput:
    """One rank's program: events without flushes, as recorded, its boundaries and starting state.

    ``program_columns``/``recorded_columns``: the same two event lists as columns, built once, for the
    compiled replay engine (``memory/replay_engine.py``); fork passes them to the worker processes
    without copying (the columns are a few flat buffers, untouched by reference counting)."""

    rank: int
    program: list[Event]
    recorded: list[Event]
    boundaries: Boundaries
    trace: Trace  # initial segments, allocator settings, capture
    program_columns: TraceColumns | None = None
    recorded_columns: TraceColumns | None = None
    # a colocated rollout engine: the rank's record of it (rollout/engine.py: EngineStandIn.describe; None: none
    # recorded) and the boundaries right before one of its wake-ups (its first mapping follows, marks between)
    engine: dict | None = None
    wake_up_boundaries: frozenset[str] = frozenset()


def wake_up_boundaries(events: list[Event], b: Boundaries) -> frozenset[str]:
    """The boundaries of ``b`` after which the next event other than a phase mark or a flush is another
    allocator's mapping (``EXTERNAL_MAP``): a flush there is the trainer's ``empty_cache()`` right before a
    colocated engine's ``wake_up`` (TRL's ``sync_weights``)."""
    out = set()
    for name, pos in b.positions.items():
        nxt = next((e for e in events[pos:] if e.action not in (PHASE, PHASE_END, FLUSH)), None)
        if nxt is not None and nxt.action == EXTERNAL_MAP:
            out.add(name)
    return frozenset(out)


@dataclass
class ScenarioInput:
    """What the advisor replays for one scenario: its ranks and what the run measured (if a result)."""

    scenario_id: str
    capture: str
    ranks: list[RankInput]
    measured: dict | None = None  # the result's metrics (max over ranks), for the premise check
    measured_flush_s: list[float] = field(default_factory=list)  # CUDA: durations of the recorded flushes
    flush_segments_released: int = 0
    flush_policy: str | None = None
    torch_version: str | None = None  # the run's torch (a result's versions); None for a snapshot pickle


def _is_library_flush(e: Event) -> bool:
    """A flush the recipe's code or a library made (``empty_cache@<file>:<line>``, e.g. DeepSpeed's ZeRO-2 init and
    Hybrid Engine), not the flush policy's (``after-<phase>``, rlhf/common.py ``PhaseSteps``)."""
    return not e.name.startswith(POLICY_FLUSH_PREFIX)


def _rank_input(rank: int, trace: Trace, library_flushes: bool = False, engine: dict | None = None) -> RankInput:
    """``library_flushes`` (a recipe result: its flush policy is known): the recipe's and libraries' own
    ``empty_cache()`` calls stay in the program, as every policy's run makes them; only the policy's flushes are
    placements. Otherwise (a capture, a snapshot) every flush is a placement the advisor may move or drop."""
    program, recorded = program_events(trace, _is_library_flush if library_flushes else None)
    kw = {"initial_segments": trace.initial_segments, "allocator_settings": trace.allocator_settings,
          "capture": trace.capture, "source": trace.source}
    pc = columns_from_trace(Trace(events=program, **kw))
    rc = columns_from_trace(Trace(events=recorded, **kw)) if len(recorded) != len(program) else pc
    b = find_boundaries(program)
    return RankInput(rank, program, recorded, b, trace, pc, rc, engine, wake_up_boundaries(program, b))


def load_inputs(path: str | Path) -> list[ScenarioInput]:
    """Read INPUT: a result JSON (``rlhfmem run --json``, a session ``--rlhfmem-json``, ``rlhfmem capture``)
    whose ranks name their trace files, or a memory snapshot pickle. Raises :class:`AdviseInputError`."""
    p = Path(path)
    if not p.exists():
        raise AdviseInputError(f"{p}: no such file")
    head = b""  # not a regular file (a device, a FIFO): the snapshot reader below refuses it in one line
    if p.is_file():
        try:
            with open(p, "rb") as f:
                head = f.read(1)
        except OSError as exc:
            raise AdviseInputError(f"{p}: cannot be read: {exc.strerror or exc}") from None
    if head in (b"{", b"["):
        try:
            results = read_results(p)  # each result checked against report.RESULT_SCHEMA
        except ReportInputError as exc:
            raise AdviseInputError(str(exc)) from None
        out = []
        for r in results:
            ranks = []
            policy = (r.get("scenario") or {}).get("flush")
            for rk in r.get("ranks") or []:
                tf = rk.get("trace_file")
                if not tf:
                    raise AdviseInputError(
                        f"{p}: {r['scenario_id']} rank {rk.get('rank')} names no trace file (a result written "
                        "before results saved their traces, or a run without capture): rerun it to advise")
                try:
                    rank = len(ranks) if rk.get("rank") is None else rk["rank"]
                    ranks.append(_rank_input(rank, load_trace(resolve_trace_path(tf, p)),
                                             library_flushes=policy is not None,
                                             engine=(rk.get("recipe") or {}).get("rollout_engine")))
                except TraceFileError as exc:
                    raise AdviseInputError(str(exc)) from None
            if not ranks:
                raise AdviseInputError(f"{p}: {r['scenario_id']} has no ranks with traces (status "
                                       f"{r.get('status')!r})")
            fc = [rk.get("flush_cost") or {} for rk in r.get("ranks") or []]
            measured_s = [s for f in fc for s in (f.get("measured_flush_s") or [])]
            released = sum(f.get("segments_released") or 0 for f in fc)
            out.append(ScenarioInput(r["scenario_id"], r.get("capture") or ranks[0].trace.capture, ranks,
                                     measured=r.get("metrics"), measured_flush_s=measured_s,
                                     flush_segments_released=released,
                                     flush_policy=policy,
                                     torch_version=(r.get("versions") or {}).get("torch")))
        return out
    try:
        snap = load_snapshot(p)
        devices = [i for i, t in enumerate(snap.get("device_traces") or []) if t]
        if not devices:
            raise AdviseInputError(f"{p}: the snapshot holds no trace events (recorded without "
                                   "torch.cuda.memory._record_memory_history?): nothing to replay")
        ranks = []
        for d in devices:
            tr = trace_from_snapshot(snap, device=d, source=str(p))
            if sum(1 for e in tr.events if e.action in (ALLOC, FREE)) == 0:
                continue
            ranks.append(_rank_input(d, tr))
    except SnapshotError as exc:
        raise AdviseInputError(str(exc)) from None
    if not ranks:
        raise AdviseInputError(f"{p}: the snapshot holds no alloc/free events: nothing to replay")
    return [ScenarioInput(p.stem, CAPTURE_CUDA, ranks)]
