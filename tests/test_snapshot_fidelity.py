"""Real GPU snapshots (../shared/snapshots; provenance in its README) replayed through the model."""

import pickle
from dataclasses import replace

import pytest
from helpers import shared_snapshot

from pytest_rlhfmem.memory.replay import agreement, recorded_summary, replay
from pytest_rlhfmem.memory.trace import SnapshotError, load_snapshot, trace_from_snapshot

# (segment_alloc count, segment_free count, final reserved bytes) from the provenance table.
EXPECTED = {
    "eor_nn": (7, 0, 134_217_728),
    "select_n_a": (13, 0, 2_776_629_248),
    "cs336_ctx256_fwd": (471, 287, 26_545_750_016),
}


@pytest.mark.parametrize("mode", ["anchored", "free-running"])
def test_replay_makes_the_recorded_cuda_malloc_decisions(snapshot_path, mode):
    trace = trace_from_snapshot(load_snapshot(snapshot_path))
    rec = recorded_summary(trace)
    n_alloc, n_free, final_reserved = EXPECTED[snapshot_path.stem]
    assert len(rec.segment_allocs) == n_alloc
    assert sum(len(b) for b in rec.segment_free_batches) == n_free
    result = replay(trace, mode=mode)
    agree = agreement(rec, result, trace.has_segment_events())
    # every cudaMalloc in order, same size
    assert [s for _, s in result.segment_allocs] == [s for _, s in rec.segment_allocs]
    if mode == "anchored":
        assert result.segment_allocs == rec.segment_allocs  # same addresses too
        assert result.segment_free_batches == rec.segment_free_batches
    assert agree["segment_free_batches_equal"]
    assert result.final_reserved == final_reserved == rec.final_reserved
    assert result.final_allocated == rec.final_allocated
    assert agree["peak_reserved_equal"]
    assert result.unmatched_frees == 0


def test_anchored_replay_ends_with_the_recorded_segments(snapshot_path):
    snap = load_snapshot(snapshot_path)
    result = replay(trace_from_snapshot(snap), mode="anchored")
    recorded = {(s["address"], s["total_size"], s["allocated_size"]) for s in snap["segments"]}
    simulated = {(s["address"], s["total_size"], s["allocated_size"]) for s in result.segments}
    assert simulated == recorded


def test_pre_existing_segments_are_rebuilt():
    trace = trace_from_snapshot(load_snapshot(shared_snapshot("select_n_a")))
    assert len(trace.initial_segments) == 82 - 13  # segments at end minus those created in the trace
    assert any(seg.live_blocks for seg in trace.initial_segments)


def test_cs336_release_is_a_users_empty_cache_not_a_retry():
    trace = trace_from_snapshot(load_snapshot(shared_snapshot("cs336_ctx256_fwd")))
    result = replay(trace, mode="anchored")
    assert result.total.alloc_retries == 0
    assert len(result.flush_points) == 1 and len(result.segment_free_batches[0]) == 287


def _write(tmp_path, obj, name="x.pickle"):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(obj))
    return p


class Evil:
    def __reduce__(self):
        return (print, ("code ran",))


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda tmp: _write(tmp, {"a": 1}), "not a torch.cuda.memory._snapshot() pickle"),
        (lambda tmp: _write(tmp, [1, 2, 3]), "not a torch.cuda.memory._snapshot() pickle"),
        (lambda tmp: _write(tmp, Evil()), "names the global builtins.print"),
        (lambda tmp: (tmp / "t.pickle").write_bytes(pickle.dumps({"segments": []})[:-3]) and tmp / "t.pickle",
         "truncated or corrupt"),
        (lambda tmp: tmp / "missing.pickle", "cannot read"),
    ],
)
def test_bad_snapshots_give_a_named_error(tmp_path, make, fragment, capsys):
    path = make(tmp_path)
    with pytest.raises(SnapshotError) as exc:
        load_snapshot(path)
    assert fragment in str(exc.value) and str(path) in str(exc.value)
    assert "code ran" not in capsys.readouterr().out


# -- the formats added by issue 9 ------------------------------------------------------------------

def _anchored(name: str, device: int | None = None, mode: str = "anchored"):
    trace = trace_from_snapshot(load_snapshot(shared_snapshot(name)), device=device)
    return trace, recorded_summary(trace), replay(trace, mode=mode)


@pytest.mark.parametrize("mode", ["anchored", "free-running"])
@pytest.mark.parametrize("device, n_maps", [(0, 175), (2, 78)])
def test_expandable_segments_both_devices_match_every_map(device, n_maps, mode):
    trace, rec, result = _anchored("codeloc_expandable_dev0_dev2", device, mode)
    assert trace.device == device and len(rec.segment_maps) == n_maps
    if mode == "anchored":
        assert result.segment_maps == rec.segment_maps  # same address and size, in order
    else:
        assert [s for _, s in result.segment_maps] == [s for _, s in rec.segment_maps]
    assert result.segment_unmaps == rec.segment_unmaps == [] and result.segment_allocs == []
    assert result.final_reserved == rec.final_reserved and result.final_allocated == rec.final_allocated
    assert result.total.peak_reserved == rec.peak_reserved
    assert result.unmatched_frees == 0
    result.model.check_invariants()


def test_expandable_default_device_is_the_one_with_most_events():
    trace = trace_from_snapshot(load_snapshot(shared_snapshot("codeloc_expandable_dev0_dev2")))
    assert trace.device == 0


@pytest.mark.parametrize("mode", ["anchored", "free-running"])
def test_private_pool_matches_every_segment_event(mode):
    trace, rec, result = _anchored("slime_init_b", mode=mode)
    assert trace.device == 1
    assert sum(e.action == "pool_enter" for e in trace.events) >= 1
    assert len(rec.segment_allocs) == 422 and sum(len(b) for b in rec.segment_free_batches) == 181
    if mode == "anchored":
        assert result.segment_allocs == rec.segment_allocs
        assert result.segment_free_batches == rec.segment_free_batches
    assert [s for _, s in result.segment_allocs] == [s for _, s in rec.segment_allocs]
    assert agreement(rec, result, True)["segment_free_batches_equal"]
    assert result.final_reserved == rec.final_reserved == 24_679_284_736
    assert result.final_allocated == rec.final_allocated
    pools = {s["segment_pool_id"] for s in result.segments}
    assert pools == {(0, 0), (0, 1)}
    result.model.check_invariants()


def test_private_pool_segments_end_where_recorded():
    snap = load_snapshot(shared_snapshot("slime_init_b"))
    result = replay(trace_from_snapshot(snap), mode="anchored")
    recorded = {(s["address"], s["total_size"], s["allocated_size"], tuple(s["segment_pool_id"]))
                for s in snap["segments"]}
    simulated = {(s["address"], s["total_size"], s["allocated_size"], s["segment_pool_id"]) for s in result.segments}
    assert simulated == recorded


def test_record_stream_frees_leave_allocated_at_the_request_and_their_pool_at_the_completion():
    """slime_init_b frees 15 blocks that other streams still used: PyTorch wrote ``free_requested`` with other
    entries before their ``free_completed``. Those requests are kept (and no other: a request its completion
    follows at once changes nothing); at each, the replay's allocated drops by the block, as PyTorch's stats do
    in ``free`` before ``insert_events``, while the block stays held until its completion."""
    snap = load_snapshot(shared_snapshot("slime_init_b"))
    trace = trace_from_snapshot(snap)
    requests = [i for i, e in enumerate(trace.events) if e.action == "free_requested"]
    assert len(requests) == 15
    assert all(trace.events[i + 1].action != "free" or trace.events[i + 1].addr != trace.events[i].addr
               for i in requests)
    for i in requests[:3]:  # the trace cut just before and just after a request
        before, after = (replay(replace(trace, events=trace.events[:n]), mode="anchored") for n in (i, i + 1))
        block = after.model.active_blocks[trace.events[i].addr]
        assert block.held and before.final_allocated - after.final_allocated == block.size > 0
        assert before.final_reserved == after.final_reserved
    result = replay(trace, mode="anchored")
    assert result.final_allocated == recorded_summary(trace).final_allocated
    assert not any(b.held for b in result.model.active_blocks.values())
    result.model.check_invariants()


def test_a_held_free_survives_a_written_snapshot_and_reads_back(tmp_path):
    """write_snapshot writes a FREE_REQUESTED as ``free_requested`` and its later FREE as ``free_completed`` alone
    (any other FREE as the pair PyTorch writes); reading the file back gives the same events."""
    from pytest_rlhfmem.memory.trace import ALLOC, FREE, FREE_REQUESTED, Event, Trace, write_snapshot

    events = [Event(ALLOC, 4096, 1000), Event(FREE_REQUESTED, 4096, 1000), Event(ALLOC, 8192, 1000),
              Event(FREE, 8192, 1000), Event(FREE, 4096, 1000)]
    path = write_snapshot(tmp_path / "held.pickle", Trace(events=events), [])
    snap = load_snapshot(path)
    assert [e["action"] for e in snap["device_traces"][0]] == [
        "alloc", "free_requested", "alloc", "free_requested", "free_completed", "free_completed"]
    assert [(e.action, e.addr) for e in trace_from_snapshot(snap).events] == [(e.action, e.addr) for e in events]
    result = replay(trace_from_snapshot(snap))
    assert (result.total.peak_allocated, result.final_allocated) == (1024, 0)


def test_blocks_without_address_get_them_from_the_segment():
    snap = load_snapshot(shared_snapshot("llminf_1p3b_a"))
    assert all("address" not in b for s in snap["segments"] for b in s["blocks"])
    trace = trace_from_snapshot(snap)
    result = replay(trace, mode="anchored")
    assert result.final_reserved == 1_851_785_216 == sum(s["total_size"] for s in snap["segments"])
    # the one recorded event frees a block that was live before the trace
    assert result.unmatched_frees == 0 and result.final_allocated == recorded_summary(trace).final_allocated


@pytest.mark.parametrize("name", ["wedson_medium_128_inference", "wedson_medium_256_training"])
def test_snapshots_without_segment_events_replay(name):
    trace, rec, result = _anchored(name)
    assert not trace.has_segment_events()
    # the recorded end state, exactly: the segments the snapshot holds and the bytes still allocated in them
    snap = load_snapshot(shared_snapshot(name))
    assert result.final_reserved == rec.final_reserved == sum(s["total_size"] for s in snap["segments"])
    assert result.final_allocated == rec.final_allocated == sum(
        b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert result.final_allocated > 0 and result.unmatched_frees == 0


MiB = 1 << 20


def _snap(events, segments=(), settings=None):
    return {"segments": list(segments), "device_traces": [list(events)], "allocator_settings": settings}


def test_oom_entry_gives_the_capacity_and_the_model_fails_the_same_request():
    # 3 x 40 MiB live, a 4th request fails: the retry released nothing (no free segment), then OOM with
    # 30 MiB free on the device. Capacity = 120 MiB reserved + 30 MiB free.
    ev = []
    for k in range(3):
        ev += [{"action": "segment_alloc", "addr": (k + 1) << 30, "size": 40 * MiB},
               {"action": "alloc", "addr": (k + 1) << 30, "size": 40 * MiB}]
    ev.append({"action": "oom", "device_free": 30 * MiB, "size": 40 * MiB, "stream": 0})  # PyTorch's layout
    segs = [{"address": (k + 1) << 30, "total_size": 40 * MiB, "allocated_size": 40 * MiB, "stream": 0,
             "segment_type": "large", "blocks": [{"address": (k + 1) << 30, "size": 40 * MiB,
                                                  "requested_size": 40 * MiB, "state": "active_allocated"}]}
            for k in range(3)]
    trace = trace_from_snapshot(_snap(ev, segs))
    for mode in ("anchored", "free-running"):
        result = replay(trace, mode=mode)
        assert result.capacity == 150 * MiB and result.capacity_source.startswith("inferred")
        assert result.total.ooms == 1 and result.total.alloc_retries == 1 and result.oom_mismatches == 0
        assert result.final_reserved == 120 * MiB



def test_oom_after_the_retry_released_a_cached_segment():
    # 2 x 40 MiB live, one 40 MiB segment cached; a 60 MiB request: cudaMalloc fails, the retry releases
    # the cached segment (segment_free), cudaMalloc fails again: OOM with 50 MiB free.
    segs, ev = [], []
    for k in range(3):
        ev += [{"action": "segment_alloc", "addr": (k + 1) << 30, "size": 40 * MiB},
               {"action": "alloc", "addr": (k + 1) << 30, "size": 40 * MiB}]
    ev += [{"action": "free_completed", "addr": 3 << 30, "size": 40 * MiB},
           {"action": "segment_free", "addr": 3 << 30, "size": 40 * MiB},
           {"action": "oom", "device_free": 50 * MiB, "size": 60 * MiB}]
    for k in range(2):
        segs.append({"address": (k + 1) << 30, "total_size": 40 * MiB, "allocated_size": 40 * MiB,
                     "segment_type": "large", "blocks": [{"address": (k + 1) << 30, "size": 40 * MiB,
                                                          "requested_size": 40 * MiB, "state": "active_allocated"}]})
    trace = trace_from_snapshot(_snap(ev, segs))
    rec = recorded_summary(trace)
    for mode in ("anchored", "free-running"):
        result = replay(trace, mode=mode)
        assert result.capacity == 130 * MiB  # 80 MiB reserved after the release + 50 MiB free
        assert result.total.alloc_retries == 1 and result.total.ooms == 1 and result.oom_mismatches == 0
        assert [len(b) for b in result.segment_free_batches] == [1] and not result.flush_points
        assert agreement(rec, result, True)["segment_free_batches_equal"]
        assert result.final_reserved == rec.final_reserved == 80 * MiB


def test_a_pre_trace_block_owns_the_unsplit_remainder_that_a_recorded_block_start_proves():
    """A block allocated before the trace began (8 MiB requested) carried a 983,040 B remainder the GPU never
    split off (<= 1 MiB, CUDACachingAllocator.cpp should_split); the trace proves it: while that block is still
    allocated, a block starts 983,040 B after its rounded end. Rebuilt at its rounded size, the remainder would
    be a free block the next request takes, and final allocated would be 983,040 B short."""
    seg = 1 << 30
    a_size = 8 * MiB + 983_040  # the pre-trace block as the GPU holds it
    x_req = 40 * MiB - a_size - 983_040  # leaves a 983,040 B remainder: not split either
    ev = [{"action": "alloc", "addr": seg + a_size, "size": x_req, "stream": 0},
          {"action": "free_completed", "addr": seg, "size": 8 * MiB, "stream": 0}]
    segs = [{"address": seg, "total_size": 40 * MiB, "allocated_size": 40 * MiB - a_size, "stream": 0,
             "segment_type": "large",
             "blocks": [{"address": seg, "size": a_size, "requested_size": 0, "state": "inactive"},
                        {"address": seg + a_size, "size": 40 * MiB - a_size, "requested_size": x_req,
                         "state": "active_allocated"}]}]
    trace = trace_from_snapshot(_snap(ev, segs))
    assert trace.initial_segments[0].live_blocks == [(seg, a_size, 8 * MiB)]
    for mode in ("anchored", "free-running"):
        for engine in ("python", "compiled"):
            result = replay(trace, mode=mode, engine=engine, record_series=False)
            assert (result.final_reserved, result.final_allocated) == (40 * MiB, 40 * MiB - a_size), (mode, engine)
