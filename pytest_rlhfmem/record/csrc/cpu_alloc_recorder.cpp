// Records every allocation and free of PyTorch's CPU allocator, from every thread, in one ordered
// buffer, with markers (phases, flushes, placement annotations) interleaved under the same lock.
// The CPU twin of CUDA's memory history (c10/cuda/CUDACachingAllocator.cpp, record_trace).
//
// install(): wraps the current CPU allocator (c10::GetCPUAllocator) with c10::SetCPUAllocator.
// Only allocators whose DataPtr context is the data pointer (the default CPU allocator's
// ReportAndDelete) can be wrapped; install() refuses others.
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

struct Entry {
  int64_t time_ns;
  int64_t ptr;   // data pointer, or the marker id for kind 2
  int64_t size;  // requested bytes
  int64_t kind;  // 0 alloc, 1 free, 2 marker
  int64_t thread;  // 1 if the event ran on the thread that called start(), else 0
};

std::mutex mu;
std::vector<Entry> entries;
std::unordered_map<void*, int64_t> live_sizes;
std::atomic<bool> recording{false};
std::thread::id main_thread;
c10::Allocator* base = nullptr;
c10::DeleterFnPtr base_deleter = nullptr;

int64_t on_main() { return std::this_thread::get_id() == main_thread ? 1 : 0; }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

void record_and_delete(void* ptr) {
  if (ptr != nullptr) {
    std::lock_guard<std::mutex> g(mu);
    auto it = live_sizes.find(ptr);
    if (it != live_sizes.end()) {
      if (recording.load()) entries.push_back({now_ns(), reinterpret_cast<int64_t>(ptr), it->second, 1, on_main()});
      live_sizes.erase(it);
    }
  }
  base_deleter(ptr);
}

struct RecordingCPUAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    void* ctx = inner.release_context();  // ctx == data for the default CPU allocator
    if (data != nullptr && n > 0) {
      std::lock_guard<std::mutex> g(mu);
      live_sizes[data] = static_cast<int64_t>(n);
      if (recording.load()) entries.push_back({now_ns(), reinterpret_cast<int64_t>(data), static_cast<int64_t>(n), 0, on_main()});
    }
    return {data, ctx, &record_and_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &record_and_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

RecordingCPUAllocator recorder;

bool install() {
  if (base != nullptr) return true;
  c10::Allocator* current = c10::GetCPUAllocator();
  c10::DataPtr probe = current->allocate(64);
  bool ctx_is_data = probe.get() == probe.get_context();
  c10::DeleterFnPtr deleter = probe.get_deleter();
  if (!ctx_is_data || deleter == nullptr) return false;
  base = current;
  base_deleter = deleter;
  c10::SetCPUAllocator(&recorder, /*priority=*/100);
  return c10::GetCPUAllocator() == &recorder;
}

void start() {
  std::lock_guard<std::mutex> g(mu);
  entries.clear();
  main_thread = std::this_thread::get_id();
  recording.store(true);
}

void mark(int64_t id) {
  std::lock_guard<std::mutex> g(mu);
  entries.push_back({now_ns(), id, 0, 2, on_main()});
}

// Stops recording and returns the entries as a [N, 5] int64 tensor (time_ns, ptr, size, kind, on_main).
torch::Tensor stop() {
  std::vector<Entry> out;
  {
    std::lock_guard<std::mutex> g(mu);
    recording.store(false);
    out.swap(entries);
  }
  auto t = torch::empty({static_cast<int64_t>(out.size()), 5}, torch::kInt64);
  if (!out.empty()) std::memcpy(t.data_ptr<int64_t>(), out.data(), out.size() * sizeof(Entry));
  return t;
}

// The entries from index `from` on, recording going on: the bytes of [N, 5] int64 rows as stop() returns.
// Copied into a std::string (malloc), never through the CPU allocator, so reading them records nothing.
pybind11::bytes rows_from(int64_t from) {
  std::string buf;
  {
    std::lock_guard<std::mutex> g(mu);
    if (from >= 0 && from < static_cast<int64_t>(entries.size()))
      buf.assign(reinterpret_cast<const char*>(entries.data() + from), (entries.size() - from) * sizeof(Entry));
  }
  return pybind11::bytes(buf);
}

// Bytes of host memory the recording itself holds: its entries (written, hence resident) and the live-pointer map's
// nodes (key, size, hash-node overhead). What a rank's host figures take out as the instrument's own (recorder.py).
int64_t own_bytes() {
  std::lock_guard<std::mutex> g(mu);
  return static_cast<int64_t>(entries.size() * sizeof(Entry) + live_sizes.size() * 32);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "wrap the CPU allocator; False if it cannot be wrapped");
  m.def("start", &start, "start recording");
  m.def("mark", &mark, "append a marker");
  m.def("rows_from", &rows_from, "entries from an index on while recording: bytes of [N, 5] int64 rows");
  m.def("own_bytes", &own_bytes, "bytes the recording holds itself: its entries and live-pointer map");
  m.def("stop", &stop, "stop and return entries [N, 5] int64: time_ns, ptr, size, kind, on_main");
}
