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


# -- the GPU route's edges (tests/gpu_route.py's report) --------------------------------------------------------

def test_the_profile_of_cuda_devices_names_the_card_and_the_count():
    from pytest_rlhfmem.hardware import CudaDevice, profile_name

    assert profile_name([]) == "cpu"
    assert profile_name([CudaDevice("NVIDIA A100-SXM4-80GB", 80 * 2**30)] * 4) == "cuda-nvidia-a100-sxm4-80gb-x4"


def test_without_torch_there_is_no_cuda_device(monkeypatch):
    import sys

    from pytest_rlhfmem.hardware import cuda_device_count, detect_cuda_devices

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert detect_cuda_devices() == [] and cuda_device_count() == 0
    assert launch.no_cuda_device().startswith("no CUDA device here (torch is not installed); run on device cpu")


def test_an_unknown_device_and_a_cuda_build_without_a_gpu_are_named(monkeypatch):
    import torch

    with pytest.raises(launch.ScenarioError, match=r"^unknown device 'tpu'; valid: auto, cpu, cuda, cuda-rehearsal$"):
        launch.resolve_device("tpu", 1)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "(torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES='')" in launch.no_cuda_device()


def test_a_simulated_device_that_cannot_be_built_is_one_line(monkeypatch):
    from pytest_rlhfmem.simcuda import build

    def no_compiler(source):
        raise build.FakeCudaUnavailable("g++ not found")

    monkeypatch.setattr(build, "library_path", no_compiler)
    with pytest.raises(launch.ScenarioError) as e:
        launch._sim_cuda_library()
    assert str(e.value) == "device cuda-rehearsal: the simulated CUDA device: g++ not found"


def test_a_rank_without_a_cuda_device_of_its_own_is_refused():
    from pytest_rlhfmem.command.rank import _start_cuda

    with pytest.raises(RuntimeError, match=r"local rank 3 has no CUDA device of its own \(0 visible\)"):
        _start_cuda(3)  # a CPU build of torch: no device at all


def test_peaks_that_cannot_be_read_leave_the_progress_file_without_them(monkeypatch):
    import torch

    from pytest_rlhfmem.record.rank import _cuda_peaks

    def not_initialised(device=None):
        raise RuntimeError("CUDA driver not initialised")

    monkeypatch.setattr(torch.cuda, "memory_stats", not_initialised)
    assert _cuda_peaks() == {}


def test_every_unit_of_the_gpu_route_exists_and_its_hardware_only_lines_say_why():
    import gpu_route

    units = gpu_route.units()  # LookupError naming a unit that was renamed or removed
    assert len(units) == len(gpu_route.ROUTE) and all(u.lines for u in units)
    marked = {(f, n): why for f in gpu_route.ROUTE_FILES for n, why in gpu_route.hardware_only(f).items()}
    assert marked and all(why for why in marked.values())  # each names its reason


def test_the_heartbeat_reads_the_ranks_device_not_its_threads_device_0(monkeypatch, tmp_path):
    """cudaSetDevice is per host thread: the heartbeat's thread starts on device 0 whatever the rank set, so a rank 1
    that read ``memory_stats()`` there wrote device 0's empty figures over its own. ``start()`` reads the rank's
    device on the main thread, and every progress file is written from it. (torch.cuda answered by a stand-in with a
    per-thread current device: a CPU build of torch has none.)"""
    import json
    import threading

    import torch

    from pytest_rlhfmem.record.rank import RankCapture, _current_cuda_device

    main = threading.main_thread()
    stats = {0: {}, 1: {"reserved_bytes.all.peak": 64 << 20, "allocated_bytes.all.peak": 48 << 20}}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1 if threading.current_thread() is main else 0)
    monkeypatch.setattr(torch.cuda, "memory_stats",
                        lambda device=None: stats[torch.cuda.current_device() if device is None else device])
    cap = RankCapture(identity=None, device="cuda", out_dir=tmp_path, rank=1, world_size=2)
    cap._cuda_index = _current_cuda_device()  # what start() reads, on the main thread
    beat = threading.Thread(target=cap.progress, args=("generate",))
    beat.start()
    beat.join()
    written = json.loads((tmp_path / "progress-rank1.json").read_text())
    assert (written["peak_reserved"], written["peak_allocated"]) == (64 << 20, 48 << 20)

    def not_initialised():
        raise RuntimeError("CUDA driver not initialised")

    monkeypatch.setattr(torch.cuda, "current_device", not_initialised)
    assert _current_cuda_device() is None
