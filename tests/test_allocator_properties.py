"""Property tests on random traces: the allocator model's invariants hold after every step."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_rlhfmem.memory.allocator import MiB, AllocatorConfig, CachingAllocatorModel

sizes = st.one_of(
    st.integers(1, 4096),  # tiny -> small pool, 512-byte blocks
    st.integers(4096, 1 * MiB),  # small pool
    st.integers(1 * MiB + 1, 10 * MiB),  # large pool, 20 MiB segments
    st.integers(10 * MiB, 64 * MiB),  # large pool, own segments
)
ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "empty_cache"]), sizes, st.integers(0, 10**6),
                         st.integers(0, 1)), min_size=1, max_size=120)
confs = st.sampled_from(["", "max_split_size_mb:32", "roundup_power2_divisions:4",
                         "roundup_power2_divisions:[1:4,16:2,>:1],max_split_size_mb:48"])


@settings(max_examples=150, deadline=None)
@given(ops=ops, conf=confs)
def test_invariants_hold_on_random_traces(ops, conf):
    m = CachingAllocatorModel(AllocatorConfig.parse(conf))
    live = []
    for op, size, pick, stream in ops:
        if op == "alloc":
            live.append(m.malloc(size, stream))
        elif op == "free" and live:
            m.free(live.pop(pick % len(live)))
        elif op == "empty_cache":
            fully_free = sum(m.segment_sizes[a] for a, first in m.segments.items()
                             if not first.allocated and first.next is None)
            before = m.stats.reserved_bytes
            m.empty_cache()
            assert before - m.stats.reserved_bytes == fully_free  # exactly the fully free segments
            assert all(first.allocated or first.next is not None for first in m.segments.values())
        st_ = m.stats
        assert st_.reserved_bytes >= st_.allocated_bytes >= 0
        assert st_.allocated_bytes == sum(b.size for b in live)
        m.check_invariants()  # includes: no two adjacent free blocks, pools hold exactly the free blocks
