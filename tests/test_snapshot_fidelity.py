"""Real GPU snapshots (../shared/snapshots; provenance in its README) replayed through the model."""

import pickle

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
