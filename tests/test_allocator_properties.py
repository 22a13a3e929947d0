"""Property tests on random traces: the allocator model's invariants hold after every step, with the
default allocator, with expandable_segments:True, and with allocations diverted to private pools."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_rlhfmem.memory.allocator import MiB, AllocatorConfig, CachingAllocatorModel, OutOfMemoryError

sizes = st.one_of(
    st.integers(1, 4096),  # tiny -> small pool, 512-byte blocks
    st.integers(4096, 1 * MiB),  # small pool
    st.integers(1 * MiB + 1, 10 * MiB),  # large pool, 20 MiB segments
    st.integers(10 * MiB, 64 * MiB),  # large pool, own segments
)
OPS = ["alloc", "alloc", "alloc", "free", "free", "empty_cache", "pool_enter", "pool_exit", "pool_release"]
ops = st.lists(st.tuples(st.sampled_from(OPS), sizes, st.integers(0, 10**6), st.integers(0, 1)),
               min_size=1, max_size=120)
confs = st.sampled_from(["", "max_split_size_mb:32", "roundup_power2_divisions:4",
                         "roundup_power2_divisions:[1:4,16:2,>:1],max_split_size_mb:48",
                         "expandable_segments:True", "expandable_segments:True,roundup_power2_divisions:4"])
POOLS = [(0, 1), (0, 2)]


def fully_free_releasable(m: CachingAllocatorModel) -> int:
    """Bytes empty_cache must return: fully free cudaMalloc'd segments and whole free mapped pages, in
    the default pools (unless allocations are being diverted to a pool: 2.6+ leaves them then) and in
    pools nobody holds."""
    total = 0
    releasable = [] if m.captures_underway else [m.large_blocks, m.small_blocks]
    for pp in m.graph_pools_freeable.values():
        releasable += [pp.large_blocks, pp.small_blocks]
    for pool in releasable:
        for b in pool.ordered():
            es = b.expandable_segment
            if es is None:
                if b.prev is None and b.next is None:
                    total += b.size
            else:
                first = -(-(b.address - es.ptr) // es.segment_size)
                last = (b.address + b.size - es.ptr) // es.segment_size
                total += max(0, last - first) * es.segment_size
    return total


@settings(max_examples=150, deadline=None)
@given(ops=ops, conf=confs, capacity=st.sampled_from([None, None, 160 * MiB]))
def test_invariants_hold_on_random_traces(ops, conf, capacity):
    m = CachingAllocatorModel(AllocatorConfig.parse(conf), capacity=capacity)
    live = []  # (block, pool it was allocated in)
    held: list[tuple[int, int]] = []  # pools a MemPool object still holds
    for op, size, pick, stream in ops:
        if op == "alloc":
            inside = m.captures_underway[0] if m.captures_underway else None
            try:
                b = m.malloc(size, stream)
            except OutOfMemoryError:
                continue
            owner = b.pool.owner_private_pool
            assert (owner.id if owner else None) == inside  # never in another pool's segment
            if b.expandable_segment is not None:  # its expandable segment belongs to the same pool
                head = m.segments[b.expandable_segment.ptr]
                assert b.pool is head.pool
            live.append(b)
        elif op == "free" and live:
            m.free(live.pop(pick % len(live)))
        elif op == "empty_cache":
            expected = fully_free_releasable(m)
            before = m.stats.reserved_bytes
            m.empty_cache()
            assert before - m.stats.reserved_bytes == expected  # exactly the releasable bytes
            assert fully_free_releasable(m) == 0  # no fully free segment or free mapped page left behind
        elif op == "pool_enter" and not m.captures_underway:
            pid = POOLS[pick % 2]
            if pid not in m.graph_pools:
                m.create_or_incref_pool(pid)
                held.append(pid)
            elif pid not in held:
                continue  # released pool: a MemPool is not reused after its destructor
            m.begin_allocate_to_pool(pid)
        elif op == "pool_exit" and m.captures_underway:
            pid = m.captures_underway[0]
            m.end_allocate_to_pool(pid)
            m.release_pool(pid)
        elif op == "pool_release" and held and not m.captures_underway:
            pid = held.pop(pick % len(held))
            m.release_pool(pid)
            m.empty_cache(pid)
        s = m.stats
        assert s.reserved_bytes >= s.allocated_bytes >= 0
        assert s.allocated_bytes == sum(b.size for b in live)
        m.check_invariants()  # contiguity, no two adjacent free blocks, pools hold exactly the free blocks
