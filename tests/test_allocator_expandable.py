"""expandable_segments:True, case by case against the C++ (CUDACachingAllocator.cpp at 001074d25084):
pages of 2 MiB (small pool) and 20 MiB (large pool) mapped on demand, unmapped by empty_cache."""

import pickle
import subprocess
import sys

import pytest

from pytest_rlhfmem.memory.allocator import MiB, AllocatorConfig, CachingAllocatorModel, OutOfMemoryError
from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.memory.trace import trace_from_snapshot


def model(conf: str = "expandable_segments:True", capacity: int | None = None) -> CachingAllocatorModel:
    events: list[tuple[str, int, int]] = []
    m = CachingAllocatorModel(
        AllocatorConfig.parse(conf), capacity=capacity,
        on_segment_map=lambda a, s, _st: events.append(("map", a, s)),
        on_segment_unmap=lambda a, s, _st: events.append(("unmap", a, s)),
        on_segment_alloc=lambda a, s, _st: events.append(("alloc", a, s)),
    )
    m.events = events  # type: ignore[attr-defined]
    return m


def test_one_segment_grows_by_large_pages():
    m = model()
    a = m.malloc(16 * MiB)
    b = m.malloc(16 * MiB)  # 4 MiB left in page 0: one more 20 MiB page, b straddles both
    base = a.address
    assert b.address == base + 16 * MiB
    assert m.events == [("map", base, 20 * MiB), ("map", base + 20 * MiB, 20 * MiB)]
    assert m.stats.reserved_bytes == 40 * MiB and m.stats.allocated_bytes == 32 * MiB
    assert len(m.expandable_segments) == 1
    m.check_invariants()


def test_small_pool_maps_2_mib_pages_in_its_own_segment():
    m = model()
    m.malloc(512)
    m.malloc(16 * MiB)
    assert [(k, s) for k, _a, s in m.events] == [("map", 2 * MiB), ("map", 20 * MiB)]
    assert len(m.expandable_segments) == 2  # one per (stream, pool kind)
    m.check_invariants()


def test_split_uses_the_512_byte_rule_in_the_large_pool():
    m = model()
    a = m.malloc(3 * MiB)
    assert a.size == 3 * MiB and a.next is not None  # default settings would split too (rem > 1 MiB) ...
    m.free(a)
    b = m.malloc(20 * MiB - 1024)  # ... but here a 1 KiB remainder is split off as well
    assert b.size == 20 * MiB - 1024 and b.next is not None and b.next.size == 1024
    assert m.stats.inactive_split_bytes == 0  # expandable segments are left out of inactive_split
    m.check_invariants()


def test_empty_cache_unmaps_whole_free_pages_only():
    m = model()
    a = m.malloc(16 * MiB)
    b = m.malloc(16 * MiB)
    m.free(a)
    m.empty_cache()  # a's bytes [0, 16 MiB) hold no whole page: nothing unmapped
    assert m.stats.reserved_bytes == 40 * MiB and not [e for e in m.events if e[0] == "unmap"]
    m.free(b)
    m.empty_cache()  # everything free: both pages unmapped in one call, the segment released
    assert m.events[-1] == ("unmap", a.address, 40 * MiB)
    assert m.stats.reserved_bytes == 0 and not m.expandable_segments and not m.segments
    m.check_invariants()


def test_free_space_before_the_unmapped_tail_is_extended():
    m = model()
    a = m.malloc(30 * MiB)  # maps 2 pages (40 MiB); 10 MiB free after a
    c = m.malloc(15 * MiB)  # free tail 10 MiB + one more page
    assert c.address == a.address + 30 * MiB
    assert [s for k, _a, s in m.events if k == "map"] == [40 * MiB, 20 * MiB]
    m.check_invariants()


def test_capacity_refuses_pages_then_oom():
    m = model(capacity=40 * MiB)
    m.malloc(30 * MiB)
    with pytest.raises(OutOfMemoryError):
        m.malloc(30 * MiB)  # would need 2 more pages: 80 MiB
    assert m.stats.num_ooms == 1 and m.stats.num_alloc_retries == 1
    m.check_invariants()


def test_what_if_on_the_clone_chain_of_the_reference():
    # 3 x (10 MiB + 512): default settings take 3 segments of 12 MiB (36 MiB); expandable pages: 2 x 20 MiB
    m = model()
    for _ in range(3):
        m.malloc(10 * MiB + 512)
    assert m.stats.reserved_bytes == 40 * MiB
    m.check_invariants()


def test_a_snapshot_with_an_empty_trace_and_only_expandable_segments_replays_its_end_state(tmp_path):
    """Nothing was recorded (device trace empty): the replay reports the state at the end and says agreement
    is unavailable, as for the default allocator (it used to be refused: 'the trace maps 0')."""
    mib = 1 << 20
    seg = {"address": 1 << 30, "total_size": 40 * mib, "allocated_size": 30 * mib, "stream": 0, "device": 0,
           "segment_type": "large", "is_expandable": True, "segment_pool_id": (0, 0),
           "blocks": [{"address": 1 << 30, "size": 30 * mib, "requested_size": 30 * mib, "state": "active_allocated"},
                      {"address": (1 << 30) + 30 * mib, "size": 10 * mib, "requested_size": 0, "state": "inactive"}]}
    snap = {"segments": [seg], "device_traces": [[]], "allocator_settings": {"expandable_segments": True}}
    result = replay(trace_from_snapshot(snap))
    assert (result.final_reserved, result.final_allocated) == (40 * mib, 30 * mib)
    path = tmp_path / "exp.pickle"
    path.write_bytes(pickle.dumps(snap))
    r = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "replay", str(path)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "agreement unavailable" in r.stdout and "final reserved                         40.00 MiB" in r.stdout
