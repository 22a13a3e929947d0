"""PyTorch 2.8-2.10 allocator behaviours, each under the version it belongs to (issue 22).

Read in ``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/cuda/CUDAAllocatorConfig.cpp`` (main after PRs 169699
and 169739); the scenarios follow PyTorch's own tests of ``test/test_cuda.py`` (``TestMemPool``:
``test_mempool_limited_memory_with_allocator``, ``test_deleted_mempool_not_used_on_oom``,
``test_mempool_no_split``; read in their torch_npu and torch_musa ports, which keep the names, sizes and
comments), rewritten for the model: a limited device is a ``capacity``, a MemPool's life is
``create_or_incref_pool`` / ``begin_allocate_to_pool`` ... ``release_pool`` + ``empty_cache(pool id)`` as
``python_engine.py`` replays POOL_ENTER / POOL_EXIT / POOL_RELEASE. Each scenario also runs through both
replay engines, which must agree.
"""

from __future__ import annotations

import shutil

import pytest

from pytest_rlhfmem.memory.allocator import (
    MiB, AllocatorConfig, AllocatorConfigError, CachingAllocatorModel, OutOfMemoryError, parse_torch_version,
)
from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.memory.replay_engine import COMPILED
from pytest_rlhfmem.memory.trace import ALLOC, FLUSH, FREE, POOL_ENTER, POOL_EXIT, POOL_RELEASE, Event, Trace

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for the compiled core")

POOL_USE, POOL_DO_NOT_USE = (0, 1), (0, 2)


def mempool(m: CachingAllocatorModel, pool_id: tuple[int, int]) -> None:
    """``torch.cuda.MemPool()``: the pool object holds the pool once."""
    m.create_or_incref_pool(pool_id)


def in_pool(m: CachingAllocatorModel, pool_id: tuple[int, int], size: int):
    """``with use_mem_pool(pool): torch.empty(size)`` (``beginAllocateToPool`` increfs the pool)."""
    m.begin_allocate_to_pool(pool_id)
    try:
        return m.malloc(size)
    finally:
        m.end_allocate_to_pool(pool_id)
        m.release_pool(pool_id)


def destroy(m: CachingAllocatorModel, pool_id: tuple[int, int]) -> None:
    """``del pool``: ``~MemPool`` releases it and empties its cache."""
    m.release_pool(pool_id)
    m.empty_cache(pool_id)


# -- per_process_memory_fraction (2.10, PR 161035) ---------------------------------------------------------

def test_fraction_key_parses_with_clear_errors():
    assert AllocatorConfig.parse("per_process_memory_fraction:0.5").per_process_memory_fraction == 0.5
    assert AllocatorConfig.parse("per_process_memory_fraction:1").per_process_memory_fraction == 1.0
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(AllocatorConfigError, match=r"per_process_memory_fraction=.*0\.0 to 1\.0"):
            AllocatorConfig.parse(f"per_process_memory_fraction:{bad}")
    with pytest.raises(AllocatorConfigError, match="from PyTorch 2.10.*torch 2.9 rejects it"):
        AllocatorConfig.parse("per_process_memory_fraction:0.5", "2.9.1+cu128")
    assert AllocatorConfig.parse("per_process_memory_fraction:0.5", "2.10.0").torch_version == (2, 10)


def test_fraction_caps_reserved_memory_after_free_and_retry():
    """test_cuda's fraction case (120 MiB allowed, max_split_size_mb:40), the cap set by the conf key: three
    40 MiB tensors fit, a fourth is an OOM after the release-and-retry; freed, one 120 MiB tensor fits."""
    config = AllocatorConfig.parse("per_process_memory_fraction:0.5,max_split_size_mb:40", "2.10")
    m = CachingAllocatorModel(config, capacity=240 * MiB)
    assert m.capacity == 120 * MiB and m.device_total == 240 * MiB
    blocks = [m.malloc(40 * MiB) for _ in range(3)]
    with pytest.raises(OutOfMemoryError):
        m.malloc(40 * MiB)
    assert m.stats.num_alloc_retries == 1 and m.stats.num_ooms == 1
    for b in blocks:
        m.free(b)
    # cudaMalloc fails; release_available_cached_blocks frees the three oversize (>= 40 MiB) cached segments
    # and the next cudaMalloc fits, before the full release-and-retry
    m.malloc(120 * MiB)
    assert m.stats.reserved_bytes == 120 * MiB and m.stats.num_alloc_retries == 1 and m.stats.num_device_free == 3
    m.check_invariants()


def test_fraction_checks_the_cudamalloc_size_before_expandable_pages():
    """alloc_block tests reserved + alloc_size against allowed_memory_maximum before it tries an expandable
    segment: a 32 MiB request whose missing 14 MiB one more 20 MiB page would cover is refused under a 50 MiB
    cap (20 + 32 > 50), though a 50 MiB device (cuMemCreate page by page) maps it."""
    capped = CachingAllocatorModel(AllocatorConfig.parse("expandable_segments:True,per_process_memory_fraction:0.5"),
                                   capacity=100 * MiB)
    device = CachingAllocatorModel(AllocatorConfig.parse("expandable_segments:True"), capacity=50 * MiB)
    for m in (capped, device):
        m.malloc(2 * MiB)  # one 20 MiB page mapped, 18 MiB of it free
    with pytest.raises(OutOfMemoryError):
        capped.malloc(32 * MiB)
    device.malloc(32 * MiB)
    assert device.stats.reserved_bytes == 40 * MiB
    if shutil.which("g++"):
        trace = Trace(events=[Event(ALLOC, 1, 2 * MiB), Event(ALLOC, 2, 32 * MiB)])
        for m in (capped, device):
            py = replay(trace, m.config, capacity=100 * MiB if m is capped else 50 * MiB, record_series=False)
            cc = replay(trace, m.config, capacity=100 * MiB if m is capped else 50 * MiB, record_series=False,
                        engine=COMPILED)
            assert (py.total, py.segment_maps) == (cc.total, cc.segment_maps)
            assert py.total.ooms == (1 if m is capped else 0)


def test_fraction_without_a_known_capacity_counts_an_80_gib_device():
    m = CachingAllocatorModel(AllocatorConfig.parse("per_process_memory_fraction:0.25"))
    assert m.capacity == 20 * 1024 * MiB and m.device_total is None


# -- MemPool(use_on_oom=True) (2.8, PR 151487) and its place in the miss path (2.10, PR 169699) ---------------

@pytest.mark.parametrize("version, retries", [("2.9", 1), ("2.10", 0), (None, 0)])
def test_use_on_oom_pool_absorbs_what_the_default_pool_cannot(version, retries):
    """test_mempool_limited_memory_with_allocator: 88 MiB allowed; a 40 MiB tensor in each of two pools; a
    third 40 MiB is an OOM; freed, a 30 MiB tensor comes from the use_on_oom pool (at b's address), a second
    30 MiB is an OOM (the other pool is not used); a tensor allocated in the use_on_oom pool afterwards reuses
    that address. Before 2.10 the fallback comes after the release-and-retry (one retry counted); from 2.10
    it comes first (none)."""
    config = AllocatorConfig(use_on_oom_pools=(POOL_USE,)).with_options(torch_version=version)
    m = CachingAllocatorModel(config, capacity=88 * MiB)
    mempool(m, POOL_DO_NOT_USE)
    mempool(m, POOL_USE)
    a = in_pool(m, POOL_DO_NOT_USE, 40 * MiB)
    b = in_pool(m, POOL_USE, 40 * MiB)
    b_ptr = b.address
    with pytest.raises(OutOfMemoryError):
        m.malloc(40 * MiB)  # the pools' blocks are live: nothing to fall back on
    m.free(a)
    m.free(b)
    before = m.stats.num_alloc_retries
    c = m.malloc(30 * MiB)
    assert c.address == b_ptr and c.pool.owner_private_pool.id == POOL_USE
    assert m.stats.num_alloc_retries - before == retries
    with pytest.raises(OutOfMemoryError):
        m.malloc(30 * MiB)  # POOL_DO_NOT_USE holds 40 MiB free, but it is not a use_on_oom pool
    m.free(c)  # (a Block object may be reused by a later split: compare saved addresses, as the test's data_ptr)
    e = in_pool(m, POOL_USE, 20 * MiB)
    assert e.address == b_ptr
    m.free(e)
    destroy(m, POOL_USE)
    destroy(m, POOL_DO_NOT_USE)
    assert m.stats.reserved_bytes == 0
    m.check_invariants()


def test_deleted_use_on_oom_pools_are_not_used():
    """test_deleted_mempool_not_used_on_oom: ten use_on_oom pools created, used and deleted, then one live
    pool holding 40 MiB free; two 20 MiB tensors come from it and nothing touches the deleted ids."""
    ids = [(0, 10 + k) for k in range(10)]
    live = (0, 99)
    m = CachingAllocatorModel(AllocatorConfig(use_on_oom_pools=(*ids, live)), capacity=48 * MiB)
    for pid in ids:
        mempool(m, pid)
        m.free(in_pool(m, pid, 40 * MiB))
        destroy(m, pid)
    assert not any(pid in m.graph_pools for pid in ids)
    mempool(m, live)
    m.free(in_pool(m, live, 40 * MiB))
    b = m.malloc(20 * MiB)
    c = m.malloc(20 * MiB)
    assert b.pool is c.pool is m.graph_pools[live].large_blocks
    assert m.stats.num_ooms == 0 and not any(pid in m.graph_pools for pid in ids)
    m.check_invariants()


def test_no_fallback_while_allocating_into_a_pool():
    """'if already trying to use a mempool, then just oom' (try_mempool_fallback)."""
    m = CachingAllocatorModel(AllocatorConfig(use_on_oom_pools=(POOL_USE,)), capacity=40 * MiB)
    mempool(m, POOL_USE)
    m.free(in_pool(m, POOL_USE, 40 * MiB))
    mempool(m, POOL_DO_NOT_USE)
    with pytest.raises(OutOfMemoryError):
        in_pool(m, POOL_DO_NOT_USE, 20 * MiB)


def test_pool_options_need_their_version():
    with pytest.raises(AllocatorConfigError, match="use_on_oom=True.*2.8"):
        AllocatorConfig(use_on_oom_pools=(POOL_USE,), torch_version=(2, 7))
    with pytest.raises(AllocatorConfigError, match="no_split=True.*2.10"):
        AllocatorConfig(no_split_pools=(POOL_USE,), torch_version=(2, 9))
    with pytest.raises(AllocatorConfigError, match="major.minor"):
        parse_torch_version("latest")


# -- MemPool(no_split=True) (2.10, PR 169739) -----------------------------------------------------------------

def test_no_split_pool_gives_each_tensor_its_own_segment():
    """test_mempool_no_split: two 4 MiB tensors in a splitting pool share one 20 MiB segment; in a no_split
    pool each takes a whole segment (one block per segment, more segments, fewer blocks)."""
    split, no_split = (0, 1), (0, 2)
    m = CachingAllocatorModel(AllocatorConfig(no_split_pools=(no_split,)))
    mempool(m, split)
    mempool(m, no_split)
    for _ in range(2):
        in_pool(m, split, 4 * MiB)
        in_pool(m, no_split, 4 * MiB)
    segs = m.snapshot_segments()
    of = {pid: [s for s in segs if s["segment_pool_id"] == pid] for pid in (split, no_split)}
    assert len(of[split]) == 1 and len(of[no_split]) == 2
    assert all(len(s["blocks"]) == 1 for s in of[no_split])
    assert sum(len(s["blocks"]) for s in of[no_split]) < sum(len(s["blocks"]) for s in of[split])
    m.check_invariants()


# -- pools nested (2.10, PR 168382) and empty_cache inside a region (PR 133602 / PR 154042) -----------------

@pytest.mark.parametrize("version, innermost", [("2.9", False), ("2.10", True)])
def test_nested_regions_allocate_to_the_version_s_pool(version, innermost):
    outer, inner = (0, 1), (0, 2)
    m = CachingAllocatorModel(AllocatorConfig().with_options(torch_version=version))
    m.begin_allocate_to_pool(outer)
    m.begin_allocate_to_pool(inner)
    b = m.malloc(4 * MiB)
    assert b.pool.owner_private_pool.id == (inner if innermost else outer)


@pytest.mark.parametrize("version, released", [("2.7", 0), ("2.8", 20 * MiB)])
def test_empty_cache_inside_a_region_by_version(version, released):
    """A released pool's cached segment; empty_cache() called inside another pool's use_mem_pool region: 2.7
    releases only the region's own pool (held, so nothing); 2.8+ every pool nobody holds."""
    old, region = (0, 1), (0, 2)
    m = CachingAllocatorModel(AllocatorConfig().with_options(torch_version=version))
    mempool(m, old)
    m.free(in_pool(m, old, 4 * MiB))
    m.release_pool(old)  # the MemPool object gone, its cache not emptied yet
    mempool(m, region)
    m.begin_allocate_to_pool(region)
    before = m.stats.reserved_bytes
    m.empty_cache()
    assert before - m.stats.reserved_bytes == released


# -- allocator_settings read from a snapshot -------------------------------------------------------------------

def test_snapshot_settings_effective_values_win():
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "max_split_size": 128 * MiB,
                "garbage_collection_threshold": 0.6, "expandable_segments": False,
                "roundup_power2_divisions": {"1": 0, "2": 0, "4": 0, "8": 0, "16": 0, "32": 0, "64": 4, "128": 0,
                                             "256": 0, "512": 0, "1024": 0, "2048": 0, "4096": 0, "8192": 0,
                                             "16384": 0, "32768": 0},
                "graph_capture_record_stream_reuse": True, "per_process_memory_fraction": 0.75}
    c = AllocatorConfig.from_snapshot_settings(settings)
    assert c.max_split_size == 128 * MiB and c.garbage_collection_threshold == 0.6
    assert c.roundup_power2_divisions[6] == 4 and sum(c.roundup_power2_divisions) == 4
    assert c.graph_capture_record_stream_reuse and c.per_process_memory_fraction == 0.75
    assert c.torch_version is None and c.torch_version_source.startswith("2.9 or later")  # no upper bound
    unlimited = AllocatorConfig.from_snapshot_settings({"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1})
    assert unlimited == AllocatorConfig(torch_version=(2, 8))  # PyTorch's settings without the 2.9 key
    assert "at most 2.8" in unlimited.torch_version_source
    given = AllocatorConfig.from_snapshot_settings({"max_split_size": -1}, "2.7")
    assert given.torch_version == (2, 7) and given.torch_version_source == "given"
    assert AllocatorConfig.from_snapshot_settings({"PYTORCH_CUDA_ALLOC_CONF": ""}).torch_version is None
    captured = AllocatorConfig.from_snapshot_settings({"rlhfmem_torch_version": "2.9.1+cpu", "max_split_size": -1})
    assert captured.torch_version == (2, 9) and "rlhfmem_torch_version" in captured.torch_version_source
    with pytest.raises(AllocatorConfigError, match=r"allocator_settings\['max_split_size'\]"):
        AllocatorConfig.from_snapshot_settings({"max_split_size": "big"})


# -- both engines ----------------------------------------------------------------------------------------------

def _limited_memory_trace() -> Trace:
    """test_mempool_limited_memory_with_allocator as a trace (addresses are the recorded program's)."""
    e = [Event(POOL_ENTER, *POOL_DO_NOT_USE), Event(ALLOC, 0xA, 40 * MiB), Event(POOL_EXIT, *POOL_DO_NOT_USE),
         Event(POOL_ENTER, *POOL_USE), Event(ALLOC, 0xB, 40 * MiB), Event(POOL_EXIT, *POOL_USE),
         Event(ALLOC, 0xC, 40 * MiB), Event(FREE, 0xA), Event(FREE, 0xB), Event(ALLOC, 0xD, 30 * MiB),
         Event(ALLOC, 0xE, 30 * MiB), Event(FREE, 0xD), Event(FLUSH, name="f"),
         Event(POOL_ENTER, *POOL_USE), Event(ALLOC, 0xF, 20 * MiB), Event(POOL_EXIT, *POOL_USE), Event(FREE, 0xF),
         Event(POOL_RELEASE, *POOL_USE), Event(POOL_RELEASE, *POOL_DO_NOT_USE)]
    return Trace(events=e)


@needs_gxx
@pytest.mark.parametrize("version, conf", [(v, c) for v in ("2.8", "2.9", "2.10")
                                           for c in ("", "expandable_segments:True")]
                         + [("2.10", "per_process_memory_fraction:0.5")])
def test_both_engines_agree_on_the_limited_memory_scenario(version, conf):
    config = AllocatorConfig.parse(conf, version).with_options(use_on_oom_pools=[POOL_USE])
    capacity = 176 * MiB if "fraction" in conf else 88 * MiB
    py = replay(_limited_memory_trace(), config, capacity=capacity, record_series=False)
    cc = replay(_limited_memory_trace(), config, capacity=capacity, record_series=False, engine=COMPILED)
    assert cc.engine == COMPILED
    for f in ("total", "segment_allocs", "segment_free_batches", "final_reserved", "final_allocated", "flushes",
              "segment_maps", "segment_unmaps"):
        assert getattr(py, f) == getattr(cc, f), f
    # 2.8-2.9: the 30 MiB request retries before its fallback; 2.10: it does not. With expandable segments 2.10
    # searches the pool with expandable segments off (mempool_params), so the pool's expandable blocks do not
    # serve it: a third OOM.
    expected = {("2.8", ""): (2, 3), ("2.9", ""): (2, 3), ("2.10", ""): (2, 2)}
    expected.update({(v, "expandable_segments:True"): (2, 3) for v in ("2.8", "2.9")})
    expected[("2.10", "expandable_segments:True")] = (3, 3)
    expected[("2.10", "per_process_memory_fraction:0.5")] = (2, 2)
    assert (py.total.ooms, py.total.alloc_retries) == expected[(version, conf)]


def test_replay_json_names_the_version_and_why():
    """rlhfmem replay --json: a snapshot whose settings lack the 2.9 key replays as 2.8 and says so."""
    from helpers import shared_snapshot
    from pytest_rlhfmem.memory.replay import (
        agreement, allocator_config, load_columns_for_replay, recorded_summary, replay_json,
    )

    path = str(shared_snapshot("slime_init_b"))
    cols, recorded = load_columns_for_replay(path)
    result = replay(cols, mode="anchored", record_series=False, engine="auto")
    config = result.config
    assert config == allocator_config(recorded.allocator_settings)
    rec = recorded_summary(cols)
    out = replay_json(path, "anchored", config, cols, result, rec, agreement(rec, result, True))
    assert out["torch_version"] == "2.8" and "at most 2.8" in out["torch_version_source"]
    assert out["agreement"]["segment_allocs_matching"] == 422
    assert out["allowed_memory_maximum"] is None
    config = allocator_config(recorded.allocator_settings, torch_version="2.10", source=path)
    assert config.torch_version == (2, 10) and config.torch_version_source == "given"
    config = config.with_options(per_process_memory_fraction=0.5)
    result = replay(cols, config, capacity=8 * 1024 * MiB, record_series=False, engine="auto")
    out = replay_json(path, "free-running", config, cols, result, rec, agreement(rec, result, True))
    assert out["capacity"] == 8 * 1024 * MiB and out["allowed_memory_maximum"] == 4 * 1024 * MiB
