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

This module is the one replay entry, above both engines, the formats and the types. Its surface takes one trace
shape, ``Trace | TraceColumns``, through one conversion (:func:`~.columns.as_columns`; a ``Trace`` is converted
once, at this boundary, and the Python engine gets it back): :func:`replay` (``engine="python"``, the default, or
``"auto"``: the compiled core where it applies), :func:`recorded_summary`, :func:`infer_capacity`. The loaders
(:func:`load_columns_for_replay`: an ``.rlhftrace`` file or a snapshot pickle) return the columns and the
recorded settings as the file holds them (:class:`~.columns.RecordedSettings`); :func:`allocator_config` is the
one place an :class:`~.allocator.AllocatorConfig` is built from recorded settings (``replay`` calls it when
given none). It re-exports the names its callers import from here (modes, results, ``with_flushes``).
"""

from __future__ import annotations

from .allocator import AllocatorConfig, AllocatorConfigError, allowed_memory_maximum
from .columns import RecordedSettings, TraceColumns, as_columns
from .driver_va import SegmentPlacement
from .events import Trace
from .python_engine import replay_python, with_flush_events, with_flushes
from .recorded import infer_capacity, recorded_summary
from .replay_engine import engine_for, run_compiled
from .replay_types import (
    ANCHORED, FREE_RUNNING, MODES, PYTHON, RecordedSummary, ReplayError, ReplayResult,
)
from .trace import snapshot_columns_for_replay
from .trace_io import is_trace_file, load_columns

__all__ = [  # the replay entry's own names, and those its callers import from here
    "ANCHORED", "FREE_RUNNING", "MODES", "PYTHON", "RecordedSettings", "RecordedSummary", "ReplayError",
    "ReplayResult", "agreement", "allocator_config", "infer_capacity", "load_columns_for_replay", "recorded_summary",
    "replay", "replay_json", "with_flushes",
]


def load_columns_for_replay(path: str, device: int | None = None) -> tuple[TraceColumns, RecordedSettings]:
    """``rlhfmem replay``'s input: ``(columns, recorded settings)`` of an ``.rlhftrace`` file
    (:func:`~.trace_io.load_columns`) or a snapshot pickle (:func:`~.trace.snapshot_columns_for_replay`: the
    compiled snapshot reader when it builds here, else Python's global-refusing Unpickler, with the same results
    and one-line errors; ``device`` picks the pickle's device trace, default the one with most events). Nothing is
    parsed into an :class:`~.allocator.AllocatorConfig` here: :func:`allocator_config` does that. Raises
    :class:`~.trace.SnapshotError` or :class:`~.trace_io.TraceFileError`."""
    if is_trace_file(path):
        return load_columns(path)
    return snapshot_columns_for_replay(path, device)


def allocator_config(settings: dict | None, torch_version: str | tuple[int, int] | None = None,
                     alloc_conf: str | None = None, segment_placement: str | None = None,
                     source: str = "") -> AllocatorConfig:
    """The one place an :class:`~.allocator.AllocatorConfig` is built from a recording's settings.

    ``settings``: the recording's ``allocator_settings`` (:class:`~.columns.RecordedSettings`, or a trace's own),
    read by :meth:`~.allocator.AllocatorConfig.from_snapshot_settings` (``CUDAAllocatorConfig`` as
    ``torch/csrc/cuda/Module.cpp`` ``_memory_snapshot`` writes it) for ``torch_version`` (``"2.10"``; ``None``:
    the newest the settings allow). ``alloc_conf`` (a ``PYTORCH_CUDA_ALLOC_CONF`` string, ``rlhfmem replay
    --alloc-conf``) replaces the recorded allocator settings; the driver's segment placement is not one of them,
    so the recording's is kept unless ``segment_placement`` (``driver_va.SegmentPlacement.parse``'s spec,
    ``--segment-placement``) is given. Raises :class:`~.allocator.AllocatorConfigError`: for ``alloc_conf``,
    ``segment_placement`` or ``torch_version`` as parsed, for the recorded settings as ``<source>:
    allocator_settings: <why>``."""
    config = AllocatorConfig.parse(alloc_conf, torch_version) if alloc_conf is not None else None
    try:
        recorded = AllocatorConfig.from_snapshot_settings(settings, torch_version)
    except (AllocatorConfigError, AttributeError, TypeError) as exc:
        raise AllocatorConfigError(f"{source or 'trace'}: allocator_settings: {exc}") from None
    if config is None and segment_placement is None:
        return recorded
    try:
        placement = (recorded.segment_placement if segment_placement is None
                     else SegmentPlacement.parse(segment_placement, "--segment-placement"))
    except ValueError as exc:
        raise AllocatorConfigError(str(exc)) from None
    return (config or recorded).with_options(segment_placement=placement)


def replay(trace: Trace | TraceColumns, config: AllocatorConfig | None = None, mode: str = FREE_RUNNING,
           capacity: int | None = None, record_series: bool = True, record_events: bool = False,
           engine: str = PYTHON, flush_at: list[int] | tuple[int, ...] = (),
           flush_names: list[str] | tuple[str, ...] = ()) -> ReplayResult:
    """Replay ``trace`` (a :class:`~.events.Trace` or its :class:`~.columns.TraceColumns`); returns a
    :class:`ReplayResult` (``config``: the settings it ran under).

    ``engine``: ``python`` (``python_engine.py`` and ``allocator.py``: the reference, and the only one returning
    ``model`` and ``collector``), ``auto`` (the compiled core of ``replay_engine.py`` when it supports
    this replay: no series or events recorded, the default segment placement; else Python; the CLI's and the
    advisor's) or ``compiled`` (raises ``ValueError`` when unsupported). ``ReplayResult.engine`` says which ran
    and ``engine_reason`` why.

    ``record_events`` keeps the replayed trace (``ReplayResult.events``): allocations at the addresses the
    model chose, with its own segment_alloc/segment_free events, ready for :func:`~.trace.write_snapshot`.
    ``flush_at``/``flush_names``: FLUSH events (``after-<name>``) inserted before those event indices
    (:func:`~.python_engine.with_flushes`; the compiled core inserts them itself): the advisor's placements.

    ``config`` defaults to the trace's recorded allocator settings (:func:`allocator_config`); ``capacity`` is the
    device's bytes (``None``: inferred from the trace's ``oom`` entries if it has any, else unlimited). Raises
    ``ValueError`` for an unknown ``mode`` or ``engine``, :class:`~.allocator.AllocatorConfigError` for recorded
    settings PyTorch could not have written, and :class:`ReplayError` for a trace the model cannot follow
    (unbalanced pool markers, a pre-existing segment its live blocks do not fit). A request the model
    cannot satisfy counts as an OOM (``ooms``) and the replay goes on, as a caught ``OutOfMemoryError``
    would. ``EXTERNAL_MAP``/``EXTERNAL_UNMAP`` events (device memory another allocator maps, a colocated rollout
    engine's) lower what cudaMalloc can have while they are mapped; one the device cannot back counts as an OOM
    (``ReplayResult.external_map_failures``) and maps nothing (Python engine).
    """
    if mode not in MODES:
        raise ValueError(f"replay mode {mode!r}: allowed values are {', '.join(MODES)}")
    config = config or allocator_config(trace.allocator_settings, source=trace.source)
    cols = None
    if engine == PYTHON:
        name, why = PYTHON, "requested"
    else:
        cols = as_columns(trace)
        name, why = engine_for(cols, config, mode, record_series, record_events, engine)
    if name == PYTHON:
        events = trace if isinstance(trace, Trace) else trace.to_trace()
        if flush_at:
            events = with_flush_events(events, flush_at, flush_names)
        result = replay_python(events, config, mode, capacity, record_series, record_events, why)
    else:
        assert cols is not None
        capacity_source = "given" if capacity is not None else "unlimited"
        if capacity is None:
            capacity = infer_capacity(cols)
            if capacity is not None:
                capacity_source = "inferred from the trace's oom entries"
        result = run_compiled(cols, config, capacity, flush_at, flush_names, mode)
        result.capacity_source = capacity_source
        result.engine_reason = why
        result.peak_device_used = result.total.peak_reserved  # nothing outside the allocator (engine_for)
    result.config = config
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


def replay_json(path: str, mode: str, config: AllocatorConfig, trace: Trace | TraceColumns, result: ReplayResult,
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
