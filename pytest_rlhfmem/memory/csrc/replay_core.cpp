// The compiled replay engine: memory/allocator.py's default pools and memory/replay.py's loop (both modes),
// function for function, for the 1M-events-per-second target of issue 9 (item 5).
//
// ONE source of behaviour: memory/allocator.py is the readable reference and the property tests
// (tests/test_replay_core.py) hold this file to it, metric for metric and cudaMalloc for cudaMalloc. Both
// follow c10/cuda/CUDACachingAllocator.cpp of pytorch/pytorch (2.5-2.9): the functions below keep
// PyTorch's names (malloc, get_free_block, should_split, alloc_found_block, alloc_block, free_block,
// try_merge_blocks, release_block, release_blocks, release_cached_blocks, release_available_cached_blocks,
// garbage_collect_cached_blocks, round_size, get_allocation_size, get_pool, create_or_incref_pool,
// begin_allocate_to_pool, end_allocate_to_pool, release_pool) and each names the Python method it mirrors.
// Every size is in bytes.
//
// What this engine covers (memory/replay_engine.py::engine_for says which replays take it and why):
// the small and large default pools, round_size with roundup_power2_divisions, max_split_size,
// max_non_split_rounding_size, garbage_collection_threshold, the miss path with its retry and OOM
// against a capacity, expandable segments (ExpandableSegment, find_expandable_block, map_block,
// try_allocate_expandable_block, unmap_block, release_expandable_segment), private pools (PrivatePool:
// POOL_ENTER / POOL_EXIT / POOL_RELEASE as python_engine.py drives them, release_cached_blocks(mempool_id)),
// FLUSH events and recorded empty_cache() batches (release_cached_blocks), anchored mode (recorded
// addresses, recorded cudaMalloc failures), segments that existed before the trace (in the default pools
// or a private one), record_stream's held blocks (FREE_REQUESTED: request_free, completed by the block's
// FREE), phase windows and the MetricsCollector figures; and the PyTorch 2.8-2.10 behaviours
// allocator.py selects by version (per_process_memory_fraction, computed in replay_engine.py as the capacity;
// try_mempool_fallback for use_on_oom pools, last in 2.8-2.9 and first from 2.10, PR 169699; no_split pools;
// the innermost use_mem_pool region from 2.10; empty_cache inside a region scoped to its pool in 2.6-2.7).
// Not covered (the Python model replays them): the per-event series and the replayed-events output.
//
// Interface: plain C functions for ctypes (no Python headers, no torch): rc_new (the settings by name: struct
// ReplaySettings), rc_set_pools, rc_import_segment, rc_run (returns an enum ReplayStatus), rc_result_size,
// rc_result_copy, rc_free, and rc_settings_layout (the struct's size and offsets, for the ctypes mirror's test).
// The result is one int64 array whose layout Model::result documents.

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

namespace {

using i64 = int64_t;

constexpr i64 MiB = 1024 * 1024;
constexpr i64 GiB = 1024 * MiB;
constexpr i64 DEFAULT_DEVICE_MEMORY = 80 * GiB;  // allocator.py: address space of an expandable segment
// Constants of CUDACachingAllocator.cpp (allocator.py's module constants).
constexpr i64 kMinBlockSize = 512;
constexpr i64 kSmallSize = 1 * MiB;
constexpr i64 kSmallBuffer = 2 * MiB;
constexpr i64 kLargeBuffer = 20 * MiB;
constexpr i64 kMinLargeAlloc = 10 * MiB;
constexpr i64 kRoundLarge = 2 * MiB;
constexpr int kRoundUpPowerOfTwoIntervals = 16;
constexpr i64 UNLIMITED = INT64_MAX;
constexpr i64 NONE = INT64_MIN;  // Python's None in the result array
// The replay's bounds (replay_types.py: MAX_REPLAY_BYTES, MAX_SEGMENT_ADDRESS, MAX_TIME_US, MAX_MODEL_ADDRESS;
// rc_bounds reports them for the test that holds the two alike). Within them no int64 sum below can overflow:
// one event adds at most three cudaMallocs (or their pages) of at most 2**48 + 40 MiB bytes each, so reserved,
// allocated and requested stay below 2**50 and addresses below 2**62 + 2**52.
constexpr i64 kMaxReplayBytes = (i64)1 << 48;     // a request, a segment, a capacity, the bytes reserved at once
constexpr i64 kMaxSegmentAddress = (i64)1 << 60;  // a recorded segment's address (anchored mode places blocks there)
constexpr i64 kMaxTimeUs = (i64)1 << 62;          // |time_us| of an event
constexpr i64 kMaxModelAddress = (i64)1 << 62;    // the next synthetic segment address

// -- containers (speed only: they change no decision) ---------------------------------------------

// A free-list allocator for the std::set nodes of the pools: a replay inserts and erases a node on almost
// every event, and the general-purpose heap dominated the profile.
struct FreeNode {
  FreeNode* next;
};

template <class T>
struct NodeAllocator {
  using value_type = T;
  FreeNode** head;  // the owning Model's free list (shared by its pools' sets)
  explicit NodeAllocator(FreeNode** h) : head(h) {}
  template <class U>
  NodeAllocator(const NodeAllocator<U>& o) : head(o.head) {}
  T* allocate(std::size_t n) {
    static_assert(sizeof(T) >= sizeof(FreeNode), "node too small");
    if (n == 1 && *head) {
      FreeNode* f = *head;
      *head = f->next;
      return reinterpret_cast<T*>(f);
    }
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) {
    if (n != 1) {
      ::operator delete(p);
      return;
    }
    FreeNode* f = reinterpret_cast<FreeNode*>(p);
    f->next = *head;
    *head = f;
  }
  template <class U>
  bool operator==(const NodeAllocator<U>& o) const { return head == o.head; }
  template <class U>
  bool operator!=(const NodeAllocator<U>& o) const { return head != o.head; }
};

// address -> Block*: open addressing, linear probing, backward-shift deletion (allocator.py's dicts
// ``active_blocks`` and replay.py's ``live``).
template <class V>
class FlatMap {
 public:
  FlatMap() { rehash(1024); }
  V* find(int64_t key) {
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      if (!used_[i]) return nullptr;
      if (keys_[i] == key) return &vals_[i];
    }
  }
  void put(int64_t key, V value) {
    if (2 * (size_ + 1) > keys_.size()) rehash(2 * keys_.size());
    std::size_t i = slot(key);
    for (; used_[i]; i = (i + 1) & mask_)
      if (keys_[i] == key) {
        vals_[i] = value;
        return;
      }
    used_[i] = 1;
    keys_[i] = key;
    vals_[i] = value;
    ++size_;
  }
  bool erase(int64_t key) {
    std::size_t i = slot(key);
    for (;; i = (i + 1) & mask_) {
      if (!used_[i]) return false;
      if (keys_[i] == key) break;
    }
    // backward shift: move later entries of the probe run into the hole
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask_; used_[j]; j = (j + 1) & mask_) {
      std::size_t home = slot(keys_[j]);
      bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        keys_[hole] = keys_[j];
        vals_[hole] = vals_[j];
        hole = j;
      }
    }
    used_[hole] = 0;
    --size_;
    return true;
  }

 private:
  std::size_t slot(int64_t key) const {
    return (std::size_t)(((uint64_t)key * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void rehash(std::size_t capacity) {
    std::vector<int64_t> keys = std::move(keys_);
    std::vector<V> vals = std::move(vals_);
    std::vector<uint8_t> used = std::move(used_);
    keys_.assign(capacity, 0);
    vals_.assign(capacity, V());
    used_.assign(capacity, 0);
    mask_ = capacity - 1;
    shift_ = 64 - __builtin_ctzll(capacity);
    size_ = 0;
    for (std::size_t i = 0; i < used.size(); ++i)
      if (used[i]) put(keys[i], vals[i]);
  }
  std::vector<int64_t> keys_;
  std::vector<V> vals_;
  std::vector<uint8_t> used_;
  std::size_t mask_ = 0, size_ = 0;
  int shift_ = 0;
};

// Action codes: the index of each action in memory/columns.py's ACTIONS.
enum Action : uint8_t {
  A_ALLOC = 0, A_FREE, A_SEGMENT_ALLOC, A_SEGMENT_FREE, A_SEGMENT_MAP, A_SEGMENT_UNMAP, A_OOM,
  A_POOL_ENTER, A_POOL_EXIT, A_POOL_RELEASE, A_PHASE, A_PHASE_END, A_FLUSH, A_FREE_REQUESTED,
  A_EXTERNAL_MAP, A_EXTERNAL_UNMAP,  // never reach the core: replay_engine.py's engine_for picks Python for them
  A_OTHER
};

// What rc_run returns: 0, or where the Python engine raises (replay_engine.py's ReplayStatus mirrors it and
// holds the messages).
enum ReplayStatus : int {
  RC_OK = 0,
  RC_DOUBLE_FREE = 1,                 // a block freed twice (ValueError)
  RC_POOL_ALREADY_RECORDING = 2,      // POOL_ENTER into a pool already recorded to (beginAllocateToPool)
  RC_POOL_RELEASED_WHILE_IN_USE = 3,  // an allocation diverted to a forgotten pool (get_pool's KeyError)
  RC_POOL_NOT_RECORDING = 4,          // POOL_EXIT of a pool not recorded to (endAllocateToPool)
  RC_POOL_UNKNOWN = 5,                // POOL_EXIT / POOL_RELEASE of an unknown pool (releasePool)
  // beyond the replay's bounds (kMaxReplayBytes ...): refused before anything replays, or where the model passes one
  RC_SIZE_OUT_OF_RANGE = 6,           // ALLOC / OOM / SEGMENT_ALLOC / SEGMENT_MAP size outside 0..kMaxReplayBytes
  RC_ADDRESS_OUT_OF_RANGE = 7,        // SEGMENT_ALLOC / SEGMENT_MAP address outside 0..kMaxSegmentAddress
  RC_TIME_OUT_OF_RANGE = 8,           // |time_us| above kMaxTimeUs (or a time delta sum that overflows)
  RC_RESERVED_OUT_OF_RANGE = 9,       // reserved bytes above kMaxReplayBytes after an ALLOC / OOM
  RC_ADDRESS_SPACE_EXHAUSTED = 10,    // the next synthetic segment address above kMaxModelAddress
  RC_CAPACITY_OUT_OF_RANGE = 11,      // the settings' capacity or device_total outside -kMaxReplayBytes..kMaxReplayBytes
  RC_SEGMENT_OUT_OF_RANGE = 12,       // a segment that existed before the trace outside the bounds (rc_import_segment)
};

struct BlockPool;
struct PrivatePool;

// MempoolId_t: (ev.addr, ev.size) of a POOL_* event; (0, 0) names the default pools (allocator.py: DEFAULT_POOL).
struct MempoolId {
  i64 first = 0, second = 0;
  bool operator==(const MempoolId& o) const { return first == o.first && second == o.second; }
  bool operator!=(const MempoolId& o) const { return !(*this == o); }
  bool operator<(const MempoolId& o) const { return first != o.first ? first < o.first : second < o.second; }
};
constexpr MempoolId DEFAULT_POOL{0, 0};

// Python's floor division and its ceiling twin (-(-a // b)), for b > 0.
inline i64 floordiv(i64 a, i64 b) { return a / b - ((a % b != 0) && (a < 0)); }
inline i64 ceildiv(i64 a, i64 b) { return -floordiv(-a, b); }

// struct ExpandableSegment (allocator.py: ExpandableSegment): a virtual range mapped page by page.
struct ExpandableSegment {
  i64 ptr, segment_size, max_handles, stream;
  std::vector<char> handles;  // handles[i]: page i mapped
  ExpandableSegment(i64 ptr_, i64 segment_size_, i64 address_space_size, i64 stream_)
      : ptr(ptr_), segment_size(segment_size_), max_handles(ceildiv(address_space_size, segment_size_)),
        stream(stream_) {}
  i64 size() const { return max_handles * segment_size; }
  // pages_to_map: [segmentLeft(ptr), segmentRight(ptr + size))
  i64 first_page(i64 p) const { return floordiv(p - ptr, segment_size); }
  i64 end_page(i64 p, i64 size) const { return ceildiv(p + size - ptr, segment_size); }
  // map: returns the mapped (ptr, size)
  std::pair<i64, i64> map(i64 p, i64 size) {
    i64 begin = first_page(p), end = end_page(p, size);
    if ((i64)handles.size() < end) handles.resize(end, 0);
    for (i64 i = begin; i < end; ++i) handles[i] = 1;
    return {ptr + begin * segment_size, (end - begin) * segment_size};
  }
  // unmap: every page wholly inside [p, p + size); returns the unmapped (ptr, size)
  std::pair<i64, i64> unmap(i64 p, i64 size) {
    i64 begin = ceildiv(p - ptr, segment_size), end = floordiv(p + size - ptr, segment_size);
    if (begin >= end) return {p, 0};
    for (i64 i = begin; i < end; ++i) handles[i] = 0;
    while (!handles.empty() && !handles.back()) handles.pop_back();  // trimHandles
    return {ptr + begin * segment_size, (end - begin) * segment_size};
  }
};

// struct Block (allocator.py: Block).
struct Block {
  i64 stream, size, requested_size = 0, address;
  BlockPool* pool;
  bool allocated = false;
  // freed by the program while other streams still use it (request_free): out of the stats, not yet back in
  // its pool; allocated stays true so that no merge, reuse or release touches it before free() completes it
  bool held = false;
  bool mapped = true;
  ExpandableSegment* expandable_segment = nullptr;
  Block* prev = nullptr;
  Block* next = nullptr;
  i64 gc_count_base = 0;
  i64 serial = 0;  // which life of this (recycled) object: a reference from before a reuse is stale
  Block(i64 stream_, i64 size_, BlockPool* pool_, i64 address_)
      : stream(stream_), size(size_), address(address_), pool(pool_) {}
  bool is_split() const { return prev != nullptr || next != nullptr; }
  // Block::splice: insert this block between before and after
  void splice(Block* before, Block* after) {
    if (before) before->next = this;
    prev = before;
    if (after) after->prev = this;
    next = after;
  }
};

// BlockComparatorSize: (stream, size, address), as BlockPool.blocks is sorted in allocator.py.
struct BlockComparatorSize {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->address < b->address;
  }
};

// BlockComparatorAddress: (stream, address), the order of the unmapped blocks.
struct BlockComparatorAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->address < b->address;
  }
};

// struct BlockPool (allocator.py: BlockPool; insert_into_blocks / erase / insert_unmapped / erase_unmapped).
// owner_private_pool: the PrivatePool it belongs to, nullptr for the default pools.
struct BlockPool {
  bool is_small;
  PrivatePool* owner_private_pool = nullptr;
  std::set<Block*, BlockComparatorSize, NodeAllocator<Block*>> blocks;
  std::set<Block*, BlockComparatorAddress, NodeAllocator<Block*>> unmapped;
  i64 get_free_blocks_call_count = 0;
  BlockPool(bool small, FreeNode** nodes)
      : is_small(small), blocks(BlockComparatorSize(), NodeAllocator<Block*>(nodes)),
        unmapped(BlockComparatorAddress(), NodeAllocator<Block*>(nodes)) {}
  void insert_into_blocks(Block* b) {
    blocks.insert(b);
    b->gc_count_base = get_free_blocks_call_count;
  }
  void erase(Block* b) { blocks.erase(b); }
  void insert_unmapped(Block* b) { unmapped.insert(b); }
  void erase_unmapped(Block* b) { unmapped.erase(b); }
};

// struct PrivatePool (allocator.py: PrivatePool): the BlockPools of one torch.cuda.MemPool or graph pool.
// use_count: its holders (the pool object, each open use_mem_pool region); cudaMalloc_count: its segments
// (or page mappings) not yet returned.
struct PrivatePool {
  MempoolId id;
  i64 use_count = 1;
  i64 cudaMalloc_count = 0;
  BlockPool large_blocks, small_blocks;
  PrivatePool(MempoolId id_, FreeNode** nodes) : id(id_), large_blocks(false, nodes), small_blocks(true, nodes) {
    large_blocks.owner_private_pool = this;
    small_blocks.owner_private_pool = this;
  }
};

// AllocatorStats (allocator.py).
struct Stats {
  i64 allocated_bytes = 0, requested_bytes = 0, reserved_bytes = 0, inactive_split_bytes = 0;
  i64 peak_allocated_bytes = 0, peak_reserved_bytes = 0, num_alloc_retries = 0, num_ooms = 0;
  i64 num_device_alloc = 0, num_device_free = 0, num_allocs = 0, num_frees = 0;
};

// WindowMetrics (metrics.py); optional fields hold NONE.
struct Window {
  i64 peak_reserved = 0, peak_allocated = 0, fragmentation_at_peak = NONE, max_fragmentation = 0;
  i64 inactive_split_at_peak = NONE, cuda_malloc_count = 0, cuda_free_count = 0, alloc_retries = 0, ooms = 0;
  i64 events = 0, start_us = 0, end_us = 0, phase_event = -1;  // phase_event: index of its PHASE event
};
constexpr int kWindowFields = 13;

// MetricsCollector (metrics.py) without the series (a replay recording series takes the Python engine).
struct Collector {
  Window total;
  std::vector<Window> phases;
  Window* current = nullptr;
  i64 peak_phase = -1;  // index into phases, -1 = None

  void begin_phase(i64 phase_event, i64 reserved, i64 allocated, i64 time_us) {
    if (current) current->end_us = time_us;
    Window w;
    w.peak_reserved = reserved;
    w.peak_allocated = allocated;
    w.start_us = w.end_us = time_us;
    w.phase_event = phase_event;
    phases.push_back(w);
    current = &phases.back();
    if (total.start_us == 0) total.start_us = time_us;
  }
  void on_cuda_malloc(i64 size, i64 reserved_after, i64 allocated, i64 inactive_split) {
    i64 frag = reserved_after - size - allocated;
    if (reserved_after > total.peak_reserved) peak_phase = current ? (i64)phases.size() - 1 : -1;
    for (Window* w : {&total, current}) {
      if (!w) continue;
      w->cuda_malloc_count += 1;
      if (frag > w->max_fragmentation) w->max_fragmentation = frag;
      if (reserved_after > w->peak_reserved) {
        w->peak_reserved = reserved_after;
        w->fragmentation_at_peak = frag;
        w->inactive_split_at_peak = inactive_split;
      }
    }
  }
  void on_cuda_free() {
    total.cuda_free_count += 1;
    if (current) current->cuda_free_count += 1;
  }
  void on_retry_or_oom(i64 retries, i64 ooms) {
    for (Window* w : {&total, current}) {
      if (!w) continue;
      w->alloc_retries += retries;
      w->ooms += ooms;
    }
  }
  void after_event(i64 allocated, i64 time_us) {
    for (Window* w : {&total, current}) {
      if (!w) continue;
      w->events += 1;
      if (allocated > w->peak_allocated) w->peak_allocated = allocated;
      if (time_us) w->end_us = time_us;
    }
  }
};

// One cudaMalloc/cudaFree decision, in order: kind 0 = segment_alloc, 1 = segment_free opening a batch,
// 2 = segment_free continuing the batch, 3 = segment_map, 4 = segment_unmap (replay.py's segment_allocs,
// segment_free_batches, segment_maps, segment_unmaps).
struct Decision { i64 kind, address, size; };

struct FlushRecord { i64 event, phase, released_bytes, segments_released, requested_before, requested_after; };

// CachingAllocatorModel (allocator.py) for one device, plus replay.py's loop state.
struct Model {
  // config
  i64 max_split_size = UNLIMITED, max_non_split_rounding_size = kLargeBuffer;
  i64 roundup_power2_divisions[kRoundUpPowerOfTwoIntervals] = {0};
  bool power2_rounding = false;
  double garbage_collection_threshold = 0.0;
  bool expandable_segments = false;
  i64 capacity = 0;
  bool has_capacity = false;  // false = unlimited (None)
  // allocator.py's device_total: the device's bytes before per_process_memory_fraction (capacity is after it);
  // an expandable segment reserves 1 1/8 of it.
  i64 device_total = 0;
  bool has_device_total = false;
  bool has_allowed_memory_maximum = false;  // a per_process_memory_fraction below 1.0: capacity is that cap
  // Version-selected behaviours (allocator.py: AllocatorConfig.since): get_pool takes the innermost region
  // (2.10, PR 168382); use_on_oom pools before release_available_cached_blocks (2.10, PR 169699); empty_cache
  // inside a use_mem_pool region scoped to that region's pool (2.6-2.7, PR 133602, until PR 154042).
  bool innermost_pool = true, use_on_oom_before_release = true, empty_cache_scoped_to_region = false;
  std::vector<MempoolId> use_on_oom_pools;  // AllocatorConfig.use_on_oom_pools, in the order tried
  std::vector<MempoolId> no_split_pools;    // AllocatorConfig.no_split_pools (MemPool(no_split=True), 2.10)

  FreeNode* free_nodes = nullptr;  // spare set nodes (NodeAllocator); released with the pools below
  BlockPool small_blocks{true, &free_nodes}, large_blocks{false, &free_nodes};
  FlatMap<Block*> active_blocks;  // model address -> allocated block
  Stats st;
  i64 next_synthetic_address = (i64)1 << 56;
  std::vector<Block*> all_blocks;  // ownership (freed at rc_free)
  std::vector<Block*> spare_blocks;  // blocks a merge subsumed (PyTorch deletes them), reused by new_block
  i64 block_serial = 0;
  std::vector<ExpandableSegment*> all_expandable_segments;  // ownership (freed at rc_free)
  i64 n_expandable_segments = 0;  // allocator.py: len(self.expandable_segments)
  // Private pools. A pool the Python model forgets (del graph_pools[id]) may still be named by blocks of its
  // expandable segments, so every PrivatePool lives until rc_free; graph_pools maps the ids in use.
  std::vector<std::unique_ptr<PrivatePool>> all_private_pools;  // ownership
  std::map<MempoolId, PrivatePool*> graph_pools;
  std::vector<std::pair<MempoolId, PrivatePool*>> graph_pools_freeable;  // in insertion order, as the dict
  std::vector<MempoolId> captures_underway;  // pools allocations are diverted to
  bool pool_gone = false;  // get_pool found no pool for captures_underway[0] (the Python model's KeyError)

  // replay state
  Collector collector;
  std::vector<Decision> decisions;
  bool last_was_free = false;
  std::vector<FlushRecord> flushes;
  std::vector<i64> flush_points;
  std::vector<i64> requested_at_end;  // pairs (phase window index, requested bytes)
  i64 unmatched_frees = 0, oom_mismatches = 0, flush_frees = 0, error = 0, error_event = -1;
  bool bad_import = false;  // rc_import_segment was given a segment beyond the bounds: rc_run refuses

  ~Model() {
    all_private_pools.clear();  // their set nodes join the free list, freed below
    for (Block* b : all_blocks) delete b;
    for (ExpandableSegment* es : all_expandable_segments) delete es;
    for (BlockPool* pool : {&small_blocks, &large_blocks}) {  // their nodes join the free list, freed next
      pool->blocks.clear();
      pool->unmapped.clear();
    }
    while (free_nodes) {
      FreeNode* f = free_nodes;
      free_nodes = f->next;
      ::operator delete(f);
    }
  }
  Block* new_block(i64 stream, i64 size, BlockPool* pool, i64 address) {
    if (!spare_blocks.empty()) {
      Block* b = spare_blocks.back();
      spare_blocks.pop_back();
      *b = Block(stream, size, pool, address);
      b->serial = ++block_serial;
      return b;
    }
    Block* b = new Block(stream, size, pool, address);
    b->serial = ++block_serial;
    all_blocks.push_back(b);
    return b;
  }

  // -- sizes (allocator.py: round_size, get_allocation_size, get_pool) ----------------------------

  static bool is_power_of_2(i64 v) { return v > 0 && (v & (v - 1)) == 0; }
  static int bit_length(i64 v) { return v <= 0 ? 0 : 64 - __builtin_clzll((unsigned long long)v); }

  // roundup_power2_next_division
  static i64 roundup_power2_next_division(i64 size, i64 divisions) {
    if (is_power_of_2(size)) return size;
    i64 power2_floor = (i64)1 << (bit_length(size) - 1);
    i64 power2_division = power2_floor >> (bit_length(divisions) - 1);
    if (power2_division == 0) return power2_floor << 1;
    i64 round_size_floor = size & ~(power2_division - 1);
    return round_size_floor == size ? size : round_size_floor + power2_division;
  }

  // AllocatorConfig.roundup_divisions_for
  i64 roundup_divisions_for(i64 size) const {
    int log_size = bit_length(size) - 1;
    int index = log_size > 20 ? log_size - 20 : 0;
    if (index > kRoundUpPowerOfTwoIntervals - 1) index = kRoundUpPowerOfTwoIntervals - 1;
    return roundup_power2_divisions[index];
  }

  // round_size
  i64 round_size(i64 size) const {
    if (size < kMinBlockSize) return kMinBlockSize;
    if (power2_rounding) {
      i64 divisions = roundup_divisions_for(size);
      if (divisions > 1 && size > kMinBlockSize * divisions) return roundup_power2_next_division(size, divisions);
    }
    return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
  }

  // get_allocation_size
  static i64 get_allocation_size(i64 size) {
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return kLargeBuffer;
    return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
  }

  // get_pool: a private pool's BlockPool while allocations are diverted to one (captures_underway[0]), else
  // the default small or large pool. nullptr (pool_gone set) where the Python model raises KeyError: the
  // pool allocations go to was forgotten (a pool revived after release_pool, then emptied).
  BlockPool* get_pool(i64 size) {
    if (!captures_underway.empty()) {
      auto it = graph_pools.find(innermost_pool ? captures_underway.back() : captures_underway[0]);
      if (it == graph_pools.end()) {
        pool_gone = true;
        return nullptr;
      }
      PrivatePool* pp = it->second;
      return size <= kSmallSize ? &pp->small_blocks : &pp->large_blocks;
    }
    return size <= kSmallSize ? &small_blocks : &large_blocks;
  }

  // -- private pools (allocator.py: the same names) ----------------------------------------------

  // create_or_incref_pool: a new pool starts at use_count 1 (MemPool construction).
  PrivatePool* create_or_incref_pool(MempoolId pool_id) {
    auto it = graph_pools.find(pool_id);
    if (it != graph_pools.end()) {
      it->second->use_count += 1;
      return it->second;
    }
    all_private_pools.push_back(std::make_unique<PrivatePool>(pool_id, &free_nodes));
    PrivatePool* pp = all_private_pools.back().get();
    graph_pools[pool_id] = pp;
    return pp;
  }

  // begin_allocate_to_pool (use_mem_pool entry); false where the Python model raises ValueError (already
  // recording to that pool).
  bool begin_allocate_to_pool(MempoolId pool_id) {
    if (std::find(captures_underway.begin(), captures_underway.end(), pool_id) != captures_underway.end())
      return false;
    create_or_incref_pool(pool_id);
    captures_underway.push_back(pool_id);
    return true;
  }

  // end_allocate_to_pool; false where the Python model raises ValueError (not recording to that pool).
  bool end_allocate_to_pool(MempoolId pool_id) {
    auto it = std::find(captures_underway.begin(), captures_underway.end(), pool_id);
    if (it == captures_underway.end()) return false;
    captures_underway.erase(it);
    return true;
  }

  // release_pool: drop one holder; at use_count 0 release_cached_blocks may return the pool's memory. false
  // where the Python model raises ValueError (no such pool).
  bool release_pool(MempoolId pool_id) {
    auto it = graph_pools.find(pool_id);
    if (it == graph_pools.end()) return false;
    PrivatePool* pp = it->second;
    pp->use_count -= 1;
    if (pp->use_count == 0) {  // graph_pools_freeable[pool_id] = pp: a present key keeps its place
      auto f = std::find_if(graph_pools_freeable.begin(), graph_pools_freeable.end(),
                            [&](const std::pair<MempoolId, PrivatePool*>& e) { return e.first == pool_id; });
      if (f != graph_pools_freeable.end()) {
        f->second = pp;
      } else {
        graph_pools_freeable.emplace_back(pool_id, pp);
      }
    }
    return true;
  }

  bool gc_enabled() const { return garbage_collection_threshold > 0.0 && has_capacity; }

  // -- the allocation path ----------------------------------------------------------------------

  // malloc: returns the allocated block, or nullptr for an OOM (allocator.py raises OutOfMemoryError).
  // use_on_oom pools: last in 2.8-2.9 (PR 151487), right after the first cudaMalloc fails from 2.10 (PR 169699).
  Block* malloc(i64 orig_size, i64 stream) {
    i64 size = round_size(orig_size);
    BlockPool* pool_p = get_pool(size);
    if (!pool_p) return nullptr;  // pool_gone: the caller stops the replay
    BlockPool& pool = *pool_p;
    i64 alloc_size = get_allocation_size(size);
    Block* block = get_free_block(pool, size, stream);
    int expandable_rule = -1;  // should_split's rule: -1 the config's; 0 for a use_on_oom block from 2.10
    if (!block) {
      if (gc_enabled()) garbage_collect_cached_blocks();
      bool fallback = !use_on_oom_pools.empty() && !pool.owner_private_pool;
      bool early = fallback && use_on_oom_before_release;
      block = alloc_block(pool, size, alloc_size, stream, false);
      if (!block && early) {
        block = try_mempool_fallback(size, stream);
        if (block) expandable_rule = 0;  // mempool_params: expandable segments off
      }
      if (!block && release_available_cached_blocks(pool, size, stream))
        block = alloc_block(pool, size, alloc_size, stream, false);
      if (!block && captures_underway.empty() && release_cached_blocks())  // no release-and-retry in a pool
        block = alloc_block(pool, size, alloc_size, stream, true);
      if (!block && fallback && !early) block = try_mempool_fallback(size, stream);
      if (!block) {
        st.num_ooms += 1;
        return nullptr;
      }
    }
    return alloc_found_block(block, size, orig_size, should_split(block, size, expandable_rule));
  }

  bool is_freeable(MempoolId pool_id) const {
    return std::find_if(graph_pools_freeable.begin(), graph_pools_freeable.end(),
                        [&](const std::pair<MempoolId, PrivatePool*>& e) { return e.first == pool_id; }) !=
           graph_pools_freeable.end();
  }

  // try_mempool_fallback: a cached block from the first use_on_oom pool that has one (get_free_block only),
  // skipping pools not created yet or already destroyed; nullptr if none.
  Block* try_mempool_fallback(i64 size, i64 stream) {
    for (const MempoolId& pool_id : use_on_oom_pools) {
      auto it = graph_pools.find(pool_id);
      if (it == graph_pools.end() || is_freeable(pool_id)) continue;
      PrivatePool* pp = it->second;
      // 2.10: mempool_params with is_expandable_segments_active false (expandable blocks are passed over)
      Block* block = get_free_block(size <= kSmallSize ? pp->small_blocks : pp->large_blocks, size, stream,
                                    use_on_oom_before_release ? 0 : -1);
      if (block) return block;
    }
    return nullptr;
  }

  // _find_free_block: the block get_free_block would take, or end(). expandable_rule: -1 = the config's
  // expandable_segments (AllocParams.is_expandable_segments_active), 0/1 given (0: a 2.10 use_on_oom search).
  using BlockSet = std::set<Block*, BlockComparatorSize, NodeAllocator<Block*>>;
  BlockSet::iterator find_free_block(BlockPool& pool, i64 size, i64 stream, int expandable_rule = -1) {
    Block key(stream, size, &pool, 0);
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != stream) return pool.blocks.end();
    bool active = expandable_rule < 0 ? expandable_segments : expandable_rule != 0;
    if (n_expandable_segments && (*it)->expandable_segment && active) {
      // A free block followed by unmapped space counts as the size it can expand to.
      auto expandable_size = [](const Block* b) {
        return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
      };
      auto j = std::next(it);
      while ((*it)->expandable_segment && j != pool.blocks.end() && (*j)->stream == stream &&
             expandable_size(*j) < expandable_size(*it)) {
        it = j;
        ++j;
      }
    } else if (n_expandable_segments && (*it)->expandable_segment) {  // not active: only ordinary blocks
      do {
        ++it;
      } while (it != pool.blocks.end() && (*it)->expandable_segment && (*it)->stream == stream);
      if (it == pool.blocks.end() || (*it)->stream != stream) return pool.blocks.end();
    }
    i64 found = (*it)->size;
    if (size < max_split_size && found >= max_split_size) return pool.blocks.end();
    if (size >= max_split_size && found >= size + max_non_split_rounding_size) return pool.blocks.end();
    return it;
  }

  // get_free_block
  Block* get_free_block(BlockPool& pool, i64 size, i64 stream, int expandable_rule = -1) {
    if (gc_enabled()) pool.get_free_blocks_call_count += 1;
    auto it = find_free_block(pool, size, stream, expandable_rule);
    if (it == pool.blocks.end()) return nullptr;
    Block* b = *it;
    pool.blocks.erase(it);
    return b;
  }

  // can_serve_from_cache
  bool can_serve_from_cache(i64 orig_size, i64 stream) {
    i64 size = round_size(orig_size);
    BlockPool* pool = get_pool(size);
    if (!pool) return false;  // pool_gone: the caller stops the replay
    return find_free_block(*pool, size, stream) != pool->blocks.end();
  }

  // should_split: never in a no_split pool; expandable_rule -1 = the config's expandable_segments, 0/1 given.
  bool should_split(const Block* block, i64 size, int expandable_rule = -1) const {
    if (block->pool->owner_private_pool && !no_split_pools.empty() &&
        std::find(no_split_pools.begin(), no_split_pools.end(), block->pool->owner_private_pool->id) !=
            no_split_pools.end())
      return false;
    i64 remaining = block->size - size;
    bool expandable = expandable_rule < 0 ? expandable_segments : expandable_rule != 0;
    if (block->pool->is_small || expandable) return remaining >= kMinBlockSize;
    return size < max_split_size && remaining > kSmallSize;
  }

  // alloc_found_block
  Block* alloc_found_block(Block* block, i64 size, i64 orig_size, bool split_remainder) {
    bool already_split = block->is_split();
    bool expandable = block->expandable_segment != nullptr;  // inactive_split_bytes leaves these out
    if (split_remainder) {
      Block* remaining = block;
      block = new_block(remaining->stream, size, remaining->pool, remaining->address);
      block->expandable_segment = remaining->expandable_segment;
      block->prev = remaining->prev;
      if (block->prev) block->prev->next = block;
      block->next = remaining;
      remaining->prev = block;
      remaining->address += size;
      remaining->size -= size;
      remaining->pool->insert_into_blocks(remaining);
      if (already_split && !expandable) {
        st.inactive_split_bytes -= block->size;
      } else if (!expandable) {
        st.inactive_split_bytes += remaining->size;
      }
    } else if (already_split && !expandable) {
      st.inactive_split_bytes -= block->size;
    }
    block->allocated = true;
    block->requested_size = orig_size;
    active_blocks.put(block->address, block);
    st.allocated_bytes += block->size;
    st.requested_bytes += orig_size;
    st.num_allocs += 1;
    if (st.allocated_bytes > st.peak_allocated_bytes) st.peak_allocated_bytes = st.allocated_bytes;
    return block;
  }

  // replay.py's anchor(): in anchored mode a new segment takes the address of the recorded segment_alloc
  // of the same size (the first one pending; a different size anchors nothing), a new expandable segment
  // (size < 0 here, None in Python) that of the first pending segment_map. Returns false for no anchor.
  struct Pending {
    i64 addr, size;
    bool is_map;
  };
  std::vector<Pending> pending_anchor;
  bool anchored = false;
  bool fail_next_cuda_malloc = false;  // anchored: the recorded run's first cudaMalloc for this request failed

  bool anchor(i64 size, i64* address) {
    for (std::size_t k = 0; k < pending_anchor.size(); ++k) {
      const Pending& p = pending_anchor[k];
      if (size < 0 && p.is_map) {
        *address = p.addr;
        pending_anchor.erase(pending_anchor.begin() + k);
        return true;
      }
      if (size >= 0 && !p.is_map) {
        if (p.size != size) return false;
        *address = p.addr;
        pending_anchor.erase(pending_anchor.begin() + k);
        return true;
      }
    }
    return false;
  }

  // _new_address: the anchor when anchored and one matches, else a synthetic address far above real ones.
  // size: the cudaMalloc size, or -1 for a new expandable segment's virtual base.
  i64 new_address(i64 size, i64 span) {
    i64 address;
    if (anchored && anchor(size, &address)) return address;
    address = next_synthetic_address;
    next_synthetic_address += span + kRoundLarge;
    return address;
  }

  // alloc_block: one cudaMalloc of alloc_size bytes; nullptr if the device refuses.
  Block* alloc_block(BlockPool& pool, i64 size, i64 alloc_size, i64 stream, bool is_retry) {
    if (is_retry) st.num_alloc_retries += 1;
    if (fail_next_cuda_malloc) {
      fail_next_cuda_malloc = false;  // anchored replay: the recorded run failed here
      return nullptr;
    }
    // allowed_memory_maximum: checked against the cudaMalloc size, before an expandable segment's pages
    if (has_allowed_memory_maximum && st.reserved_bytes + alloc_size > capacity) return nullptr;
    if (expandable_segments) {
      Block* block = try_allocate_expandable_block(stream, pool, size);
      if (block && pool.owner_private_pool) pool.owner_private_pool->cudaMalloc_count += 1;
      return block;
    }
    if (has_capacity && st.reserved_bytes + alloc_size > capacity) return nullptr;
    if (pool.owner_private_pool) pool.owner_private_pool->cudaMalloc_count += 1;
    i64 address = new_address(alloc_size, alloc_size);
    Block* block = new_block(stream, alloc_size, &pool, address);
    st.reserved_bytes += alloc_size;
    st.num_device_alloc += 1;
    if (st.reserved_bytes > st.peak_reserved_bytes) st.peak_reserved_bytes = st.reserved_bytes;
    on_segment_alloc(address, alloc_size);
    return block;
  }

  // -- expandable segments (allocator.py: the same names) --------------------------------------

  // find_expandable_block: the lowest-address run of free and unmapped blocks with room for size bytes in
  // one of this (stream, pool)'s expandable segments, or a new segment's whole unmapped range.
  Block* find_expandable_block(i64 stream, BlockPool& pool, i64 size) {
    auto allocatable = [](const Block* b) { return b != nullptr && !b->allocated; };
    auto has_available_address_space = [&](const Block* b) {
      i64 total = 0;
      while (total < size && allocatable(b)) {
        total += b->size;
        b = b->next;
      }
      return total >= size;
    };
    Block key(stream, 0, &pool, 0);
    for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
      Block* c = *it;
      if (allocatable(c->prev)) c = c->prev;
      if (has_available_address_space(c)) return c;
    }
    i64 segment_size = pool.is_small ? kSmallBuffer : kLargeBuffer;
    i64 total = has_device_total ? device_total : DEFAULT_DEVICE_MEMORY;
    i64 address_space_size = total + floordiv(total, 8);
    ExpandableSegment probe(0, segment_size, address_space_size, stream);
    i64 ptr = new_address(-1, probe.size());
    ExpandableSegment* es = new ExpandableSegment(ptr, segment_size, address_space_size, stream);
    all_expandable_segments.push_back(es);
    n_expandable_segments += 1;
    Block* candidate = new_block(stream, es->size(), &pool, ptr);
    candidate->mapped = false;
    candidate->expandable_segment = es;
    pool.insert_unmapped(candidate);
    return candidate;
  }

  // map_block: map the pages covering [to_map->address, + size); false if capacity cannot back them.
  bool map_block(Block* to_map, i64 size) {
    ExpandableSegment* es = to_map->expandable_segment;
    i64 pages = std::max<i64>(0, es->end_page(to_map->address, size) - es->first_page(to_map->address));  // len(range)
    if (has_capacity && st.reserved_bytes + pages * es->segment_size > capacity) return false;
    auto mapped = es->map(to_map->address, size);
    BlockPool& pool = *to_map->pool;
    pool.erase_unmapped(to_map);
    to_map->mapped = true;
    if (mapped.second < to_map->size) {
      Block* remaining =
          new_block(to_map->stream, to_map->size - mapped.second, &pool, to_map->address + mapped.second);
      remaining->mapped = false;
      remaining->expandable_segment = es;
      remaining->splice(to_map, to_map->next);
      pool.insert_unmapped(remaining);
      to_map->size = mapped.second;
    }
    try_merge_blocks(to_map, to_map->prev, pool);
    try_merge_blocks(to_map, to_map->next, pool);
    pool.insert_into_blocks(to_map);
    st.reserved_bytes += mapped.second;
    if (st.reserved_bytes > st.peak_reserved_bytes) st.peak_reserved_bytes = st.reserved_bytes;
    st.num_device_alloc += 1;
    on_segment_map(mapped.first, mapped.second);
    return true;
  }

  // try_allocate_expandable_block: a free block of at least size bytes, taken out of the pool.
  Block* try_allocate_expandable_block(i64 stream, BlockPool& pool, i64 size) {
    Block* candidate = find_expandable_block(stream, pool, size);
    // A request larger than a new segment's whole address space (1 1/8 of the device's memory): PyTorch maps the
    // whole range, which the device cannot back, so the request fails (the capacity check of map_block says so
    // where the capacity is known; without one the loop below would run past the segment's last block).
    if (!candidate->next && candidate->size < size) return nullptr;
    if (!candidate->mapped && !map_block(candidate, std::min(candidate->size, size))) return nullptr;
    while (candidate->size < size) {
      i64 remaining = size - candidate->size;
      Block* new_candidate = candidate->next;
      if (!map_block(new_candidate, std::min(remaining, new_candidate->size))) return nullptr;
      candidate = new_candidate;
    }
    pool.erase(candidate);
    return candidate;
  }

  // unmap_block: unmap the whole pages inside a free block; partial pages stay mapped free blocks.
  void unmap_block(Block* block) {
    ExpandableSegment* es = block->expandable_segment;
    auto unmapped = es->unmap(block->address, block->size);
    if (unmapped.second == 0) return;
    BlockPool& pool = *block->pool;
    pool.erase(block);
    i64 before_size = unmapped.first - block->address;
    if (before_size > 0) {
      Block* before_free = new_block(block->stream, before_size, &pool, block->address);
      before_free->expandable_segment = es;
      before_free->splice(block->prev, block);
      pool.insert_into_blocks(before_free);
    }
    i64 after_size = block->size - (before_size + unmapped.second);
    if (after_size > 0) {
      Block* after_free = new_block(block->stream, after_size, &pool, unmapped.first + unmapped.second);
      after_free->expandable_segment = es;
      after_free->splice(block, block->next);
      pool.insert_into_blocks(after_free);
    }
    block->address = unmapped.first;
    block->size = unmapped.second;
    block->mapped = false;
    try_merge_blocks(block, block->prev, pool);
    try_merge_blocks(block, block->next, pool);
    pool.insert_unmapped(block);
    st.reserved_bytes -= unmapped.second;
    if (pool.owner_private_pool) pool.owner_private_pool->cudaMalloc_count -= 1;
    st.num_device_free += 1;
    on_segment_unmap(unmapped.first, unmapped.second);
  }

  // release_expandable_segment: give back the virtual range of a fully unmapped segment.
  void release_expandable_segment(Block* block) {
    block->pool->erase_unmapped(block);
    n_expandable_segments -= 1;
  }

  // -- the free path ----------------------------------------------------------------------------

  // free (DeviceCachingAllocator::free without stream events): free_block. For a block request_free held,
  // the completion (process_events -> free_block): its stats dropped at the request. false for a double free.
  bool free(Block* block) {
    if (!block->allocated) return false;
    active_blocks.erase(block->address);
    if (block->held) {
      block->held = false;
    } else {
      drop_stats(block);
    }
    block->allocated = false;
    free_block(block);
    return true;
  }

  // request_free (DeviceCachingAllocator::free of a block other streams still use, Tensor.record_stream): the
  // stats drop now; the block stays out of its pool until free() completes it. false for a block not allocated
  // or already held (a double free).
  bool request_free(Block* block) {
    if (!block->allocated || block->held) return false;
    drop_stats(block);
    block->held = true;
    return true;
  }

  // _drop_stats
  void drop_stats(const Block* block) {
    st.allocated_bytes -= block->size;
    st.requested_bytes -= block->requested_size;
    st.num_frees += 1;
  }

  // free_block
  void free_block(Block* block) {
    BlockPool* pool = block->pool;
    bool expandable = block->expandable_segment != nullptr;
    for (Block* candidate : {block->prev, block->next}) {
      i64 subsumed = try_merge_blocks(block, candidate, *pool);
      if (subsumed && !expandable) st.inactive_split_bytes -= subsumed;
    }
    pool->insert_into_blocks(block);
    if (block->is_split() && !expandable) st.inactive_split_bytes += block->size;
  }

  // try_merge_blocks: fold free src into dst (both mapped or both unmapped); the bytes subsumed (0 if none).
  i64 try_merge_blocks(Block* dst, Block* src, BlockPool& pool) {
    if (!src || src->allocated || dst->mapped != src->mapped) return 0;
    if (dst->prev == src) {  // [src dst]
      dst->address = src->address;
      dst->prev = src->prev;
      if (dst->prev) dst->prev->next = dst;
    } else {  // [dst src]
      dst->next = src->next;
      if (dst->next) dst->next->prev = dst;
    }
    i64 subsumed = src->size;
    dst->size += subsumed;
    if (src->mapped) {
      pool.erase(src);
    } else {
      pool.erase_unmapped(src);
    }
    spare_blocks.push_back(src);  // delete src
    return subsumed;
  }

  // -- releasing cached memory -----------------------------------------------------------------

  // release_block: cudaFree a whole free segment.
  void release_block(Block* block) {
    block->pool->erase(block);
    if (block->pool->owner_private_pool) block->pool->owner_private_pool->cudaMalloc_count -= 1;
    st.reserved_bytes -= block->size;
    st.num_device_free += 1;
    on_segment_free(block->address, block->size);
  }

  // release_blocks: every unsplit free block of the pool in pool order, then the whole free pages of its
  // expandable segments (and a segment left with no mapped page).
  void release_blocks(BlockPool& pool) {
    std::vector<Block*> ordered(pool.blocks.begin(), pool.blocks.end());
    std::vector<Block*> to_unmap;
    for (Block* b : ordered) {
      if (b->expandable_segment) {
        to_unmap.push_back(b);
      } else if (!b->prev && !b->next) {
        release_block(b);
      }
    }
    for (Block* b : to_unmap) {
      unmap_block(b);
      if (!b->prev && !b->next) release_expandable_segment(b);
    }
  }

  // release_cached_blocks(mempool_id) (2.6+; torch.cuda.empty_cache()): for the default id and no
  // diversion to a pool underway, the default large pool, then the small one. Then every private pool nobody
  // holds (use_count 0), in the order it became so: its small pool, then its large pool; a pool with nothing
  // left is forgotten. A non-default id limits the second part to that pool.
  bool release_cached_blocks(MempoolId mempool_id = DEFAULT_POOL) {
    // 2.6-2.7: inside a use_mem_pool region the id was that region's pool (MemPoolContext)
    if (mempool_id == DEFAULT_POOL && !captures_underway.empty() && empty_cache_scoped_to_region)
      mempool_id = captures_underway.back();
    if (mempool_id == DEFAULT_POOL && captures_underway.empty()) {
      release_blocks(large_blocks);
      release_blocks(small_blocks);
    }
    if (graph_pools_freeable.empty()) return true;
    std::vector<std::pair<MempoolId, PrivatePool*>> freeable = graph_pools_freeable;  // list(...items())
    for (const auto& [pid, pp] : freeable) {
      if (mempool_id != DEFAULT_POOL && pid != mempool_id) continue;
      release_blocks(pp->small_blocks);
      release_blocks(pp->large_blocks);
      if (pp->cudaMalloc_count == 0) {
        graph_pools.erase(pid);
        graph_pools_freeable.erase(
            std::find_if(graph_pools_freeable.begin(), graph_pools_freeable.end(),
                         [&](const std::pair<MempoolId, PrivatePool*>& e) { return e.first == pid; }));
      }
    }
    return true;
  }

  // release_available_cached_blocks: free oversize (>= max_split_size) blocks; only with max_split_size set.
  bool release_available_cached_blocks(BlockPool& pool, i64 size, i64 stream) {
    i64 ms = max_split_size;
    if (ms == UNLIMITED) return false;
    i64 key_size = size < ms ? ms : size;
    Block key(stream, key_size, &pool, 0);
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != stream) {
      if (it == pool.blocks.begin()) return false;
      i64 total_released = 0;
      --it;
      while (total_released < key_size && (*it)->size >= ms && (*it)->stream == stream) {
        Block* cur = *it;
        bool is_first = it == pool.blocks.begin();
        if (!is_first) --it;
        if (!cur->expandable_segment) {  // blocks of expandable segments are skipped (2.8+)
          total_released += cur->size;
          release_block(cur);
        }
        if (is_first) break;
      }
      if (total_released < key_size) return false;
    } else {
      if ((*it)->expandable_segment) return false;
      release_block(*it);
    }
    return true;
  }

  // garbage_collect_cached_blocks: free unsplit large blocks older than the average age.
  void garbage_collect_cached_blocks() {
    // int(threshold * capacity), as Python's int() truncates the float product
    i64 gc_threshold = (i64)(garbage_collection_threshold * (double)capacity);
    if (st.reserved_bytes <= gc_threshold) return;
    i64 target_size = st.reserved_bytes - gc_threshold;
    BlockPool& pool = large_blocks;
    auto gc_count = [&pool](const Block* b) { return pool.get_free_blocks_call_count - b->gc_count_base; };
    i64 total_age = 0, count = 0;
    for (Block* b : pool.blocks)
      if (!b->is_split()) {
        total_age += gc_count(b);
        count += 1;
      }
    if (count == 0) return;
    i64 reclaimed = 0;
    bool block_freed = true;
    while (reclaimed < target_size && block_freed && count > 0) {
      double age_threshold = (double)total_age / (double)count;
      block_freed = false;
      std::vector<Block*> ordered(pool.blocks.begin(), pool.blocks.end());
      for (Block* b : ordered) {
        if (!b->is_split() && (double)gc_count(b) >= age_threshold) {
          block_freed = true;
          reclaimed += b->size;
          total_age -= gc_count(b);
          count -= 1;
          release_block(b);
        }
      }
    }
  }

  // -- import_segment (a segment that existed before the trace) --------------------------------

  // pieces: (address, size, requested) with requested < 0 for a free gap; sorted, validated by Python.
  // pool_id: the segment's segment_pool_id (a private pool is created, held once).
  void import_segment(i64 address, i64 total_size, i64 stream, bool is_small, i64 n, const i64* pieces,
                      MempoolId pool_id) {
    // replay_types.check_initial_segments' bounds (Python refuses first; this keeps the core safe on its own)
    bool fits = !bad_import && address >= 0 && address <= kMaxSegmentAddress && total_size >= 0 &&
                total_size <= kMaxReplayBytes && st.reserved_bytes + total_size <= kMaxReplayBytes;
    for (i64 k = 0; fits && k < n; ++k) {
      i64 a = pieces[3 * k], sz = pieces[3 * k + 1], req = pieces[3 * k + 2];
      fits = a >= address && sz >= 0 && a - address <= total_size - sz && req <= sz;
    }
    if (!fits) {
      bad_import = true;
      return;
    }
    BlockPool* pool_p = is_small ? &small_blocks : &large_blocks;
    if (pool_id != DEFAULT_POOL) {
      auto it = graph_pools.find(pool_id);
      PrivatePool* pp = it != graph_pools.end() ? it->second : create_or_incref_pool(pool_id);
      pool_p = is_small ? &pp->small_blocks : &pp->large_blocks;
      pp->cudaMalloc_count += 1;
    }
    BlockPool& pool = *pool_p;
    st.reserved_bytes += total_size;
    if (st.reserved_bytes > st.peak_reserved_bytes) st.peak_reserved_bytes = st.reserved_bytes;
    // new segments must not land on it (a simulated snapshot's segments lie where new ones are placed)
    next_synthetic_address = std::max(next_synthetic_address, address + total_size + kRoundLarge);
    Block* prev = nullptr;
    std::vector<Block*> segment;
    for (i64 k = 0; k < n; ++k) {
      Block* b = new_block(stream, pieces[3 * k + 1], &pool, pieces[3 * k]);
      b->prev = prev;
      if (prev) prev->next = b;
      prev = b;
      if (pieces[3 * k + 2] >= 0) {
        b->allocated = true;
        b->requested_size = pieces[3 * k + 2];
        active_blocks.put(b->address, b);
        st.allocated_bytes += b->size;
        st.requested_bytes += b->requested_size;
      }
      segment.push_back(b);
    }
    if (st.allocated_bytes > st.peak_allocated_bytes) st.peak_allocated_bytes = st.allocated_bytes;
    for (Block* b : segment) {
      if (!b->allocated) {
        pool.insert_into_blocks(b);
        if (b->is_split()) st.inactive_split_bytes += b->size;
      }
    }
  }

  // -- replay.py's observers --------------------------------------------------------------------

  void on_segment_alloc(i64 address, i64 size) {
    decisions.push_back({0, address, size});
    last_was_free = false;
    collector.on_cuda_malloc(size, st.reserved_bytes, st.allocated_bytes, st.inactive_split_bytes);
  }
  void on_segment_free(i64 address, i64 size) {
    decisions.push_back({last_was_free ? 2 : 1, address, size});
    last_was_free = true;
    collector.on_cuda_free();
  }
  void on_segment_map(i64 address, i64 size) {
    decisions.push_back({3, address, size});
    collector.on_cuda_malloc(size, st.reserved_bytes, st.allocated_bytes, st.inactive_split_bytes);
  }
  void on_segment_unmap(i64 address, i64 size) {
    decisions.push_back({4, address, size});
    collector.on_cuda_free();
  }

  // -- replay.py: replay()'s loop ----------------------------------------------------------------

  // _recorded_release_batches: for each batch start, the index of the ALLOC/OOM that followed it or -1.
  static std::unordered_map<i64, i64> recorded_release_batches(i64 n, const uint8_t* act) {
    std::unordered_map<i64, i64> batches;
    auto is_release = [](uint8_t a) { return a == A_SEGMENT_FREE || a == A_SEGMENT_UNMAP; };
    i64 i = 0;
    while (i < n) {
      if (!is_release(act[i])) {
        ++i;
        continue;
      }
      i64 start = i;
      while (i < n && is_release(act[i])) ++i;
      i64 j = i;
      bool created = false;
      while (j < n && (act[j] == A_SEGMENT_ALLOC || act[j] == A_SEGMENT_MAP || act[j] == A_POOL_ENTER)) {
        if (act[j] != A_POOL_ENTER) created = true;
        ++j;
      }
      bool follower = j < n && (act[j] == A_OOM || (created && act[j] == A_ALLOC));
      batches[start] = follower ? j : -1;
    }
    return batches;
  }

  // After an ALLOC or OOM (the only events that reserve): RC_OK, or the bound the model passed (error_event set).
  int out_of_bounds(i64 idx) {
    if (st.reserved_bytes > kMaxReplayBytes) {
      error_event = idx;
      return RC_RESERVED_OUT_OF_RANGE;
    }
    if (next_synthetic_address > kMaxModelAddress) {
      error_event = idx;
      return RC_ADDRESS_SPACE_EXHAUSTED;
    }
    return RC_OK;
  }

  // The loop of replay(); returns RC_OK, or a ReplayStatus where the Python engine raises (error_event: the
  // event).
  int run(i64 n, const uint8_t* act, const i64* addr, const i64* size, const i64* stream, const i64* time_us) {
    // recorded address -> model block. The Python model keeps a freed, merged block alive while `live`
    // still names it (and refuses a second free of it); here its object may have been reused, which the
    // serial number tells.
    struct LiveRef {
      Block* block = nullptr;
      i64 serial = 0;
    };
    FlatMap<LiveRef> live;
    std::unordered_map<i64, i64> release_batches;
    bool has_releases = false;
    for (i64 i = 0; i < n && !has_releases; ++i)
      has_releases = act[i] == A_SEGMENT_FREE || act[i] == A_SEGMENT_UNMAP;
    if (has_releases) release_batches = recorded_release_batches(n, act);
    std::vector<char> retry_allocs;  // ALLOC/OOM indices whose recorded cudaMalloc failed first
    if (has_releases) retry_allocs.assign(n, 0);
    // python_engine.check_event_ranges: the same checks, in the same order, before anything replays
    for (i64 i = 0; i < n; ++i) {
      uint8_t a = act[i];
      bool sized = a == A_ALLOC || a == A_OOM || a == A_SEGMENT_ALLOC || a == A_SEGMENT_MAP;
      if (sized && (size[i] < 0 || size[i] > kMaxReplayBytes)) {
        error_event = i;
        return RC_SIZE_OUT_OF_RANGE;
      }
      if ((a == A_SEGMENT_ALLOC || a == A_SEGMENT_MAP) && (addr[i] < 0 || addr[i] > kMaxSegmentAddress)) {
        error_event = i;
        return RC_ADDRESS_OUT_OF_RANGE;
      }
      if (time_us[i] < -kMaxTimeUs || time_us[i] > kMaxTimeUs) {
        error_event = i;
        return RC_TIME_OUT_OF_RANGE;
      }
    }

    for (i64 idx = 0; idx < n; ++idx) {
      uint8_t action = act[idx];
      switch (action) {
        case A_ALLOC: {
          if (has_releases && retry_allocs[idx]) fail_next_cuda_malloc = anchored;
          i64 retries = st.num_alloc_retries, ooms = st.num_ooms;
          Block* block = malloc(size[idx], stream[idx]);
          if (pool_gone) {
            error_event = idx;
            return RC_POOL_RELEASED_WHILE_IN_USE;
          }
          if (block) live.put(addr[idx], LiveRef{block, block->serial});
          fail_next_cuda_malloc = false;
          pending_anchor.clear();
          if (st.num_alloc_retries != retries || st.num_ooms != ooms)
            collector.on_retry_or_oom(st.num_alloc_retries - retries, st.num_ooms - ooms);
          last_was_free = false;
          collector.after_event(st.allocated_bytes, time_us[idx]);
          if (int rc = out_of_bounds(idx)) return rc;
          break;
        }
        case A_FREE:
        case A_FREE_REQUESTED: {  // FREE_REQUESTED (record_stream): out of the stats now, back in its pool at its FREE
          bool request = action == A_FREE_REQUESTED;
          Block* block = nullptr;
          if (LiveRef* found = live.find(addr[idx])) {
            if (found->block->serial != found->serial) {  // merged away since: a double free
              error_event = idx;
              return RC_DOUBLE_FREE;
            }
            block = found->block;
            if (!request) live.erase(addr[idx]);  // a requested block stays in live: its FREE finds it there
          } else if (Block** ab = active_blocks.find(addr[idx])) {  // allocated before the trace began
            block = *ab;
          } else {
            unmatched_frees += 1;
            break;
          }
          if (!(request ? request_free(block) : free(block))) {
            error_event = idx;
            return RC_DOUBLE_FREE;
          }
          last_was_free = false;
          collector.after_event(st.allocated_bytes, time_us[idx]);
          break;
        }
        case A_OOM: {  // the recorded request that failed: the model must fail it too
          if (has_releases && retry_allocs[idx]) fail_next_cuda_malloc = anchored;
          i64 retries = st.num_alloc_retries, ooms = st.num_ooms;
          Block* block = malloc(size[idx], stream[idx]);
          if (pool_gone) {
            error_event = idx;
            return RC_POOL_RELEASED_WHILE_IN_USE;
          }
          if (block) {
            free(block);  // the program never got it
            oom_mismatches += 1;
          }
          fail_next_cuda_malloc = false;
          pending_anchor.clear();
          collector.on_retry_or_oom(st.num_alloc_retries - retries, st.num_ooms - ooms);
          last_was_free = false;
          collector.after_event(st.allocated_bytes, time_us[idx]);
          if (int rc = out_of_bounds(idx)) return rc;
          break;
        }
        case A_SEGMENT_ALLOC:
        case A_SEGMENT_MAP:
          pending_anchor.push_back({addr[idx], size[idx], action == A_SEGMENT_MAP});
          break;
        case A_SEGMENT_FREE:
        case A_SEGMENT_UNMAP: {
          auto it = release_batches.find(idx);
          if (it == release_batches.end()) break;  // inside a batch already handled
          i64 j = it->second;
          bool retry = j >= 0 && (act[j] == A_OOM || !can_serve_from_cache(size[j], stream[j]));
          if (pool_gone) {
            error_event = idx;
            return RC_POOL_RELEASED_WHILE_IN_USE;
          }
          if (retry) {
            retry_allocs[j] = 1;  // the recorded cudaMalloc failed, then released and retried
            break;
          }
          last_was_free = false;  // a user's torch.cuda.empty_cache()
          release_cached_blocks();
          flush_points.push_back(idx);
          break;
        }
        case A_FLUSH: {
          last_was_free = false;
          i64 before = st.reserved_bytes, frees_before = st.num_device_free, requested_before = st.requested_bytes;
          release_cached_blocks();
          flush_frees += st.num_device_free - frees_before;
          flushes.push_back({idx, collector.current ? (i64)collector.phases.size() - 1 : -1,
                             before - st.reserved_bytes, st.num_device_free - frees_before, requested_before,
                             st.requested_bytes});
          if (st.reserved_bytes != before) flush_points.push_back(idx);
          collector.after_event(st.allocated_bytes, time_us[idx]);
          break;
        }
        case A_PHASE:
          if (collector.current) requested_at_end.insert(requested_at_end.end(),
                                                          {(i64)collector.phases.size() - 1, st.requested_bytes});
          collector.begin_phase(idx, st.reserved_bytes, st.allocated_bytes, time_us[idx]);
          break;
        case A_POOL_ENTER: {  // use_mem_pool entry: the pool object holds it, the region too
          MempoolId pool_id{addr[idx], size[idx]};
          if (!graph_pools.count(pool_id)) create_or_incref_pool(pool_id);
          if (!begin_allocate_to_pool(pool_id)) {
            error_event = idx;
            return RC_POOL_ALREADY_RECORDING;
          }
          break;
        }
        case A_POOL_EXIT: {
          MempoolId pool_id{addr[idx], size[idx]};
          if (!end_allocate_to_pool(pool_id)) {
            error_event = idx;
            return RC_POOL_NOT_RECORDING;
          }
          if (!release_pool(pool_id)) {
            error_event = idx;
            return RC_POOL_UNKNOWN;
          }
          break;
        }
        case A_POOL_RELEASE: {  // MemPool destroyed: releasePool, then emptyCache(pool id)
          MempoolId pool_id{addr[idx], size[idx]};
          if (!release_pool(pool_id)) {
            error_event = idx;
            return RC_POOL_UNKNOWN;
          }
          release_cached_blocks(pool_id);
          break;
        }
        default:  // PHASE_END, OTHER
          break;
      }
    }
    if (collector.current)
      requested_at_end.insert(requested_at_end.end(), {(i64)collector.phases.size() - 1, st.requested_bytes});
    return RC_OK;
  }

  // -- the result array ---------------------------------------------------------------------------

  static void put_window(std::vector<i64>& out, const Window& w) {
    i64 f[kWindowFields] = {w.peak_reserved, w.peak_allocated, w.fragmentation_at_peak, w.max_fragmentation,
                            w.inactive_split_at_peak, w.cuda_malloc_count, w.cuda_free_count, w.alloc_retries,
                            w.ooms, w.events, w.start_us, w.end_us, w.phase_event};
    out.insert(out.end(), f, f + kWindowFields);
  }

  // Layout (every item an int64):
  //   header[16]: error, error_event, final_reserved, final_allocated, final_requested, unmatched_frees,
  //               oom_mismatches, num_device_free, flush_frees, peak_phase, n_phases, n_decisions,
  //               n_flushes, n_flush_points, n_requested_at_end, num_device_alloc
  //   total window[13], then n_phases windows[13]: peak_reserved, peak_allocated, fragmentation_at_peak,
  //               max_fragmentation, inactive_split_at_peak, cuda_malloc_count, cuda_free_count,
  //               alloc_retries, ooms, events, start_us, end_us, phase_event (INT64_MIN = None)
  //   decisions[n_decisions][3]: kind (0 segment_alloc, 1 segment_free opening a batch, 2 continuing,
  //               3 segment_map, 4 segment_unmap), address, size
  //   flushes[n_flushes][6]: event, phase window (-1 none), released_bytes, segments_released,
  //               requested_before, requested_after
  //   flush_points[n_flush_points]
  //   requested_at_end[n_requested_at_end][2]: phase window, requested bytes
  std::vector<i64> result() const {
    std::vector<i64> out = {error, error_event, st.reserved_bytes, st.allocated_bytes, st.requested_bytes,
                            unmatched_frees, oom_mismatches, st.num_device_free, flush_frees,
                            collector.peak_phase, (i64)collector.phases.size(), (i64)decisions.size(),
                            (i64)flushes.size(), (i64)flush_points.size(), (i64)requested_at_end.size() / 2,
                            st.num_device_alloc};
    put_window(out, collector.total);
    for (const Window& w : collector.phases) put_window(out, w);
    for (const Decision& d : decisions) out.insert(out.end(), {d.kind, d.address, d.size});
    for (const FlushRecord& f : flushes)
      out.insert(out.end(), {f.event, f.phase, f.released_bytes, f.segments_released, f.requested_before,
                             f.requested_after});
    out.insert(out.end(), flush_points.begin(), flush_points.end());
    out.insert(out.end(), requested_at_end.begin(), requested_at_end.end());
    return out;
  }
};

struct Handle {
  Model model;
  std::vector<i64> result;
};

}  // namespace

// The settings of one replay, passed by name (replay_engine.py mirrors this struct once, as the ctypes.Structure
// ReplaySettings; rc_settings_layout reports its size and offsets, which tests/test_replay_core.py checks). The
// names are AllocatorConfig's (allocator.py) and CUDACachingAllocator.cpp's: CUDAAllocatorConfig's
// max_split_size, max_non_split_rounding_size, roundup_power2_divisions, garbage_collection_threshold,
// expandable_segments; DeviceCachingAllocator's allowed_memory_maximum (setMemoryFraction). Sizes are bytes;
// every flag is 0 or 1; a has_* flag 0 means None (unlimited, unknown).
struct ReplaySettings {
  int64_t max_split_size;               // bytes; INT64_MAX = unlimited
  int64_t max_non_split_rounding_size;  // bytes
  int64_t roundup_power2_divisions[kRoundUpPowerOfTwoIntervals];  // divisions per power-of-2 interval
  double garbage_collection_threshold;  // 0.0 = off
  int64_t expandable_segments;
  int64_t capacity;      // bytes the allocator may reserve: the device's, or allowed_memory_maximum below it
  int64_t has_capacity;  // 0: unlimited (capacity None)
  int64_t has_allowed_memory_maximum;  // per_process_memory_fraction < 1.0: capacity is that cap
  int64_t device_total;  // bytes of the device before per_process_memory_fraction (allocator.py: device_total)
  int64_t has_device_total;
  int64_t anchored;      // replay.py's mode: 1 anchored, 0 free-running
  // behaviours selected by the modelled PyTorch version (allocator.py: AllocatorConfig.since)
  int64_t innermost_pool;                // get_pool takes the innermost use_mem_pool region (2.10, PR 168382)
  int64_t use_on_oom_before_release;     // use_on_oom pools tried before release_available_cached_blocks (2.10)
  int64_t empty_cache_scoped_to_region;  // empty_cache inside a region scoped to its pool (2.6-2.7, PR 133602)
};

extern "C" {


// ReplaySettings' size and field offsets, in declaration order (roundup_power2_divisions: its first item), into
// out[1 + 15]; out[0] = sizeof. For the layout test of the ctypes mirror.
// The replay's bounds into out[4]: kMaxReplayBytes, kMaxSegmentAddress, kMaxTimeUs, kMaxModelAddress (for the test
// that holds them to replay_types.py's).
void rc_bounds(int64_t* out) {
  out[0] = kMaxReplayBytes;
  out[1] = kMaxSegmentAddress;
  out[2] = kMaxTimeUs;
  out[3] = kMaxModelAddress;
}

void rc_settings_layout(int64_t* out) {
  int k = 0;
  out[k++] = (int64_t)sizeof(ReplaySettings);
#define RC_OFFSET(f) out[k++] = (int64_t)offsetof(ReplaySettings, f)
  RC_OFFSET(max_split_size); RC_OFFSET(max_non_split_rounding_size); RC_OFFSET(roundup_power2_divisions);
  RC_OFFSET(garbage_collection_threshold); RC_OFFSET(expandable_segments); RC_OFFSET(capacity);
  RC_OFFSET(has_capacity); RC_OFFSET(has_allowed_memory_maximum); RC_OFFSET(device_total);
  RC_OFFSET(has_device_total); RC_OFFSET(anchored); RC_OFFSET(innermost_pool); RC_OFFSET(use_on_oom_before_release);
  RC_OFFSET(empty_cache_scoped_to_region);
#undef RC_OFFSET
}

void* rc_new(const ReplaySettings* s) {
  Handle* h = new Handle();
  Model& m = h->model;
  m.max_split_size = s->max_split_size;
  m.max_non_split_rounding_size = s->max_non_split_rounding_size;
  for (int i = 0; i < kRoundUpPowerOfTwoIntervals; ++i) {
    m.roundup_power2_divisions[i] = s->roundup_power2_divisions[i];
    if (s->roundup_power2_divisions[i] > 1) m.power2_rounding = true;
  }
  m.garbage_collection_threshold = s->garbage_collection_threshold;
  m.expandable_segments = s->expandable_segments != 0;
  m.capacity = s->capacity;
  m.has_capacity = s->has_capacity != 0;
  m.has_allowed_memory_maximum = s->has_allowed_memory_maximum != 0;
  m.device_total = s->device_total;
  m.has_device_total = s->has_device_total != 0;
  m.anchored = s->anchored != 0;
  m.innermost_pool = s->innermost_pool != 0;
  m.use_on_oom_before_release = s->use_on_oom_before_release != 0;
  m.empty_cache_scoped_to_region = s->empty_cache_scoped_to_region != 0;
  return h;
}

// The MemPool options a snapshot does not record (AllocatorConfig.use_on_oom_pools / no_split_pools): n_oom and
// n_no_split pool ids, each as two int64 (MempoolId_t's pair). Call before rc_run.
void rc_set_pools(void* h, int64_t n_oom, const int64_t* oom_ids, int64_t n_no_split, const int64_t* no_split_ids) {
  Model& m = static_cast<Handle*>(h)->model;
  for (int64_t i = 0; i < n_oom; ++i) m.use_on_oom_pools.push_back(MempoolId{oom_ids[2 * i], oom_ids[2 * i + 1]});
  for (int64_t i = 0; i < n_no_split; ++i)
    m.no_split_pools.push_back(MempoolId{no_split_ids[2 * i], no_split_ids[2 * i + 1]});
}

// pieces[n][3]: (address, size, requested size or -1 for a free gap), by address, covering the segment.
// pool_id0, pool_id1: the segment's segment_pool_id ((0, 0): the default pools).
void rc_import_segment(void* h, int64_t address, int64_t total_size, int64_t stream, int is_small, int64_t n,
                       const int64_t* pieces, int64_t pool_id0, int64_t pool_id1) {
  static_cast<Handle*>(h)->model.import_segment(address, total_size, stream, is_small != 0, n, pieces,
                                                MempoolId{pool_id0, pool_id1});
}

// Call after the imports: the collector starts from the imported reserved/allocated figures.
// time_is_delta: time_us holds differences from the previous event (the .rlhftrace column); a prefix sum
// is taken here. flush_at (sorted, n_flush of them): a FLUSH event is inserted before each of those
// indices (the advisor's candidates), exactly as advise.with_flushes builds the event list.
int rc_run(void* hp, int64_t n, const uint8_t* act, const int64_t* addr, const int64_t* size,
           const int64_t* stream, const int64_t* time_us, int time_is_delta, int64_t n_flush,
           const int64_t* flush_at) {
  Handle* h = static_cast<Handle*>(hp);
  Model& m = h->model;
  m.collector.total.peak_reserved = m.st.reserved_bytes;
  m.collector.total.peak_allocated = m.st.allocated_bytes;
  auto in_range = [](i64 v) { return v >= -kMaxReplayBytes && v <= kMaxReplayBytes; };
  int rc = RC_OK;
  if ((m.has_capacity && !in_range(m.capacity)) || (m.has_device_total && !in_range(m.device_total))) {
    rc = RC_CAPACITY_OUT_OF_RANGE;
  } else if (m.bad_import) {
    rc = RC_SEGMENT_OUT_OF_RANGE;
  }
  if (rc != RC_OK) {
    m.error = rc;
    h->result = m.result();
    return rc;
  }
  std::vector<i64> t;
  const i64* times = time_us;
  if (time_is_delta) {
    // A running sum past int64 saturates (and stays so): the check in Model::run then refuses the first event out of
    // range, as the Python engine's exact sums do (a wrapped sum could land back in range: -2**62 - 2**63 wraps to
    // 2**62).
    t.resize(n);
    i64 acc = 0;
    bool saturated = false;
    for (i64 i = 0; i < n; ++i) {
      if (!saturated && __builtin_add_overflow(acc, time_us[i], &acc)) {
        saturated = true;
        acc = time_us[i] > 0 ? INT64_MAX : INT64_MIN;
      }
      t[i] = acc;
    }
    times = t.data();
  }
  if (n_flush == 0) {
    rc = m.run(n, act, addr, size, stream, times);
  } else {  // materialise the list with flushes, as with_flushes does
    i64 total = n + n_flush;
    std::vector<uint8_t> a2(total);
    std::vector<i64> addr2(total), size2(total), stream2(total), time2(total);
    i64 k = 0, o = 0;
    for (i64 i = 0; i <= n; ++i) {
      while (k < n_flush && flush_at[k] == i) {
        a2[o] = A_FLUSH;
        addr2[o] = size2[o] = stream2[o] = 0;
        time2[o] = i > 0 ? times[i - 1] : 0;
        ++o;
        ++k;
      }
      if (i == n) break;
      a2[o] = act[i];
      addr2[o] = addr[i];
      size2[o] = size[i];
      stream2[o] = stream[i];
      time2[o] = times[i];
      ++o;
    }
    rc = m.run(total, a2.data(), addr2.data(), size2.data(), stream2.data(), time2.data());
  }
  m.error = rc;
  h->result = m.result();
  return rc;
}

int64_t rc_result_size(void* h) { return (int64_t) static_cast<Handle*>(h)->result.size(); }

void rc_result_copy(void* h, int64_t* out) {
  const std::vector<int64_t>& r = static_cast<Handle*>(h)->result;
  std::memcpy(out, r.data(), r.size() * sizeof(int64_t));
}

void rc_free(void* h) { delete static_cast<Handle*>(h); }

}  // extern "C"
