"""``rlhfmem advise``: from ONE recorded trace, the flush points and allocator settings that cut the peak.

Premise (issue 13): ``torch.cuda.empty_cache()`` changes the caching allocator's state, not the program's
allocations. So one trace of the program (its ``alloc``/``free`` events and phase marks) can be replayed
through the allocator model (``memory/allocator.py``, after ``c10/cuda/CUDACachingAllocator.cpp``) with
FLUSH events inserted at other places, or under another ``PYTORCH_CUDA_ALLOC_CONF``, instead of rerunning
the iteration once per policy and setting. The premise holds for this project's recipes (the tests replay
a flush-none run's trace under each of the study's four policies and get the policy runs' measured peak
reserved and fragmentation to the byte); it does NOT hold for a program that reads
``memory_allocated()``/``memory_reserved()`` or catches an OOM to change what it allocates: for such a
program every figure below is what the *same allocations* would do.

Candidates, each replayed on every rank (the answer is the maximum over ranks, as budgets are per GPU):

- flush placements: none; the trace as recorded (its own flushes); the study's four policies (flush
  after each inference phase, after each training phase, after both); every single boundary; then the
  best set of at most K boundaries, found by greedy forward selection (below);
- allocator settings (on the trace without flushes): ``max_split_size_mb`` at values around the trace's
  large requests, ``garbage_collection_threshold`` (needs a device capacity: ``capacity`` below),
  ``roundup_power2_divisions``, and ``expandable_segments:True`` when the model accepts it (until then it
  is listed under ``not_evaluated``, never dropped);
- combinations: the best flush placement with the best setting of each family.

Boundaries are where a flush can go: after each phase's code (the ``phase_end`` mark the recorder writes,
exactly where the recipes' ``maybe_flush`` calls ``empty_cache``); in a trace without phase ends (older
results), at the next phase's start; in a trace without phases (a user's snapshot), at the moment of
least live memory in each of 8 equal slices of the trace (where a flush can release the most).

Search for the best set of at most K boundaries (not enumeration: 2^B sets): start from the best single
boundary; at each step, replay the current set plus each boundary that lies before the current peak (a
flush after the peak cannot lower it) and keep the addition that lowers peak reserved most (ties: lower
cost); stop at K boundaries or when no addition lowers the peak. At most K x B replays, each a full replay
(flushes interact: one flush changes what the next can release).

Cost of a candidate, relative to no flush under the default settings (allocator terms, max over ranks):
extra cudaMalloc calls, extra cudaFree calls, bytes re-acquired (the extra bytes obtained from the driver:
cudaMalloc'd, or mapped with expandable segments; negative = fewer than without the change). A time is
given only where the result carries measured CUDA flush durations (``flush_cost.measured_flush_s``); it is
then an ESTIMATE (extra cudaFree x the measured mean per released segment; cudaMalloc time is not
measured and is left out, so the estimate is a lower bound). CPU runs give no time: a cudaMalloc's
duration is a GPU figure.

All sizes are bytes; the JSON schema (``SCHEMA``) is documented in ``docs/advise.md``.
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .memory.allocator import AllocatorConfig, AllocatorConfigError, MiB, kLargeBuffer
from .memory.recorded import recorded_release_batches
from .memory.replay import FREE_RUNNING, PYTHON, replay, replay_columns
from .memory.replay_engine import TraceColumns, columns_from_trace, engine_for
from .memory.trace import (
    ALLOC, FLUSH, FREE, PHASE, PHASE_END, SEGMENT_FREE, CAPTURE_CUDA, Event, SnapshotError, Trace,
)
from .units import format_size

SCHEMA = "rlhfmem-advise/1"
STUDY_POLICIES = ("none", "after-inference", "after-training", "after-both")
INFERENCE_PHASES = ("generate", "infer_actor", "infer_reference", "infer_reward", "infer_critic")
TRAINING_PHASES = ("train_actor", "train_critic")
DEFAULT_MAX_FLUSHES = 3
WINDOWS = 8  # boundaries of a trace without phases
GC_THRESHOLDS = (0.5, 0.8)
ROUNDUP_DIVISIONS = (4, 8)
RECORDED_FLUSH = "recorded-empty_cache"


class AdviseInputError(ValueError):
    """An input the advisor cannot use; the message is one line naming the file and what is wrong."""


# ---------------------------------------------------------------------------------------------------
# The program's trace and where flushes can go
# ---------------------------------------------------------------------------------------------------


def program_events(trace: Trace) -> tuple[list[Event], list[Event]]:
    """``(program, as_recorded)``: the program's own events (alloc, free, phase marks) without any flush
    or allocator decision, and the same with the recorded flushes as FLUSH events.

    Recorded flushes are the trace's FLUSH events and, in a CUDA snapshot, each ``segment_free`` batch
    that no allocation followed (a ``torch.cuda.empty_cache()``); a batch followed by a cudaMalloc is the
    allocator's own retry and is dropped with the other segment events (a free-running replay decides
    them again).
    """
    batches = recorded_release_batches(trace.events) if any(
        e.action == SEGMENT_FREE for e in trace.events) else {}
    program: list[Event] = []
    recorded: list[Event] = []
    for i, e in enumerate(trace.events):
        a = e.action
        if a in (ALLOC, FREE, PHASE, PHASE_END):
            program.append(e)
            recorded.append(e)
        elif a == FLUSH:
            recorded.append(e)
        elif a == SEGMENT_FREE and i in batches and batches[i] is None:
            recorded.append(Event(FLUSH, time_us=e.time_us, name=RECORDED_FLUSH))
    return program, recorded


@dataclass
class Boundaries:
    """Where a flush can go in one rank's program events: name -> insertion index (before that event)."""

    positions: dict[str, int]
    kind: str  # "phase-end" | "phase-start" | "window"
    phase_starts: dict[str, int] = field(default_factory=dict)  # phase -> index of its (last) PHASE event


def find_boundaries(events: list[Event]) -> Boundaries:
    """The flush boundaries of ``events`` (see the module docstring for the three kinds)."""
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
            put(name, starts[k + 1][0] if k + 1 < len(starts) else len(events))
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
        elif e.action == FREE:
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


def policy_boundaries(policy: str, names: list[str]) -> list[str] | None:
    """The boundaries a study policy flushes at (in ``names``), or ``None`` if the trace has none of its
    phases (the policy does not apply: not a recipe trace)."""
    inf = [n for n in names if n.split("#")[0] in INFERENCE_PHASES]
    tr = [n for n in names if n.split("#")[0] in TRAINING_PHASES]
    if not inf and not tr:
        return None
    return {"none": [], "after-inference": inf, "after-training": tr, "after-both": inf + tr}[policy]


# ---------------------------------------------------------------------------------------------------
# Replaying candidates (both cores: one process per core, traces shared by fork)
# ---------------------------------------------------------------------------------------------------


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


_RANKS: list[RankInput] = []


@dataclass(frozen=True)
class Spec:
    """A candidate: flush boundaries (or the recorded flushes), an alloc-conf string, a capacity (bytes)."""

    flushes: tuple[str, ...] = ()
    alloc_conf: str = ""
    capacity: int | None = None
    recorded: bool = False


def _spec_config(ri: RankInput, spec: Spec) -> AllocatorConfig:
    base = (ri.trace.allocator_settings or {}).get("PYTORCH_CUDA_ALLOC_CONF") or ""
    return AllocatorConfig.parse(",".join(c for c in (base, spec.alloc_conf) if c))


def _replay_one(job: tuple[Spec, int]) -> dict:
    """One candidate on one rank: the compiled engine inserts the flushes itself (``flush_at``) when it
    supports the setting; otherwise the Python model replays the event list with the flushes in it."""
    spec, r = job
    ri = _RANKS[r]
    positions: list[int] = []
    names: list[str] = []
    if spec.recorded:
        events, cols = ri.recorded, ri.recorded_columns
    else:
        events, cols = ri.program, ri.program_columns
        if spec.flushes:
            names = [n for n in spec.flushes if n in ri.boundaries.positions]
            positions = [ri.boundaries.positions[n] for n in names]
    trace = Trace(events=events, initial_segments=ri.trace.initial_segments,
                  allocator_settings=ri.trace.allocator_settings, capture=ri.trace.capture)
    if cols is None:
        cols = columns_from_trace(trace)
    res = replay_columns(cols, config=_spec_config(ri, spec), mode=FREE_RUNNING, capacity=spec.capacity,
                         flush_at=positions, flush_names=names, trace=trace)
    t = res.total
    return {"rank": ri.rank, "peak_reserved": t.peak_reserved, "fragmentation_at_peak": t.fragmentation_at_peak,
            "peak_phase": res.peak_phase, "cuda_malloc": t.cuda_malloc_count, "cuda_free": t.cuda_free_count,
            # bytes obtained from the driver: cudaMalloc'd segments plus, with expandable segments, mapped pages
            "bytes_acquired": sum(s for _, s in res.segment_allocs) + sum(s for _, s in res.segment_maps),
            "alloc_retries": t.alloc_retries,
            "ooms": t.ooms, "peak_allocated": t.peak_allocated,
            "flushes": len(res.flushes), "engine": res.engine}


class Evaluator:
    """Replays candidates on every rank, with a cache; ``processes`` > 1 uses a fork pool."""

    def __init__(self, ranks: list[RankInput], processes: int) -> None:
        global _RANKS
        _RANKS = ranks
        self.ranks = ranks
        self.cache: dict[Spec, dict] = {}
        self.replays = 0
        self.pool = None
        if processes > 1 and "fork" in multiprocessing.get_all_start_methods():
            # The workers inherit the ranks' columns and events by fork; freezing the objects made so far
            # keeps the workers' garbage collector from touching (and so copying) their pages.
            gc.collect()
            gc.freeze()
            self.pool = multiprocessing.get_context("fork").Pool(processes)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
            self.pool = None
            gc.unfreeze()

    def _engine(self, job: tuple[Spec, int]) -> str:
        spec, r = job
        ri = self.ranks[r]
        cols = ri.recorded_columns if spec.recorded else ri.program_columns
        return engine_for(cols, _spec_config(ri, spec), FREE_RUNNING)[0]

    def evaluate(self, specs: list[Spec]) -> list[dict]:
        todo = [s for s in dict.fromkeys(specs) if s not in self.cache]
        jobs = [(s, r) for s in todo for r in range(len(self.ranks))]
        # Python-engine replays (expandable segments) first, then the largest traces: better balance
        # across the two processes.
        jobs.sort(key=lambda j: (self._engine(j) != PYTHON, -len(self.ranks[j[1]].program)))
        outs = self.pool.map(_replay_one, jobs, chunksize=1) if self.pool and len(jobs) > 1 else \
            [_replay_one(j) for j in jobs]
        self.replays += len(jobs)
        per: dict[Spec, list[dict]] = {}
        for (s, _r), o in zip(jobs, outs):
            per.setdefault(s, []).append(o)
        for s, rows in per.items():
            self.cache[s] = _aggregate(rows)
        return [self.cache[s] for s in specs]


def _aggregate(rows: list[dict]) -> dict:
    """Max over ranks per metric (as the run's result aggregates); the peak's phase from the peak rank."""
    rows = sorted(rows, key=lambda d: d["rank"])
    top = max(rows, key=lambda d: d["peak_reserved"])
    out = {k: max((d[k] or 0) for d in rows) for k in ("peak_reserved", "fragmentation_at_peak", "cuda_malloc",
                                                       "cuda_free", "bytes_acquired", "alloc_retries", "ooms",
                                                       "peak_allocated", "flushes")}
    out["peak_phase"] = top["peak_phase"]
    out["peak_rank"] = top["rank"]
    engines = {d["engine"] for d in rows}
    out["engine"] = engines.pop() if len(engines) == 1 else "mixed"
    out["per_rank"] = [{k: d[k] for k in ("rank", "peak_reserved", "fragmentation_at_peak", "peak_phase",
                                          "cuda_malloc", "cuda_free")} for d in rows]
    return out


# ---------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------


def _large_request_mib(ranks: list[RankInput]) -> list[int]:
    """max_split_size_mb values around the trace's large requests: the 50th/90th percentile and the largest
    request above 20 MiB (kLargeBuffer), in MiB rounded up, plus one below the largest; the smallest allowed
    value (21) when no request is that large."""
    sizes = sorted(e.size for ri in ranks for e in ri.program if e.action == ALLOC and e.size > kLargeBuffer)
    if not sizes:
        return [21]
    picks = {sizes[len(sizes) // 2], sizes[min(len(sizes) - 1, int(len(sizes) * 0.9))], sizes[-1]}
    out = sorted({max(21, math.ceil(s / MiB)) for s in picks} | {max(21, math.ceil(sizes[-1] / MiB) - 1)})
    return out[:4]


_KIND_ORDER = {"flush": 0, "flush-set": 1, "setting": 2, "combination": 3, "policy": 4, "recorded": 5}


def _cost_key(c: dict) -> tuple:
    """Rank: no OOM, then peak reserved, then extra allocator calls, bytes re-acquired, fewer changes."""
    return (c["ooms"] > 0, c["peak_reserved"], c["extra_cuda_malloc"] + c["extra_cuda_free"], c["bytes_reacquired"],
            len(c["flushes_at"]) + bool(c["alloc_conf"]), _KIND_ORDER.get(c["kind"], 9))


def _describe(spec: Spec) -> str:
    parts = []
    if spec.recorded:
        parts.append("flushes as recorded")
    elif spec.flushes:
        parts.append("flush after " + _join(spec.flushes))
    if spec.alloc_conf:
        parts.append(f"PYTORCH_CUDA_ALLOC_CONF={spec.alloc_conf}")
    return " + ".join(parts) or "no flush, settings as recorded"


def _join(names: tuple[str, ...] | list[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


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


def advise_scenario(si: ScenarioInput, evaluator: Evaluator, max_flushes: int = DEFAULT_MAX_FLUSHES,
                    budget: int | None = None, capacity: int | None = None, top: int = 8,
                    settings: tuple[str, ...] = ()) -> dict:
    """Run the sweep on one scenario; returns its JSON section (see ``docs/advise.md``)."""
    t0 = time.perf_counter()
    names = list(si.ranks[0].boundaries.positions)
    for ri in si.ranks[1:]:  # boundaries every rank has, in the first rank's order
        names = [n for n in names if n in ri.boundaries.positions]
    none_spec = Spec()
    specs: dict[str, tuple[str, Spec]] = {"none": ("flush", none_spec)}
    has_recorded_flushes = any(e.action == FLUSH for ri in si.ranks for e in ri.recorded)
    if has_recorded_flushes:
        specs["as-recorded"] = ("recorded", Spec(recorded=True))
    policies: dict[str, str | None] = {}
    policy_names: dict[str, str] = {}
    for p in STUDY_POLICIES:
        b = policy_boundaries(p, names)
        if b is None:
            policies[p] = "none" if p == "none" else None
            continue
        cid = "none" if not b else f"policy:{p}"
        policy_names[cid] = p
        if b:
            specs[cid] = ("policy", Spec(flushes=tuple(b)))
        policies[p] = cid
    for n in names:
        specs[f"flush:{n}"] = ("flush", Spec(flushes=(n,)))
    evaluator.evaluate([s for _, s in specs.values()])
    base = evaluator.cache[none_spec]

    def row(cid: str, kind: str, spec: Spec) -> dict:
        c = dict(evaluator.cache[spec])
        desc = _describe(spec)
        if kind == "policy":
            desc = f"study policy {policy_names.get(cid, cid)} ({len(spec.flushes)} flushes)"
        elif kind == "recorded":
            desc = f"flushes as recorded ({si.flush_policy or 'the program'}'s)"
        c.update({"id": cid, "kind": kind, "description": desc, "flushes_at": list(spec.flushes),
                  "alloc_conf": spec.alloc_conf, "capacity": spec.capacity,
                  "delta_peak_reserved": c["peak_reserved"] - base["peak_reserved"],
                  "delta_peak_pct": (100.0 * (c["peak_reserved"] - base["peak_reserved"]) / base["peak_reserved"]
                                     if base["peak_reserved"] else 0.0),
                  "extra_cuda_malloc": c["cuda_malloc"] - base["cuda_malloc"],
                  "extra_cuda_free": c["cuda_free"] - base["cuda_free"],
                  "bytes_reacquired": c["bytes_acquired"] - base["bytes_acquired"]})
        c["time_estimate"] = _time_estimate(si, c)
        return c

    # Greedy forward selection of at most max_flushes boundaries.
    singles = sorted((row(f"flush:{n}", "flush", specs[f"flush:{n}"][1]) for n in names), key=_cost_key)
    search_steps = []
    best_set: tuple[str, ...] = ()
    if singles and max_flushes > 0 and singles[0]["peak_reserved"] < base["peak_reserved"]:
        best_set = tuple(singles[0]["flushes_at"])
        best = singles[0]
        search_steps.append({"set": list(best_set), "peak_reserved": best["peak_reserved"]})
        while len(best_set) < max_flushes:
            peak_rank = si.ranks[[ri.rank for ri in si.ranks].index(best["peak_rank"])]
            limit = peak_rank.boundaries.phase_starts.get(best["peak_phase"] or "", None)
            if limit is None and peak_rank.boundaries.kind == "window":
                limit = len(peak_rank.program)
            tries = [n for n in names if n not in best_set
                     and (limit is None or peak_rank.boundaries.positions.get(n, 0) <= limit)]
            if not tries:
                break
            cand_specs = [Spec(flushes=tuple(n2 for n2 in names if n2 in best_set or n2 == n)) for n in tries]
            evaluator.evaluate(cand_specs)
            rows = sorted((row("search", "flush", s) for s in cand_specs), key=_cost_key)
            if rows[0]["peak_reserved"] >= best["peak_reserved"]:
                break
            best = rows[0]
            best_set = tuple(best["flushes_at"])
            search_steps.append({"set": list(best_set), "peak_reserved": best["peak_reserved"]})
        if len(best_set) > 1:
            specs["flush-set:" + "+".join(best_set)] = ("flush-set", Spec(flushes=best_set))

    # Allocator settings, on the trace without flushes.
    gc_capacity = capacity or budget or base["peak_reserved"]
    cap_source = ("--capacity" if capacity else "--budget" if budget else
                  "the no-flush peak reserved (a device exactly as large as the unchanged program needs)")
    families: dict[str, list[str]] = {
        "max_split_size_mb": [f"max_split_size_mb:{v}" for v in _large_request_mib(si.ranks)],
        "garbage_collection_threshold": [f"garbage_collection_threshold:{v}" for v in GC_THRESHOLDS],
        "roundup_power2_divisions": [f"roundup_power2_divisions:{v}" for v in ROUNDUP_DIVISIONS],
        "expandable_segments": ["expandable_segments:True"],
    }
    if settings:
        families["requested"] = list(settings)
    not_evaluated = []
    setting_specs: dict[str, Spec] = {}
    for fam, confs in families.items():
        for conf in confs:
            try:
                AllocatorConfig.parse(conf)
            except AllocatorConfigError as exc:
                not_evaluated.append({"setting": conf, "reason": f"not evaluated (not modelled): {exc}"})
                continue
            cap = gc_capacity if fam == "garbage_collection_threshold" else None
            setting_specs[conf] = Spec(alloc_conf=conf, capacity=cap)
            specs[f"setting:{conf}"] = ("setting", setting_specs[conf])
    evaluator.evaluate([s for _, s in specs.values()])

    rows_by_id = {cid: row(cid, kind, spec) for cid, (kind, spec) in specs.items()}
    flush_rows = [r for r in rows_by_id.values() if r["kind"] in ("flush", "policy", "flush-set") and r["flushes_at"]]
    best_flush = min(flush_rows, key=_cost_key) if flush_rows else None
    combos: list[Spec] = []
    if best_flush and best_flush["peak_reserved"] < base["peak_reserved"]:
        for fam in families:
            fam_rows = [rows_by_id[f"setting:{c}"] for c in families[fam] if f"setting:{c}" in rows_by_id]
            if not fam_rows:
                continue
            b = min(fam_rows, key=_cost_key)
            combos.append(Spec(flushes=tuple(best_flush["flushes_at"]), alloc_conf=b["alloc_conf"],
                               capacity=b["capacity"]))
        evaluator.evaluate(combos)
        for s in combos:
            rows_by_id[f"combination:{'+'.join(s.flushes)}|{s.alloc_conf}"] = row(
                f"combination:{'+'.join(s.flushes)}|{s.alloc_conf}", "combination", s)

    ranked, seen = [], {}
    for r in sorted(rows_by_id.values(), key=_cost_key):  # one row per distinct candidate
        key = (tuple(r["flushes_at"]), r["alloc_conf"], r["capacity"], r["kind"] == "recorded")
        if key in seen:
            seen[key].setdefault("same_as", []).append(r["id"])
            policies = {p: (seen[key]["id"] if c == r["id"] else c) for p, c in policies.items()}
            continue
        seen[key] = r
        ranked.append(r)
    for i, r in enumerate(ranked):
        r["rank"] = i + 1
    best_row = ranked[0]
    section = {
        "scenario_id": si.scenario_id,
        "capture": si.capture,
        "simulated": si.capture != CAPTURE_CUDA,
        "ranks": len(si.ranks),
        "events": [len(ri.program) for ri in si.ranks],
        "boundaries": names,
        "boundary_kind": si.ranks[0].boundaries.kind,
        "baseline": rows_by_id["none"],  # (the rows below are the same dicts as in candidates)
        "as_recorded": rows_by_id.get("as-recorded"),
        "policies": policies,
        "candidates": ranked,
        "not_evaluated": not_evaluated,
        "assumptions": {"gc_capacity": gc_capacity, "gc_capacity_source": cap_source,
                        "replay": "free-running (the model's own cudaMalloc/cudaFree decisions, no device "
                                  "limit except for garbage_collection_threshold candidates)"},
        "search": {"method": "greedy forward selection over boundaries before the current peak",
                   "max_flushes": max_flushes, "steps": search_steps},
        "premise": _premise(si, evaluator, rows_by_id),
        "recommendation": _recommend(best_row, base),
        "budget": _fit_budget(ranked, base, budget) if budget is not None else None,
        "top": top,
        "replays": evaluator.replays,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return section


def _time_estimate(si: ScenarioInput, c: dict) -> dict | None:
    if not si.measured_flush_s or not si.flush_segments_released:
        return None
    per_free = sum(si.measured_flush_s) / si.flush_segments_released
    return {"seconds": round(max(c["extra_cuda_free"], 0) * per_free, 6), "estimate": True,
            "basis": f"extra cudaFree x {per_free * 1e6:.0f} us (measured mean per released segment of this "
                     "run's flushes); cudaMalloc time not measured, so a lower bound"}


def _premise(si: ScenarioInput, ev: Evaluator, rows: dict) -> dict:
    """The premise, and what the advisor can check itself: the replay of the trace as recorded against the
    run's measured peak reserved and fragmentation."""
    text = ("a flush changes the allocator's state, not the program's allocations: every candidate replays the "
            "same allocations. This holds for the recipes (tests/test_advise.py); a program that reads "
            "memory_reserved() or catches OOM to allocate differently would not follow these predictions.")
    out: dict = {"text": text, "measured_check": None}
    m = si.measured
    rec = rows.get("as-recorded") or rows["none"]
    if m:
        same = (m.get("peak_reserved") == rec["peak_reserved"]
                and (m.get("fragmentation_at_peak") or 0) == (rec["fragmentation_at_peak"] or 0))
        out["measured_check"] = {
            "measured_peak_reserved": m.get("peak_reserved"), "replayed_peak_reserved": rec["peak_reserved"],
            "measured_fragmentation_at_peak": m.get("fragmentation_at_peak"),
            "replayed_fragmentation_at_peak": rec["fragmentation_at_peak"], "equal": same,
            "note": ("the replay of the trace as recorded reproduces the run's figures" if same else
                     "the replay of the trace as recorded does NOT reproduce the run's figures: on CUDA the model "
                     "replays free-running (its own segment decisions); treat the deltas, not the absolute "
                     "figures, as the prediction"),
        }
    return out


def _recommend(best: dict, base: dict) -> dict:
    if best["peak_reserved"] >= base["peak_reserved"] or best["id"] == "none":
        return {"candidate": "none", "text": (f"no flush placement or evaluated setting lowers peak reserved below "
                                               f"{format_size(base['peak_reserved'])}: keep the program as it is")}
    text = (f"{best['description']}: {best['delta_peak_pct']:+.1f}% peak reserved "
            f"({format_size(base['peak_reserved'])} -> {format_size(best['peak_reserved'])}), "
            f"{best['extra_cuda_malloc']:+d} cudaMalloc, {best['extra_cuda_free']:+d} cudaFree")
    return {"candidate": best["id"], "text": text}


def _fit_budget(ranked: list[dict], base: dict, budget: int) -> dict:
    fits = [r for r in ranked if r["peak_reserved"] <= budget and r["ooms"] == 0]
    if not fits:
        return {"size": budget, "candidate": None,
                "text": f"no evaluated change fits {format_size(budget)}; the lowest peak reserved is "
                        f"{format_size(ranked[0]['peak_reserved'])} ({ranked[0]['description']})"}
    cheapest = min(fits, key=lambda r: (r["extra_cuda_malloc"] + r["extra_cuda_free"], r["bytes_reacquired"],
                                        len(r["flushes_at"]) + bool(r["alloc_conf"]), r["peak_reserved"]))
    what = "no change needed" if cheapest["id"] == "none" else cheapest["description"]
    return {"size": budget, "candidate": cheapest["id"],
            "text": f"cheapest change that fits {format_size(budget)}: {what} (peak reserved "
                    f"{format_size(cheapest['peak_reserved'])}, {cheapest['extra_cuda_malloc']:+d} cudaMalloc, "
                    f"{cheapest['extra_cuda_free']:+d} cudaFree)"}


# ---------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------


def _rank_input(rank: int, trace: Trace) -> RankInput:
    program, recorded = program_events(trace)
    kw = {"initial_segments": trace.initial_segments, "allocator_settings": trace.allocator_settings,
          "capture": trace.capture}
    pc = columns_from_trace(Trace(events=program, **kw))
    rc = columns_from_trace(Trace(events=recorded, **kw)) if len(recorded) != len(program) else pc
    return RankInput(rank, program, recorded, find_boundaries(program), trace, pc, rc)


def load_inputs(path: str | Path) -> list[ScenarioInput]:
    """Read INPUT: a result JSON (``rlhfmem run --json``, a session ``--rlhfmem-json``, ``rlhfmem capture``)
    whose ranks name their trace files, or a memory snapshot pickle. Raises :class:`AdviseInputError`."""
    from .memory.trace_io import TraceFileError, load_trace, resolve_trace_path

    p = Path(path)
    if not p.exists():
        raise AdviseInputError(f"{p}: no such file")
    head = p.read_bytes()[:1]
    if head in (b"{", b"["):
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdviseInputError(f"{p}: not valid JSON ({exc})") from None
        results = data.get("results") if isinstance(data, dict) and "results" in data else [data]
        results = [r for r in results if isinstance(r, dict) and "scenario_id" in r]
        if not results:
            raise AdviseInputError(f"{p}: not a result of rlhfmem run/capture or a session --rlhfmem-json "
                                   "(no scenario_id)")
        out = []
        for r in results:
            ranks = []
            for rk in r.get("ranks") or []:
                tf = rk.get("trace_file")
                if not tf:
                    raise AdviseInputError(
                        f"{p}: {r['scenario_id']} rank {rk.get('rank')} names no trace file (a result written "
                        "before results saved their traces, or a run without capture): rerun it to advise")
                try:
                    ranks.append(_rank_input(int(rk.get("rank", len(ranks))), load_trace(resolve_trace_path(tf, p))))
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
                                     flush_policy=(r.get("scenario") or {}).get("flush")))
        return out
    from .memory.trace import load_snapshot, trace_from_snapshot

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


def check_settings(settings: tuple[str, ...] | list[str]) -> None:
    """Refuse an extra setting with an unknown key or a bad value (:class:`AllocatorConfigError`); a
    setting the model does not implement (``expandable_segments:True``) is kept and listed as not evaluated."""
    for conf in settings:
        try:
            AllocatorConfig.parse(conf)
        except AllocatorConfigError as exc:
            if "not modelled" not in str(exc):
                raise


def advise(path: str | Path, max_flushes: int = DEFAULT_MAX_FLUSHES, budget: int | None = None,
           capacity: int | None = None, processes: int | None = None, settings: tuple[str, ...] = ()) -> dict:
    """The whole advisor: one JSON document for every scenario of INPUT (see ``docs/advise.md``).

    ``settings``: extra ``PYTORCH_CUDA_ALLOC_CONF`` strings to evaluate. Raises :class:`AdviseInputError`
    for an input it cannot use, :class:`AllocatorConfigError` for a bad extra setting.
    """
    check_settings(settings)
    inputs = load_inputs(path)
    procs = processes if processes is not None else min(2, os.cpu_count() or 1)
    sections = []
    for si in inputs:
        ev = Evaluator(si.ranks, procs)
        try:
            sections.append(advise_scenario(si, ev, max_flushes, budget, capacity, settings=tuple(settings)))
        finally:
            ev.close()
    return {"schema": SCHEMA, "input": str(path), "scenarios": sections}


# ---------------------------------------------------------------------------------------------------
# The flush's own cost (issue 15), computed by the worker for every result
# ---------------------------------------------------------------------------------------------------


def flush_cost(trace: Trace, measured_flush_s: list | None = None) -> dict:
    """What the trace's flushes cost in allocator calls: their count and the cudaMalloc/cudaFree calls and
    bytes they cause (a replay with them against one without; free-running, max 0), plus, on CUDA, the
    measured seconds of each ``empty_cache()`` (``measured_flush_s``, from the recorder)."""
    program, recorded = program_events(trace)
    n = sum(1 for e in recorded if e.action == FLUSH)
    out = {"flushes": n, "extra_cuda_malloc": 0, "extra_cuda_free": 0, "bytes_reacquired": 0,
           "segments_released": 0, "measured_flush_s": [round(s, 6) for _, s in (measured_flush_s or [])]}
    if not n:
        return out
    kw = {"initial_segments": trace.initial_segments, "allocator_settings": trace.allocator_settings,
          "capture": trace.capture}
    a = replay(Trace(events=recorded, **kw), mode=FREE_RUNNING, record_series=False, engine="auto")
    b = replay(Trace(events=program, **kw), mode=FREE_RUNNING, record_series=False, engine="auto")
    out.update({"extra_cuda_malloc": a.total.cuda_malloc_count - b.total.cuda_malloc_count,
                "extra_cuda_free": a.total.cuda_free_count - b.total.cuda_free_count,
                "bytes_reacquired": sum(s for _, s in a.segment_allocs) - sum(s for _, s in b.segment_allocs),
                "segments_released": sum(f["segments_released"] for f in a.flushes)})
    return out


# ---------------------------------------------------------------------------------------------------
# Human output
# ---------------------------------------------------------------------------------------------------


def _fmt_row(r: dict) -> tuple:
    frag = format_size(r["fragmentation_at_peak"]) if r["fragmentation_at_peak"] else "-"
    te = r.get("time_estimate")
    cost = f"{r['extra_cuda_malloc']:+d} / {r['extra_cuda_free']:+d}"
    t = f"~{te['seconds'] * 1e3:.1f} ms (est.)" if te else "-"
    oom = " OOM" if r["ooms"] else ""
    return (str(r["rank"]), r["description"] + oom, format_size(r["peak_reserved"]), f"{r['delta_peak_pct']:+.1f}%",
            frag, str(r["peak_phase"] or "-"), cost, format_size(r["bytes_reacquired"]), t)


def text_lines(doc: dict, top: int = 8) -> list[str]:
    """The human report: per scenario the top rows, the study's policies beside them, the recommendation."""
    lines = []
    for s in doc["scenarios"]:
        label = "simulated: CPU trace replayed through the allocator model" if s["simulated"] else \
            "CUDA trace replayed through the allocator model (free-running)"
        lines.append(f"{s['scenario_id']}: {s['ranks']} rank(s), {sum(s['events'])} events, "
                     f"{len(s['boundaries'])} flush boundaries ({s['boundary_kind']}); {label}")
        header = ("#", "candidate", "peak reserved", "vs none", "frag. at peak", "peak phase",
                  "cudaMalloc / cudaFree", "re-acquired", "time")
        rows = [header]
        shown = s["candidates"][:top]
        ids = {r["id"] for r in shown}
        extra = [r for r in s["candidates"] if r["id"] not in ids and (r["kind"] in ("policy", "recorded")
                                                                      or r["id"] == "none")]
        rows += [_fmt_row(r) for r in shown]
        if extra:
            rows.append(("", "study's policies and references:", "", "", "", "", "", "", ""))
            rows += [_fmt_row(r) for r in extra]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        pol = ", ".join(f"{p}: {'not applicable (no recipe phases)' if c is None else '#' + str(_rank_of(s, c))}"
                        for p, c in s["policies"].items())
        lines.append(f"  study's policies: {pol}")
        for ne in s["not_evaluated"]:
            lines.append(f"  {ne['setting']}: {ne['reason']}")
        capacity = format_size(s["assumptions"]["gc_capacity"])
        lines.append(f"  garbage_collection_threshold assumes a device of {capacity}"
                     f" ({s['assumptions']['gc_capacity_source']})")
        mc = s["premise"]["measured_check"]
        if mc:
            lines.append(f"  check: {mc['note']} (measured {format_size(mc['measured_peak_reserved'])}, replayed "
                         f"{format_size(mc['replayed_peak_reserved'])})")
        lines.append(f"  recommendation: {s['recommendation']['text']}")
        if s["budget"]:
            lines.append(f"  budget: {s['budget']['text']}")
        lines.append(f"  ({s['replays']} replays in {s['seconds']:.1f} s; cost = extra calls and bytes vs no "
                     "flush; times only where CUDA flush durations were measured, and then estimates)")
    return lines


def _rank_of(s: dict, cid: str) -> int:
    return next((r["rank"] for r in s["candidates"] if r["id"] == cid), 0)


def markdown(doc: dict, top: int = 8) -> str:
    out = ["# rlhfmem advise", ""]
    for s in doc["scenarios"]:
        out += [f"## `{s['scenario_id']}`", "",
                ("_simulated: a CPU allocation trace replayed through the CUDA caching allocator model_"
                 if s["simulated"] else "_a CUDA trace replayed through the allocator model (free-running)_"), "",
                f"**Recommendation:** {s['recommendation']['text']}", ""]
        if s["budget"]:
            out += [f"**Budget:** {s['budget']['text']}", ""]
        out += ["| # | candidate | peak reserved | vs none | fragmentation at peak | peak phase | cudaMalloc / "
                "cudaFree | re-acquired | time |", "|---|---|---|---|---|---|---|---|---|"]
        shown = s["candidates"][:top]
        ids = {r["id"] for r in shown}
        shown += [r for r in s["candidates"] if r["id"] not in ids and (r["kind"] in ("policy", "recorded")
                                                                       or r["id"] == "none")]
        for r in shown:
            out.append("| " + " | ".join(_fmt_row(r)) + " |")
        out.append("")
        for ne in s["not_evaluated"]:
            out.append(f"- `{ne['setting']}`: {ne['reason']}")
        out.append(f"- garbage_collection_threshold assumes a device of "
                   f"{format_size(s['assumptions']['gc_capacity'])} ({s['assumptions']['gc_capacity_source']})")
        out.append("")
    return "\n".join(out)


def one_line(result: dict, budget: int | None = None) -> str:
    """The plugin's line for a scenario over budget: the advisor's recommendation (or the cheapest change
    that fits ``budget``), from the result's own traces. Never raises: a failure becomes the line."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "result.json"
            p.write_text(json.dumps(result))
            doc = advise(p, budget=budget, processes=1)  # inside pytest: no fork of the test process
        s = doc["scenarios"][0]
        if s["budget"]:
            return f"rlhfmem advise: {s['budget']['text']} (best: {s['recommendation']['text']})"
        return f"rlhfmem advise: {s['recommendation']['text']}"
    except (AdviseInputError, OSError, AllocatorConfigError) as exc:
        return f"rlhfmem advise: not available ({exc})"


# ---------------------------------------------------------------------------------------------------
# Command line: rlhfmem advise
# ---------------------------------------------------------------------------------------------------


def add_advise_parser(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
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
    from .errors import CliError
    from .units import parse_size

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
