"""The small types every replay shares: modes, engine names, the result, the recorded summary, the error.

Both engines (the Python model driven by ``python_engine.py``, the compiled core of ``replay_engine.py``)
return a :class:`ReplayResult`; :class:`RecordedSummary` is what the real allocator did, read off a
recorded trace (``recorded.py``). Sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import AllocatorConfig, CachingAllocatorModel
from .events import Event
from .metrics import MetricsCollector, WindowMetrics

# Replay modes (``replay.replay``'s docstring): the recorded segment addresses, or the model's own.
ANCHORED = "anchored"
FREE_RUNNING = "free-running"
MODES = (ANCHORED, FREE_RUNNING)

# Replay engines (``replay_engine.engine_for`` picks between the two for ``auto``).
PYTHON = "python"
COMPILED = "compiled"
ENGINES = ("auto", COMPILED, PYTHON)


class ReplayError(ValueError):
    """A trace the model cannot replay (e.g. unbalanced pool markers); the message names the event."""


@dataclass
class ReplayResult:
    """What a replay produced: metrics, the model's own cudaMalloc/cudaFree decisions, its end state."""

    total: WindowMetrics
    phases: list[WindowMetrics]
    peak_phase: str | None
    segment_allocs: list[tuple[int, int]]  # (address, size) in order
    segment_free_batches: list[list[tuple[int, int]]]
    final_reserved: int
    final_allocated: int
    final_requested: int
    model: CachingAllocatorModel | None  # None from the compiled engine
    collector: MetricsCollector | None  # None from the compiled engine
    mode: str
    unmatched_frees: int = 0
    flush_points: list[int] = field(default_factory=list)  # event indices where a flush released memory
    flushes: list[dict] = field(default_factory=list)  # each FLUSH: name, phase, bytes and segments released
    cuda_frees_outside_flushes: int = 0  # cudaFree calls made by the miss path (retries), not by a flush
    requested_at_phase_end: dict[str, int] = field(default_factory=dict)  # live tensor bytes as each phase ends
    events: list[Event] | None = None  # with record_events: the replayed trace (model addresses, segment events)
    segment_maps: list[tuple[int, int]] = field(default_factory=list)  # expandable: (address, size) mapped
    segment_unmaps: list[tuple[int, int]] = field(default_factory=list)
    capacity: int | None = None  # the device bytes the replay ran against
    capacity_source: str = "unlimited"  # "given", "inferred from the trace's oom entries" or "unlimited"
    oom_mismatches: int = 0  # recorded OOMs the model could satisfy (the block was handed back at once)
    engine: str = "python"  # "python" (allocator.py) or "compiled" (csrc/replay_core.cpp): replay_engine.py
    engine_reason: str = ""  # why that engine (replay_engine.engine_for)
    config: AllocatorConfig | None = None  # the settings the replay ran under (replay.replay sets it)
    # device memory outside the caching allocator (events.py: EXTERNAL_MAP; Python engine only), bytes
    external_peak: int = 0  # the most mapped outside the allocator at once
    peak_device_used: int = 0  # the peak of reserved + external (the device's used bytes, this process)
    # each EXTERNAL_MAP the device could not back: name (tag), bytes, phase, reserved and external then, capacity
    external_map_failures: list[dict] = field(default_factory=list)

    @property
    def segments(self) -> list[dict]:
        """The end state in ``_snapshot()['segments']`` form (built on demand; Python engine only)."""
        if self.model is None:
            raise ValueError("the compiled replay engine keeps no end state: replay with engine='python'")
        return self.model.snapshot_segments()


@dataclass
class RecordedSummary:
    """What the real allocator did, read from the trace and the final segments (bytes)."""

    segment_allocs: list[tuple[int, int]]
    segment_free_batches: list[list[tuple[int, int]]]
    peak_reserved: int
    final_reserved: int | None
    final_allocated: int | None
    initial_reserved: int
    segment_maps: list[tuple[int, int]] = field(default_factory=list)
    segment_unmaps: list[tuple[int, int]] = field(default_factory=list)
    ooms: int = 0
