// A CUDA device without a GPU, for running a user's unchanged CUDA script on a CPU-only PyTorch build.
//
// What a tensor on device "cuda" is here: a real ATen tensor with the CUDA dispatch keys (so autograd,
// CUDA autocast and its cast cache, and every CompositeImplicit/CompositeExplicit kernel run exactly the
// code paths a GPU build runs) whose storage comes from SimCudaAllocator: a unique address and a size, no
// memory. Every allocation and free is logged; the log is the device trace the allocator model replays.
//
// Kernels: a CPU build registers no kernel for the CUDA key, so a boxed fallback computes each op's
// outputs from its Meta kernel (C++ structured meta functions and torch/_meta_registrations.py): the CUDA
// inputs are viewed as meta tensors of the same geometry over one meta storage per CUDA storage, the op is
// redispatched to Meta, and each output becomes a CUDA tensor: an input itself (in-place and out= ops), a
// view of an input's CUDA storage (view ops), or a new storage from SimCudaAllocator (what a CUDA
// kernel's output allocation asks the caching allocator for). Values are computed only in values mode (see
// "values mode": the CPU kernel on host memory at the device address); without it `.item()` on a CUDA tensor
// gets a fixed answer by dtype (counted per dtype), and copies into or out of the device do nothing to values.
//
// cuBLAS: the first op of a thread that calls cuBLAS on a GPU (mm, bmm, addmm, baddbmm, ...) takes the
// handle's workspace from the caching allocator (aten/src/ATen/cuda/CublasHandlePool.cpp:
// getCurrentCUDABlasHandle -> setWorkspaceForHandle), never freed; its size is set from Python
// (CUBLAS_WORKSPACE_CONFIG, compute capability). It is placed before the op's output: with it after, the
// training recording's warm-ups end one 40 MiB segment short (measured, tests/test_sim_cuda.py).
//
// Also registers a device guard for CUDA (streams, device index, synchronisation) and CUDA hooks with hasCUDA()
// true (cuda_hooks.h, shared with fake_cuda.cpp).
// Must be loaded (ctypes, RTLD_GLOBAL) BEFORE `import torch`. On a CUDA build of torch the same device runs
// the same code paths: see "on a CUDA build of torch" below (simcuda/build.py: load_built).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <ATen/native/transformers/attention.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include "cuda_hooks.h"  // the CUDA hooks and guard, shared with fake_cuda.cpp

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

// ---- the device trace -------------------------------------------------------------------------------
struct Ev {
  int64_t action;  // 1 alloc, 2 free; logged from Python (rlhfmem_sim_cuda_log): 3 record_stream, 4 host sync,
                   // 6 empty_cache
  uint64_t addr;
  int64_t size;
  int64_t stream;
  int64_t time_us;
};

std::mutex g_mu;
std::vector<Ev> g_events;
std::atomic<uint64_t> g_next_addr{uint64_t(1) << 40};
thread_local int64_t t_stream = 0;
int64_t g_workspace_bytes = 8519680;  // CUBLAS_WORKSPACE_CONFIG default before sm_90
std::atomic<int64_t> g_scalar_answers[4];  // bool, int, float, other
std::atomic<int64_t> g_workspaces{0};

int64_t steady_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The device's clock: steady_clock microseconds, advanced at least 1 us per stamp (a log event or an annotation),
// so that time orders the log and the memory history's annotations exactly. A GPU's allocator stamps both with
// one approximate clock too (c10::getApproximateTime), where two stamps may share a microsecond; here they never
// do. Read and advanced under g_mu.
int64_t g_last_us = 0;
int64_t stamp_us() {
  g_last_us = std::max(steady_us(), g_last_us + 1);
  return g_last_us;
}
// system_clock minus steady_clock when the library loaded: a stamp plus this is microseconds since the epoch, as
// a real snapshot's time_us (CUDACachingAllocator.cpp converts its approximate clock with tsc_to_us).
const int64_t g_epoch_offset_us =
    std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::system_clock::now().time_since_epoch()).count() - steady_us();

void log_event(int64_t action, uint64_t addr, int64_t size, int64_t stream) {
  std::lock_guard<std::mutex> g(g_mu);
  g_events.push_back({action, addr, size, stream, stamp_us()});
}

// ---- the memory history's annotations ------------------------------------------------------------------------
// PyTorch's _record_memory_history(enabled=...) registers a RecordFunction callback for USER_SCOPE functions
// (torch/csrc/cuda/memory_snapshot.cpp: _initRecordAnnotations; thread-local unless global_record_annotations) that
// records a START and an END annotation with the function's name, the current device and the allocator's clock
// (CUDACachingAllocator.cpp: recordAnnotation); disabling removes it. The same here, into g_annotations, stamped on
// the device's clock; which of them a snapshot shows (a ring buffer cleared at every _record_memory_history call) is
// simcuda/torch_cuda.py's. `record_function` from Python is USER_SCOPE.
struct Annotation {
  std::string name;
  int64_t stage;  // 0 START, 1 END
  int64_t device;
  int64_t time_us;
};
std::vector<Annotation> g_annotations;
at::CallbackHandle g_annotation_handle = 0;

void record_annotation(const at::RecordFunction& fn, int64_t stage) {
  int64_t device = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
  std::lock_guard<std::mutex> g(g_mu);
  g_annotations.push_back({fn.name(), stage, device, stamp_us()});
}

struct Block {
  uint64_t addr;
  int64_t size;
  int64_t stream;
  int64_t span;  // bytes of address space the block takes (values mode: whole pages, released at its free)
};

// ---- values mode ---------------------------------------------------------------------------------------
// Off (the default of the library; Python turns it on for a user's program: simcuda/library.py), a device
// allocation is an address and a size: no memory, no values. On, every device allocation is real host memory at
// its device address, inside one reserved address range (mmap, MAP_NORESERVE: pages exist once written), so a
// tensor's data_ptr() is both the address the log names and where its values are. Each op then also computes its
// values with the CPU kernel on host views of the same memory (cuda_via_meta: after the meta kernel made the
// outputs, so the allocation sequence is the value-free one), copies move bytes, and `.item()` reads them:
// control flow that depends on values (stopping criteria, masks, sampling) follows the program. A block takes
// whole pages, returned to the OS at its free (madvise MADV_DONTNEED), so host memory follows the live tensors.
std::atomic<bool> g_values{false};
constexpr uint64_t kValuesRange = uint64_t(16) << 40;  // 16 TiB of device addresses per process, never reused
constexpr uint64_t kPage = 4096;
uint64_t g_values_base = 0;

void sim_delete(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  log_event(2, b->addr, b->size, b->stream);
  if (b->span > 0) madvise(reinterpret_cast<void*>(b->addr), static_cast<size_t>(b->span), MADV_DONTNEED);
  delete b;
}

void noop_delete(void*) {}

struct SimCudaAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    // the thread's current device, as the caching allocator's (c10::cuda::current_device()); an op sets it to its
    // tensors' device first (cuda_via_meta), as a CUDA kernel's device guard does. One log for all devices.
    c10::Device dev(c10::DeviceType::CUDA, rlhfmem::DeviceGuard::current());
    if (n == 0) return {nullptr, nullptr, &noop_delete, dev};  // as the caching allocator: no block
    int64_t span = 0;
    uint64_t addr;
    if (g_values.load(std::memory_order_relaxed)) {
      span = static_cast<int64_t>((n + kPage - 1) / kPage * kPage);
      addr = g_next_addr.fetch_add(static_cast<uint64_t>(span));
      TORCH_CHECK(addr + span <= g_values_base + kValuesRange, "rlhfmem simulated CUDA device (values on): its ",
                  kValuesRange >> 40, " TiB of device addresses are used up (addresses are not reused); run with "
                  "values off (--sim-values off) if the program's control flow does not read device values");
    } else {
      addr = g_next_addr.fetch_add((n + 1023) / 512 * 512);  // unique; never dereferenced
    }
    auto* b = new Block{addr, static_cast<int64_t>(n), t_stream, span};
    log_event(1, addr, b->size, b->stream);
    return {reinterpret_cast<void*>(addr), b, &sim_delete, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dst, const void* src, std::size_t n) const override {
    if (g_values.load(std::memory_order_relaxed)) std::memcpy(dst, src, n);
  }
};

SimCudaAllocator g_allocator;

// ---- kernels ----------------------------------------------------------------------------------------
const std::unordered_set<std::string> kCublasOps = {
    "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::addmv", "aten::mv",
    "aten::dot", "aten::vdot", "aten::_addmm_activation"};

thread_local std::unordered_set<int64_t> t_workspace_streams;
std::mutex g_ws_mu;
std::vector<c10::DataPtr> g_workspace_holders;  // never freed, as cuBLAS's

void cublas_workspace() {
  if (!t_workspace_streams.insert(t_stream).second) return;
  auto p = g_allocator.allocate(static_cast<size_t>(g_workspace_bytes));
  g_workspaces++;
  std::lock_guard<std::mutex> g(g_ws_mu);
  g_workspace_holders.push_back(std::move(p));
}

bool is_cuda(const at::Tensor& t) { return t.defined() && t.device().is_cuda(); }

// ---- CUDA kernels' own device temporaries (allocated through the caching allocator inside a kernel) ----
// The GPU whose launch geometry decides them: an RTX 3090 (sm_86), as in the study and shared/snapshots.
constexpr int kMultiProcessors = 82;
constexpr int kMaxThreadsPerMultiProcessor = 1536;
constexpr int kWarpSize = 32;
std::atomic<int64_t> g_reduce_staging{0};
std::atomic<int64_t> g_index_sort{0};
constexpr int64_t kCubSingleTileKeysMeasured = 1024;  // the largest sort seen taking cub's 1-byte temp storage

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t last_pow2(int64_t n) {
  int64_t p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

// gpu_reduce_kernel's global-memory staging (aten/src/ATen/native/cuda/Reduce.cuh: setReduceConfig,
// ReduceConfig::global_memory_size / semaphore_size), for a sum or mean whose input, after TensorIterator's
// reordering (reduced dims first, each group by ascending stride) and coalescing, is one reduced block and
// at most one kept block. Returns {staging bytes, semaphore bytes}, {0, 0} when the kernel reduces in
// shared memory only or the geometry is outside that case (then nothing is added).
std::pair<int64_t, int64_t> reduce_staging(const at::Tensor& in, c10::OptionalArrayRef<int64_t> dims) {
  const int64_t nd = in.dim();
  if (nd == 0 || in.numel() == 0) return {0, 0};
  std::vector<bool> reduced(nd, !dims.has_value() || dims->empty());
  if (dims.has_value())
    for (int64_t d : *dims) reduced[c10::maybe_wrap_dim(d, nd)] = true;
  struct D { int64_t size, stride; bool red; };
  std::vector<D> red, kept;
  for (int64_t d = 0; d < nd; ++d)
    if (in.size(d) != 1) (reduced[d] ? red : kept).push_back({in.size(d), in.stride(d), reduced[d]});
  auto by_stride = [](const D& a, const D& b) { return a.stride < b.stride; };
  std::sort(red.begin(), red.end(), by_stride);
  std::sort(kept.begin(), kept.end(), by_stride);
  auto coalesce = [](std::vector<D>& v) {
    std::vector<D> out;
    for (const D& d : v) {
      if (!out.empty() && out.back().stride * out.back().size == d.stride) out.back().size *= d.size;
      else out.push_back(d);
    }
    v = out;
  };
  coalesce(red);
  coalesce(kept);
  if (red.size() != 1 || kept.size() > 1) return {0, 0};
  const int64_t elem = in.element_size();
  const int64_t arg_size = in.scalar_type() == at::kDouble ? 8 : 4;  // acc type: float, or double
  const int64_t num_outputs = kept.empty() ? 1 : kept[0].size;
  const int64_t inputs_per_output = red[0].size;
  const bool on_fastest = kept.empty() || red[0].stride < kept[0].stride;
  int64_t dim0 = on_fastest ? inputs_per_output : num_outputs;
  int64_t dim1 = on_fastest ? num_outputs : inputs_per_output;
  const int64_t fastest_stride = (on_fastest ? red[0].stride : kept[0].stride) * elem;
  int64_t output_vec = 1;
  if (fastest_stride == elem) {
    if (on_fastest && dim0 > 128) {
      dim0 /= 4;  // vectorize along the input (vt0 = input_vec_size = 4)
    } else if (!on_fastest) {  // get_output_vec_size
      output_vec = 4;
      auto fit = [&](int64_t n) { while (n % output_vec != 0) output_vec /= 2; };
      fit(in.storage_offset());
      fit(num_outputs);
      fit(red[0].stride);
      dim0 /= output_vec;
    }
  }
  const int64_t max_threads = 512 / output_vec;  // set_block_dimension
  const int64_t dim0_pow2 = dim0 < max_threads ? last_pow2(dim0) : max_threads;
  const int64_t dim1_pow2 = dim1 < max_threads ? last_pow2(dim1) : max_threads;
  int64_t block_width = std::min<int64_t>(dim0_pow2, kWarpSize);
  const int64_t block_height = std::min<int64_t>(dim1_pow2, max_threads / block_width);
  block_width = std::min<int64_t>(dim0_pow2, max_threads / block_height);
  const int64_t num_threads = block_width * block_height;
  int64_t step_input = 1, step_output = 1;
  bool block_x_reduce = false, split_input_1 = false;
  if (on_fastest) { block_x_reduce = true; step_input *= block_width; } else { step_output *= block_width; }
  auto values_per_thread = [&] { return div_up(inputs_per_output, step_input); };
  if (values_per_thread() >= block_height * 16 || values_per_thread() >= 256) {
    split_input_1 = true;
    step_input *= block_height;
  } else {
    step_output *= block_height;
  }
  const int64_t target_grid = kMultiProcessors * (kMaxThreadsPerMultiProcessor / num_threads);
  const int64_t grid_x = div_up(num_outputs / output_vec, step_output);
  if (!(split_input_1 && values_per_thread() >= 256 && grid_x <= target_grid)) return {0, 0};
  const int64_t ctas = std::max(std::min(div_up(target_grid, grid_x), div_up(values_per_thread(), 16)),
                                div_up(values_per_thread(), 256));
  if (ctas <= 1) return {0, 0};
  int64_t staging = arg_size * num_outputs * ctas;
  if (!block_x_reduce) staging *= block_width * output_vec;
  return {staging, static_cast<int64_t>(sizeof(int)) * grid_x};
}

const std::unordered_set<std::string> kStagedReductions = {"aten::sum", "aten::mean"};

// What a CUDA kernel allocates and frees inside itself, after its outputs exist.
// Memory-efficient attention's backward (_scaled_dot_product_efficient_attention_backward_cuda ->
// _efficient_attention_backward, aten/src/ATen/native/transformers/cuda/attention_backward.cu at 1e07335b, and
// mem_eff_attention/kernel_backward.h): grad_out, transposed to (B, T, H, D), is copied when not contiguous
// (freed at return); after grad_q/k/v, `delta` (B, H, T) fp32 (freed when the launch returns) and the kernel's
// fp32 workspace: for head dim <= 64 on sm80-sm89 (the 64x64 k64 kernel: grad_q accumulates in global memory,
// grad_k/v in registers) B * H * ceil(T/64) * ceil(D/64) * 16,400 B (GradQTempStorage: a 64x64 fp32 tile and
// 16 B). Larger head dims take kernels whose grad_k/v workspace is not modelled: counted, not invented.
constexpr const char* kEfficientAttentionBackward = "aten::_scaled_dot_product_efficient_attention_backward";
std::atomic<int64_t> g_attention_backwards{0};
std::atomic<int64_t> g_attention_backwards_unmodelled{0};

c10::DataPtr pre_op_temporaries(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  if (schema.name() == kEfficientAttentionBackward && !args.empty() && args[0].isTensor()) {
    const at::Tensor& grad_out = args[0].toTensor();
    if (grad_out.dim() == 4 && !grad_out.transpose(1, 2).is_contiguous())
      return g_allocator.allocate(static_cast<size_t>(grad_out.numel() * grad_out.element_size()));
  }
  return c10::DataPtr();
}

void attention_backward_temporaries(const std::vector<c10::IValue>& args) {
  if (args.size() < 2 || !args[1].isTensor() || args[1].toTensor().dim() != 4) return;
  const at::Tensor& query = args[1].toTensor();  // (B, H, T, D)
  const int64_t b = query.size(0), h = query.size(1), t = query.size(2), d = query.size(3);
  g_attention_backwards++;
  auto delta = g_allocator.allocate(static_cast<size_t>(b * h * t * 4));
  if (d > 64) { g_attention_backwards_unmodelled++; return; }
  const int64_t grad_q_floats = ((t + 63) / 64) * ((d + 63) / 64) * (16400 / 4);
  c10::DataPtr workspace = g_allocator.allocate(static_cast<size_t>(b * h * ((grad_q_floats + 3) / 4 * 4) * 4));
  delta = c10::DataPtr();  // the launch's local, freed before the workspace
}

void kernel_temporaries(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  const std::string& name = schema.name();
  if (name == kEfficientAttentionBackward) { attention_backward_temporaries(args); return; }
  if (kStagedReductions.count(name) && !args.empty() && args[0].isTensor() && is_cuda(args[0].toTensor())) {
    c10::OptionalArrayRef<int64_t> dims;
    std::vector<int64_t> dv;
    if (args.size() > 1 && args[1].isIntList()) { dv = args[1].toIntVector(); dims = dv; }
    auto [staging, sems] = reduce_staging(args[0].toTensor(), dims);
    if (staging > 0) {  // gpu_reduce_kernel: buffer, then semaphores; freed in reverse
      auto buffer = g_allocator.allocate(static_cast<size_t>(staging));
      auto semaphores = g_allocator.allocate(static_cast<size_t>(sems));
      g_reduce_staging++;
    }
    return;
  }
  // index_put_ with accumulate (an embedding's backward): index_put_with_sort_kernel
  // (aten/src/ATen/native/cuda/Indexing.cu) builds the linear index (makeLinearIndex: two int64 temporaries,
  // the first freed at once), then sorted_indices, orig_indices and the arange of positions for cub's radix
  // sort; all freed when it returns. cub's temp storage (at::cuda::cub::radix_sort_pairs asks cub for its size,
  // then allocates it from the caching allocator and frees it after the sort): 1 B for 1,024 keys, as the GPU
  // recording wedson_medium_256_training shows (cub answers 1 when a single tile sorts the keys without temp
  // storage); for more keys the size depends on cub's tuning per architecture and is not modelled.
  if (name == "aten::_index_put_impl_" && args.size() > 3 && args[3].isBool() && args[3].toBool() &&
      args[0].isTensor() && is_cuda(args[0].toTensor()) && args[1].isList()) {
    int64_t n = 0;
    for (const c10::IValue& e : args[1].toList()) {
      const c10::IValue v = e;
      if (v.isTensor() && v.toTensor().defined()) { n = v.toTensor().numel(); break; }
    }
    if (n == 0) return;
    const size_t bytes = static_cast<size_t>(n) * sizeof(int64_t);
    c10::DataPtr linear;
    {
      auto wrapped = g_allocator.allocate(bytes);  // wrapIndexOnce(...)
      linear = g_allocator.allocate(bytes);        // ... * stride
    }
    auto sorted = g_allocator.allocate(bytes);
    auto orig = g_allocator.allocate(bytes);
    auto range = g_allocator.allocate(bytes);
    if (n <= kCubSingleTileKeysMeasured) {
      auto cub_temp = g_allocator.allocate(1);
    }
    g_index_sort++;
  }
}

c10::DispatchKeySet cuda_keys() { return c10::DispatchKeySet(c10::DispatchKey::CUDA); }

struct DeviceStorage {
  c10::Storage storage;
  std::optional<c10::DispatchKeySet> view_keys;  // set for an input's storage: outputs over it are views
};

struct Mapping {
  std::unordered_map<c10::StorageImpl*, c10::Storage> to_meta;     // CUDA storage -> its meta stand-in
  std::unordered_map<c10::StorageImpl*, DeviceStorage> to_cuda;    // meta storage -> CUDA storage
  std::vector<std::pair<at::Tensor, at::Tensor>> args;             // (cuda input, its meta alias)
  std::unordered_set<c10::StorageImpl*> fresh;                     // CUDA storages the op's outputs got new
};

// A tensor over `storage` with `like`'s sizes, strides and offset. A view keeps its base's dispatch keys
// (TensorImpl's VIEW constructor, as at::native::alias_with_sizes_and_strides makes views), so a view of a
// normal tensor taken under inference_mode is not an inference tensor; a new output is made as
// at::detail::empty_generic makes it.
at::Tensor with_geometry(c10::Storage storage, c10::DispatchKeySet ks, caffe2::TypeMeta dtype,
                         const at::Tensor& like, bool view = false) {
  auto impl = view ? c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, std::move(storage), ks, dtype)
                   : c10::make_intrusive<c10::TensorImpl>(std::move(storage), ks, dtype);
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return at::Tensor(std::move(impl));
}

at::Tensor meta_alias(const at::Tensor& t, Mapping& m) {
  auto* si = t.storage().unsafeGetStorageImpl();
  auto it = m.to_meta.find(si);
  if (it == m.to_meta.end()) {
    c10::Storage ms(c10::Storage::use_byte_size_t(), t.storage().nbytes(), c10::GetAllocator(c10::kMeta),
                    /*resizable=*/true);
    it = m.to_meta.emplace(si, ms).first;
    m.to_cuda.emplace(ms.unsafeGetStorageImpl(), DeviceStorage{t.storage(), t.key_set()});
  }
  auto meta = with_geometry(it->second, c10::DispatchKeySet(c10::DispatchKey::Meta), t.dtype(), t);
  m.args.emplace_back(t, meta);
  return meta;
}

// An op's argument with each CUDA tensor in it (alone, in a tensor list, or in a list such as index's Tensor?[])
// replaced by f(tensor), and a CUDA device argument (factory ops' device=) by `device`: the meta pass and, with
// values on, the host pass see the same arguments on another device.
template <class F>
c10::IValue map_cuda(const c10::IValue& v, F& f, c10::DeviceType device) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    return is_cuda(t) ? c10::IValue(f(t)) : v;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(is_cuda(t) ? f(t) : t);
    return out;
  }
  if (v.isList()) {
    auto in = v.toList();
    bool any = false;
    for (const c10::IValue& e : in) any = any || (e.isTensor() && is_cuda(e.toTensor()));
    if (!any) return v;
    c10::impl::GenericList out(in.elementType());
    for (const c10::IValue& e : in) out.push_back(map_cuda(e, f, device));
    return out;
  }
  if (v.isDevice() && v.toDevice().is_cuda()) return c10::IValue(c10::Device(device));
  return v;
}

c10::IValue to_meta(const c10::IValue& v, Mapping& m) {
  auto alias = [&m](const at::Tensor& t) { return meta_alias(t, m); };
  return map_cuda(v, alias, c10::DeviceType::Meta);
}

at::Tensor from_meta_tensor(const at::Tensor& out, Mapping& m) {
  if (!out.defined() || !out.is_meta()) return out;
  for (auto& [cuda, meta] : m.args)  // in-place and out= ops return their argument
    if (out.unsafeGetTensorImpl() == meta.unsafeGetTensorImpl()) return cuda;
  auto* msi = out.storage().unsafeGetStorageImpl();
  auto it = m.to_cuda.find(msi);
  if (it == m.to_cuda.end()) {  // a new output: the device allocation a CUDA kernel makes
    c10::Storage cs(c10::Storage::use_byte_size_t(), out.storage().nbytes(), &g_allocator, /*resizable=*/true);
    m.fresh.insert(cs.unsafeGetStorageImpl());
    it = m.to_cuda.emplace(msi, DeviceStorage{cs, std::nullopt}).first;
  }
  const DeviceStorage& ds = it->second;
  return with_geometry(ds.storage, ds.view_keys.value_or(cuda_keys()), out.dtype(), out, ds.view_keys.has_value());
}

c10::IValue from_meta(const c10::IValue& v, Mapping& m) {
  if (v.isTensor()) return from_meta_tensor(v.toTensor(), m);
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(from_meta_tensor(t, m));
    return out;
  }
  return v;
}

// After the op: a mutated argument's geometry and storage size follow its meta alias (resize_, as_strided_,
// set_ ...). A storage that grew gets a new device allocation, as resize_ on CUDA does.
void sync_mutated(Mapping& m) {
  for (auto& [cuda, meta] : m.args) {
    auto* impl = cuda.unsafeGetTensorImpl();
    size_t want = meta.storage().nbytes();
    if (want > cuda.storage().nbytes()) {
      auto dp = g_allocator.allocate(want);
      // the old contents move too (values on), as resize_bytes_cuda copies them (aten/src/ATen/native/cuda/
      // Resize.cpp): all_gather_object resizes its pickled bytes to the largest rank's size
      const void* old = cuda.storage().data_ptr().get();
      if (old != nullptr && g_values.load(std::memory_order_relaxed))
        std::memcpy(dp.get(), old, cuda.storage().nbytes());
      cuda.storage().set_data_ptr_noswap(std::move(dp));
      cuda.storage().set_nbytes(want);
    }
    if (cuda.sizes() != meta.sizes() || cuda.strides() != meta.strides() ||
        cuda.storage_offset() != meta.storage_offset())
      impl->set_sizes_and_strides(meta.sizes(), meta.strides(), meta.storage_offset());
  }
}

// ---- values mode: the CPU kernel on host views of the device memory ------------------------------------
// A host tensor over `t`'s device memory (values mode: the memory exists at the device address): same dtype,
// sizes, strides and offset; it never frees the memory.
at::Tensor host_view(const at::Tensor& t) {
  c10::Storage s(c10::Storage::use_byte_size_t(), t.storage().nbytes(),
                 c10::DataPtr(t.storage().data_ptr().get(), c10::Device(c10::DeviceType::CPU)), nullptr, false);
  return with_geometry(std::move(s), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype(), t);
}

struct HostArgs {
  std::vector<std::pair<c10::TensorImpl*, at::Tensor>> views;  // (host view, the device tensor it shows)
};

c10::IValue to_host(const c10::IValue& v, HostArgs& h) {
  auto view = [&h](const at::Tensor& t) {
    at::Tensor hv = host_view(t);
    h.views.emplace_back(hv.unsafeGetTensorImpl(), t);
    return hv;
  };
  return map_cuda(v, view, c10::DeviceType::CPU);
}

// Ops with no CPU kernel (the GPU-only kernels: memory-efficient and flash attention, fused optimizers of some
// builds): their outputs keep no values (zeros: fresh pages), counted by op name for the capture's description.
std::mutex g_skipped_mu;
std::map<std::string, int64_t> g_values_skipped;

bool has_cpu_kernel(const c10::OperatorHandle& op) {
  using c10::DispatchKey;
  for (DispatchKey k : {DispatchKey::CPU, DispatchKey::CompositeExplicitAutograd,
                        DispatchKey::CompositeExplicitAutogradNonFunctional, DispatchKey::CompositeImplicitAutograd})
    if (op.hasKernelForDispatchKey(k)) return true;
  return false;
}

// Arguments whose dtype the device (a CUDA kernel's meta) and the CPU kernel choose differently, in the CPU kernel's:
// native_layer_norm keeps its mean and rstd in fp32 for a bf16/fp16 input on CUDA (layer_norm_kernel.cu: acc type, as
// the meta kernel says), in the input's dtype on CPU unless the weight is fp32 (layer_norm_kernel.cpp:
// param_scalar_type), and its CPU backward refuses the other ("expected scalar type BFloat16 but found Float").
void cpu_kernel_dtypes(const c10::FunctionSchema& schema, torch::jit::Stack& host) {
  if (schema.name() != "aten::native_layer_norm_backward" || host.size() < 6) return;
  const at::Tensor& input = host[1].toTensor();
  const bool reduced = input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf;
  bool mixed = false;
  for (size_t i : {size_t(5), size_t(6)})
    if (i < host.size() && host[i].isTensor() && host[i].toTensor().defined())
      mixed = mixed || (reduced && host[i].toTensor().scalar_type() == at::kFloat);
  const at::ScalarType stats = mixed ? at::kFloat : input.scalar_type();
  for (size_t i : {size_t(3), size_t(4)})
    if (host[i].isTensor() && host[i].toTensor().defined() && host[i].toTensor().scalar_type() != stats)
      host[i] = host[i].toTensor().to(stats);
}

// Run `op`'s CPU kernel on host views of `args` (the device arguments as called, after the meta kernel resized
// any); returns its outputs, none for an op without a CPU kernel (counted). The CPU kernel writes in-place and
// out= results straight into the device memory; its own errors are the program's (an index out of range
// raises here as a device-side assert does on a GPU).
torch::jit::Stack host_run(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, HostArgs& h) {
  torch::jit::Stack host;
  if (!has_cpu_kernel(op)) {
    std::lock_guard<std::mutex> g(g_skipped_mu);
    g_values_skipped[c10::toString(op.schema().operator_name())]++;
    return host;
  }
  host.reserve(args.size());
  for (const c10::IValue& a : args) host.push_back(to_host(a, h));
  cpu_kernel_dtypes(op.schema(), host);
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &host);
  return host;
}

// A new output's values: the CPU kernel's output copied into the device output the meta kernel made.
void fill_fresh(const c10::IValue& out, const c10::IValue& val, const Mapping& m) {
  if (out.isTensor() && val.isTensor()) {
    const at::Tensor& o = out.toTensor();
    if (is_cuda(o) && m.fresh.count(o.storage().unsafeGetStorageImpl())) host_view(o).copy_(val.toTensor());
  } else if (out.isTensorList() && val.isTensorList()) {
    auto os = out.toTensorList();
    auto vs = val.toTensorList();
    for (size_t i = 0; i < os.size() && i < vs.size(); ++i) fill_fresh(c10::IValue(os.get(i)), c10::IValue(vs.get(i)), m);
  }
}

// An op whose output shapes depend on values (nonzero, masked_select, a boolean mask's index, unique ...): the
// CPU kernel runs first, and each output that is not an argument becomes a new device allocation of its
// (contiguous) size, holding its values. The GPU kernel's own temporaries for such ops are not modelled.
c10::IValue to_device_output(const c10::IValue& v, const HostArgs& h) {
  if (v.isTensor()) {
    const at::Tensor& r = v.toTensor();
    if (!r.defined() || !r.device().is_cpu()) return v;
    for (const auto& [impl, cuda] : h.views)
      if (impl == r.unsafeGetTensorImpl()) return cuda;  // in-place and out= ops return their argument
    at::Tensor c = r.contiguous();
    c10::Storage cs(c10::Storage::use_byte_size_t(), c.nbytes(), &g_allocator, /*resizable=*/true);
    at::Tensor out = with_geometry(cs, cuda_keys(), c.dtype(), c);
    if (c.nbytes() > 0) std::memcpy(cs.data_ptr().get(), c.data_ptr(), c.nbytes());
    return out;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(to_device_output(c10::IValue(t), h).toTensor());
    return out;
  }
  return v;
}

// Returns a CUDA kernel makes on the host: the fused attention kernels' philox seed and offset (attention.cu:
// at::empty({}, at::dtype(at::kLong)) unless a CUDA graph is being captured); their meta kernels say "meta".
const std::unordered_set<std::string> kHostReturns = {"philox_seed", "philox_offset"};

// The device an op runs on, as a CUDA kernel's device guard picks it: an explicit CUDA `device=` argument with an
// index, else the first CUDA tensor argument's device; none (the current device) otherwise.
std::optional<c10::Device> op_device(const std::vector<c10::IValue>& args) {
  for (const c10::IValue& a : args)
    if (a.isDevice() && a.toDevice().is_cuda() && a.toDevice().has_index()) return a.toDevice();
  for (const c10::IValue& a : args) {
    if (a.isTensor() && is_cuda(a.toTensor())) return a.toTensor().device();
    if (a.isTensorList()) {
      for (const at::Tensor& t : a.toTensorList())
        if (is_cuda(t)) return t.device();
    } else if (a.isList()) {
      for (const c10::IValue& e : a.toList())
        if (e.isTensor() && is_cuda(e.toTensor())) return e.toTensor().device();
    }
  }
  return std::nullopt;
}

void cuda_via_meta(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto n_args = schema.arguments().size();
  const size_t base = stack->size() - n_args;
  std::vector<c10::IValue> args(stack->end() - n_args, stack->end());  // the CUDA arguments, as called
  c10::OptionalDeviceGuard device_guard(op_device(args));  // outputs and temporaries on the op's device
  const bool values = g_values.load(std::memory_order_relaxed);
  Mapping m;
  for (size_t i = base; i < stack->size(); ++i) (*stack)[i] = to_meta((*stack)[i], m);
  if (kCublasOps.count(schema.name())) cublas_workspace();  // before the output: what the recordings show
  c10::DataPtr before_outputs = pre_op_temporaries(schema, args);  // freed after the kernel's own temporaries
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  } catch (const std::exception& e) {  // no meta kernel, or an output shape that depends on values
    std::string what = e.what();
    TORCH_CHECK_NOT_IMPLEMENTED(values, "rlhfmem simulated CUDA device: ", schema.operator_name(),
                                " cannot run without values (its meta kernel: ", what.substr(0, what.find('\n')),
                                "); run with values on (--sim-values on) to compute them");
    if (stack->size() > base) stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
    TORCH_CHECK_NOT_IMPLEMENTED(has_cpu_kernel(op), "rlhfmem simulated CUDA device (values on): ",
                                schema.operator_name(), " has neither a meta kernel that runs without values (",
                                what.substr(0, what.find('\n')), ") nor a CPU kernel to compute them");
    HostArgs h;
    for (c10::IValue& r : host_run(op, args, h)) stack->push_back(to_device_output(r, h));
    kernel_temporaries(schema, args);
    return;
  }
  const auto n_out = schema.returns().size();
  const size_t first_out = stack->size() - n_out;
  for (size_t i = first_out; i < stack->size(); ++i) {
    const c10::IValue& v = (*stack)[i];
    if (v.isTensor() && kHostReturns.count(schema.returns()[i - first_out].name())) {
      (*stack)[i] = at::empty(v.toTensor().sizes(), v.toTensor().options().device(at::kCPU));
    } else {
      (*stack)[i] = from_meta(v, m);
    }
  }
  sync_mutated(m);
  if (values) {
    HostArgs h;
    torch::jit::Stack host = host_run(op, args, h);
    for (size_t i = 0; i < n_out && i < host.size(); ++i) {
      if (kHostReturns.count(schema.returns()[i].name())) (*stack)[first_out + i] = host[i];
      else fill_fresh((*stack)[first_out + i], host[i], m);
    }
  }
  kernel_temporaries(schema, args);
}

// .item() on a device tensor. Values on: the value in the device memory. Off, no value exists, and the answers let
// control flow take the normal path: false for bool (no overflow found), 1 for floats (a finite norm / loss),
// 2**62 for integers (an end index that Python slicing clamps); each counted by dtype.
at::Scalar local_scalar_dense(const at::Tensor& self) {
  if (g_values.load(std::memory_order_relaxed)) return host_view(self).item();
  auto st = self.scalar_type();
  if (st == at::kBool) { g_scalar_answers[0]++; return at::Scalar(false); }
  if (at::isIntegralType(st, /*includeBool=*/false)) {
    g_scalar_answers[1]++;
    return (st == at::kByte || st == at::kChar) ? at::Scalar(int64_t(0)) : at::Scalar(int64_t(1) << 62);
  }
  if (at::isFloatingType(st)) { g_scalar_answers[2]++; return at::Scalar(1.0); }
  g_scalar_answers[3]++;
  return at::Scalar(1.0);
}

// A copy into, out of or within the device: the bytes move with values on (host views of the device memory;
// conversions and broadcasting as the CPU's copy_ does them). With values off nothing moves, except that a host
// tensor copied from the device reads zeros: the device computed nothing, and a host buffer left as it was would
// hold whatever its memory held (torch.empty), so host code reading it (DeepSpeed's overflow check of offloaded
// fp32 gradients: has_overflow_partitioned_grads_serial) would decide differently from run to run (ZeRO-3 with
// CPU offload skipped its actor's step in some runs: 22,146 to 22,259 trace events, tiny OPT). Zeros are no
// overflow, as the device's fixed answers are (false for a device flag read).
at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool) {
  if (!g_values.load(std::memory_order_relaxed)) {
    if (!is_cuda(self) && is_cuda(src)) self.zero_();
    return self;
  }
  at::Tensor dst = is_cuda(self) ? host_view(self) : self;
  dst.copy_(is_cuda(src) ? host_view(src) : src);
  return self;
}

// scaled_dot_product_attention's backend: on a GPU, _fused_sdp_choice_cuda (aten/src/ATen/native/transformers/
// cuda/sdp_utils.cpp) picks by dtype, head size, mask and architecture; here the choice is a setting (SDPBackend's
// values: 0 math, 1 flash_attention, 2 efficient_attention), math unless set, so a run says which kernels it
// models. The efficient kernel's allocations are its meta kernels' outputs (output, logsumexp; no score matrix).
std::atomic<int64_t> g_sdp_backend{0};
int64_t fused_sdp_choice(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                         double, bool, std::optional<double>, bool) {
  return g_sdp_backend.load();
}

}  // namespace

TORCH_LIBRARY_IMPL(_, CUDA, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&cuda_via_meta>()); }

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("copy_", TORCH_FN(copy_));
  m.impl("_fused_sdp_choice", TORCH_FN(fused_sdp_choice));
}

// ---- on a CUDA build of torch ------------------------------------------------------------------------
// A CPU build registers (almost) no kernel for the CUDA key, so the device runs each op through the boxed
// fallback above, or through the op's composite kernel (CompositeExplicitAutogradNonFunctional,
// CompositeExplicitAutograd, CompositeImplicitAutograd) where it has one: the dispatch table's precedence
// (aten/src/ATen/core/dispatch/OperatorEntry.cpp: computeDispatchTableEntryWithDebug). A CUDA build's
// libtorch_cuda registers real CUDA kernels for ~1,300 ops, which win over a fallback, its CUDA guard, its
// DispatchStub pointers and its CUDA hooks. simcuda/build.py loads this library, then calls
// rlhfmem_sim_cuda_note_cpu_kernels(), then loads libtorch_cuda, then calls rlhfmem_sim_cuda_take_over(): every
// op that got a direct CUDA kernel since the note gets the table entry a CPU build computes for CUDA again, as
// a direct CUDA kernel of this library (a later registration wins: OperatorEntry::registerKernel): its
// composite kernel where it has one (reached through a backend key nobody registers kernels for, whose table
// entry is computed the same way: PrivateUse3), else cuda_via_meta. AutogradCUDA, for the ops whose only
// composite besides CompositeExplicitAutogradNonFunctional is CompositeImplicitAutograd: the CPU build's entry
// is that kernel (no CUDA kernel and no CompositeExplicitAutograd one), the CUDA build's is the op's autograd
// kernel (a CUDA kernel exists); it gets the composite again (through AutogradPrivateUse3).
namespace {
constexpr c10::DispatchKey kMirror = c10::DispatchKey::PrivateUse3;
constexpr c10::DispatchKey kAutogradMirror = c10::DispatchKey::AutogradPrivateUse3;
std::unordered_set<std::string> g_cpu_build_cuda_kernels;  // "ns::name.overload" with a CUDA kernel at the note
bool g_noted = false;
std::atomic<int64_t> g_taken_over[3];  // CUDA kernels -> fallback, CUDA kernels -> composite, AutogradCUDA

void cuda_composite(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(kMirror), stack);
}
void autograd_cuda_composite(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(kAutogradMirror), stack);
}

std::string qualified(const c10::OperatorName& n) {
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

std::vector<std::unique_ptr<torch::Library>> g_takeover_libraries;
torch::Library& library_for(std::unordered_map<std::string, torch::Library*>& libs, const std::string& ns,
                            c10::DispatchKey key) {
  auto it = libs.find(ns);
  if (it != libs.end()) return *it->second;
  g_takeover_libraries.push_back(
      std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, static_cast<uint32_t>(__LINE__)));
  return *libs.emplace(ns, g_takeover_libraries.back().get()).first->second;
}
}  // namespace

namespace {
struct RegisterAllocator {
  RegisterAllocator() {
    c10::SetAllocator(c10::DeviceType::CUDA, &g_allocator, /*priority=*/100);
    // scaled_dot_product_attention asks this DispatchStub, not the op, and a CPU build registers no CUDA kernel
    at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&fused_sdp_choice);
  }
} g_register_allocator;
}  // namespace

// ---- read by Python through ctypes ---------------------------------------------------------------------
extern "C" {
int rlhfmem_sim_cuda_loaded() { return 1; }
// Values mode on (see "values mode"): before the first device allocation only. Returns 0, -1 when a device
// allocation exists already, -2 when the address range cannot be reserved (errno's mmap failure).
int64_t rlhfmem_sim_cuda_set_values(int on) {
  if (!on) return g_values.load() ? -1 : 0;
  if (g_values.load()) return 0;
  {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_events.empty()) return -1;
  }
  void* p = mmap(nullptr, kValuesRange, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return -2;
  g_values_base = reinterpret_cast<uint64_t>(p);
  g_next_addr = g_values_base;
  g_values = true;
  return 0;
}
int64_t rlhfmem_sim_cuda_values() { return g_values.load() ? 1 : 0; }
// The ops whose values were not computed (no CPU kernel), as "name=count" lines into buf (up to cap bytes, cut
// at a line); returns the bytes written.
int64_t rlhfmem_sim_cuda_values_skipped(char* buf, int64_t cap) {
  std::lock_guard<std::mutex> g(g_skipped_mu);
  std::string out;
  for (const auto& [name, n] : g_values_skipped) {
    std::string line = name + "=" + std::to_string(n) + "\n";
    if (static_cast<int64_t>(out.size() + line.size()) > cap) break;
    out += line;
  }
  std::memcpy(buf, out.data(), out.size());
  return static_cast<int64_t>(out.size());
}
// Before a CUDA build's libtorch_cuda is loaded: remember which ops have a CUDA kernel (what a CPU build has).
int64_t rlhfmem_sim_cuda_note_cpu_kernels() {
  auto& d = c10::Dispatcher::singleton();
  for (const c10::OperatorName& n : d.getAllOpNames()) {
    auto op = d.findOp(n);
    if (op && op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) g_cpu_build_cuda_kernels.insert(qualified(n));
  }
  g_noted = true;
  return static_cast<int64_t>(g_cpu_build_cuda_kernels.size());
}
// After libtorch_cuda is loaded (see "on a CUDA build of torch"): the device's CUDA hooks stay (registered
// preferred), its guard, allocator, DispatchStub and own kernels are registered again, and every op with a CUDA
// kernel not noted gets the CPU build's table entry back. Returns the ops taken over, -1 without the note.
int64_t rlhfmem_sim_cuda_take_over() {
  if (!g_noted) return -1;
  using c10::DispatchKey;
  rlhfmem::register_fake_cuda_guard_again();
  c10::SetAllocator(c10::DeviceType::CUDA, &g_allocator, /*priority=*/100);
  at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&fused_sdp_choice);
  std::unordered_map<std::string, torch::Library*> cuda_libs, autograd_libs;
  auto& d = c10::Dispatcher::singleton();
  int64_t n_ops = 0;
  for (const c10::OperatorName& n : d.getAllOpNames()) {
    auto op = d.findOp(n);
    if (!op || !op->hasKernelForDispatchKey(DispatchKey::CUDA)) continue;
    const std::string name = qualified(n);
    if (g_cpu_build_cuda_kernels.count(name)) continue;
    const std::string ns = name.substr(0, name.find("::"));
    const bool implicit = op->hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd);
    const bool explicit_ = op->hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd);
    const bool composite = implicit || explicit_ ||
                           op->hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutogradNonFunctional);
    if (composite && !op->hasKernelForDispatchKey(kMirror)) {
      library_for(cuda_libs, ns, DispatchKey::CUDA)
          .impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&cuda_composite>());
      g_taken_over[1]++;
    } else {
      library_for(cuda_libs, ns, DispatchKey::CUDA)
          .impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&cuda_via_meta>());
      g_taken_over[0]++;
    }
    if (implicit && !explicit_ && !op->hasKernelForDispatchKey(DispatchKey::AutogradCUDA) &&
        !op->hasKernelForDispatchKey(kAutogradMirror)) {
      library_for(autograd_libs, ns, DispatchKey::AutogradCUDA)
          .impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&autograd_cuda_composite>());
      g_taken_over[2]++;
    }
    n_ops++;
  }
  auto& aten = library_for(cuda_libs, "aten", DispatchKey::CUDA);  // the device's own, replaced by libtorch_cuda's
  aten.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  aten.impl("copy_", TORCH_FN(copy_));
  aten.impl("_fused_sdp_choice", TORCH_FN(fused_sdp_choice));
  return n_ops;
}
// 0: CUDA kernels replaced by the meta fallback, 1: by the op's composite kernel, 2: AutogradCUDA composites.
int64_t rlhfmem_sim_cuda_taken_over(int kind) { return kind >= 0 && kind < 3 ? g_taken_over[kind].load() : -1; }
void rlhfmem_sim_cuda_set_workspace_bytes(int64_t n) { g_workspace_bytes = n; }
void rlhfmem_sim_cuda_set_stream(int64_t s) { t_stream = s; }
void rlhfmem_sim_cuda_set_sdp_backend(int64_t b) { g_sdp_backend = b; }
int64_t rlhfmem_sim_cuda_stream() { return t_stream; }
// Python's stand-ins log what changes when a freed block returns to the pool (simcuda/library.py:
// delay_record_stream_frees): 3 = Tensor.record_stream(storage at addr, stream), 4 = the host waits for
// stream (-1: every stream: synchronize, empty_cache); and 6 = torch.cuda.empty_cache() (simcuda/torch_cuda.py).
void rlhfmem_sim_cuda_log(int64_t action, uint64_t addr, int64_t stream) { log_event(action, addr, 0, stream); }
int64_t rlhfmem_sim_cuda_workspaces() { return g_workspaces.load(); }
// The device addresses of the cuBLAS workspaces made so far (never freed, so each names one allocation), in
// creation order: up to cap of them into out; returns how many were copied.
int64_t rlhfmem_sim_cuda_workspace_addresses(uint64_t* out, int64_t cap) {
  std::lock_guard<std::mutex> g(g_ws_mu);
  int64_t n = 0;
  for (const auto& p : g_workspace_holders) {
    if (n >= cap) break;
    out[n++] = reinterpret_cast<uint64_t>(p.get());
  }
  return n;
}
int64_t rlhfmem_sim_cuda_reduce_stagings() { return g_reduce_staging.load(); }
int64_t rlhfmem_sim_cuda_index_sorts() { return g_index_sort.load(); }
int64_t rlhfmem_sim_cuda_attention_backwards() { return g_attention_backwards.load(); }
int64_t rlhfmem_sim_cuda_attention_backwards_unmodelled() { return g_attention_backwards_unmodelled.load(); }
int64_t rlhfmem_sim_cuda_scalar_answers(int kind) { return kind >= 0 && kind < 4 ? g_scalar_answers[kind].load() : -1; }
// Copy events [start, start + cap) into the caller's arrays; returns how many were copied.
int64_t rlhfmem_sim_cuda_events(int64_t start, int64_t cap, int64_t* action, uint64_t* addr, int64_t* size,
                                int64_t* stream, int64_t* time_us) {
  std::lock_guard<std::mutex> g(g_mu);
  int64_t n = 0;
  for (int64_t i = start; i < static_cast<int64_t>(g_events.size()) && n < cap; ++i, ++n) {
    const Ev& e = g_events[i];
    action[n] = e.action; addr[n] = e.addr; size[n] = e.size; stream[n] = e.stream; time_us[n] = e.time_us;
  }
  return n;
}
int64_t rlhfmem_sim_cuda_event_count() {
  std::lock_guard<std::mutex> g(g_mu);
  return static_cast<int64_t>(g_events.size());
}
// torch.UntypedStorage.resize_ of a device storage, which a CPU build refuses ("built without USE_CUDA";
// torch/csrc/StorageMethods.cpp). As aten/src/ATen/native/cuda/Resize.cpp: resize_bytes_cuda: to 0 bytes the block
// is freed; otherwise a new block on the storage's device, the old contents copied (values on), then the old
// freed. FSDP2 frees and re-allocates its unsharded parameters this way (_fsdp_param.py: free_storage,
// alloc_storage). `impl`: the c10::StorageImpl (Python: storage._cdata). Returns 0, -1 when it is not resizable.
int64_t rlhfmem_sim_cuda_resize_storage(void* impl, int64_t nbytes) {
  auto* s = static_cast<c10::StorageImpl*>(impl);
  if (!s->resizable()) return -1;
  const c10::Device device = s->device();
  if (nbytes == 0) {
    s->set_data_ptr_noswap(at::DataPtr(nullptr, device));
    s->set_nbytes(0);
    return 0;
  }
  c10::DeviceGuard guard(device);
  c10::Allocator* allocator = s->allocator() != nullptr ? s->allocator() : &g_allocator;
  at::DataPtr data = allocator->allocate(static_cast<size_t>(nbytes));
  if (s->data_ptr().get() != nullptr && g_values.load())
    std::memcpy(data.get(), s->data_ptr().get(), std::min<size_t>(s->nbytes(), static_cast<size_t>(nbytes)));
  s->set_data_ptr_noswap(std::move(data));
  s->set_nbytes(static_cast<size_t>(nbytes));
  return 0;
}
// A stamp of the device's clock now (advancing it), e.g. a snapshot's own history entry.
int64_t rlhfmem_sim_cuda_stamp_us() {
  std::lock_guard<std::mutex> g(g_mu);
  return stamp_us();
}
// Microseconds to add to a stamp (a log event's or an annotation's time_us) for microseconds since the epoch.
int64_t rlhfmem_sim_cuda_epoch_offset_us() { return g_epoch_offset_us; }
// The memory history's annotation callback (see "the memory history's annotations"): on (global: every thread's
// record_function, else the calling thread's, as PyTorch's global_record_annotations) or off. Returns 0.
int64_t rlhfmem_sim_cuda_set_annotations(int on, int global) {
  if (g_annotation_handle != 0) {
    at::removeCallback(g_annotation_handle);
    g_annotation_handle = 0;
  }
  if (!on) return 0;
  auto callback = at::RecordFunctionCallback(
                      [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                        record_annotation(fn, 0);
                        return nullptr;
                      },
                      [](const at::RecordFunction& fn, at::ObserverContext*) { record_annotation(fn, 1); })
                      .scopes({at::RecordScope::USER_SCOPE});
  g_annotation_handle = global ? at::addGlobalCallback(callback) : at::addThreadLocalCallback(callback);
  return 0;
}
int64_t rlhfmem_sim_cuda_annotation_count() {
  std::lock_guard<std::mutex> g(g_mu);
  return static_cast<int64_t>(g_annotations.size());
}
// Annotation i: its name into name (up to cap bytes, not terminated), stage (0 START, 1 END), device and time_us;
// returns the name's full length, -1 when there is no annotation i.
int64_t rlhfmem_sim_cuda_annotation(int64_t i, char* name, int64_t cap, int64_t* stage, int64_t* device,
                                    int64_t* time_us) {
  std::lock_guard<std::mutex> g(g_mu);
  if (i < 0 || i >= static_cast<int64_t>(g_annotations.size())) return -1;
  const Annotation& a = g_annotations[i];
  std::memcpy(name, a.name.data(), std::min<size_t>(a.name.size(), static_cast<size_t>(cap)));
  *stage = a.stage; *device = a.device; *time_us = a.time_us;
  return static_cast<int64_t>(a.name.size());
}
}
