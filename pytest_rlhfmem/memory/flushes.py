"""A trace's flushes: the program's own events without them, and what they cost in allocator calls.

A flush (``torch.cuda.empty_cache()``) changes the caching allocator's state, not the program's allocations
(the advisor's premise, ``docs/advise.md``). :func:`program_events` separates the two; :func:`flush_cost`
replays a trace with and without its flushes. The capture of every run computes the cost for its result
(``flush_cost`` in each rank's result); the advisor (``advise/``) replays the program events under other
placements. Sizes are bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from .events import (
    ALLOC, EXTERNAL_MAP, EXTERNAL_UNMAP, FLUSH, FREE, FREE_REQUESTED, PHASE, PHASE_END, SEGMENT_FREE, Event, Trace,
)
from .recorded import recorded_release_batches
from .replay import FREE_RUNNING, replay

RECORDED_FLUSH = "recorded-empty_cache"  # the name of a flush read off a CUDA snapshot's release batch


def program_events(trace: Trace, keep_flush: Callable[[Event], bool] | None = None
                   ) -> tuple[list[Event], list[Event]]:
    """``(program, as_recorded)``: the program's own events (alloc, free, phase marks, another allocator's
    mappings: ``EXTERNAL_MAP``/``EXTERNAL_UNMAP``) without any flush
    or allocator decision, and the same with the recorded flushes as FLUSH events. ``keep_flush``: FLUSH
    events it accepts stay in the program too (the advisor keeps a recipe's library calls, which every flush
    policy's run makes).

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
        if a in (ALLOC, FREE, FREE_REQUESTED, PHASE, PHASE_END, EXTERNAL_MAP, EXTERNAL_UNMAP):
            program.append(e)
            recorded.append(e)
        elif a == FLUSH:
            recorded.append(e)
            if keep_flush is not None and keep_flush(e):
                program.append(e)
        elif a == SEGMENT_FREE and i in batches and batches[i] is None:
            recorded.append(Event(FLUSH, time_us=e.time_us, name=RECORDED_FLUSH))
    return program, recorded


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
