"""The small types every replay shares: modes, engine names, the result, the recorded summary, the error.

Both engines (the Python model driven by ``python_engine.py``, the compiled core of ``replay_engine.py``)
return a :class:`ReplayResult`; :class:`RecordedSummary` is what the real allocator did, read off a
recorded trace (``recorded.py``). Sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import MAX_REPLAY_BYTES, AllocatorConfig, CachingAllocatorModel
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


# The replay's bounds (docs/replay-engine.md, "Bounds"). A snapshot holds any number in 0..2**63-1; the compiled
# core (csrc/replay_core.cpp: kMaxReplayBytes, kMaxSegmentAddress, kMaxTimeUs, kMaxModelAddress) computes in
# int64, so both engines refuse, in one line and alike, what would overflow it: a request, a recorded segment or
# a device capacity above MAX_REPLAY_BYTES (256 TiB: a thousand times the largest GPU's memory), a recorded
# segment address above MAX_SEGMENT_ADDRESS, a time beyond +-MAX_TIME_US, and a replay whose reserved bytes pass
# MAX_REPLAY_BYTES or whose new segments' addresses pass MAX_MODEL_ADDRESS. Within them no sum can overflow: one
# event adds at most three cudaMallocs (or their pages) of at most 2**48 + 40 MiB bytes each.
MAX_SEGMENT_ADDRESS = 2**60
MAX_TIME_US = 2**62
MAX_MODEL_ADDRESS = 2**62
_BYTES_BOUND = "0 to 2**48 bytes (256 TiB), the replay's bound"
# The one-line messages of the bounds ({source}: the trace's file, {event}: the event's index in the replayed list,
# flushes inserted; {action}; {value}); replay_engine.STATUS_MESSAGES gives the compiled core's statuses these texts.
SIZE_OUT_OF_RANGE = "{source}: event {event} ({action}): size {value} is out of range (" + _BYTES_BOUND + ")"
ADDRESS_OUT_OF_RANGE = ("{source}: event {event} ({action}): addr {value} is out of range (0 to 2**60, the replay's "
                        "bound)")
TIME_OUT_OF_RANGE = ("{source}: event {event} ({action}): time_us is out of range (-2**62 to 2**62 microseconds, "
                     "the replay's bound)")
RESERVED_OUT_OF_RANGE = ("{source}: event {event} ({action}): the model reserves {value} bytes, out of range ("
                         + _BYTES_BOUND + ")")
ADDRESS_SPACE_EXHAUSTED = ("{source}: event {event} ({action}): the model's new segments' addresses pass 2**62, the "
                           "replay's bound (too many segments of this size)")
CAPACITY_OUT_OF_RANGE = ("{source}: device capacity {value} bytes is out of range (-2**48 to 2**48 bytes, the "
                         "replay's bound)")


def bound_error(template: str, source: str, event: int = -1, action: str = "", value: int = 0) -> ReplayError:
    """The :class:`ReplayError` of one of the bounds' templates above, for the event ``event`` (its index in the
    replayed list) of the trace ``source``."""
    return ReplayError(template.format(source=source or "trace", event=event, action=action, value=value))


def check_initial_segments(source: str, segments: list) -> None:
    """Segments that existed before the trace (:class:`~.events.SegmentState`), within the bounds: each address
    0..:data:`MAX_SEGMENT_ADDRESS`, size 0..:data:`MAX_REPLAY_BYTES`, each live block's requested size 0..its
    block's size, and all of them together at most :data:`MAX_REPLAY_BYTES`. Raises :class:`ReplayError`."""
    total = 0
    for k, seg in enumerate(segments):
        what = None
        if not 0 <= seg.address <= MAX_SEGMENT_ADDRESS:
            what = f"address {seg.address} is out of range (0 to 2**60, the replay's bound)"
        elif not 0 <= seg.total_size <= MAX_REPLAY_BYTES:
            what = f"size {seg.total_size} is out of range ({_BYTES_BOUND})"
        else:
            bad = next((b for b in seg.live_blocks if not 0 <= b[2] <= b[1]), None)
            if bad is not None:
                what = (f"the live block at 0x{bad[0]:x} requested {bad[2]} bytes of its {bad[1]} "
                        "(0 to the block's size)")
        total += seg.total_size
        if what is None and total > MAX_REPLAY_BYTES:
            what = f"the segments before it hold {total} bytes with it, out of range ({_BYTES_BOUND})"
        if what is not None:
            raise ReplayError(f"{source or 'trace'}: segment {k} that existed before the trace: {what}")


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
