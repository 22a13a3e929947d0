"""Allocation traces: the one input of the allocator model and the metrics.

A :class:`Trace` is a list of :class:`Event` in time order plus the device state before the first
event. It comes from a ``torch.cuda.memory._dump_snapshot()`` pickle (a real GPU run; see
:func:`trace_from_snapshot`) or from the CPU capture of ``capture.py`` (a simulated run), and it can be
written back as a snapshot pickle that ``torch.cuda._memory_viz`` and pytorch.org/memory_viz read
(:func:`write_snapshot`).

Snapshot format followed: ``torch/cuda/memory.py`` (``_snapshot``), ``torch/cuda/_memory_viz.py`` and
``TraceEntry`` in ``c10/cuda/CUDACachingAllocator.h``. Sizes are bytes.
"""

from __future__ import annotations

import bisect
import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .allocator import AllocatorConfig, CachingAllocatorModel, kSmallBuffer, kSmallSize

# Event actions. ALLOC/FREE carry the REQUESTED size; SEGMENT_* the segment size.
ALLOC = "alloc"
FREE = "free"  # free_completed: the moment the block went back to its pool
SEGMENT_ALLOC = "segment_alloc"
SEGMENT_FREE = "segment_free"
OOM = "oom"
PHASE = "phase"  # a phase begins (name); the previous one ends
FLUSH = "flush"  # torch.cuda.empty_cache() at this point (name says which policy point)

# How a trace was obtained: part of every result, budget and report.
CAPTURE_CUDA = "cuda-memory-history"
CAPTURE_CPU_SIMULATED = "cpu-trace-simulated"
CAPTURE_FAKE_CUDA_SIMULATED = "fake-cuda-simulated"  # fake CUDA tensors recorded at the dispatcher (fakecuda/)
SIMULATED_CAPTURES = (CAPTURE_CPU_SIMULATED, CAPTURE_FAKE_CUDA_SIMULATED)
CAPTURE_SYNTHETIC = "synthetic"


class Event(NamedTuple):
    action: str
    addr: int = 0
    size: int = 0
    stream: int = 0
    time_us: int = 0
    name: str = ""


@dataclass
class SegmentState:
    """A segment that existed before the trace began, with the blocks then allocated.

    ``live_blocks`` are ``(address, block size, requested size)``.
    """

    address: int
    total_size: int
    stream: int
    is_small: bool
    live_blocks: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class Trace:
    """Device allocation events in time order, with the state they started from.

    ``final_segments`` is the recorded end state (a snapshot's ``segments``), ``None`` for captured
    CPU traces. ``capture`` is one of ``CAPTURE_*``.
    """

    events: list[Event]
    initial_segments: list[SegmentState] = field(default_factory=list)
    final_segments: list[dict] | None = None
    allocator_settings: dict | None = None
    capture: str = CAPTURE_SYNTHETIC
    source: str = ""

    def has_segment_events(self) -> bool:
        return any(e.action in (SEGMENT_ALLOC, SEGMENT_FREE) for e in self.events)


class SnapshotError(ValueError):
    """A file that is not a readable memory snapshot; the message names the file and the reason."""


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Snapshots are plain builtins: any global is refused before it is imported, so no code runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"names the global {module}.{name}")


def load_snapshot(path: str | Path) -> dict:
    """Read a ``_dump_snapshot`` pickle safely.

    Returns the snapshot dict (``segments``, ``device_traces``, optional ``allocator_settings``).
    Raises :class:`SnapshotError` for a missing or truncated file, a pickle naming any global (refused,
    nothing executed), or a pickle that is not a snapshot.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        snap = _NoGlobalsUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        msg = str(exc)
        if msg.startswith("names the global"):
            raise SnapshotError(f"{p}: refused: the pickle {msg}; memory snapshots hold only builtins, "
                                "so nothing was loaded or run") from None
        if "truncated" in msg:
            raise SnapshotError(f"{p}: truncated or corrupt pickle ({msg})") from None
        raise SnapshotError(f"{p}: not a valid pickle ({msg})") from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError) as exc:
        raise SnapshotError(f"{p}: truncated or corrupt pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(snap, dict) or "segments" not in snap or not isinstance(snap.get("segments"), list):
        kind = type(snap).__name__
        raise SnapshotError(f"{p}: not a torch.cuda.memory._snapshot() pickle (a {kind} without a "
                            "'segments' list)")
    return snap


def _pick_device(snap: dict, device: int | None) -> int:
    traces = snap.get("device_traces") or []
    if device is not None:
        if device >= max(len(traces), 1):
            raise SnapshotError(f"device {device} not in snapshot (it has {len(traces)} device traces)")
        return device
    if traces:
        return max(range(len(traces)), key=lambda i: len(traces[i] or []))
    devs = [s.get("device", 0) for s in snap["segments"]]
    return max(set(devs), key=devs.count) if devs else 0


def trace_from_snapshot(snap: dict, device: int | None = None, config: AllocatorConfig | None = None,
                        source: str = "") -> Trace:
    """Turn a snapshot dict into a :class:`Trace` for one device (default: the longest trace).

    Handles every 2.x trace variant: ``free_completed`` (or the old single ``free``) is the moment of
    free, ``free_requested`` is ignored, ``snapshot`` entries are skipped, missing ``stream``/``time_us``
    default to 0. Segments that existed before the trace began are rebuilt from the final ``segments``
    plus blocks freed in the trace that were never allocated in it (their block size is the rounded
    request, extended over a gap the allocator could not have left free). ``config`` gives the rounding
    (default: the snapshot's own ``allocator_settings``).
    Raises :class:`SnapshotError` if the trace contradicts the final segments.
    """
    dev = _pick_device(snap, device)
    config = config or AllocatorConfig.from_snapshot_settings(snap.get("allocator_settings"))
    raw = (snap.get("device_traces") or [[]] * (dev + 1))[dev] or []
    actions = {e.get("action") for e in raw}
    free_action = "free_completed" if "free_completed" in actions else "free"
    events: list[Event] = []
    for e in raw:
        a = e.get("action")
        if a == "alloc":
            act = ALLOC
        elif a == free_action:
            act = FREE
        elif a in (SEGMENT_ALLOC, SEGMENT_FREE, OOM):
            act = a
        elif a in ("segment_map", "segment_unmap"):
            raise SnapshotError(f"{source or 'snapshot'}: recorded with expandable_segments (segment_map/"
                                "segment_unmap), which the allocator model does not replay")
        else:
            continue  # free_requested, snapshot
        events.append(Event(act, int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0) or 0),
                            int(e.get("time_us", 0) or 0)))
    segments = [s for s in snap["segments"] if s.get("device", dev) == dev]
    initial = _rebuild_initial_segments(events, segments, config, source)
    return Trace(events=events, initial_segments=initial, final_segments=segments,
                 allocator_settings=snap.get("allocator_settings"), capture=CAPTURE_CUDA, source=source)


def _rebuild_initial_segments(events: list[Event], final_segments: list[dict], config: AllocatorConfig,
                              source: str) -> list[SegmentState]:
    live: set[int] = set()
    pre_live: dict[int, tuple[int, int]] = {}  # addr -> (requested size, stream): freed, never allocated
    created: set[int] = set()
    pre_segments: dict[int, tuple[int, int, bool]] = {}  # addr -> (size, stream, is_small)
    for e in events:
        if e.action == ALLOC:
            live.add(e.addr)
        elif e.action == FREE:
            if e.addr in live:
                live.discard(e.addr)
            else:
                pre_live[e.addr] = (e.size, e.stream)
        elif e.action == SEGMENT_ALLOC:
            created.add(e.addr)
        elif e.action == SEGMENT_FREE:
            if e.addr in created:
                created.discard(e.addr)
            else:
                pre_segments[e.addr] = (e.size, e.stream, e.size == kSmallBuffer)
    exact: dict[int, tuple[int, int]] = {}  # addr -> (block size, requested): live from start to end
    for s in final_segments:
        if s["address"] not in created:
            pre_segments[s["address"]] = (s["total_size"], int(s.get("stream", 0) or 0),
                                          s.get("segment_type") == "small")
        for b in s.get("blocks", []):
            if b.get("state", "").startswith("active") and b["address"] not in live:
                exact[b["address"]] = (b["size"], b.get("requested_size", b["size"]))
    if not pre_segments:
        if pre_live:
            raise SnapshotError(f"{source or 'snapshot'}: {len(pre_live)} blocks freed before being allocated, "
                                "but no segment existed before the trace")
        return []
    starts = sorted(pre_segments)
    by_segment: dict[int, list[tuple[int, int | None, int]]] = {a: [] for a in starts}

    def owner(addr: int) -> int:
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr >= starts[i] + pre_segments[starts[i]][0]:
            raise SnapshotError(f"{source or 'snapshot'}: block 0x{addr:x} was live before the trace but lies "
                                "in no segment that existed then")
        return starts[i]

    for addr, (req, _stream) in pre_live.items():
        by_segment[owner(addr)].append((addr, None, req))
    for addr, (size, req) in exact.items():
        by_segment[owner(addr)].append((addr, size, req))

    model = CachingAllocatorModel(config)
    out = []
    for seg_addr in starts:
        size, stream, is_small = pre_segments[seg_addr]
        blocks = sorted(by_segment[seg_addr])
        resolved = []
        for i, (addr, bsize, req) in enumerate(blocks):
            if bsize is None:
                bsize = model.round_size(req)
                boundary = blocks[i + 1][0] if i + 1 < len(blocks) else seg_addr + size
                gap = boundary - (addr + bsize)
                # A large-pool block is not split when the remainder is <= 1 MiB (or, for a request
                # >= max_split_size, below max_non_split_rounding): the block then owns that gap.
                if not is_small and 0 < gap and (
                    gap <= kSmallSize
                    or (req >= config.max_split_size and gap < config.max_non_split_rounding_size)
                ):
                    bsize += gap
            resolved.append((addr, bsize, req))
        out.append(SegmentState(seg_addr, size, stream, is_small, resolved))
    return out


def write_snapshot(path: str | Path, trace: Trace, segments: list[dict], *, device_count: int = 1,
                   note: str = "") -> Path:
    """Write ``trace`` as a ``_dump_snapshot`` pickle that ``torch.cuda._memory_viz`` can read.

    ``segments`` is the end state (``CachingAllocatorModel.snapshot_segments()`` for a simulated run).
    Phases become ``external_annotations`` (START/END), as ``torch.profiler.record_function`` writes
    them; the capture method is recorded under ``allocator_settings['rlhfmem_capture']``.
    Returns the path written.
    """
    entries: list[dict] = []
    annotations: list[dict] = []
    open_phase: tuple[str, int] | None = None
    for e in trace.events:
        if e.action == ALLOC:
            entries.append({"action": "alloc", "addr": e.addr, "size": e.size, "stream": e.stream,
                            "time_us": e.time_us, "frames": []})
        elif e.action == FREE:
            for a in ("free_requested", "free_completed"):
                entries.append({"action": a, "addr": e.addr, "size": e.size, "stream": e.stream,
                                "time_us": e.time_us, "frames": []})
        elif e.action in (SEGMENT_ALLOC, SEGMENT_FREE, OOM):
            entries.append({"action": e.action, "addr": e.addr, "size": e.size, "stream": e.stream,
                            "time_us": e.time_us, "frames": []})
        elif e.action == PHASE:
            if open_phase:
                annotations.append({"stage": "END", "name": open_phase[0], "device": 0, "time_us": e.time_us})
            annotations.append({"stage": "START", "name": e.name, "device": 0, "time_us": e.time_us})
            open_phase = (e.name, e.time_us)
    if open_phase and trace.events:
        annotations.append({"stage": "END", "name": open_phase[0], "device": 0,
                            "time_us": trace.events[-1].time_us})
    snap = {
        "segments": segments,
        "device_traces": [entries] + [[] for _ in range(device_count - 1)],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False,
                               "rlhfmem_capture": trace.capture, "rlhfmem_note": note},
        "external_annotations": annotations,
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    tmp.replace(p)
    return p
