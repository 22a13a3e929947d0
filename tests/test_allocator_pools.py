"""Private pools (torch.cuda.MemPool / use_mem_pool, CUDA graph pools) against CUDACachingAllocator.cpp
(2.6+: release_cached_blocks(context, mempool_id), no release-and-retry while allocating into a pool)."""

import pytest

from pytest_rlhfmem.memory.allocator import MiB, AllocatorConfig, CachingAllocatorModel, OutOfMemoryError

POOL = (0, 1)


def test_pool_blocks_serve_only_pool_allocations():
    m = CachingAllocatorModel()
    m.create_or_incref_pool(POOL)  # MemPool()
    m.begin_allocate_to_pool(POOL)  # with use_mem_pool(pool):
    a = m.malloc(4 * MiB)
    m.end_allocate_to_pool(POOL)
    m.release_pool(POOL)
    m.free(a)  # its 20 MiB segment now holds 20 MiB free, in the pool
    b = m.malloc(4 * MiB)  # outside the pool: a new default segment
    assert b.pool is m.large_blocks and a.pool.owner_private_pool is m.graph_pools[POOL]
    assert m.stats.num_device_alloc == 2
    m.check_invariants()


def test_empty_cache_keeps_a_held_pool_and_frees_a_released_one():
    m = CachingAllocatorModel()
    m.create_or_incref_pool(POOL)
    m.begin_allocate_to_pool(POOL)
    m.free(m.malloc(4 * MiB))
    m.end_allocate_to_pool(POOL)
    m.release_pool(POOL)
    m.empty_cache()
    assert m.stats.reserved_bytes == 20 * MiB  # the MemPool object still holds it
    m.release_pool(POOL)  # MemPool destroyed ...
    m.empty_cache(POOL)  # ... and emptyCache(pool id)
    assert m.stats.reserved_bytes == 0 and POOL not in m.graph_pools
    m.check_invariants()


def test_no_release_and_retry_while_allocating_into_a_pool():
    m = CachingAllocatorModel(capacity=40 * MiB)
    m.free(m.malloc(30 * MiB))  # a free 30 MiB default segment
    m.create_or_incref_pool(POOL)
    m.begin_allocate_to_pool(POOL)
    with pytest.raises(OutOfMemoryError):
        m.malloc(20 * MiB)  # the default segment could be released, but not from inside a pool
    assert m.stats.num_alloc_retries == 0 and m.stats.num_ooms == 1
    m.end_allocate_to_pool(POOL)
    m.malloc(36 * MiB)  # outside: cudaMalloc fails, release the free segment, retry, succeed
    assert m.stats.num_alloc_retries == 1
    m.check_invariants()


def test_expandable_segment_per_pool():
    m = CachingAllocatorModel(AllocatorConfig.parse("expandable_segments:True"))
    m.malloc(4 * MiB)
    m.create_or_incref_pool(POOL)
    m.begin_allocate_to_pool(POOL)
    p = m.malloc(4 * MiB)  # 16 MiB are free in the default segment's page, but not in this pool
    assert len(m.expandable_segments) == 2 and p.pool.owner_private_pool is not None
    m.check_invariants()


def test_unbalanced_markers_are_named():
    m = CachingAllocatorModel()
    with pytest.raises(ValueError, match="not currently recording to mempool_id"):
        m.end_allocate_to_pool(POOL)


def test_cpu_capture_pool_markers_reach_the_replay():
    from pytest_rlhfmem.record.recorder import Recorder
    from pytest_rlhfmem.memory.replay import replay
    from pytest_rlhfmem.memory.trace import POOL_ENTER, POOL_EXIT, Trace

    rec = Recorder(device="cpu")
    rec._marks = [(POOL_ENTER, POOL), (POOL_EXIT, POOL)]  # what rec.mem_pool(POOL) records
    # (time_ns, seq, kind 0=alloc/free 1=mark, ptr or mark index, +size / -size)
    items = [(1000, 0, 0, 4096, 4 * MiB), (2000, 1, 1, 0, 0), (3000, 2, 0, 8192, 4 * MiB),
             (4000, 3, 0, 8192, -4 * MiB), (5000, 4, 1, 1, 0), (6000, 5, 0, 12288, 4 * MiB)]
    events = rec.cpu_events(items)
    assert [e.action for e in events] == ["alloc", POOL_ENTER, "alloc", "free", POOL_EXIT, "alloc"]
    result = replay(Trace(events=events))
    # the pool's segment served only the allocation made in it; the last one reuses the default segment
    assert sorted(s["segment_pool_id"] for s in result.segments) == [(0, 0), (0, 1)]
    assert len(result.segment_allocs) == 2 and result.final_allocated == 8 * MiB
