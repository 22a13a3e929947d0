"""The cases of shared/reference/caching-allocator.md (from PyTorch's test/test_cuda.py)."""

import pytest

from pytest_rlhfmem.memory.allocator import (
    MiB, AllocatorConfig, AllocatorConfigError, CachingAllocatorModel, OutOfMemoryError, alloc_conf_variable,
)


def model(conf: str = "", capacity: int | None = None) -> CachingAllocatorModel:
    return CachingAllocatorModel(AllocatorConfig.parse(conf), capacity=capacity)


@pytest.mark.parametrize(
    "conf, size, expected",
    [
        ("", 88_080_384, 88_080_384),  # 21 Mi float32
        ("roundup_power2_divisions:4", 88_080_384, 100_663_296),
        ("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]", 84 * MiB, 88 * MiB),
        ("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]", 400 * MiB, 512 * MiB),
        ("", 1, 512),
        ("", 513, 1024),
        ("roundup_power2_divisions:4", 64 * MiB, 64 * MiB),  # a power of 2 stays
    ],
)
def test_round_size(conf, size, expected):
    m = model(conf)
    assert m.round_size(size) == expected
    before = m.stats.allocated_bytes
    m.malloc(size)
    assert m.stats.allocated_bytes - before == expected


@pytest.mark.parametrize(
    "size, segments, reserved, reserved_after_empty_cache",
    [
        (512, 1, 2 * MiB, 2 * MiB),
        (1 * MiB, 2, 4 * MiB, 2 * MiB),
        (1 * MiB + 512, 1, 20 * MiB, 20 * MiB),
        (10 * MiB - 512, 2, 40 * MiB, 20 * MiB),
        (10 * MiB + 512, 3, 36 * MiB, 12 * MiB),
    ],
)
def test_clone_chain_segments(size, segments, reserved, reserved_after_empty_cache):
    m = model()
    blocks = [m.malloc(size) for _ in range(3)]
    assert len(m.segments) == segments
    assert m.stats.reserved_bytes == reserved
    for b in blocks[1:]:
        m.free(b)
    m.empty_cache()
    assert m.stats.reserved_bytes == reserved_after_empty_cache
    m.check_invariants()


def test_fraction_cap_with_max_split_size():
    m = model("max_split_size_mb:40", capacity=120 * MiB)
    blocks = [m.malloc(40 * MiB) for _ in range(3)]
    with pytest.raises(OutOfMemoryError):
        m.malloc(40 * MiB)
    assert m.stats.num_ooms == 1
    for b in blocks:
        m.free(b)
    big = m.malloc(120 * MiB)  # release_available_cached_blocks frees the three oversize blocks
    assert big.size == 120 * MiB and m.stats.reserved_bytes == 120 * MiB
    assert m.stats.num_alloc_retries == 1  # the earlier OOM went through the retry once
    m.check_invariants()


def test_retry_counts_and_releases_cached_segments():
    m = model(capacity=40 * MiB)
    a = m.malloc(15 * MiB)  # 16 MiB segment (2 MiB multiple)
    m.free(a)
    b = m.malloc(30 * MiB)  # cannot fit 16 + 30 > 40: release the free 16 MiB segment, retry
    assert m.stats.num_alloc_retries == 1 and m.stats.num_device_free == 1
    assert m.stats.reserved_bytes == 30 * MiB and b.size == 30 * MiB


def test_max_split_size_refuses_oversize_block_for_small_request():
    m = model("max_split_size_mb:40")
    big = m.malloc(60 * MiB)
    m.free(big)
    m.malloc(25 * MiB)  # < MS must not take the free 60 MiB block (>= MS): new segment
    assert m.stats.num_device_alloc == 2


def test_empty_cache_keeps_partly_used_segments():
    m = model()
    a, b = m.malloc(4 * MiB), m.malloc(4 * MiB)  # both in one 20 MiB segment
    m.free(a)
    m.empty_cache()
    assert m.stats.reserved_bytes == 20 * MiB
    m.free(b)
    m.empty_cache()
    assert m.stats.reserved_bytes == 0


def test_a_record_stream_block_leaves_the_stats_at_its_free_and_its_pool_at_the_completion():
    """CUDACachingAllocator.cpp ``free``: a block with ``stream_uses`` drops ``allocated_bytes`` at once and goes
    to ``insert_events``; ``process_events`` -> ``free_block`` returns it later. Meanwhile it is not reused, not
    merged, its segment not released, and ``_snapshot()`` shows it ``active_pending_free``."""
    m = model()
    a, b = m.malloc(4 * MiB), m.malloc(4 * MiB)  # one 20 MiB segment: a, b and 12 MiB free after them
    base = a.address
    m.request_free(a)
    assert (m.stats.allocated_bytes, m.stats.requested_bytes) == (4 * MiB, 4 * MiB)
    c = m.malloc(4 * MiB)  # best fit would take a's 4 MiB block at the lowest address if it were back
    assert c.address != base
    m.free(b)
    m.empty_cache()  # b's block merged with the free tail, but a and c hold the segment
    assert m.stats.reserved_bytes == 20 * MiB
    (seg,) = m.snapshot_segments()
    states = [blk["state"] for blk in seg["blocks"]]
    assert states == ["active_pending_free", "inactive", "active_allocated", "inactive"]
    assert (seg["allocated_size"], seg["active_size"]) == (4 * MiB, 8 * MiB)
    m.check_invariants()
    with pytest.raises(ValueError, match="double free"):
        m.request_free(a)
    m.free(a)  # the completion: the stats do not drop twice
    assert m.stats.allocated_bytes == 4 * MiB
    assert m.malloc(4 * MiB).address == base  # back in the pool: best fit's lowest address
    m.check_invariants()


@pytest.mark.parametrize(
    "conf, fragment",
    [
        ("bogus_key:1", "unknown alloc-conf key 'bogus_key'"),
        ("max_split_size_mb:abc", "max_split_size_mb='abc'"),
        ("max_split_size_mb:10", "must be > 20"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("roundup_power2_divisions:[64:3]", "power of 2"),
        ("garbage_collection_threshold:1.5", "strictly between 0.0 and 1.0"),
        ("expandable_segments:yes", "allowed values are True, False"),
        ("backend:cudaMallocAsync", "only 'native'"),
        ("max_split_size_mb", "is not 'key:value'"),
    ],
)
def test_alloc_conf_is_parsed_strictly(conf, fragment):
    with pytest.raises(AllocatorConfigError, match=None) as exc:
        AllocatorConfig.parse(conf)
    assert fragment in str(exc.value)


def test_alloc_conf_list_form_fills_like_the_cpp():
    c = AllocatorConfig.parse("roundup_power2_divisions:[64:8,256:4,>:1]")
    # first value fills buckets below 64 MiB; '>' fills from the last key's bucket (inclusive) on
    assert c.roundup_power2_divisions[:7] == (8,) * 7
    assert c.roundup_power2_divisions[7] == 0
    assert c.roundup_power2_divisions[8:] == (1,) * 8


def test_garbage_collection_threshold_frees_old_cached_blocks():
    m = model("garbage_collection_threshold:0.5", capacity=100 * MiB)
    blocks = [m.malloc(20 * MiB) for _ in range(3)]
    for b in blocks:
        m.free(b)
    m.malloc(30 * MiB)  # reserved 60 MiB > 50 MiB threshold: gc releases aged free blocks first
    assert m.stats.num_device_free >= 1
    assert m.stats.num_alloc_retries == 0
    m.check_invariants()


@pytest.mark.parametrize(("version", "conf", "variable"), [
    ("2.8.0", "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF"),  # before 2.9: the only name
    ("2.9.1+cu128", "max_split_size_mb:128", "PYTORCH_ALLOC_CONF"),
    ("2.9.1+cu128", "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF"),  # pytorch issue 183387
    ("2.10.0", "expandable_segments:True", "PYTORCH_ALLOC_CONF"),
    ("2.13.0+cpu", "garbage_collection_threshold:0.8", "PYTORCH_ALLOC_CONF"),
    (None, "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF"),  # unknown: the alias every version reads
])
def test_the_allocator_variable_a_pytorch_version_reads(version, conf, variable):
    assert alloc_conf_variable(version, conf)[0] == variable


def test_both_variable_names_are_accepted_as_settings():
    want = AllocatorConfig.parse("max_split_size_mb:128")
    for pasted in ("PYTORCH_ALLOC_CONF=max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:128'"):
        assert AllocatorConfig.parse(pasted).max_split_size == want.max_split_size == 128 * MiB
    # a snapshot of PyTorch >= 2.9 may carry the new name; it wins over the alias, as in AllocatorConfig.cpp
    both = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert AllocatorConfig.from_snapshot_settings(both).max_split_size == 64 * MiB
