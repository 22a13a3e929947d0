"""The CUDA capture path's data handling, exercised on a real recorded GPU snapshot (no GPU here)."""

import pytest

from helpers import shared_snapshot
from pytest_rlhfmem.record.recorder import PhaseRecord, Recorder, cuda_phase_counters, cuda_trace_with_marks
from pytest_rlhfmem.memory.trace import CAPTURE_CUDA, FLUSH, PHASE, load_snapshot
from pytest_rlhfmem.rlhf import launch
from pytest_rlhfmem.rlhf.scenario import Scenario


def _marks(snap):
    times = [e["time_us"] for e in snap["device_traces"][0] if e.get("time_us")]
    lo, hi = min(times), max(times)
    third = (hi - lo) // 3
    return [(PHASE, lo, "generate"), (PHASE, lo + third, "infer_actor"), (FLUSH, lo + 2 * third, "after-infer_actor"),
            (PHASE, lo + 2 * third + 1, "train_actor")]


def test_phase_marks_merge_into_the_recorded_trace_by_time():
    snap = load_snapshot(shared_snapshot("cs336_ctx256_fwd"))
    trace = cuda_trace_with_marks(snap, _marks(snap))
    assert trace.capture == CAPTURE_CUDA
    names = [e.name for e in trace.events if e.action in (PHASE, FLUSH)]
    assert names == ["generate", "infer_actor", "after-infer_actor", "train_actor"]
    times = [e.time_us for e in trace.events]
    assert times == sorted(times)  # marks land in time order among the recorded events


def test_cuda_rank_result_takes_the_allocators_counters_and_the_replays_peaks():
    """What the recorder gives rank_result on CUDA (Recorder.phase: cuda_phase_counters of two memory_stats() dicts,
    no peaks, since the program's own peak counters are never reset): a phase's cudaMalloc/cudaFree calls, retries
    and OOMs are the allocator's own counters, its peaks the anchored replay's."""
    from pytest_rlhfmem.memory.replay import ANCHORED, replay
    from pytest_rlhfmem.record.rank import rank_result

    snap = load_snapshot(shared_snapshot("cs336_ctx256_fwd"))
    trace = cuda_trace_with_marks(snap, _marks(snap))
    before = {"num_device_alloc": 40, "num_device_free": 7, "num_alloc_retries": 0, "num_ooms": 0,
              "reserved_bytes.all.peak": 30 * 2**30, "allocated_bytes.all.peak": 25 * 2**30}
    after = {**before, "num_device_alloc": 540, "num_device_free": 307, "num_alloc_retries": 1}
    counters = cuda_phase_counters(before, after)
    assert counters == {"cuda_malloc_count": 500, "cuda_free_count": 300, "alloc_retries": 1, "ooms": 0}
    rec = Recorder("cuda")
    rec.phases = [PhaseRecord("generate", 1.0, counters), PhaseRecord("infer_actor", 0.5, None),
                  PhaseRecord("train_actor", 2.0, None)]
    res = rank_result(Scenario("deepspeed-chat", "opt-1.3b", "zero3", "after-inference", 4), 0, 4, "cuda", rec, trace,
                      {}, None, 1, 3.5)
    assert res["simulated"] is False and res["capture"] == CAPTURE_CUDA
    replayed = {w.phase: w.to_dict() for w in replay(trace, mode=ANCHORED).phases}
    gen = next(p for p in res["phases"] if p["phase"] == "generate")
    assert (gen["cuda_malloc_count"], gen["cuda_free_count"], gen["alloc_retries"]) == (500, 300, 1)
    assert gen["peak_reserved"] == replayed["generate"]["peak_reserved"]  # no stats peak: the replay's
    infer = next(p for p in res["phases"] if p["phase"] == "infer_actor")
    assert infer["cuda_malloc_count"] == replayed["infer_actor"]["cuda_malloc_count"]  # no counters: the replay's
    assert res["flushes"][0]["name"] == "after-infer_actor"


def test_cuda_phase_counters_leave_out_a_counter_that_went_down():
    before = {"num_device_alloc": 10, "num_device_free": 2, "num_alloc_retries": 1, "num_ooms": 0}
    after = {"num_device_alloc": 15, "num_device_free": 1, "num_alloc_retries": 3, "num_ooms": 1}
    assert cuda_phase_counters(before, after) == {"cuda_malloc_count": 5, "alloc_retries": 2, "ooms": 1}


@pytest.mark.parametrize("available, count, world, expected", [(True, 4, 4, "cuda"), (True, 0, 4, "cpu"),
                                                                (False, 0, 1, "cpu")])
def test_auto_device_takes_cuda_whenever_enough_devices(monkeypatch, available, count, world, expected):
    """(Fewer devices than ranks is refused: tests/test_gpu_runner_devices.py.)"""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert launch.resolve_device("auto", world) == expected
    assert launch.resolve_device("cpu", world) == "cpu"
