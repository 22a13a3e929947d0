"""Replay a :class:`~.events.Trace` through :class:`~.allocator.CachingAllocatorModel`.

Two modes:

- ``anchored``: the model's new segments take the recorded ``segment_alloc`` addresses (when the size
  agrees) and a new expandable segment takes the address of the recorded ``segment_map`` that created
  it, so ties between equal-size free blocks break as they did on the real GPU, and a recorded
  cudaMalloc failure (a ``segment_free`` batch right before the ``segment_alloc`` of the same request)
  is taken as given: the device's capacity and other processes are outside the trace.
- ``free-running``: synthetic addresses; cudaMalloc fails only past ``capacity``. This is the mode for a
  captured CPU trace and for "what if" questions (``--alloc-conf``).

Either way, a recorded ``segment_free``/``segment_unmap`` batch that no allocation needed (a user's
``torch.cuda.empty_cache()``) and every ``FLUSH`` event call ``release_cached_blocks``; POOL_ENTER /
POOL_EXIT / POOL_RELEASE markers divert allocations to a private pool as ``use_mem_pool`` does (from a
snapshot, :func:`~.trace.trace_from_snapshot` places them from the recorded addresses' segments, so
both modes keep the recorded pool membership); a recorded ``oom`` entry is replayed as the failing
request, and its free-memory figure gives the device capacity when none is given.

Two engines replay (``docs/replay-engine.md``): ``python_engine.py`` with ``allocator.py`` (the reference;
every mode) and the compiled core ``csrc/replay_core.cpp`` behind ``replay_engine.py``, which mirrors them
function by function for replays without series or replayed events (private pools included), about 25 times
faster.
:func:`replay` uses the Python model unless asked (``engine="auto"``); :func:`replay_columns` (the CLI and the
advisor) picks. This module is the one replay entry: it sits above both engines, the formats and the types,
and re-exports the names its callers have always imported from it (modes, results, ``with_flushes``).
"""

from __future__ import annotations

from .allocator import AllocatorConfig, allowed_memory_maximum
from .columns import TraceColumns, columns_from_trace
from .events import Trace
from .python_engine import replay_python, with_flush_events, with_flushes
from .recorded import infer_capacity, recorded_summary
from .replay_engine import engine_for, infer_capacity_columns, run_compiled
from .replay_types import ANCHORED, FREE_RUNNING, MODES, PYTHON, RecordedSummary, ReplayError, ReplayResult

__all__ = [  # the replay entry's own names, and those its callers import from here
    "ANCHORED", "FREE_RUNNING", "MODES", "PYTHON", "RecordedSummary", "ReplayError", "ReplayResult", "agreement",
    "infer_capacity", "recorded_summary", "replay", "replay_columns", "replay_json", "with_flushes",
]


def replay(trace: Trace, config: AllocatorConfig | None = None, mode: str = FREE_RUNNING,
           capacity: int | None = None, record_series: bool = True, record_events: bool = False,
           engine: str = PYTHON) -> ReplayResult:
    """Replay ``trace``; returns a :class:`ReplayResult`.

    ``engine``: ``python`` (``python_engine.py`` and ``allocator.py``: the reference, and the only one returning
    ``model`` and ``collector``), ``auto`` (the compiled core of ``replay_engine.py`` when it supports
    this replay: no series or events recorded; else Python) or
    ``compiled`` (raises ``ValueError`` when unsupported). ``ReplayResult.engine`` says which ran.

    ``record_events`` keeps the replayed trace (``ReplayResult.events``): allocations at the addresses the
    model chose, with its own segment_alloc/segment_free events, ready for :func:`~.trace.write_snapshot`.

    ``config`` defaults to the trace's recorded allocator settings; ``capacity`` is the device's bytes
    (``None``: inferred from the trace's ``oom`` entries if it has any, else unlimited). Raises
    ``ValueError`` for an unknown ``mode`` and :class:`ReplayError` for a trace the model cannot follow
    (unbalanced pool markers, a pre-existing segment its live blocks do not fit). A request the model
    cannot satisfy counts as an OOM (``ooms``) and the replay goes on, as a caught ``OutOfMemoryError``
    would.
    """
    if mode not in MODES:
        raise ValueError(f"replay mode {mode!r}: allowed values are {', '.join(MODES)}")
    config = config or AllocatorConfig.from_snapshot_settings(trace.allocator_settings)
    if engine != PYTHON:
        return replay_columns(columns_from_trace(trace), config, mode, capacity, record_series, record_events,
                              engine, trace=trace)
    return replay_python(trace, config, mode, capacity, record_series, record_events, "requested")


def replay_columns(cols: TraceColumns, config: AllocatorConfig | None = None, mode: str = FREE_RUNNING,
                   capacity: int | None = None, record_series: bool = False, record_events: bool = False,
                   engine: str = "auto", flush_at: list[int] | tuple[int, ...] = (),
                   flush_names: list[str] | tuple[str, ...] = (), trace: Trace | None = None) -> ReplayResult:
    """:func:`replay` of a trace given as columns (:class:`~.columns.TraceColumns`), by the engine
    :func:`~.replay_engine.engine_for` picks. ``flush_at``/``flush_names``: FLUSH events inserted before
    those event indices (:func:`~.python_engine.with_flushes`). ``trace``: the same trace as Events, if the caller has
    it (saves rebuilding it for the Python engine). Raises as :func:`replay` does."""
    if mode not in MODES:
        raise ValueError(f"replay mode {mode!r}: allowed values are {', '.join(MODES)}")
    config = config or AllocatorConfig.from_snapshot_settings(cols.allocator_settings)
    name, why = engine_for(cols, config, mode, record_series, record_events, engine)
    if name == PYTHON:
        if trace is None:
            trace = cols.to_trace()
        if flush_at:
            trace = with_flush_events(trace, flush_at, flush_names)
        return replay_python(trace, config, mode, capacity, record_series, record_events, why)
    capacity_source = "given" if capacity is not None else "unlimited"
    if capacity is None:
        capacity = infer_capacity_columns(cols)
        if capacity is not None:
            capacity_source = "inferred from the trace's oom entries"
    result = run_compiled(cols, config, capacity, flush_at, flush_names, mode)
    result.capacity_source = capacity_source
    result.engine_reason = why
    return result


def agreement(recorded: RecordedSummary, sim: ReplayResult, has_segment_events: bool) -> dict:
    """The fidelity figures of ``rlhfmem replay --json``; ``available`` False (with a reason) when the
    trace holds no segment events to compare against."""
    if not has_segment_events:
        return {"available": False,
                "reason": "the trace holds no segment_alloc/segment_free/segment_map events (a captured CPU trace, "
                          "or a "
                          "snapshot recorded without them): nothing recorded to compare against"}
    same_pos = sum(1 for r, s in zip(recorded.segment_allocs, sim.segment_allocs) if r[1] == s[1])
    anchored = sim.mode == ANCHORED

    def matching(rec: list[tuple[int, int]], simulated: list[tuple[int, int]]) -> int:
        # anchored: same address and size at the same position; free-running addresses are synthetic
        return sum(1 for r, s in zip(rec, simulated) if (r == s if anchored else r[1] == s[1]))

    def norm(batches: list[list[tuple[int, int]]]) -> list:
        return [b if anchored else sorted(sz for _, sz in b) for b in batches]

    return {
        "available": True,
        "segment_allocs_recorded": len(recorded.segment_allocs),
        "segment_allocs_simulated": len(sim.segment_allocs),
        "segment_allocs_matching": same_pos,
        "segment_free_batches_recorded": len(recorded.segment_free_batches),
        "segment_free_batches_simulated": len(sim.segment_free_batches),
        "segment_free_batches_equal": norm(recorded.segment_free_batches) == norm(sim.segment_free_batches),
        "final_reserved_equal": recorded.final_reserved == sim.final_reserved,
        "final_allocated_equal": recorded.final_allocated == sim.final_allocated,
        "peak_reserved_equal": recorded.peak_reserved == sim.total.peak_reserved,
        "segment_maps_recorded": len(recorded.segment_maps),
        "segment_maps_simulated": len(sim.segment_maps),
        "segment_maps_matching": matching(recorded.segment_maps, sim.segment_maps),
        "segment_unmaps_recorded": len(recorded.segment_unmaps),
        "segment_unmaps_simulated": len(sim.segment_unmaps),
        "segment_unmaps_matching": matching(recorded.segment_unmaps, sim.segment_unmaps),
        "ooms_recorded": recorded.ooms,
        "ooms_simulated": sim.total.ooms,
    }


def replay_json(path: str, mode: str, config: AllocatorConfig, trace: Trace, result: ReplayResult,
                rec: RecordedSummary, agree: dict) -> dict:
    """The ``rlhfmem replay --json`` object (also timed by benchmarks/replay_throughput.py)."""
    out = {
        "snapshot": path,
        "device": trace.device,
        "mode": mode,
        "alloc_conf": config.source,
        "expandable_segments": config.expandable_segments,
        "segment_placement": config.segment_placement.spec(),
        "torch_version": ".".join(map(str, config.torch_version)) if config.torch_version else None,
        "torch_version_source": config.torch_version_source or "unknown: the newest modelled behaviour",
        "capacity": result.capacity,
        "capacity_source": result.capacity_source,
        # per_process_memory_fraction (2.10): the bytes the allocator may reserve, None without a fraction below 1
        "allowed_memory_maximum": (allowed_memory_maximum(config, result.capacity)
                                   if config.per_process_memory_fraction < 1.0 else None),
        "capture": trace.capture,
        "engine": result.engine,
        "engine_reason": result.engine_reason,
        "recorded": {
            "segment_allocs": [s for _, s in rec.segment_allocs],
            "segment_free_batches": [[s for _, s in b] for b in rec.segment_free_batches],
            "segment_maps": [s for _, s in rec.segment_maps],
            "segment_unmaps": [s for _, s in rec.segment_unmaps],
            "peak_reserved": rec.peak_reserved,
            "final_reserved": rec.final_reserved,
            "final_allocated": rec.final_allocated,
        },
        "simulated": {
            **result.total.to_dict(),
            "peak_phase": result.peak_phase,
            "final_reserved": result.final_reserved,
            "final_allocated": result.final_allocated,
            "segment_allocs": [s for _, s in result.segment_allocs],
            "segment_free_batches": [[s for _, s in b] for b in result.segment_free_batches],
            "segment_maps": [s for _, s in result.segment_maps],
            "segment_unmaps": [s for _, s in result.segment_unmaps],
            "label": "simulated (allocator model)",
        },
        "agreement": agree,
    }
    return out
