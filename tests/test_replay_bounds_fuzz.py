"""Issue 47 item 6: a property-based fuzz of the snapshot reader and the compiled replay core over sizes, addresses
and event orders, with the Python engine as the oracle.

Each example is a ``_dump_snapshot`` pickle of random entries (alloc, free_requested, free_completed, segment
events, oom, others) whose sizes, addresses and times are drawn around every bound a reader or an engine has (0,
512, 1 MiB, 92 GiB, 2**48, 2**60, 2**62, 2**63 - 1, 2**63, 2**64), under random settings (expandable segments,
a device capacity, anchored or free-running). The all-Python path (Python's unpickler, ``trace_from_snapshot``,
the Python engine) and the compiled path (the compiled reader, ``columns_from_snapshot``, the compiled core) must
give the same figures, or the same one-line refusal: a ``SnapshotError`` from both readers, or a ``ReplayError``
(or the double free's ``ValueError``) from both engines.

Cheap by default (``RLHFMEM_FUZZ_EXAMPLES``, default 60 examples, about 2 s); the long fuzz runs outside tox, which
does not pass the variable: ``RLHFMEM_FUZZ_EXAMPLES=5000 .tox/py/bin/python -m pytest
tests/test_replay_bounds_fuzz.py`` (3000 examples took 20 s here)."""

from __future__ import annotations

import os
import pickle
import shutil
from dataclasses import asdict

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from pytest_rlhfmem.memory.allocator import AllocatorConfig
from pytest_rlhfmem.memory.replay import ANCHORED, FREE_RUNNING, replay
from pytest_rlhfmem.memory.replay_engine import COMPILED, PYTHON
from pytest_rlhfmem.memory.trace import (
    SnapshotError, columns_from_snapshot, load_snapshot, load_snapshot_columnar, trace_from_snapshot,
)

GiB = 2**30
EXAMPLES = int(os.environ.get("RLHFMEM_FUZZ_EXAMPLES", "60"))
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) for the compiled core")

EDGES = [0, 1, 511, 512, 2**20, 2**21 + 1, 20 * 2**20, 92 * GiB, 2**47, 2**48 - 1, 2**48, 2**48 + 1, 2**60, 2**60 + 1,
         2**62, 2**62 + 1, 2**63 - 1]
PAST_INT64 = [2**63, 2**64]  # a number a snapshot cannot hold: both readers refuse it
sizes = st.one_of(*[st.integers(1, 64 * 2**20)] * 4, st.sampled_from(EDGES), st.integers(0, 2**63 - 1))
bases = st.sampled_from([4096, 2**40, 2**60 - 2**30, 2**60, 2**62, 2**63 - 2**21])  # + 4 KiB per new block
TIME_EDGES = [2**62, 2**62 + 1, 2**63 - 1]
ACTIONS = ["alloc"] * 12 + ["free"] * 8 + ["free_requested", "free_requested", "oom", "snapshot", "segment_alloc",
                                           "segment_free", "segment_map", "segment_unmap"]
_PAIR = {"segment_free": "segment_alloc", "segment_unmap": "segment_map"}


@st.composite
def snapshots(draw) -> dict:
    """A snapshot's device trace in a random order, made as a program's is (a free names a live block:
    free_requested, then free_completed or, for a record_stream block, nothing; a segment_free or segment_unmap
    names a segment the trace created), with sizes, addresses and times around every bound; in about one
    example of eight a size past int64, which no snapshot can hold."""
    entries, live, segments = [], [], {"segment_alloc": [], "segment_map": []}
    base = draw(bases)
    for k in range(draw(st.integers(1, 30))):
        action, t = draw(st.sampled_from(ACTIONS)), k
        stream = draw(st.sampled_from([0, 0, 7]))
        if action in ("free", "free_requested"):
            if not live:
                continue
            addr, size, stream = live.pop(draw(st.integers(0, len(live) - 1)))
            entries.append({"action": "free_requested", "addr": addr, "size": size, "stream": stream, "time_us": t})
            if action == "free":
                entries.append({"action": "free_completed", "addr": addr, "size": size, "stream": stream,
                                "time_us": t})
            continue
        if action in _PAIR:
            made = segments[_PAIR[action]]
            if not made:
                continue
            addr, size, stream = made.pop(draw(st.integers(0, len(made) - 1)))
            entries.append({"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t})
            continue
        e = {"action": action, "addr": base + 4096 * k, "size": draw(sizes), "stream": stream, "time_us": t}
        if action == "oom":  # PyTorch writes an oom entry's free bytes as device_free, without addr
            e["device_free"] = draw(st.sampled_from([0, GiB, 80 * GiB, 2**48]))
            del e["addr"]
        elif action == "alloc":
            live.append((e["addr"], e["size"], stream))
        elif action in segments:
            segments[action].append((e["addr"], e["size"], stream))
        entries.append(e)
    for addr, size, stream in segments["segment_map"]:  # nothing stays mapped: the snapshot lists no segment
        entries.append({"action": "segment_unmap", "addr": addr, "size": size, "stream": stream, "time_us": 31})
    twist = draw(st.integers(0, 11))  # in about one example of four, one entry past a bound
    if entries and twist in (3, 5, 7):
        e = entries[draw(st.integers(0, len(entries) - 1))]
        if twist == 3:
            e["size"] = draw(st.sampled_from(PAST_INT64))  # no snapshot can hold it
        elif twist == 5:
            e["time_us"] = draw(st.sampled_from(TIME_EDGES))
        elif e["action"] == "oom":
            e["device_free"] = 2**62
    settings = {"expandable_segments": True} if draw(st.booleans()) else None
    return {"segments": [], "device_traces": [entries], **({"allocator_settings": settings} if settings else {})}


def _outcome(fn):  # noqa: ANN001, ANN202
    try:
        return "ok", fn()
    except (SnapshotError, ValueError) as exc:  # ReplayError and the double free's ValueError are ValueErrors
        assert "\n" not in str(exc)
        return type(exc).__name__, str(exc)


def _figures(r) -> dict:  # noqa: ANN001
    return {"total": asdict(r.total), "phases": [asdict(w) for w in r.phases], "segment_allocs": r.segment_allocs,
            "segment_free_batches": r.segment_free_batches, "segment_maps": r.segment_maps,
            "segment_unmaps": r.segment_unmaps, "final": (r.final_reserved, r.final_allocated, r.final_requested),
            "unmatched_frees": r.unmatched_frees, "oom_mismatches": r.oom_mismatches, "capacity": r.capacity}


@needs_gxx
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(snap=snapshots(), mode=st.sampled_from([FREE_RUNNING, ANCHORED]),
       capacity=st.sampled_from([None, None, 24 * GiB, 141 * 10**9, 2**48, 2**48 + 1]))
@example(snap={"segments": [], "allocator_settings": {"expandable_segments": True}, "device_traces": [[
    {"action": "alloc", "addr": 4096, "size": 92 * GiB, "stream": 0, "time_us": 1}]]}, mode=FREE_RUNNING, capacity=None)
@example(snap={"segments": [], "device_traces": [[
    {"action": "alloc", "addr": 4096, "size": 2**63 - 2**20, "stream": 0, "time_us": 1}]]}, mode=ANCHORED,
    capacity=None)
def test_the_compiled_path_gives_the_python_paths_figures_or_its_refusal(tmp_path_factory, snap, mode, capacity):
    path = tmp_path_factory.mktemp("fuzz") / "s.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    src = str(path)

    def python_path():  # noqa: ANN202
        s = load_snapshot(path)
        config = AllocatorConfig.from_snapshot_settings(s.get("allocator_settings"))
        trace = trace_from_snapshot(s, None, config, source=src)
        return _figures(replay(trace, config, mode, capacity=capacity, record_series=False, engine=PYTHON))

    def compiled_path():  # noqa: ANN202
        s, reader = load_snapshot_columnar(path)
        config = AllocatorConfig.from_snapshot_settings(s.get("allocator_settings"))
        cols = columns_from_snapshot(s, None, config, src)
        return _figures(replay(cols, config, mode, capacity=capacity, record_series=False, engine=COMPILED))

    got, want = _outcome(compiled_path), _outcome(python_path)
    event(want[0] if want[0] == "ok" else f"{want[0]}: {want[1].split(': ', 1)[-1][:60]}")
    assert got == want
