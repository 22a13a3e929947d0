"""Host figures of ZeRO-Infinity (issue 25): swap staging buffers (held, idle at the anonymous-memory peak),
glibc's heap at that peak (mallinfo2), and the NVMe budgets that gate storage traffic and staging bytes."""

import time

import pytest

from pytest_rlhfmem import budgets as B
from pytest_rlhfmem.record import host
from pytest_rlhfmem.record.host import HOST_HEAP_NAMES, HOST_SWAP_NAMES, HostMemory


def _hold_anon(nbytes: int, seconds: float) -> None:
    buf = bytearray(nbytes)  # zero-filled: its pages are written, so resident and anonymous
    for i in range(0, nbytes, 4096):
        buf[i] = 1
    time.sleep(seconds)
    del buf


def test_idle_staging_buffers_are_read_at_the_windows_anonymous_peak(monkeypatch):
    state = {"idle": 4}
    probe = lambda: (10 * 4096, 10, state["idle"] * 4096, state["idle"])  # noqa: E731
    monkeypatch.setattr(host, "_STAGING_PROBES", [probe])
    meter = HostMemory("cpu")
    meter.start()
    try:
        meter.begin_phase("train")
        state["idle"] = 1  # at the peak: 9 of 10 buffers hold a tensor
        _hold_anon(256 << 20, 0.2)
        state["idle"] = 7  # after the peak (anonymous memory lower again)
        time.sleep(0.05)
        meter.end_phase("train")
    finally:
        meter.stop()
    d = meter.to_dict()
    train = d["phases"]["train"]
    assert train["host_staging_bytes"] == 10 * 4096 and train["host_staging_buffers"] == 10
    assert train["host_staging_idle_buffers_at_peak"] == 1 and train["host_staging_idle_bytes_at_peak"] == 4096
    assert d["host_staging_idle_buffers_at_peak"] == 1 and d["host_staging_bytes"] == 10 * 4096
    assert set(HOST_SWAP_NAMES) <= set(d)


@pytest.mark.skipif(host.heap_now() is None, reason="no glibc mallinfo2 here")
def test_heap_figures_at_the_peak_come_from_mallinfo2():
    meter = HostMemory("cpu")
    meter.start()
    try:
        meter.begin_phase("p")
        _hold_anon(64 << 20, 0.1)  # 64 MiB: above the mmap threshold, so in hblkhd while held
        meter.end_phase("p")
    finally:
        meter.stop()
    p = meter.to_dict()["phases"]["p"]
    assert all(isinstance(p[k], int) for k in HOST_HEAP_NAMES)
    assert p["host_heap_used_bytes_at_peak"] > 0 and p["host_heap_arena_bytes_at_peak"] > 0
    assert p["host_heap_mmapped_bytes_at_peak"] >= 64 << 20  # read while the 64 MiB block was held
    assert p["host_heap_free_bytes_at_peak"] <= p["host_heap_arena_bytes_at_peak"]
    assert meter.to_dict()["heap_method"] == host.HEAP_MALLINFO2


def test_without_probes_the_staging_figures_are_zero():
    meter = HostMemory("cpu")
    meter.start()
    meter.begin_phase("p")
    meter.end_phase("p")
    meter.stop()
    d = meter.to_dict()
    assert d["host_staging_bytes"] == d["host_staging_idle_buffers_at_peak"] == 0
    assert d["phases"]["p"]["host_staging_buffers"] == 0


def test_deepspeed_swappers_are_counted_slot_by_slot():
    torch = pytest.importorskip("torch")
    from pytest_rlhfmem.rlhf.deepspeed_chat import swap_buffers

    class ParamSwapper:  # AsyncPartitionedParameterSwapper's attributes that hold buffers
        def __init__(self) -> None:
            self.buffers = torch.empty(5 * 1024, dtype=torch.float16)  # 5 slots of 2 KiB
            self.param_buffer_count = 5
            self.available_buffer_ids = [0, 3]
            self.partitioned_swap_buffer = torch.empty(512, dtype=torch.float16)  # 1 KiB, idle between steps

    class Manager:
        def __init__(self) -> None:
            self.all_buffers = [torch.empty(256, dtype=torch.float32) for _ in range(4)]  # 4 x 1 KiB
            self.free_buffer_index = [1, 2, 3]

    class OptimizerSwapper:
        def __init__(self) -> None:
            self.swap_buffer_manager = Manager()

    p, o = ParamSwapper(), OptimizerSwapper()
    swap_buffers._SWAPPERS.add(p)
    swap_buffers._SWAPPERS.add(o)
    try:
        held, n_held, idle, n_idle = swap_buffers.staging_now()
    finally:
        swap_buffers._SWAPPERS.discard(p)
        swap_buffers._SWAPPERS.discard(o)
    assert (held, n_held) == (5 * 2048 + 1024 + 4 * 1024, 5 + 1 + 4)
    assert (idle, n_idle) == (2 * 2048 + 1024 + 3 * 1024, 2 + 1 + 3)


def _entry(metrics: dict) -> dict:
    return {"capture": "cpu-trace-simulated", "device": "cpu", "metrics": metrics}


def test_nvme_figures_are_written_and_gated_only_for_runs_with_staging_buffers(tmp_path):
    base = {"peak_reserved": 32 << 20, "peak_allocated": 27 << 20, "fragmentation_at_peak": 5 << 20,
            "host_anon_growth": 250 << 20, "host_pinned_peak": 12 << 20, "cuda_malloc_count": 7, "alloc_retries": 0,
            "storage_read_bytes": 3 << 20, "storage_write_bytes": 5 << 20}
    offload = B.entry_from_result({"metrics": dict(base, host_staging_bytes=0)})
    nvme = B.entry_from_result({"metrics": dict(base, host_staging_bytes=40 << 20)})
    assert not set(B.SWAP_BUDGETS) & set(offload["metrics"])
    assert nvme["metrics"]["storage_read_bytes"] == "3 MiB" and nvme["metrics"]["host_staging_bytes"] == "40 MiB"
    path = tmp_path / "b.yaml"
    B.update_budget_file(path, {"nvme": _entry(nvme["metrics"]), "offload": _entry(offload["metrics"])}, "cpu")
    bf = B.load_budget_file(path)
    over = dict(base, host_staging_bytes=40 << 20, storage_write_bytes=40 << 20)
    rows = {r.metric: r for r in B.compare(bf, bf.entries["nvme"], over)}
    assert rows["storage_write_bytes"].status == "over" and rows["host_staging_bytes"].status == "ok"
    assert "storage_write_bytes" not in {r.metric for r in B.compare(bf, bf.entries["offload"], over)}
