"""A model of PyTorch's CUDA caching allocator, step for step.

Source followed: ``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/cuda/CUDAAllocatorConfig.cpp`` in
pytorch/pytorch (2.5-2.9), summarised in ``shared/reference/caching-allocator.md``. Names mirror the
C++ (``Block``, ``BlockPool``, ``round_size``, ``get_allocation_size``, ``get_free_block``,
``should_split``, ``alloc_found_block``, ``try_merge_blocks``, ``free_block``, ``alloc_block``,
``release_available_cached_blocks``, ``release_cached_blocks``, ``garbage_collect_cached_blocks``) so
that the two can be read side by side. Every size is in bytes.

What is modelled: the small and large pools, size rounding (including ``roundup_power2_divisions``),
segment sizing, best fit by (stream, size, address), splitting, merging on free, ``max_split_size_mb``,
``max_non_split_rounding_mb``, ``garbage_collection_threshold``, the whole miss path with its retry
(``num_alloc_retries``) and OOM (``num_ooms``) against a device capacity.

What is not: ``expandable_segments:True`` (refused by :class:`AllocatorConfig`), CUDA graph private
pools, and cross-stream ``record_stream`` events (a replay frees a block at ``free_completed``, the
moment the real allocator returned it to its pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from sortedcontainers import SortedList

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Constants of CUDACachingAllocator.cpp.
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1 * MiB  # largest "small" allocation is 1 MiB
kSmallBuffer = 2 * MiB  # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20 * MiB  # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10 * MiB  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 * MiB  # round up large allocations to 2 MiB
kRoundUpPowerOfTwoIntervals = 16  # buckets 1 MiB .. 32 GiB+ of roundup_power2_divisions

UNLIMITED = 2**63 - 1  # std::numeric_limits<size_t>::max() stand-in for max_split_size


class AllocatorConfigError(ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string the model cannot accept; the message names the key."""


class OutOfMemoryError(RuntimeError):
    """The modelled device could not satisfy a request (``torch.OutOfMemoryError``'s twin)."""


def _is_power_of_2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


_ALLOWED_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
)


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings that change device memory (``CUDAAllocatorConfig``).

    ``max_split_size`` and ``max_non_split_rounding_size`` are bytes; ``roundup_power2_divisions`` is
    the 16-bucket table indexed by ``clamp(floor(log2(size)) - 20, 0, 15)``.
    """

    max_split_size: int = UNLIMITED
    max_non_split_rounding_size: int = kLargeBuffer
    roundup_power2_divisions: tuple[int, ...] = (0,) * kRoundUpPowerOfTwoIntervals
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    source: str = ""

    @classmethod
    def parse(cls, conf: str | None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string strictly (``CUDAAllocatorConfig::parseArgs``).

        Raises :class:`AllocatorConfigError` naming the offending key and the allowed forms for an
        unknown key, a malformed value, or ``expandable_segments:True`` (not modelled).
        """
        if not conf or not conf.strip():
            return cls()
        kw: dict = {"source": conf}
        for item in _split_top_level(conf):
            if ":" not in item:
                raise AllocatorConfigError(
                    f"alloc-conf item {item!r} is not 'key:value'; allowed keys: {', '.join(_ALLOWED_KEYS)}"
                )
            key, value = (s.strip() for s in item.split(":", 1))
            if key == "max_split_size_mb":
                mb = _parse_int(key, value, "an integer number of MiB > 20")
                if mb <= kLargeBuffer // MiB:
                    raise AllocatorConfigError(f"max_split_size_mb={mb} too small: must be > 20 (MiB)")
                kw["max_split_size"] = mb * MiB
            elif key == "max_non_split_rounding_mb":
                mb = _parse_int(key, value, "an integer number of MiB >= 0")
                if mb < 0:
                    raise AllocatorConfigError(f"max_non_split_rounding_mb={mb} must be >= 0")
                kw["max_non_split_rounding_size"] = mb * MiB
            elif key == "roundup_power2_divisions":
                kw["roundup_power2_divisions"] = _parse_roundup_power2_divisions(value)
            elif key == "garbage_collection_threshold":
                try:
                    thr = float(value)
                except ValueError:
                    thr = -1.0
                if not 0.0 < thr < 1.0:
                    raise AllocatorConfigError(
                        f"garbage_collection_threshold={value!r}: must be a number strictly between 0.0 and 1.0"
                    )
                kw["garbage_collection_threshold"] = thr
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise AllocatorConfigError(f"expandable_segments={value!r}: allowed values are True, False")
                if value == "True":
                    raise AllocatorConfigError(
                        "expandable_segments:True is not modelled by pytest-rlhfmem's allocator model "
                        "(segments that grow page by page); replay with expandable_segments:False"
                    )
            elif key == "backend":
                if value != "native":
                    raise AllocatorConfigError(
                        f"backend={value!r}: only 'native' (the caching allocator) is modelled; "
                        "cudaMallocAsync is the driver's allocator"
                    )
            elif key in _ALLOWED_KEYS:
                pass  # host-side (pinned memory) or locking options: no effect on device memory
            else:
                raise AllocatorConfigError(
                    f"unknown alloc-conf key {key!r}; allowed keys: {', '.join(_ALLOWED_KEYS)}"
                )
        return cls(**kw)

    @classmethod
    def from_snapshot_settings(cls, settings: dict | None) -> AllocatorConfig:
        """Rebuild the config from a snapshot's ``allocator_settings`` (torch >= 2.3); ``None`` -> defaults."""
        if not settings:
            return cls()
        conf = settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""
        return cls.parse(conf)

    def roundup_divisions_for(self, size: int) -> int:
        """``CUDAAllocatorConfig::roundup_power2_divisions(size)``."""
        log_size = size.bit_length() - 1
        index = log_size - 20 if log_size > 20 else 0
        return self.roundup_power2_divisions[min(index, kRoundUpPowerOfTwoIntervals - 1)]


def _split_top_level(conf: str) -> list[str]:
    """Split on commas that are not inside ``[...]`` (the list form of roundup_power2_divisions)."""
    items, depth, cur = [], 0, []
    for ch in conf:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        items.append("".join(cur).strip())
    return [i for i in items if i]


def _parse_int(key: str, value: str, allowed: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise AllocatorConfigError(f"{key}={value!r}: expected {allowed}") from None


def _parse_roundup_power2_divisions(value: str) -> tuple[int, ...]:
    """Both forms: ``N`` (all buckets) or ``[64:8,256:4,>:1]`` (keys in MiB, powers of 2)."""
    allowed = "an integer power of 2 (or 0), or a list like [64:8,256:4,>:1] with power-of-2 MiB keys"
    table = [0] * kRoundUpPowerOfTwoIntervals
    if not value.startswith("["):
        n = _parse_int("roundup_power2_divisions", value, allowed)
        if n != 0 and not _is_power_of_2(n):
            raise AllocatorConfigError(f"roundup_power2_divisions={value!r}: expected {allowed}")
        return (n,) * kRoundUpPowerOfTwoIntervals
    if not value.endswith("]"):
        raise AllocatorConfigError(f"roundup_power2_divisions={value!r}: expected {allowed}")
    first_value, last_index = True, 0
    for pair in (p.strip() for p in value[1:-1].split(",") if p.strip()):
        if ":" not in pair:
            raise AllocatorConfigError(f"roundup_power2_divisions entry {pair!r}: expected {allowed}")
        k, v = (s.strip() for s in pair.split(":", 1))
        div = _parse_int("roundup_power2_divisions", v, allowed)
        if not _is_power_of_2(div):
            raise AllocatorConfigError(f"roundup_power2_divisions entry {pair!r}: divisions must be a power of 2")
        if k == ">":
            # Mirrors the C++: fills from last_index (inclusive) to the end.
            for i in range(last_index, kRoundUpPowerOfTwoIntervals):
                table[i] = div
            continue
        mb = _parse_int("roundup_power2_divisions", k, allowed)
        if not _is_power_of_2(mb):
            raise AllocatorConfigError(f"roundup_power2_divisions entry {pair!r}: interval must be a power of 2 (MiB)")
        index = min(mb.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
        if first_value:
            for i in range(index):
                table[i] = div
            first_value = False
        table[index] = div
        last_index = index
    return tuple(table)


# ---------------------------------------------------------------------------------------------
# Blocks and pools
# ---------------------------------------------------------------------------------------------


class Block:
    """A range of device memory inside one segment (``struct Block``).

    Blocks of a segment form a doubly linked list by address (``prev``/``next``); a segment's first
    block has ``prev is None``. ``size`` is the block's bytes; ``requested_size`` the caller's bytes.
    """

    __slots__ = ("stream", "pool", "address", "size", "requested_size", "allocated", "prev", "next", "gc_count_base")

    def __init__(self, stream: int, size: int, pool: BlockPool, address: int) -> None:
        self.stream = stream
        self.size = size
        self.requested_size = 0
        self.pool = pool
        self.address = address
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.gc_count_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self) -> tuple[int, int, int]:
        """The pool's ordering: ``BlockComparatorSize`` (stream, size, address)."""
        return (self.stream, self.size, self.address)

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        pool = "small" if self.pool.is_small else "large"
        return f"Block(addr=0x{self.address:x}, size={self.size}, {state}, pool={pool})"


class BlockPool:
    """Free blocks of one kind, ordered by (stream, size, address) (``struct BlockPool``)."""

    __slots__ = ("is_small", "blocks", "by_key", "get_free_blocks_call_count")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.blocks: SortedList = SortedList()  # keys (stream, size, address)
        self.by_key: dict[tuple[int, int, int], Block] = {}
        self.get_free_blocks_call_count = 0

    def insert_into_blocks(self, block: Block) -> None:
        k = (block.stream, block.size, block.address)
        self.blocks.add(k)
        self.by_key[k] = block

    def erase(self, block: Block) -> None:
        k = (block.stream, block.size, block.address)
        self.blocks.remove(k)
        del self.by_key[k]

    def ordered(self) -> list[Block]:
        """Free blocks in pool order (a copy: callers may mutate the pool)."""
        return [self.by_key[k] for k in self.blocks]


@dataclass
class SegmentEvent:
    """A cudaMalloc (``segment_alloc``) or cudaFree (``segment_free``) made by the model."""

    action: str  # "segment_alloc" | "segment_free"
    address: int
    size: int
    stream: int


@dataclass
class AllocatorStats:
    """The scalars of ``torch.cuda.memory_stats()`` that a replay needs (bytes, counts)."""

    allocated_bytes: int = 0  # sum of allocated blocks' sizes
    requested_bytes: int = 0  # sum of callers' requested sizes
    reserved_bytes: int = 0  # sum of segment sizes
    inactive_split_bytes: int = 0  # free bytes inside split segments: PyTorch's fragmentation figure
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0  # cudaMalloc calls
    num_device_free: int = 0  # cudaFree calls
    num_allocs: int = 0
    num_frees: int = 0


class CachingAllocatorModel:
    """One device's ``DeviceCachingAllocator``.

    Args:
        config: the allocator settings (see :meth:`AllocatorConfig.parse`).
        capacity: bytes the process may reserve (``set_per_process_memory_fraction`` x total memory,
            or the device's memory); ``None`` = unlimited. A cudaMalloc past it fails, which drives the
            retry path and, last, :class:`OutOfMemoryError`.
        on_segment_alloc / on_segment_free: observers called as ``(address, size, stream)`` right after
            the model's cudaMalloc / cudaFree; ``on_segment_alloc`` sees ``stats`` before the new
            segment is counted by the caller's allocation (reserved already includes it).
    """

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        capacity: int | None = None,
        on_segment_alloc: Callable[[int, int, int], None] | None = None,
        on_segment_free: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.config = config or AllocatorConfig()
        if self.config.expandable_segments:
            raise AllocatorConfigError("expandable_segments:True is not modelled")
        self.capacity = capacity
        self.small_blocks = BlockPool(is_small=True)
        self.large_blocks = BlockPool(is_small=False)
        self.active_blocks: dict[int, Block] = {}  # address -> allocated block
        self.segments: dict[int, Block] = {}  # segment base address -> its first block
        self.segment_sizes: dict[int, int] = {}
        self.stats = AllocatorStats()
        self.on_segment_alloc = on_segment_alloc
        self.on_segment_free = on_segment_free
        # Address source for new segments: replay may anchor them to recorded addresses.
        self._next_synthetic_address = 1 << 56  # far above real CUDA virtual addresses
        self.address_for_new_segment: Callable[[int], int | None] | None = None
        # Set by an anchored replay when the recorded run's first cudaMalloc for this request failed.
        self.fail_next_cuda_malloc = False

    # -- sizes ----------------------------------------------------------------------------------

    def round_size(self, size: int) -> int:
        """``round_size``: the block size a request of ``size`` bytes gets."""
        if size < kMinBlockSize:
            return kMinBlockSize
        divisions = self.config.roundup_divisions_for(size)
        if divisions > 1 and size > kMinBlockSize * divisions:
            return roundup_power2_next_division(size, divisions)
        return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)

    @staticmethod
    def get_allocation_size(size: int) -> int:
        """``get_allocation_size``: the cudaMalloc size for a (rounded) request."""
        if size <= kSmallSize:
            return kSmallBuffer
        if size < kMinLargeAlloc:
            return kLargeBuffer
        return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)

    def get_pool(self, size: int) -> BlockPool:
        return self.small_blocks if size <= kSmallSize else self.large_blocks

    # -- the allocation path ----------------------------------------------------------------------

    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        """``DeviceCachingAllocator::malloc``: returns the allocated block.

        Raises :class:`OutOfMemoryError` when the miss path cannot get memory; ``num_ooms`` counts it.
        """
        size = self.round_size(orig_size)
        pool = self.get_pool(size)
        alloc_size = self.get_allocation_size(size)
        block = self.get_free_block(pool, size, stream)
        if block is None:
            if self.config.garbage_collection_threshold > 0.0 and self.capacity is not None:
                self.garbage_collect_cached_blocks()
            block = (
                self.alloc_block(pool, alloc_size, stream, is_retry=False)
                or (self.release_available_cached_blocks(pool, size, stream)
                    and self.alloc_block(pool, alloc_size, stream, is_retry=False))
                or (self.release_cached_blocks()
                    and self.alloc_block(pool, alloc_size, stream, is_retry=True))
            )
            if not block:
                self.stats.num_ooms += 1
                raise OutOfMemoryError(
                    f"model OOM: tried to allocate {orig_size} bytes; reserved {self.stats.reserved_bytes}, "
                    f"allocated {self.stats.allocated_bytes}, capacity {self.capacity}"
                )
        return self.alloc_found_block(block, size, orig_size, self.should_split(block, size))

    def get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """``get_free_block``: the single best-fit candidate, subject to the max_split_size rules."""
        if self.config.garbage_collection_threshold > 0.0 and self.capacity is not None:
            pool.get_free_blocks_call_count += 1
        i = self._find_free_block(pool, size, stream)
        if i < 0:
            return None
        blocks = pool.blocks
        block = pool.by_key.pop(blocks[i])
        del blocks[i]
        return block

    def _find_free_block(self, pool: BlockPool, size: int, stream: int) -> int:
        """Position in ``pool.blocks`` of the block ``get_free_block`` would take, or -1."""
        blocks = pool.blocks
        i = blocks.bisect_left((stream, size, 0))
        if i == len(blocks):
            return -1
        k = blocks[i]
        if k[0] != stream:
            return -1
        ms = self.config.max_split_size
        if size < ms and k[1] >= ms:
            return -1
        if size >= ms and k[1] >= size + self.config.max_non_split_rounding_size:
            return -1
        return i

    def can_serve_from_cache(self, orig_size: int, stream: int = 0) -> bool:
        """Would ``malloc(orig_size)`` find a cached block now (no cudaMalloc)? Changes nothing."""
        size = self.round_size(orig_size)
        return self._find_free_block(self.get_pool(size), size, stream) >= 0

    def should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.is_small:
            return remaining >= kMinBlockSize
        return size < self.config.max_split_size and remaining > kSmallSize

    def alloc_found_block(self, block: Block, size: int, orig_size: int, split_remainder: bool) -> Block:
        """``alloc_found_block``: split off the low ``size`` bytes if asked, mark allocated."""
        st = self.stats
        already_split = block.is_split()
        if split_remainder:
            remaining = block
            block = Block(remaining.stream, size, remaining.pool, remaining.address)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                self.segments[block.address] = block
            block.next = remaining
            remaining.prev = block
            remaining.address += size
            remaining.size -= size
            remaining.pool.insert_into_blocks(remaining)
            if already_split:
                st.inactive_split_bytes -= block.size  # the remainder stays an inactive split
            else:
                st.inactive_split_bytes += remaining.size
        elif already_split:
            st.inactive_split_bytes -= block.size
        block.allocated = True
        block.requested_size = orig_size
        self.active_blocks[block.address] = block
        st.allocated_bytes += block.size
        st.requested_bytes += orig_size
        st.num_allocs += 1
        if st.allocated_bytes > st.peak_allocated_bytes:
            st.peak_allocated_bytes = st.allocated_bytes
        return block

    def alloc_block(self, pool: BlockPool, alloc_size: int, stream: int, is_retry: bool) -> Block | None:
        """``alloc_block``: one cudaMalloc of ``alloc_size`` bytes, or ``None`` if the device refuses."""
        st = self.stats
        if is_retry:
            st.num_alloc_retries += 1
        if self.fail_next_cuda_malloc:
            self.fail_next_cuda_malloc = False  # anchored replay: the recorded run failed here
            return None
        if self.capacity is not None and st.reserved_bytes + alloc_size > self.capacity:
            return None
        address = self.address_for_new_segment(alloc_size) if self.address_for_new_segment else None
        if address is None:
            address = self._next_synthetic_address
            self._next_synthetic_address += alloc_size + kRoundLarge
        block = Block(stream, alloc_size, pool, address)
        self.segments[address] = block
        self.segment_sizes[address] = alloc_size
        st.reserved_bytes += alloc_size
        st.num_device_alloc += 1
        if st.reserved_bytes > st.peak_reserved_bytes:
            st.peak_reserved_bytes = st.reserved_bytes
        if self.on_segment_alloc is not None:
            self.on_segment_alloc(address, alloc_size, stream)
        return block

    # -- the free path ----------------------------------------------------------------------------

    def free(self, block: Block) -> None:
        """``DeviceCachingAllocator::free`` with no outstanding stream events: ``free_block``."""
        if not block.allocated:
            raise ValueError(f"double free of {block!r}")
        del self.active_blocks[block.address]
        st = self.stats
        st.allocated_bytes -= block.size
        st.requested_bytes -= block.requested_size
        st.num_frees += 1
        block.allocated = False
        self.free_block(block)

    def free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours, reinsert into the pool."""
        st = self.stats
        pool = block.pool
        for candidate in (block.prev, block.next):
            subsumed = self.try_merge_blocks(block, candidate, pool)
            if subsumed:
                st.inactive_split_bytes -= subsumed
        pool.insert_into_blocks(block)
        block.gc_count_base = pool.get_free_blocks_call_count
        if block.is_split():
            st.inactive_split_bytes += block.size

    def try_merge_blocks(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        """``try_merge_blocks``: fold free ``src`` into ``dst``; returns the bytes subsumed (0 if none)."""
        if src is None or src.allocated:
            return 0
        if dst.prev is src:  # [src dst]
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                self.segments[dst.address] = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        subsumed = src.size
        dst.size += subsumed
        pool.erase(src)
        return subsumed

    # -- releasing cached memory -----------------------------------------------------------------

    def release_block(self, block: Block) -> None:
        """``release_block``: cudaFree a whole free segment."""
        block.pool.erase(block)
        del self.segments[block.address]
        del self.segment_sizes[block.address]
        st = self.stats
        st.reserved_bytes -= block.size
        st.num_device_free += 1
        if self.on_segment_free is not None:
            self.on_segment_free(block.address, block.size, block.stream)

    def release_blocks(self, pool: BlockPool) -> None:
        """``release_blocks``: every unsplit free block of ``pool``, in pool order."""
        for block in pool.ordered():
            if block.prev is None and block.next is None:
                self.release_block(block)

    def release_cached_blocks(self) -> bool:
        """``release_cached_blocks`` = ``torch.cuda.empty_cache()``: large pool, then small."""
        self.release_blocks(self.large_blocks)
        self.release_blocks(self.small_blocks)
        return True

    empty_cache = release_cached_blocks

    def release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: free oversize (>= max_split_size) blocks; only with MS set."""
        ms = self.config.max_split_size
        if ms == UNLIMITED:
            return False
        key_size = ms if size < ms else size
        blocks = pool.blocks
        i = blocks.bisect_left((stream, key_size, 0))
        if i == len(blocks) or blocks[i][0] != stream:
            if i == 0:
                return False
            total_released = 0
            i -= 1
            while total_released < key_size and blocks[i][1] >= ms and blocks[i][0] == stream:
                cur = pool.by_key[blocks[i]]
                is_first = i == 0
                if not is_first:
                    i -= 1
                total_released += cur.size
                self.release_block(cur)
                if is_first:
                    break
            if total_released < key_size:
                return False
        else:
            self.release_block(pool.by_key[blocks[i]])
        return True

    def garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: free unsplit large blocks older than the average age."""
        assert self.capacity is not None
        gc_threshold = int(self.config.garbage_collection_threshold * self.capacity)
        if self.stats.reserved_bytes <= gc_threshold:
            return
        target_size = self.stats.reserved_bytes - gc_threshold
        pool = self.large_blocks

        def gc_count(b: Block) -> int:
            return pool.get_free_blocks_call_count - b.gc_count_base

        freeable = [b for b in pool.ordered() if not b.is_split()]
        if not freeable:
            return
        total_age = sum(gc_count(b) for b in freeable)
        count = len(freeable)
        reclaimed, block_freed = 0, True
        while reclaimed < target_size and block_freed and count > 0:
            age_threshold = total_age / count
            block_freed = False
            for b in pool.ordered():
                if not b.is_split() and gc_count(b) >= age_threshold:
                    block_freed = True
                    reclaimed += b.size
                    total_age -= gc_count(b)
                    count -= 1
                    self.release_block(b)

    # -- state import / export -------------------------------------------------------------------

    def import_segment(
        self, address: int, total_size: int, stream: int, is_small: bool,
        live_blocks: list[tuple[int, int, int]] = (),  # type: ignore[assignment]
    ) -> None:
        """Recreate a segment that existed before a trace began.

        ``live_blocks`` are ``(address, size, requested_size)`` of blocks allocated at that moment, inside
        ``[address, address + total_size)``; the gaps between them become free (merged) blocks.
        Raises ``ValueError`` if a live block lies outside the segment or overlaps another.
        """
        pool = self.small_blocks if is_small else self.large_blocks
        st = self.stats
        self.segment_sizes[address] = total_size
        st.reserved_bytes += total_size
        st.peak_reserved_bytes = max(st.peak_reserved_bytes, st.reserved_bytes)
        cursor, prev = address, None
        end = address + total_size
        pieces: list[tuple[int, int, int | None]] = []
        for b_addr, b_size, b_req in sorted(live_blocks):
            if b_addr < cursor or b_addr + b_size > end:
                raise ValueError(f"live block 0x{b_addr:x}+{b_size} does not fit segment 0x{address:x}+{total_size}")
            if b_addr > cursor:
                pieces.append((cursor, b_addr - cursor, None))
            pieces.append((b_addr, b_size, b_req))
            cursor = b_addr + b_size
        if cursor < end:
            pieces.append((cursor, end - cursor, None))
        for p_addr, p_size, p_req in pieces:
            b = Block(stream, p_size, pool, p_addr)
            b.prev = prev
            if prev is not None:
                prev.next = b
            else:
                self.segments[address] = b
            prev = b
            if p_req is not None:
                b.allocated = True
                b.requested_size = p_req
                self.active_blocks[p_addr] = b
                st.allocated_bytes += p_size
                st.requested_bytes += p_req
        st.peak_allocated_bytes = max(st.peak_allocated_bytes, st.allocated_bytes)
        for blk in self._segment_blocks(address):
            if not blk.allocated:
                pool.insert_into_blocks(blk)
                if blk.is_split():
                    st.inactive_split_bytes += blk.size

    def _segment_blocks(self, address: int) -> list[Block]:
        out, b = [], self.segments[address]
        while b is not None:
            out.append(b)
            b = b.next
        return out

    def snapshot_segments(self) -> list[dict]:
        """The device's segments in ``torch.cuda.memory._snapshot()['segments']`` form, by address."""
        out = []
        for address in sorted(self.segments):
            blocks = self._segment_blocks(address)
            first = blocks[0]
            out.append({
                "device": 0,
                "address": address,
                "total_size": self.segment_sizes[address],
                "allocated_size": sum(b.size for b in blocks if b.allocated),
                "active_size": sum(b.size for b in blocks if b.allocated),
                "requested_size": sum(b.requested_size for b in blocks if b.allocated),
                "stream": first.stream,
                "segment_type": "small" if first.pool.is_small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": [
                    {"address": b.address, "size": b.size, "requested_size": b.requested_size if b.allocated else 0,
                     "state": "active_allocated" if b.allocated else "inactive", "frames": []}
                    for b in blocks
                ],
            })
        return out

    def check_invariants(self) -> None:
        """Assert the structural invariants (used by property tests); raises ``AssertionError``."""
        allocated = 0
        reserved = 0
        inactive_split = 0
        for address, first in self.segments.items():
            assert first.prev is None and first.address == address
            total, b, prev_free = 0, first, False
            while b is not None:
                assert b.address == address + total, "blocks are contiguous"
                total += b.size
                if b.allocated:
                    allocated += b.size
                    prev_free = False
                else:
                    assert not prev_free, "two adjacent free blocks"
                    prev_free = True
                    assert b.pool.by_key.get(b.key()) is b, "free block is in its pool"
                    if b.is_split():
                        inactive_split += b.size
                b = b.next
            assert total == self.segment_sizes[address]
            reserved += total
        assert allocated == self.stats.allocated_bytes
        assert reserved == self.stats.reserved_bytes
        assert inactive_split == self.stats.inactive_split_bytes
        assert len(self.small_blocks.blocks) + len(self.large_blocks.blocks) == sum(
            1 for f in self.segments.values() for b in _iter_chain(f) if not b.allocated)


def _iter_chain(b: Block | None):
    while b is not None:
        yield b
        b = b.next


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round up to the next 1/divisions step of size's power-of-2 range."""
    if _is_power_of_2(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division

