"""The memory figures of the RLHF study, per phase and over a whole iteration.

Definitions (Zhou et al., "Understanding and Alleviating Memory Consumption in RLHF for LLMs", Sec. 3
and Table 1); every figure is in bytes:

- ``peak_reserved``: the most memory held in segments (``reserved_bytes.all.peak``).
- ``peak_allocated``: the most held in allocated blocks (``allocated_bytes.all.peak``).
- ``fragmentation_at_peak`` (the study's "Frag."): reserved minus allocated just before the cudaMalloc
  that set the reserved peak. ``None`` when no cudaMalloc in the window raised reserved.
- ``max_fragmentation``: the largest reserved-minus-allocated seen just before any cudaMalloc.
- ``inactive_split_at_peak``: PyTorch's own figure (``inactive_split_bytes``) at that same moment.
- ``cuda_malloc_count`` / ``cuda_free_count`` / ``alloc_retries`` / ``ooms``: counts in the window.
- series ``reserved``, ``allocated`` and ``reserved_without_fragmentation``: the last is what an allocator
  that never fragments would hold: the running maximum of allocated since the last empty_cache.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field

METRIC_NAMES = (
    "peak_reserved", "peak_allocated", "fragmentation_at_peak", "max_fragmentation",
    "inactive_split_at_peak", "cuda_malloc_count", "cuda_free_count", "alloc_retries", "ooms",
)


@dataclass
class WindowMetrics:
    """Figures over one window of a trace: a phase, or the whole iteration (``phase='iteration'``)."""

    phase: str
    peak_reserved: int = 0
    peak_allocated: int = 0
    fragmentation_at_peak: int | None = None
    max_fragmentation: int = 0
    inactive_split_at_peak: int | None = None
    cuda_malloc_count: int = 0
    cuda_free_count: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    events: int = 0
    start_us: int = 0
    end_us: int = 0

    @property
    def time_s(self) -> float:
        return max(self.end_us - self.start_us, 0) / 1e6

    def to_dict(self) -> dict:
        d = asdict(self)
        d["time_s"] = round(self.time_s, 6)
        return d


@dataclass
class Series:
    """The study's Figure 1 curves, one point per allocator event (bytes; x = event index)."""

    index: array = field(default_factory=lambda: array("q"))
    reserved: array = field(default_factory=lambda: array("q"))
    allocated: array = field(default_factory=lambda: array("q"))
    reserved_without_fragmentation: array = field(default_factory=lambda: array("q"))

    def downsample(self, max_points: int = 2000) -> dict:
        """A JSON-able copy with at most about ``max_points`` points, keeping each bucket's maxima."""
        n = len(self.index)
        if n <= max_points:
            return {k: list(getattr(self, k)) for k in ("index", "reserved", "allocated",
                                                         "reserved_without_fragmentation")}
        step = -(-n // max_points)
        out: dict[str, list[int]] = {"index": [], "reserved": [], "allocated": [],
                                     "reserved_without_fragmentation": []}
        for s in range(0, n, step):
            e = min(s + step, n)
            out["index"].append(self.index[e - 1])
            for k in ("reserved", "allocated", "reserved_without_fragmentation"):
                out[k].append(max(getattr(self, k)[s:e]))
        return out


class MetricsCollector:
    """Fed by a replay (or a real run's trace) event by event; owns the windows.

    The replay calls :meth:`begin_phase`, :meth:`after_event`, and the allocator model's observers call
    :meth:`on_cuda_malloc` / :meth:`on_cuda_free` with the model's current figures.
    """

    def __init__(self, reserved: int = 0, allocated: int = 0, record_series: bool = True) -> None:
        self.total = WindowMetrics("iteration", peak_reserved=reserved, peak_allocated=allocated)
        self.phases: list[WindowMetrics] = []
        self.current: WindowMetrics | None = None
        self.peak_phase: str | None = None
        self.series = Series() if record_series else None
        self._rwf = allocated  # reserved without fragmentation
        self._n = 0

    def begin_phase(self, name: str, reserved: int, allocated: int, time_us: int) -> None:
        if self.current is not None:
            self.current.end_us = time_us
        w = WindowMetrics(name, peak_reserved=reserved, peak_allocated=allocated, start_us=time_us,
                          end_us=time_us)
        self.phases.append(w)
        self.current = w
        if self.total.start_us == 0:
            self.total.start_us = time_us

    def on_cuda_malloc(self, size: int, reserved_after: int, allocated: int, inactive_split: int) -> None:
        frag = reserved_after - size - allocated
        if reserved_after > self.total.peak_reserved:
            self.peak_phase = self.current.phase if self.current else None
        for w in (self.total, self.current):
            if w is None:
                continue
            w.cuda_malloc_count += 1
            if frag > w.max_fragmentation:
                w.max_fragmentation = frag
            if reserved_after > w.peak_reserved:
                w.peak_reserved = reserved_after
                w.fragmentation_at_peak = frag
                w.inactive_split_at_peak = inactive_split

    def on_cuda_free(self) -> None:
        self.total.cuda_free_count += 1
        if self.current is not None:
            self.current.cuda_free_count += 1

    def on_retry_or_oom(self, retries: int, ooms: int) -> None:
        for w in (self.total, self.current):
            if w is not None:
                w.alloc_retries += retries
                w.ooms += ooms

    def on_flush(self, allocated: int) -> None:
        self._rwf = allocated

    def after_event(self, reserved: int, allocated: int, time_us: int) -> None:
        self._n += 1
        if allocated > self._rwf:
            self._rwf = allocated
        for w in (self.total, self.current):
            if w is None:
                continue
            w.events += 1
            if allocated > w.peak_allocated:
                w.peak_allocated = allocated
            if time_us:
                w.end_us = time_us
        if self.series is not None:
            s = self.series
            s.index.append(self._n)
            s.reserved.append(reserved)
            s.allocated.append(allocated)
            s.reserved_without_fragmentation.append(max(self._rwf, 0))

    def phase_starts(self) -> list[tuple[str, int]]:
        """(phase, first event index) pairs, for plots."""
        out, n = [], 0
        for w in self.phases:
            out.append((w.phase, n))
            n += w.events
        return out
