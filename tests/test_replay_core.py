"""Differential tests: the compiled replay core (memory/csrc/replay_core.cpp) against the Python model
(memory/allocator.py + replay.py), the reference it mirrors.

Random traces (allocations of every size class on two streams, LIFO-ish and random frees, flushes, phases,
recorded cudaFree batches, requests past a device capacity, blocks live before the trace began, record_stream's
held blocks: a FREE_REQUESTED, its FREE later) under
random allocator settings must give IDENTICAL results from both engines: every WindowMetrics field of
the iteration and of every phase, the cudaMalloc/cudaFree decision sequence (addresses and sizes), the
flushes, the end state's byte counts. So must every real GPU snapshot the compiled engine accepts.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pytest_rlhfmem.memory.allocator import MiB, AllocatorConfig
from pytest_rlhfmem.memory.columns import columns_from_trace
from pytest_rlhfmem.memory.replay import (
    ANCHORED, FREE_RUNNING, ReplayResult, allocator_config, infer_capacity, recorded_summary, replay,
)
from pytest_rlhfmem.memory.replay_engine import (
    COMPILED, PYTHON, SOURCE, STATUS_MESSAGES, ReplaySettings, ReplayStatus, engine_for, settings_layout,
)
from pytest_rlhfmem.memory.replay_types import ReplayError
from pytest_rlhfmem.memory.trace import (
    ALLOC, FLUSH, FREE, FREE_REQUESTED, OOM, PHASE, PHASE_END, POOL_ENTER, POOL_EXIT, POOL_RELEASE, SEGMENT_ALLOC,
    SEGMENT_FREE, Event, SegmentState, Trace, columns_from_snapshot, load_snapshot, trace_from_snapshot,
)
from tests.helpers import shared_snapshot

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None,
                               reason="no C++ compiler (g++) to build the compiled replay core")

FIELDS = ("total", "phases", "peak_phase", "segment_allocs", "segment_free_batches", "final_reserved",
          "final_allocated", "final_requested", "unmatched_frees", "flush_points", "flushes",
          "cuda_frees_outside_flushes", "requested_at_phase_end", "capacity", "capacity_source", "oom_mismatches",
          "segment_maps", "segment_unmaps", "mode")


def assert_same(py: ReplayResult, cc: ReplayResult) -> None:
    assert py.engine == PYTHON and cc.engine == COMPILED
    for f in FIELDS:
        a, b = getattr(py, f), getattr(cc, f)
        if f in ("total",):
            a, b = asdict(a), asdict(b)
        elif f == "phases":
            a, b = [asdict(w) for w in a], [asdict(w) for w in b]
        assert a == b, f"{f} differs: python {a!r} compiled {b!r}"


sizes = st.one_of(
    st.integers(1, 4096),  # tiny: 512-byte blocks in the small pool
    st.integers(4096, 1 * MiB),  # small pool
    st.integers(1 * MiB + 1, 10 * MiB),  # large pool, 20 MiB segments
    st.integers(10 * MiB, 40 * MiB),  # large pool, own segments
    st.sampled_from([2 * MiB, 20 * MiB, 21 * MiB, 64 * MiB, 96 * MiB]),  # around the thresholds
)
OPS = ["alloc"] * 6 + ["free"] * 5 + ["flush", "phase", "phase_end", "segment_free_batch", "oom", "free_unknown",
                                      "free_model_address", "segment_alloc", "free_requested", "free_held"]
ops = st.lists(st.tuples(st.sampled_from(OPS), sizes, st.integers(0, 10**6), st.integers(0, 1)),
               min_size=1, max_size=250)

roundups = st.sampled_from(["0", "1", "2", "4", "8", "16", "[1:4,16:2,>:1]", "[2:8,>:2]", "[64:8,256:4,>:1]"])


@st.composite
def configs(draw) -> str:
    parts = []
    if draw(st.booleans()):
        parts.append(f"max_split_size_mb:{draw(st.integers(21, 120))}")
    if draw(st.booleans()):
        parts.append(f"max_non_split_rounding_mb:{draw(st.integers(0, 64))}")
    if draw(st.booleans()):
        parts.append(f"roundup_power2_divisions:{draw(roundups)}")
    if draw(st.booleans()):
        parts.append(f"garbage_collection_threshold:{draw(st.sampled_from([0.1, 0.3, 0.5, 0.6, 0.8, 0.95]))}")
    if draw(st.integers(0, 2)) == 0:
        parts.append("expandable_segments:True")
    if draw(st.integers(0, 3)) == 0:  # PyTorch 2.10's key (PR 161035): a cap below the device's capacity
        parts.append(f"per_process_memory_fraction:{draw(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]))}")
    return ",".join(parts)


POOL_IDS = [(0, 1), (0, 2), (7, 3)]  # MempoolId_t of three MemPools
POOL_OPS = ["pool_enter"] * 3 + ["pool_exit"] * 2 + ["pool_release"] * 2


def build_trace(ops_list, with_initial: bool | str) -> Trace:
    """The random trace of ``ops_list``. ``with_initial``: segments live before the trace (True), the same
    with the large one in the private pool POOL_IDS[0] (``"pool"``), or none (False).

    Pool markers follow a MemPool's life as python_engine.py replays it: POOL_ENTER (``use_mem_pool`` entry;
    several pools may be entered, nested or interleaved; allocations go to the first entered), POOL_EXIT of
    an entered pool, POOL_RELEASE (the MemPool destroyed). A released id is entered again one time in four
    (a pool forgotten, or revived while it still holds memory: the paths where ``use_count`` and
    ``cudaMalloc_count`` show). About one marker in 61 breaks the rules (entering a pool twice, exiting one not
    entered, releasing an unknown or released id), which both engines must refuse alike.

    ``Tensor.record_stream``: FREE_REQUESTED of a live block (one live before the trace too) holds it until a
    later ``free_held`` op's FREE (the oldest held block, or a random one); about one request in 61 repeats one
    for a held block (a double free both engines refuse), one of an unknown address is unmatched, and blocks
    still held at the end stay held one trace in two (their bytes out of final_allocated, their segments
    kept)."""
    events: list[Event] = []
    live: list[int] = []
    held: list[int] = []  # FREE_REQUESTED, FREE not yet emitted
    next_addr = 1 << 30
    phase = 0
    t = 0
    initial: list[SegmentState] = []
    underway: list[tuple[int, int]] = []  # pools entered and not exited, in entry order
    retired: set[tuple[int, int]] = set()  # pools released (their MemPool destroyed)
    created: set[tuple[int, int]] = {POOL_IDS[0]} if with_initial == "pool" else set()  # MemPools constructed
    if with_initial:  # one large and one small segment live before the trace, with blocks freed in it
        pool0 = POOL_IDS[0] if with_initial == "pool" else (0, 0)
        initial = [SegmentState(0x1000_0000, 20 * MiB, 0, False, [(0x1000_0000, 4 * MiB, 4 * MiB - 100),
                                                                 (0x1000_0000 + 8 * MiB, 2 * MiB, 2 * MiB)],
                                pool0),
                   SegmentState(0x2000_0000, 2 * MiB, 1, True, [(0x2000_0000 + 4096, 1024, 1000)])]
        live_before = [0x1000_0000, 0x1000_0000 + 8 * MiB, 0x2000_0000 + 4096]
    else:
        live_before = []
    for op, size, r, stream in ops_list:
        t += r % 7
        breaks = r % 61 == 17  # a pool marker that breaks the rules (not r % 61 == 0: hypothesis likes 0 and 10**6)
        if op == "alloc":
            next_addr += 1 << 12
            events.append(Event(ALLOC, next_addr, size, stream, t))
            live.append(next_addr)
        elif op == "free" and (live or live_before):
            pool = live if live else live_before
            i = len(pool) - 1 - (r % 3 if r % 4 else r % len(pool)) if len(pool) > 3 else r % len(pool)
            events.append(Event(FREE, pool.pop(i), 0, stream, t))
        elif op == "free_unknown":
            events.append(Event(FREE, 7 + r, 0, stream, t))  # never allocated: unmatched
        elif op == "free_requested":  # record_stream: the program frees a block another stream still uses
            if breaks and held:
                events.append(Event(FREE_REQUESTED, held[r % len(held)], 0, stream, t))  # requested twice
            elif live or live_before:
                pool = live_before if (live_before and r % 5 == 0) or not live else live
                addr = pool.pop(r % len(pool))
                events.append(Event(FREE_REQUESTED, addr, 0, stream, t))
                held.append(addr)
            else:
                events.append(Event(FREE_REQUESTED, 7 + r, 0, stream, t))  # never allocated: unmatched
        elif op == "free_held" and held:  # the other streams are done: the block goes back to its pool
            events.append(Event(FREE, held.pop(0 if r % 2 else r % len(held)), 0, stream, t))
        elif op == "free_model_address" and with_initial:
            # an address inside a segment that existed before the trace: it may name a block the model
            # placed there (found through active_blocks), so a later free of its recorded address is a
            # double free, which both engines must refuse
            # (a request there one time in five: it may hold a block the trace frees or requests later)
            events.append(Event(FREE_REQUESTED if r % 5 == 0 else FREE, 0x1000_0000 + (r % 40) * 512 * 1024, 0,
                                stream, t))
        elif op == "flush":
            events.append(Event(FLUSH, time_us=t, name=f"flush{r % 3}"))
        elif op == "phase":
            phase += 1
            events.append(Event(PHASE, time_us=t, name=f"p{phase % 4}"))  # names repeat, as phases do
        elif op == "phase_end":
            events.append(Event(PHASE_END, time_us=t, name=f"p{phase % 4}"))
        elif op == "segment_free_batch":  # a recorded cudaFree batch, maybe followed by a recorded cudaMalloc
            events.append(Event(SEGMENT_FREE, 1 << 40, 2 * MiB, 0, t))
            events.append(Event(SEGMENT_FREE, (1 << 40) + (4 << 20), 20 * MiB, 0, t))
            if r % 2:  # the recorded cudaMalloc: its size may or may not be the one the model asks for
                events.append(Event(SEGMENT_ALLOC, (1 << 41) + (r << 24), [20 * MiB, 2 * MiB, size][r % 3], 0, t))
                next_addr += 1 << 12
                events.append(Event(ALLOC, next_addr, size, stream, t))
                live.append(next_addr)
        elif op == "segment_alloc":  # a recorded cudaMalloc (anchored mode takes its address if the size agrees)
            events.append(Event(SEGMENT_ALLOC, (1 << 42) + (r << 24), [20 * MiB, 2 * MiB, size][r % 3], 0, t))
        elif op == "oom":
            events.append(Event(OOM, (r * 4096) if r % 3 else 0, size, stream, t))
        elif op == "pool_enter":
            pid = POOL_IDS[r % len(POOL_IDS)]
            if (pid in underway or (pid in retired and r % 4 != 1)) and not breaks:
                continue  # the rules hold 60 times in 61; a released id comes back one time in four
            events.append(Event(POOL_ENTER, pid[0], pid[1], 0, t))
            underway.append(pid)
            created.add(pid)
        elif op == "pool_exit":
            if not underway and not breaks:
                continue
            pid = underway[r % len(underway)] if underway and not breaks else POOL_IDS[r % len(POOL_IDS)]
            events.append(Event(POOL_EXIT, pid[0], pid[1], 0, t))
            if pid in underway:
                underway.remove(pid)
        elif op == "pool_release":
            pid = POOL_IDS[r % len(POOL_IDS)]
            if (pid in underway or pid in retired or pid not in created) and not breaks:
                continue
            events.append(Event(POOL_RELEASE, pid[0], pid[1], 0, t))
            retired.add(pid)
    if held and ops_list[-1][2] % 2:  # complete the held blocks (else they stay held at the end)
        events.extend(Event(FREE, addr, 0, 0, t) for addr in held)
    return Trace(events=events, initial_segments=initial)


@needs_gxx
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_list=ops, conf=configs(), capacity=st.sampled_from([None, None, 24 * MiB, 64 * MiB, 200 * MiB]),
       with_initial=st.booleans(), mode=st.sampled_from([FREE_RUNNING, ANCHORED]))
def test_compiled_core_equals_python_model_on_random_traces(ops_list, conf, capacity, with_initial, mode):
    trace = build_trace(ops_list, with_initial)
    config = AllocatorConfig.parse(conf)
    try:
        py = replay(trace, config, mode, capacity=capacity, record_series=False)
    except ValueError as exc:
        assert "double free" in str(exc)
        event("double free")
        with pytest.raises(ValueError, match="double free"):
            replay(trace, config, mode, capacity=capacity, record_series=False, engine=COMPILED)
        return
    cc = replay(trace, config, mode, capacity=capacity, record_series=False, engine=COMPILED)
    event(f"ooms {'>0' if py.total.ooms else '0'}, retries {'>0' if py.total.alloc_retries else '0'}, "
          f"flush released {'>0' if any(f['released_bytes'] for f in py.flushes) else '0'}, "
          f"unmaps {'>0' if py.segment_unmaps else '0'}")
    if mode == ANCHORED and any((1 << 41) <= a < (1 << 56) for a, _ in py.segment_allocs):
        event("anchored: a segment took a recorded address")
    if any(e.action == FREE_REQUESTED for e in trace.events):
        still_held = any(b.held for b in py.model.active_blocks.values())
        event(f"record_stream: blocks held {'at the end' if still_held else 'then freed'}")
    assert_same(py, cc)


@st.composite
def versioned(draw, conf: str) -> AllocatorConfig:
    """``conf`` under a random PyTorch version, with random use_on_oom pools (2.8+) and no_split pools (2.10+)."""
    version = draw(st.sampled_from([None, "2.7", "2.8", "2.9", "2.10"]))
    if version in ("2.7", "2.8", "2.9"):
        conf = ",".join(p for p in conf.split(",") if not p.startswith("per_process_memory_fraction"))
    config = AllocatorConfig.parse(conf, version)
    v = config.torch_version
    oom = draw(st.permutations(POOL_IDS).flatmap(lambda ids: st.integers(0, 3).map(lambda k: ids[:k])))
    no_split = draw(st.lists(st.sampled_from(POOL_IDS), max_size=2, unique=True))
    return config.with_options(use_on_oom_pools=oom if v is None or v >= (2, 8) else (),
                               no_split_pools=no_split if v is None or v >= (2, 10) else ())


pool_ops = st.lists(st.tuples(st.sampled_from(OPS + POOL_OPS), sizes, st.integers(0, 10**6), st.integers(0, 1)),
                    min_size=30, max_size=300)


@needs_gxx
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_list=pool_ops, conf=configs(), capacity=st.sampled_from([None, None, 24 * MiB, 64 * MiB, 200 * MiB]),
       with_initial=st.sampled_from([False, True, "pool"]), mode=st.sampled_from([FREE_RUNNING, ANCHORED]),
       data=st.data())
def test_compiled_core_equals_python_model_with_private_pools(ops_list, conf, capacity, with_initial, mode, data):
    """Private pools (issue 22): random traces with POOL_ENTER / POOL_EXIT / POOL_RELEASE of three pools
    (nested and interleaved regions, pools released while their blocks live, a pool's segment live before the
    trace) among allocations, frees, flushes, recorded cudaFree batches and OOMs past a capacity: the compiled
    core gives the Python model's ReplayResult, field for field, or refuses the same marker with the same
    message. Under every modelled PyTorch version (2.7: empty_cache scoped to the region's pool; 2.8-2.9:
    use_on_oom pools last; 2.10: use_on_oom pools first, no_split pools, the innermost region), with random
    use_on_oom and no_split pools."""
    trace = build_trace(ops_list, with_initial)
    config = data.draw(versioned(conf), label="config")
    try:
        py = replay(trace, config, mode, capacity=capacity, record_series=False)
    except ReplayError as exc:  # unbalanced markers: the same event, the same words
        event("unbalanced pool markers")
        with pytest.raises(ReplayError) as cc_exc:
            replay(trace, config, mode, capacity=capacity, record_series=False, engine=COMPILED)
        assert str(cc_exc.value) == str(exc)
        return
    except KeyError:  # allocator.py's get_pool: allocations go to a pool it forgot (a revived, emptied pool)
        event("python KeyError: pool forgotten while allocations go to it")
        with pytest.raises(ReplayError, match="KeyError"):
            replay(trace, config, mode, capacity=capacity, record_series=False, engine=COMPILED)
        return
    except ValueError as exc:
        assert "double free" in str(exc)
        event("double free")
        with pytest.raises(ValueError, match="double free"):
            replay(trace, config, mode, capacity=capacity, record_series=False, engine=COMPILED)
        return
    cc = replay(trace, config, mode, capacity=capacity, record_series=False, engine=COMPILED)
    model = py.model
    in_pools = sum(1 for b in model.segments.values() if b.pool.owner_private_pool is not None)
    event(f"pool segments at the end {'>0' if in_pools else '0'}, pools known at the end {len(model.graph_pools)}")
    if model.graph_pools_freeable:
        event("a released pool still holds memory")
    if py.total.ooms and any(e.action == POOL_ENTER for e in trace.events):
        event("ooms with pool markers")
    if config.use_on_oom_pools:
        event(f"use_on_oom pools, torch {config.torch_version}")
    if any(b.pool.owner_private_pool is not None and b.allocated and b.pool.owner_private_pool.id
           in config.use_on_oom_pools for b in model.active_blocks.values()) and not model.captures_underway:
        event("a use_on_oom pool's block live at the end")
    assert cc.engine_reason.endswith("private pools")
    assert_same(py, cc)


def _pool_trace(*steps: tuple) -> Trace:
    """A hand-written trace: ("enter"|"exit"|"release", pool), ("alloc", addr, size), ("free", addr), ("flush",)."""
    kinds = {"enter": POOL_ENTER, "exit": POOL_EXIT, "release": POOL_RELEASE}
    events = []
    for t, step in enumerate(steps, 1):
        if step[0] in kinds:
            events.append(Event(kinds[step[0]], step[1][0], step[1][1], 0, t))
        elif step[0] == "alloc":
            events.append(Event(ALLOC, step[1], step[2], 0, t))
        elif step[0] == "free":
            events.append(Event(FREE, step[1], 0, 0, t))
        else:
            events.append(Event(FLUSH, time_us=t, name="flush"))
    return Trace(events=events, source="hand")


A, B = POOL_IDS[0], POOL_IDS[1]


@needs_gxx
@pytest.mark.parametrize("mode", [FREE_RUNNING, ANCHORED])
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_compiled_core_pool_corner_cases(mode, conf):
    """The private-pool paths a random trace rarely takes, against the Python model: a pool revived while
    released (it keeps its place among the freeable pools, so empty_cache returns A's segment before B's);
    a pool's segment live before the trace, returned once its MemPool is destroyed; a flush inside a
    use_mem_pool region (the default pools stay, released pools go); an OOM inside a region (no
    release-and-retry)."""
    config = AllocatorConfig.parse(conf)
    revived = _pool_trace(("enter", A), ("alloc", 1, 4 * MiB), ("exit", A), ("enter", B), ("alloc", 2, 4 * MiB),
                          ("exit", B), ("release", A), ("release", B), ("enter", A), ("alloc", 3, 30 * MiB),
                          ("exit", A), ("free", 1), ("free", 2), ("free", 3), ("flush",))
    py = replay(revived, config, mode, record_series=False)
    assert len(py.segment_free_batches) == 1 or py.segment_unmaps
    assert_same(py, replay(revived, config, mode, record_series=False, engine=COMPILED))

    initial = Trace(events=_pool_trace(("alloc", 5, 4 * MiB), ("free", 0x1000_0000), ("flush",), ("release", A),
                                       ("free", 5), ("flush",)).events,
                    initial_segments=[SegmentState(0x1000_0000, 20 * MiB, 0, False,
                                                   [(0x1000_0000, 4 * MiB, 4 * MiB)], A)])
    py = replay(initial, config, mode, record_series=False)
    assert py.final_reserved == 0
    assert_same(py, replay(initial, config, mode, record_series=False, engine=COMPILED))

    inside = _pool_trace(("alloc", 1, 30 * MiB), ("free", 1), ("enter", A), ("alloc", 2, 4 * MiB), ("exit", A),
                         ("release", A), ("enter", B), ("free", 2), ("flush",), ("alloc", 3, 30 * MiB),
                         ("exit", B), ("alloc", 4, 60 * MiB))
    for capacity in (None, 64 * MiB):
        py = replay(inside, config, mode, capacity=capacity, record_series=False)
        assert py.total.ooms == (1 if capacity else 0)
        assert_same(py, replay(inside, config, mode, capacity=capacity, record_series=False, engine=COMPILED))


@needs_gxx
@pytest.mark.parametrize("mode", [FREE_RUNNING, ANCHORED])
def test_record_stream_held_block_in_both_engines(mode):
    """``Tensor.record_stream``: a 20 MiB block filling its segment is freed by the program (FREE_REQUESTED)
    while another stream still uses it. Its bytes leave allocated at once, but it stays out of the pool: the
    next 20 MiB allocation takes a new cudaMalloc (allocated 20 MiB then, not 40: the "held" phase's peak).
    After its FREE a third 20 MiB allocation reuses the cached block: no third segment. Both engines alike."""
    events = [Event(PHASE, time_us=0, name="held"), Event(ALLOC, 1, 20 * MiB, 0, 1),
              Event(FREE_REQUESTED, 1, 0, 0, 2), Event(ALLOC, 2, 20 * MiB, 0, 3),
              Event(PHASE, time_us=4, name="completed"), Event(FREE, 1, 0, 0, 4), Event(ALLOC, 3, 20 * MiB, 0, 5)]
    py = replay(Trace(events=events), mode=mode, record_series=False)
    cc = replay(Trace(events=events), mode=mode, record_series=False, engine=COMPILED)
    assert cc.engine_reason == f"{mode}, no private pools"
    for r in (py, cc):
        assert len(r.segment_allocs) == 2 and all(s == 20 * MiB for _, s in r.segment_allocs)
        held, completed = r.phases
        assert (held.peak_allocated, held.peak_reserved, held.cuda_malloc_count) == (20 * MiB, 40 * MiB, 2)
        assert (completed.peak_allocated, completed.peak_reserved, completed.cuda_malloc_count) == (
            40 * MiB, 40 * MiB, 0)
        assert (r.total.peak_allocated, r.total.peak_reserved) == (40 * MiB, 40 * MiB)
        assert (r.final_reserved, r.final_allocated, r.final_requested) == (40 * MiB, 40 * MiB, 40 * MiB)
    assert_same(py, cc)

    # the trace ends while the block is held: out of allocated and requested, its segment still reserved and
    # unreleasable (a flush returns nothing), the snapshot's state active_pending_free
    pending = Trace(events=events[1:4] + [Event(FLUSH, time_us=4, name="flush")])
    py = replay(pending, mode=mode, record_series=False)
    cc = replay(pending, mode=mode, record_series=False, engine=COMPILED)
    for r in (py, cc):
        assert (r.total.peak_allocated, r.total.peak_reserved, len(r.segment_allocs)) == (20 * MiB, 40 * MiB, 2)
        assert (r.final_reserved, r.final_allocated, r.final_requested) == (40 * MiB, 20 * MiB, 20 * MiB)
        assert r.flushes[0]["released_bytes"] == 0 and not r.segment_free_batches
    assert_same(py, cc)
    py.model.check_invariants()
    segs = py.model.snapshot_segments()
    assert [(s["allocated_size"], s["active_size"], [b["state"] for b in s["blocks"]]) for s in segs] == [
        (0, 20 * MiB, ["active_pending_free"]), (20 * MiB, 20 * MiB, ["active_allocated"])]

    # a second request for the held block: a double free in both
    twice = Trace(events=events[1:4] + [Event(FREE_REQUESTED, 1, 0, 0, 4)])
    with pytest.raises(ValueError, match="double free"):
        replay(twice, mode=mode, record_series=False)
    with pytest.raises(ValueError, match="double free"):
        replay(twice, mode=mode, record_series=False, engine=COMPILED)


@needs_gxx
def test_compiled_core_refuses_what_the_python_model_refuses():
    """Unbalanced markers: the same ReplayError, word for word. A use_mem_pool region whose pool was
    released and emptied under it: the Python model's get_pool raises KeyError; the core names the case."""
    for steps in ([("enter", A), ("enter", A)], [("exit", B)], [("release", A)],
                  [("enter", A), ("exit", A), ("release", A), ("exit", A)]):
        trace = _pool_trace(*steps)
        with pytest.raises(ReplayError) as py_exc:
            replay(trace, record_series=False)
        with pytest.raises(ReplayError) as cc_exc:
            replay(trace, record_series=False, engine=COMPILED)
        assert str(cc_exc.value) == str(py_exc.value)
    gone = _pool_trace(("enter", A), ("alloc", 1, 4 * MiB), ("exit", A), ("release", A), ("enter", A), ("free", 1),
                       ("flush",), ("alloc", 2, 4 * MiB))
    with pytest.raises(KeyError):
        replay(gone, record_series=False)
    with pytest.raises(ReplayError, match="event 7: .*KeyError"):
        replay(gone, record_series=False, engine=COMPILED)


@needs_gxx
@settings(max_examples=150, deadline=None)
@given(ops_list=st.one_of(ops, pool_ops), conf=configs(), data=st.data())
def test_inserted_flushes_equal_flush_events(ops_list, conf, data):
    """The advisor's candidates: FLUSH events inserted by the core (flush_at) equal the same events in
    the list replayed by the Python model, with private pools too (a flush inside a use_mem_pool region
    leaves the default pools alone); a trace the Python model refuses, the core refuses at the same event."""
    trace = build_trace(ops_list, False)
    n = len(trace.events)
    positions = data.draw(st.lists(st.integers(0, n), max_size=4))
    names = [f"b{i}" for i in range(len(positions))]
    config = AllocatorConfig.parse(conf)
    out, last = [], 0
    for pos, name in sorted(zip(positions, names)):
        out.extend(trace.events[last:pos])
        out.append(Event(FLUSH, time_us=trace.events[pos - 1].time_us if pos > 0 else 0, name=f"after-{name}"))
        last = pos
    out.extend(trace.events[last:])
    try:
        py = replay(Trace(events=out), config, record_series=False)
    except (ReplayError, KeyError, ValueError) as exc:
        expected = "KeyError" if isinstance(exc, KeyError) else "double free" if "double free" in str(exc) else None
        with pytest.raises((ReplayError, ValueError)) as cc_exc:
            replay(trace, config, record_series=False, flush_at=positions, flush_names=names, engine=COMPILED)
        assert expected in str(cc_exc.value) if expected else str(cc_exc.value) == str(exc)
        return
    cc = replay(trace, config, record_series=False, flush_at=positions, flush_names=names, engine=COMPILED)
    assert_same(py, cc)


@needs_gxx
def test_engine_choice_names_its_reason():
    cols = columns_from_trace(Trace(events=[Event(ALLOC, 1, 10)]))
    default = AllocatorConfig()
    assert engine_for(cols, default, FREE_RUNNING) == (COMPILED, "free-running, no private pools")
    assert engine_for(cols, default, ANCHORED)[0] == COMPILED
    assert "series" in engine_for(cols, default, FREE_RUNNING, record_series=True)[1]
    assert engine_for(cols, AllocatorConfig.parse("expandable_segments:True"), FREE_RUNNING)[0] == COMPILED
    held = columns_from_trace(Trace(events=[Event(ALLOC, 1, 10), Event(FREE_REQUESTED, 1, 0), Event(FREE, 1, 0)]))
    assert engine_for(held, default, FREE_RUNNING) == (COMPILED, "free-running, no private pools")
    pooled = columns_from_trace(Trace(events=[Event("pool_enter", 0, 1), Event(ALLOC, 1, 10)]))
    assert engine_for(pooled, default, FREE_RUNNING) == (COMPILED, "free-running, with private pools")
    with pytest.raises(ValueError, match="cannot replay this: the per-event series"):
        engine_for(cols, default, ANCHORED, record_series=True, requested=COMPILED)


@needs_gxx
def test_settings_struct_mirror_has_the_cpp_layout():
    """The ctypes mirror of ``struct ReplaySettings`` (replay_engine.ReplaySettings) has the C++ struct's size and
    every field's offset, in the same order, as the compiled core reports them (``rc_settings_layout``): a field
    added, dropped, moved or retyped on one side only fails here."""
    size, offsets = settings_layout()
    assert size == ctypes.sizeof(ReplaySettings)
    assert offsets == [getattr(ReplaySettings, name).offset for name, _ in ReplaySettings._fields_]


def test_status_enum_mirror_has_the_cpp_values_and_every_error_a_message():
    """``enum ReplayStatus`` of replay_core.cpp and its IntEnum mirror name the same values (RC_<NAME> = n); every
    error status has its message in the one table."""
    body = re.search(r"enum ReplayStatus : int \{(.*?)\};", SOURCE.read_text(), re.S).group(1)
    cpp = {name: int(v) for name, v in re.findall(r"RC_(\w+) = (\d+)", body)}
    assert cpp == {s.name: s.value for s in ReplayStatus}
    assert set(STATUS_MESSAGES) == set(ReplayStatus) - {ReplayStatus.OK}


def test_settings_struct_carries_the_config_by_name():
    """ReplaySettings.from_config: each AllocatorConfig field lands in the field of its name; the capacity the
    core enforces is per_process_memory_fraction's (allowed_memory_maximum), the device's total beside it."""
    config = AllocatorConfig.parse("max_split_size_mb:64,max_non_split_rounding_mb:4,roundup_power2_divisions:"
                                   "[1:4,>:2],garbage_collection_threshold:0.5,per_process_memory_fraction:0.5,"
                                   "expandable_segments:True")
    s = ReplaySettings.from_config(config, 1000 * MiB, ANCHORED)
    assert (s.max_split_size, s.max_non_split_rounding_size) == (64 * MiB, 4 * MiB)
    assert list(s.roundup_power2_divisions) == list(config.roundup_power2_divisions)
    assert (s.garbage_collection_threshold, s.expandable_segments, s.anchored) == (0.5, 1, 1)
    assert (s.capacity, s.has_capacity, s.has_allowed_memory_maximum) == (500 * MiB, 1, 1)
    assert (s.device_total, s.has_device_total) == (1000 * MiB, 1)
    assert (s.innermost_pool, s.use_on_oom_before_release, s.empty_cache_scoped_to_region) == (1, 1, 0)
    old = ReplaySettings.from_config(AllocatorConfig(torch_version=(2, 7)), None, FREE_RUNNING)
    assert (old.has_capacity, old.has_device_total, old.anchored) == (0, 0, 0)
    assert (old.innermost_pool, old.use_on_oom_before_release, old.empty_cache_scoped_to_region) == (0, 0, 1)


def test_a_trace_converts_to_columns_once():
    """replay's one conversion: a Trace's columns hand the same Trace back (the Python engine replays it, not a
    rebuilt copy); columns read from a file rebuild their events."""
    trace = Trace(events=[Event(ALLOC, 1, 10), Event("user_annotation", 0, 0), Event(FREE, 1, 0)])
    cols = columns_from_trace(trace)
    assert cols.to_trace() is trace
    rebuilt = columns_from_trace(trace)
    rebuilt.trace = None
    assert rebuilt == cols  # the kept Trace takes no part in equality
    assert [e.action for e in rebuilt.to_trace().events] == [ALLOC, "other", FREE]


PRIVATE_POOLS = ("slime_init_b",)  # a torch.cuda.MemPool from an RL framework's model init
REAL = ("eor_nn", "select_n_a", "cs336_ctx256_fwd", "codeloc_expandable_dev0_dev2", "slime_init_b",
        "llminf_1p3b_a", "wedson_medium_128_inference", "wedson_medium_256_training")


@needs_gxx
@pytest.mark.parametrize("mode", [ANCHORED, FREE_RUNNING])
@pytest.mark.parametrize("name", REAL)
def test_real_snapshots_same_results_from_both_engines(name, mode):
    path = shared_snapshot(name)
    snap = load_snapshot(path)
    trace = trace_from_snapshot(snap, source=str(path))
    cols = columns_from_snapshot(snap, source=str(path))
    # The columnar loader reads the same events and initial state as trace_from_snapshot.
    assert [tuple(e) for e in cols.to_trace().events] == [tuple(e) for e in trace.events]
    assert cols.initial_segments == trace.initial_segments
    assert recorded_summary(cols) == recorded_summary(trace)
    assert infer_capacity(cols) == infer_capacity(trace)
    config = allocator_config(snap.get("allocator_settings"), source=str(path))
    engine, why = engine_for(cols, config, mode)
    assert engine == COMPILED, why
    if name in PRIVATE_POOLS:
        assert why == f"{mode}, with private pools" and cols.has_pool_markers()
    py = replay(trace, config, mode, record_series=False)
    cc = replay(cols, config, mode, record_series=False, engine="auto")
    assert_same(py, cc)
    assert cc.total.events > 0


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "replay", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)


@needs_gxx
def test_cli_replays_an_rlhftrace_file_with_either_engine(tmp_path):
    """``rlhfmem replay`` reads an .rlhftrace file as columns; both engines print the same figures."""
    from pytest_rlhfmem.memory.trace_io import save_trace

    ops_list = [("alloc", 3 * MiB + k, k, 0) for k in range(40)] + [("free", 0, k, 0) for k in range(30)]
    ops_list += [("phase", 0, 1, 0), ("flush", 0, 0, 0)] + [("alloc", 700_000, k, 1) for k in range(50)]
    path = save_trace(tmp_path / "t.rlhftrace", build_trace(ops_list, False))
    docs = {}
    for engine in (COMPILED, PYTHON):
        p = _cli(str(path), "--free-running", "--json", "--engine", engine)
        assert p.returncode == 0, p.stderr
        docs[engine] = json.loads(p.stdout)
        assert docs[engine]["engine"] == engine
    assert docs[COMPILED]["simulated"] == docs[PYTHON]["simulated"]
    assert docs[COMPILED]["simulated"]["cuda_malloc_count"] > 0


def test_without_a_compiler_the_python_engine_replays_after_one_notice_per_compiled_part(tmp_path):
    path = shared_snapshot("eor_nn")
    p = _cli(str(path), "--free-running", "--json",
             env={"CXX": str(tmp_path / "no-such-g++"), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr
    notes = [line for line in p.stderr.splitlines() if line]
    # one line each for the two compiled parts the command would use: the pickle reader and the replay core
    assert len(notes) == 2 and all("no-such-g++" in n for n in notes)
    assert "compiled reader unavailable" in notes[0] and "compiled replay engine unavailable" in notes[1]
    doc = json.loads(p.stdout)
    assert doc["engine"] == PYTHON and "compiled core unavailable" in doc["engine_reason"]
