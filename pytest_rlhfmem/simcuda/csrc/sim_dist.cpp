// The simulated CUDA device's process group: `nccl` as a GPU program asks for it, and `gloo` on device tensors.
//
// A Python extension of torch (built by simcuda/build.py: dist_library_path, loaded by simcuda/distributed.py after
// `import torch`, in every rank of a `rlhfmem capture --device cuda-sim` command). On a CPU-only torch build
// `init_process_group("nccl")` fails ("Distributed package doesn't have NCCL built in") and gloo, given tensors of the
// simulated device, reads memory that is not host memory. SimBackend is a c10d::Backend that takes the CUDA device's
// place in a ProcessGroup:
//
// - kind NCCL: what `ProcessGroupNCCL(store, rank, size, options)` returns on the simulated device (simcuda/
//   distributed.py registers it under that name). Its collectives follow torch/csrc/distributed/c10d/
//   ProcessGroupNCCL.cpp of the pinned torch (2.13.0, git cf30153c; its ProcessGroupNCCL.hpp ships in the wheel, and
//   the .cpp read is the version with TensorShelf and asyncOp-dependent streams that header declares) in what touches
//   device memory:
//     * asyncOp=false (a blocking call: `async_op=False`, the default): the collective runs on the caller's current
//       stream; nothing is stashed and no work is returned (`collective(): return asyncOp ? work : nullptr`);
//     * asyncOp=true: it runs on the group's internal stream; the inputs and outputs are stashed in the work
//       (`stashed_for_allocator_safety_`, a TensorShelf) until `work.wait()` (`synchronizeStream`: unstash), or until
//       the watchdog has seen the work complete and the next collective of the group is enqueued (`workEnqueue`
//       unstashes `shelvesToUnstash_`). The device does no work, so a collective is complete at once: a stash not
//       waited for is released at the end of the group's next enqueued operation (the earliest a GPU run can free it;
//       the watchdog polls every 100 ms, so on a GPU it may live longer). TORCH_NCCL_AVOID_RECORD_STREAMS is the
//       default there ("is the default now, this environment variable is thus deprecated"): collectives never call
//       recordStream;
//     * what ProcessGroupNCCL allocates itself, through the caching allocator, on the caller's current stream:
//       `all_gather` into a list of equal sizes (`newLikeFlat(outputs)`, the flattened output, then copied into the
//       list), `reduce_scatter` from a list (`newLikeFlat(inputs)`, the flattened input), `barrier` (a 1-element fp32
//       tensor, `at::zeros({1})`, all-reduced; and ProcessGroup::barrier's own 1-byte tensor, ProcessGroup.hpp). The
//       flattened buffer lives as long as the work's `outputs_` (a blocking call: until it returns);
//     * point-to-point (send, recv): `recordStream` of the tensor on the pair's stream, no stash. Under the device's
//       `immediate` record_stream bound (the only one a command capture supports) this changes no figure;
//     * NCCL's own buffers (cudaMalloc'd by NCCL for its channels, outside PyTorch's caching allocator) are not
//       modelled: they are not part of `memory_reserved()` on a GPU either.
//   Errors as ProcessGroupNCCL raises them: BAND/BOR/BXOR, AVG on bool, PREMUL_SUM on other than half/float/bf16/
//   double, all_gather_coalesced, recv_anysource, sparse all_reduce, non-contiguous tensors.
// - kind GLOO: a ProcessGroupGloo that a `gloo` group registered for the CUDA device (simcuda/distributed.py:
//   route_cuda_to_host). Gloo copies device tensors through pinned host memory (no device allocation) and keeps the
//   tensors in its work until the work is destroyed; the device does the same.
//
// Values: with the device's values on (simcuda/library.py: values_mode), a device tensor's memory is host memory at
// its device address, so each collective runs the host ProcessGroupGloo (`host_`, on its own store prefix) on host
// views of the device tensors: real results. Collectives complete before they return (a work is already complete);
// send and recv run asynchronously on the host and their work waits for them. With values off, nothing moves: the
// outputs keep whatever they held (shapes, dtypes and the allocations above only).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Utils.hpp>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using Tensors = std::vector<at::Tensor>;
using c10d::OpType;

enum class Kind { NCCL, GLOO };

// ProcessGroupNCCL's MULTI_DEVICE_ERROR_MSG
constexpr const char* kMultiDevice =
    "Expecting one tensor only but got multiple. You are probably using multiple devices under one thread. The "
    "support for such usage has been deprecated.";

// ---- what the simulated groups did, for the capture description (collective name -> calls) --------------------
std::mutex g_count_mu;
std::map<std::string, int64_t> g_counts;
void count(const std::string& name) {
  std::lock_guard<std::mutex> g(g_count_mu);
  g_counts[name]++;
}

// ---- host views (values mode: the device memory is host memory at the device address) ----------------------------
// A CPU tensor over `t`'s memory: same dtype, sizes, strides and offset; it never frees the memory.
at::Tensor host_view(const at::Tensor& t) {
  if (!t.defined()) return t;
  c10::Storage s(c10::Storage::use_byte_size_t(), t.storage().nbytes(),
                 c10::DataPtr(const_cast<void*>(t.storage().data_ptr().get()), c10::Device(c10::DeviceType::CPU)),
                 nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(s), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}
Tensors host_views(const Tensors& ts) {
  Tensors out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(host_view(t));
  return out;
}
// The bytes of a contiguous host tensor (data movement is exact for every dtype, those gloo cannot reduce included).
at::Tensor bytes(const at::Tensor& h) { return h.reshape({-1}).view(at::kByte); }

void wait_all(const std::vector<WorkPtr>& works) {
  for (const auto& w : works)
    if (w) w->wait();
}

// ---- TensorShelf (ProcessGroupNCCL.hpp): references kept so the caching allocator cannot reuse them early ----------
struct Shelf {
  std::mutex mu;
  Tensors tensors;
  void stash(const Tensors& ts) {
    std::lock_guard<std::mutex> g(mu);
    for (const auto& t : ts)
      if (t.defined()) tensors.push_back(t);
  }
  void clear() {
    Tensors gone;
    {
      std::lock_guard<std::mutex> g(mu);
      gone.swap(tensors);
    }
  }
  bool empty() {
    std::lock_guard<std::mutex> g(mu);
    return tensors.empty();
  }
};

// ---- the work a simulated collective returns ------------------------------------------------------------------
class SimWork : public c10d::Work {
 public:
  SimWork(int rank, OpType type, Tensors outputs, c10::Device device)
      : Work(rank, type), outputs_(std::move(outputs)), shelf_(std::make_shared<Shelf>()) {
    Tensors defined;
    for (const auto& t : outputs_)
      if (t.defined()) defined.push_back(t);
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{device});
    future_->markCompleted(c10::IValue(defined));  // as ProcessGroupNCCL: completed with the outputs at once
  }
  std::shared_ptr<Shelf> shelf() const { return shelf_; }
  void add_host_work(WorkPtr w) { host_.push_back(std::move(w)); }
  void keep(const Tensors& ts) {  // gloo's work holds its tensors until it is destroyed
    for (const auto& t : ts)
      if (t.defined()) kept_.push_back(t);
  }
  bool isCompleted() override {
    for (const auto& w : host_)
      if (w && !w->isCompleted()) return false;
    return true;
  }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    wait_host();
    shelf_->clear();  // WorkNCCL::synchronizeStream: unstash after the current stream waits for the work
    return true;
  }
  void synchronize() override {
    wait_host();
    shelf_->clear();
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    wait_host();  // send/recv: the host transport has finished before anyone reads the values
    return future_;
  }

 private:
  void wait_host() {
    std::vector<WorkPtr> pending;
    {
      std::lock_guard<std::mutex> g(mu_);
      pending.swap(host_);
    }
    wait_all(pending);
  }
  std::mutex mu_;
  Tensors outputs_;
  Tensors kept_;
  std::shared_ptr<Shelf> shelf_;
  std::vector<WorkPtr> host_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// ---- how a reduction runs on the host transport ------------------------------------------------------------------
struct HostReduce {
  c10d::ReduceOp op;           // what the host runs
  std::optional<double> premul;  // PREMUL_SUM: multiply by this first, then SUM
  at::Tensor premul_tensor;      // ... or by this 1-element device tensor's value
  bool int_avg = false;          // NCCL's integer average: SUM, then divide (truncating)
  bool via_float = false;        // a dtype the host transport cannot reduce (fp8): reduce in fp32
};

bool unsupported_float8(at::ScalarType t) {  // ProcessGroupNCCL.cpp: isUnsupportedFloat8 (NCCL with fp8 support)
  return t == at::ScalarType::Float8_e5m2fnuz || t == at::ScalarType::Float8_e4m3fnuz ||
         t == at::ScalarType::Float8_e8m0fnu;
}

bool is_float8(at::ScalarType t) {
  return t == at::ScalarType::Float8_e5m2 || t == at::ScalarType::Float8_e4m3fn;
}

// ProcessGroupNCCL.cpp: getNcclReduceOp, mapped onto what the host transport runs.
HostReduce nccl_reduce(const c10d::ReduceOp& op, at::ScalarType st) {
  HostReduce h{op};
  TORCH_CHECK(!unsupported_float8(st), "Unsupported Float8 type for NCCL reduction");
  if (st == at::kBool) {
    if (op == c10d::ReduceOp::SUM) h.op = c10d::ReduceOp::MAX;  // bool sum is a bitwise or (uint8 max)
    if (op == c10d::ReduceOp::AVG) C10_THROW_ERROR(TypeError, "Cannot use ReduceOp.AVG with boolean inputs");
  }
  switch (op.op_) {
    case c10d::ReduceOp::BAND: C10_THROW_ERROR(ValueError, "Cannot use ReduceOp.BAND with NCCL");
    case c10d::ReduceOp::BOR: C10_THROW_ERROR(ValueError, "Cannot use ReduceOp.BOR with NCCL");
    case c10d::ReduceOp::BXOR: C10_THROW_ERROR(ValueError, "Cannot use ReduceOp.BXOR with NCCL");
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_TYPE(st == at::kHalf || st == at::kFloat || st == at::kBFloat16 || st == at::kDouble,
                       "PreMulSum Data type must be half, float, bfloat16 or double");
      const auto* sup = reinterpret_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(sup != nullptr, "ReduceOp.PREMUL_SUM without its factor");
      if (sup->tensor_factor.defined()) h.premul_tensor = sup->tensor_factor;
      else h.premul = sup->double_factor;
      h.op = c10d::ReduceOp::SUM;
      break;
    }
    case c10d::ReduceOp::AVG:
      if (at::isIntegralType(st, /*includeBool=*/false)) {
        h.int_avg = true;
        h.op = c10d::ReduceOp::SUM;
      }
      break;
    default: break;
  }
  h.via_float = is_float8(st);
  return h;
}

double premul_factor(const HostReduce& r) {
  if (r.premul_tensor.defined())
    return r.premul_tensor.is_cuda() ? host_view(r.premul_tensor).item<double>() : r.premul_tensor.item<double>();
  return *r.premul;
}
bool transforms(const HostReduce& r) { return r.premul || r.premul_tensor.defined() || r.via_float; }

// The input a host reduction reads: `h` itself, or a host temporary (scaled, or in fp32) when the reduction needs one.
at::Tensor reduce_input(const at::Tensor& h, const HostReduce& r) {
  if (!transforms(r)) return h;
  at::Tensor x = r.via_float ? h.to(at::kFloat) : h.clone();
  if (r.premul || r.premul_tensor.defined()) x.mul_(premul_factor(r));
  return x;
}
void reduce_output(at::Tensor& x, const at::Tensor& h, const HostReduce& r, int size) {
  if (r.int_avg) x.div_(size, "trunc");
  if (!x.is_same(h)) h.copy_(x);
}

c10d::AllreduceOptions host_allreduce_opts(const HostReduce& r, std::chrono::milliseconds timeout) {
  c10d::AllreduceOptions o;
  o.reduceOp = r.op;
  o.timeout = timeout;
  return o;
}

// ProcessGroupNCCL.cpp: check_gpu_single_tensor
void check_single(const at::Tensor& t, bool p2p = false) {
  TORCH_CHECK_VALUE(t.is_cuda() && !t.is_sparse(), "Tensors must be CUDA and dense");
  if (!t.is_contiguous(t.suggest_memory_format())) {
    if (p2p) {
      TORCH_WARN_ONCE("Detected non-contiguous tensor in P2P operations. It is user responsibility to guarantee "
                      "that source and destination tensors have the same contiguity format.");
    } else {
      TORCH_CHECK_VALUE(false, "Tensors must be contiguous");
    }
  }
}

bool same_sizes(const Tensors& ts) {
  for (const auto& t : ts)
    if (!t.sizes().equals(ts.front().sizes())) return false;
  return true;
}

std::atomic<int64_t> g_backend_ids{0};

// ---- the backend --------------------------------------------------------------------------------------------------
class SimBackend : public c10d::Backend {
 public:
  SimBackend(c10::intrusive_ptr<c10d::Backend> host, int rank, int size, bool values, Kind kind,
             int local_devices, int global_rank)
      : Backend(rank, size), host_(std::move(host)), values_(values), kind_(kind),
        local_devices_(std::max(local_devices, 1)), global_rank_(global_rank), uid_(g_backend_ids++) {}

  Kind kind() const { return kind_; }
  int64_t uid() const { return uid_; }
  bool values() const { return values_; }

  const std::string getBackendName() const override { return kind_ == Kind::NCCL ? "nccl" : host_->getBackendName(); }
  bool supportsCoalescing() const override { return kind_ == Kind::NCCL || host_->supportsCoalescing(); }
  bool supportsSplitting() const override { return false; }
  void setTimeout(std::chrono::milliseconds timeout) override { host_->setTimeout(timeout); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return host_->getBackendOptions(); }
  void eagerConnectSingleDevice(at::Device) override {}
  void setSequenceNumberForGroup() override {
    if (kind_ == Kind::GLOO) host_->setSequenceNumberForGroup();
  }  // ProcessGroupNCCL: "NCCL just starts sequence numbers at 0"
  uint64_t getSequenceNumberForGroup() override {
    return kind_ == Kind::NCCL ? seq_.load() : host_->getSequenceNumberForGroup();
  }
  void shutdown() override { host_->shutdown(); }
  void abort() override { host_->abort(); }

  // ---- coalescing (ProcessGroupNCCL: startCoalescing / endCoalescing) ----
  void startCoalescing() override {
    if (kind_ == Kind::GLOO) return host_->startCoalescing();
    std::lock_guard<std::mutex> g(mu_);
    coalescing_ = true;
    coalesced_async_ = false;
    coalesced_device_.reset();
    coalesced_host_.clear();
    coalesced_ = std::make_shared<Shelf>();
  }
  WorkPtr endCoalescing() override { return endCoalescing(OpType::COALESCED); }
  WorkPtr endCoalescing(OpType type) {
    if (kind_ == Kind::GLOO) return host_->endCoalescing();
    std::shared_ptr<Shelf> shelf;
    std::vector<WorkPtr> hosts;
    bool async_op;
    c10::Device device(c10::DeviceType::CUDA, 0);
    {
      std::lock_guard<std::mutex> g(mu_);
      TORCH_CHECK(coalescing_, "endCoalescing without startCoalescing");
      coalescing_ = false;
      shelf = coalesced_;
      hosts.swap(coalesced_host_);
      async_op = coalesced_async_;
      if (coalesced_device_) device = *coalesced_device_;
    }
    auto work = c10::make_intrusive<SimWork>(rank_, type, Tensors{}, device);
    {
      std::lock_guard<std::mutex> g(shelf->mu);
      work->shelf()->stash(shelf->tensors);  // "Hand over references to tensors during coalescing to work's stash"
    }
    for (auto& h : hosts) work->add_host_work(std::move(h));
    enqueue(work);
    return async_op ? WorkPtr(work) : WorkPtr();
  }

  // ---- collectives ----
  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    count("all_reduce");
    if (kind_ == Kind::GLOO) return forward(tensors, tensors, OpType::ALLREDUCE, [&] {
      auto h = host_views(tensors);
      return host_->allreduce(h, opts);
    });
    if (opts.sparseIndices.has_value() || (!tensors.empty() && tensors.back().is_sparse()))
      C10_THROW_ERROR(Error, "NCCL does not support all_reduce with sparse tensors. Please use dense tensors instead.");
    TORCH_CHECK(tensors.size() == 1, kMultiDevice);
    auto tensor = tensors.back();
    if (tensor.is_complex()) {
      TORCH_CHECK(c10d::isComplexViewAsRealAllowed(opts.reduceOp), "all_reduce does not support", opts.reduceOp,
                  "on complex tensors");
      tensor = at::view_as_real(tensor);
    }
    check_single(tensor);
    return allreduce_impl(tensor, opts);
  }

  WorkPtr allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    count("all_reduce_coalesced");
    if (kind_ == Kind::GLOO) return forward(tensors, tensors, OpType::ALLREDUCE_COALESCED, [&] {
      auto h = host_views(tensors);
      return host_->allreduce_coalesced(h, opts);
    });
    for (const auto& t : tensors) check_single(t);
    std::vector<HostReduce> rs;
    for (const auto& t : tensors) rs.push_back(nccl_reduce(opts.reduceOp, t.scalar_type()));
    return collective(tensors, tensors, opts.asyncOp, OpType::COALESCED, [&] {
      for (size_t i = 0; i < tensors.size(); ++i) host_allreduce(host_view(tensors[i]), rs[i], opts.timeout);
    });
  }

  WorkPtr broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override {
    count("broadcast");
    if (kind_ == Kind::GLOO) return forward(tensors, tensors, OpType::BROADCAST, [&] {
      auto h = host_views(tensors);
      return host_->broadcast(h, opts);
    });
    TORCH_CHECK(tensors.size() == 1, kMultiDevice);
    auto tensor = tensors.back();
    if (tensor.is_complex()) tensor = at::view_as_real(tensor);
    check_single(tensor);
    return collective({tensor}, {tensor}, opts.asyncOp, OpType::BROADCAST, [&] {
      host_broadcast(host_view(tensor), opts.rootRank + opts.rootTensor, opts.timeout);
    });
  }

  WorkPtr reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override {
    count("reduce");
    if (kind_ == Kind::GLOO) return forward(tensors, tensors, OpType::REDUCE, [&] {
      auto h = host_views(tensors);
      return host_->reduce(h, opts);
    });
    TORCH_CHECK(tensors.size() == 1, kMultiDevice);
    auto tensor = tensors.back();
    if (tensor.is_complex()) {
      TORCH_CHECK(c10d::isComplexViewAsRealAllowed(opts.reduceOp), "reduce does not support", opts.reduceOp,
                  "on complex tensors");
      tensor = at::view_as_real(tensor);
    }
    check_single(tensor);
    auto r = nccl_reduce(opts.reduceOp, tensor.scalar_type());
    const int64_t root = opts.rootRank + opts.rootTensor;
    return collective({tensor}, {tensor}, opts.asyncOp, OpType::REDUCE, [&] {
      at::Tensor h = host_view(tensor);
      at::Tensor x = r.via_float ? h.to(at::kFloat) : h.clone();  // ncclReduce writes only the root's buffer
      if (r.premul || r.premul_tensor.defined()) x.mul_(premul_factor(r));
      c10d::ReduceOptions o;
      o.reduceOp = r.op;
      o.rootRank = root;
      o.timeout = opts.timeout;
      Tensors v{x};
      host_->reduce(v, o)->wait();
      if (rank_ == root) reduce_output(x, h, r, size_);
    });
  }

  WorkPtr allgather(std::vector<Tensors>& outputTensors, Tensors& inputTensors,
                    const c10d::AllgatherOptions& opts) override {
    count("all_gather");
    if (kind_ == Kind::GLOO) {
      Tensors outs;
      for (const auto& l : outputTensors) outs.insert(outs.end(), l.begin(), l.end());
      return forward(inputTensors, outs, OpType::ALLGATHER, [&] {
        std::vector<Tensors> ho;
        for (const auto& l : outputTensors) ho.push_back(host_views(l));
        auto hi = host_views(inputTensors);
        return host_->allgather(ho, hi, opts);
      });
    }
    TORCH_CHECK(inputTensors.size() == 1, kMultiDevice);
    auto input = inputTensors.back();
    check_single(input);
    auto outputs = outputTensors.back();
    if (same_sizes(outputs)) {
      input = input.contiguous();
      at::Tensor flat = c10d::newLikeFlat(outputs);  // the caching allocator, on the caller's current stream
      auto work = collective({input}, {flat}, opts.asyncOp, OpType::ALLGATHER, [&] {
        host_allgather_base(host_view(flat), host_view(input), opts.timeout);
      }, /*post_stash=*/outputs);
      for (size_t j = 0; j < outputs.size(); ++j) outputs[j].copy_(flat[static_cast<int64_t>(j)], true);
      return work;
    }
    // unequal sizes: one broadcast per rank, coalesced (ProcessGroupNCCL: _broadcast_oop)
    startCoalescing();
    for (int64_t i = 0; i < static_cast<int64_t>(outputs.size()); ++i) {
      at::Tensor& out = outputs[i];
      TORCH_CHECK_VALUE(i != rank_ || out.numel() == input.numel(),
                        "Tensor input and output of _broadcast_oop must have the same number of elements ");
      collective({i == rank_ ? input : out}, {out}, opts.asyncOp, OpType::BROADCAST, [&] {
        if (i == rank_) bytes(host_view(out)).copy_(bytes(host_view(input)));
        host_broadcast(host_view(out), i, opts.timeout);
      });
    }
    return endCoalescing(OpType::ALLGATHER);
  }

  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    count("all_gather_into_tensor");
    if (kind_ == Kind::GLOO) return forward({input}, {output}, OpType::_ALLGATHER_BASE, [&] {
      auto ho = host_view(output);
      auto hi = host_view(input);
      return host_->_allgather_base(ho, hi, opts);
    });
    check_single(input);
    check_single(output);
    TORCH_CHECK_TYPE(input.dtype() == output.dtype(), "output tensor must have the same type as input tensor");
    TORCH_CHECK_VALUE(input.numel() * size_ == output.numel(),
                      "output tensor size must be equal to world_size times input tensor size");
    return collective({input}, {output}, opts.asyncOp, OpType::_ALLGATHER_BASE, [&] {
      host_allgather_base(host_view(output), host_view(input), opts.timeout);
    });
  }

  WorkPtr allgather_coalesced(std::vector<Tensors>& outputTensorLists, Tensors& inputTensors,
                              const c10d::AllgatherOptions& opts) override {
    if (kind_ == Kind::GLOO) {
      count("all_gather_coalesced");
      Tensors outs;
      for (const auto& l : outputTensorLists) outs.insert(outs.end(), l.begin(), l.end());
      return forward(inputTensors, outs, OpType::ALLGATHER_COALESCED, [&] {
        std::vector<Tensors> ho;
        for (const auto& l : outputTensorLists) ho.push_back(host_views(l));
        auto hi = host_views(inputTensors);
        return host_->allgather_coalesced(ho, hi, opts);
      });
    }
    C10_THROW_ERROR(NotImplementedError, "ProcessGroupNCCL does not support allgather_coalesced");
  }

  WorkPtr allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    count("all_gather_into_tensor_coalesced");
    if (kind_ == Kind::GLOO) return forward(inputs, outputs, OpType::COALESCED, [&] {
      auto ho = host_views(outputs);
      auto hi = host_views(inputs);
      return host_->allgather_into_tensor_coalesced(ho, hi, opts);
    });
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "allgather_into_tensor_coalesced: ", outputs.size(),
                      " outputs for ", inputs.size(), " inputs");
    return collective(inputs, outputs, opts.asyncOp, OpType::COALESCED, [&] {
      for (size_t i = 0; i < inputs.size(); ++i)
        host_allgather_base(host_view(outputs[i]), host_view(inputs[i]), opts.timeout);
    });
  }

  WorkPtr reduce_scatter(Tensors& outputTensors, std::vector<Tensors>& inputTensors,
                         const c10d::ReduceScatterOptions& opts) override {
    count("reduce_scatter");
    if (kind_ == Kind::GLOO) {
      Tensors ins;
      for (const auto& l : inputTensors) ins.insert(ins.end(), l.begin(), l.end());
      return forward(ins, outputTensors, OpType::REDUCE_SCATTER, [&] {
        auto ho = host_views(outputTensors);
        std::vector<Tensors> hi;
        for (const auto& l : inputTensors) hi.push_back(host_views(l));
        return host_->reduce_scatter(ho, hi, opts);
      });
    }
    TORCH_CHECK(outputTensors.size() == 1, kMultiDevice);
    auto output = outputTensors.back();
    check_single(output);
    auto inputs = inputTensors.back();
    auto r = nccl_reduce(opts.reduceOp, output.scalar_type());
    if (same_sizes(inputs)) {
      output = output.contiguous();
      at::Tensor flat = c10d::newLikeFlat(inputs);  // the caching allocator, on the caller's current stream
      for (size_t j = 0; j < inputs.size(); ++j) flat[static_cast<int64_t>(j)].copy_(inputs[j], true);
      return collective({flat}, {output}, opts.asyncOp, OpType::REDUCE_SCATTER, [&] {
        host_reduce_scatter_base(host_view(output), host_view(flat), r, opts.timeout);
      }, /*post_stash=*/inputs);
    }
    // unequal sizes: one reduce per rank, coalesced (ProcessGroupNCCL: _reduce_oop)
    startCoalescing();
    for (int64_t i = 0; i < static_cast<int64_t>(inputs.size()); ++i) {
      at::Tensor& in = inputs[i];
      at::Tensor out = i == rank_ ? output : in;
      collective({in}, {out}, opts.asyncOp, OpType::REDUCE, [&] {
        at::Tensor h = host_view(in);
        at::Tensor x = r.via_float ? h.to(at::kFloat) : h.clone();
        if (r.premul || r.premul_tensor.defined()) x.mul_(premul_factor(r));
        c10d::ReduceOptions o;
        o.reduceOp = r.op;
        o.rootRank = i;
        o.timeout = opts.timeout;
        Tensors v{x};
        host_->reduce(v, o)->wait();
        if (i == rank_) reduce_output(x, host_view(output), r, size_);
      });
    }
    return endCoalescing(OpType::REDUCE_SCATTER);
  }

  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const c10d::ReduceScatterOptions& opts) override {
    count("reduce_scatter_tensor");
    if (kind_ == Kind::GLOO) return forward({input}, {output}, OpType::_REDUCE_SCATTER_BASE, [&] {
      auto ho = host_view(output);
      auto hi = host_view(input);
      return host_->_reduce_scatter_base(ho, hi, opts);
    });
    TORCH_CHECK_TYPE(input.dtype() == output.dtype(), "input tensor must be the same type as the output tensor.");
    TORCH_CHECK_VALUE(input.numel() == output.numel() * size_,
                      "input tensor must be the same size as output size times world size");
    auto r = nccl_reduce(opts.reduceOp, output.scalar_type());
    return collective({input}, {output}, opts.asyncOp, OpType::_REDUCE_SCATTER_BASE, [&] {
      host_reduce_scatter_base(host_view(output), host_view(input), r, opts.timeout);
    });
  }

  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    count("reduce_scatter_tensor_coalesced");
    if (kind_ == Kind::GLOO) return forward(inputs, outputs, OpType::COALESCED, [&] {
      auto ho = host_views(outputs);
      auto hi = host_views(inputs);
      return host_->reduce_scatter_tensor_coalesced(ho, hi, opts);
    });
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "reduce_scatter_tensor_coalesced: ", outputs.size(),
                      " outputs for ", inputs.size(), " inputs");
    std::vector<HostReduce> rs;
    for (const auto& t : inputs) rs.push_back(nccl_reduce(opts.reduceOp, t.scalar_type()));
    return collective(inputs, outputs, opts.asyncOp, OpType::COALESCED, [&] {
      for (size_t i = 0; i < inputs.size(); ++i)
        host_reduce_scatter_base(host_view(outputs[i]), host_view(inputs[i]), rs[i], opts.timeout);
    });
  }

  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplitSizes,
                        std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts) override {
    count("all_to_all_single");
    if (kind_ == Kind::NCCL) {
      check_single(output);
      check_single(input);
      if (!outputSplitSizes.empty() || !inputSplitSizes.empty()) {
        c10d::checkSplitSizes(inputSplitSizes, input, size_);
        c10d::checkSplitSizes(outputSplitSizes, output, size_);
      }
    }
    auto run = [&] {
      auto ho = host_view(output);
      auto hi = host_view(input);
      return host_->alltoall_base(ho, hi, outputSplitSizes, inputSplitSizes, opts);
    };
    if (kind_ == Kind::GLOO) return forward({input}, {output}, OpType::ALLTOALL_BASE, run);
    return collective({input}, {output}, opts.asyncOp, OpType::ALLTOALL_BASE, [&] { run()->wait(); });
  }

  WorkPtr alltoall(Tensors& outputTensors, Tensors& inputTensors, const c10d::AllToAllOptions& opts) override {
    count("all_to_all");
    if (kind_ == Kind::NCCL) {
      for (size_t r = 0; r < outputTensors.size(); ++r) {
        check_single(outputTensors[r]);
        check_single(inputTensors[r]);
        TORCH_CHECK(outputTensors[r].device() == outputTensors[0].device() &&
                        inputTensors[r].device() == outputTensors[0].device(),
                    "Tensors must be on the same device")
      }
    }
    auto run = [&] {
      auto ho = host_views(outputTensors);
      auto hi = host_views(inputTensors);
      return host_->alltoall(ho, hi, opts);
    };
    if (kind_ == Kind::GLOO) return forward(inputTensors, outputTensors, OpType::ALLTOALL, run);
    return collective(inputTensors, outputTensors, opts.asyncOp, OpType::ALLTOALL, [&] { run()->wait(); });
  }

  WorkPtr gather(std::vector<Tensors>& outputTensors, Tensors& inputTensors,
                 const c10d::GatherOptions& opts) override {
    count("gather");
    Tensors outs;
    for (const auto& l : outputTensors) outs.insert(outs.end(), l.begin(), l.end());
    auto run = [&] {
      std::vector<Tensors> ho;
      for (const auto& l : outputTensors) ho.push_back(host_views(l));
      auto hi = host_views(inputTensors);
      return host_->gather(ho, hi, opts);
    };
    if (kind_ == Kind::GLOO) return forward(inputTensors, outs, OpType::GATHER, run);
    TORCH_CHECK(inputTensors.size() == 1, kMultiDevice);
    check_single(inputTensors.back());
    if (outs.empty()) outs.emplace_back();
    return collective(inputTensors, outs, opts.asyncOp, OpType::GATHER, [&] { run()->wait(); });
  }

  WorkPtr scatter(Tensors& outputTensors, std::vector<Tensors>& inputTensors,
                  const c10d::ScatterOptions& opts) override {
    count("scatter");
    Tensors ins;
    for (const auto& l : inputTensors) ins.insert(ins.end(), l.begin(), l.end());
    auto run = [&] {
      auto ho = host_views(outputTensors);
      std::vector<Tensors> hi;
      for (const auto& l : inputTensors) hi.push_back(host_views(l));
      return host_->scatter(ho, hi, opts);
    };
    if (kind_ == Kind::GLOO) return forward(ins, outputTensors, OpType::SCATTER, run);
    TORCH_CHECK(outputTensors.size() == 1, kMultiDevice);
    if (ins.empty()) ins.emplace_back();
    // ProcessGroupNCCL::scatter passes the outputs as collective()'s inputs: they fix the device
    return collective(outputTensors, ins, opts.asyncOp, OpType::SCATTER, [&] { run()->wait(); });
  }

  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    count("barrier");
    if (kind_ == Kind::GLOO) return host_->barrier(opts);
    // ProcessGroupNCCL::barrier: an all-reduce of a 1-element fp32 tensor on the chosen device
    c10::DeviceIndex idx = opts.device_ids.empty() ? guess_device() : static_cast<c10::DeviceIndex>(opts.device_ids[0]);
    TORCH_CHECK_VALUE(idx >= 0, "Failed to infer a GPU device id to perform barrier. ");
    at::Tensor barrier_tensor =
        at::zeros({1}, at::TensorOptions().device(at::Device(at::DeviceType::CUDA, idx)).dtype(at::kFloat));
    c10d::AllreduceOptions ar;
    ar.asyncOp = opts.asyncOp;
    auto work = allreduce_impl(barrier_tensor, ar);
    return opts.asyncOp ? work : WorkPtr();  // a blocking barrier waits on the host and returns no work
  }

  // ---- point-to-point ----
  WorkPtr send(Tensors& tensors, int dstRank, int tag) override {
    count("send");
    if (kind_ == Kind::GLOO) return forward_async(tensors, OpType::SEND, [&] {
      auto h = host_views(tensors);
      return host_->send(h, dstRank, tag);
    });
    TORCH_CHECK(tensors.size() == 1, kMultiDevice);
    check_single(tensors.back(), /*p2p=*/true);
    return point_to_point(tensors.back(), OpType::SEND, [&] {
      Tensors h{bytes(host_view(tensors.back().contiguous()))};
      return host_->send(h, dstRank, tag);
    });
  }

  WorkPtr recv(Tensors& tensors, int srcRank, int tag) override {
    count("recv");
    if (kind_ == Kind::GLOO) return forward_async(tensors, OpType::RECV, [&] {
      auto h = host_views(tensors);
      return host_->recv(h, srcRank, tag);
    });
    TORCH_CHECK(tensors.size() == 1, kMultiDevice);
    check_single(tensors.back(), /*p2p=*/true);
    return point_to_point(tensors.back(), OpType::RECV, [&] {
      Tensors h{bytes(host_view(tensors.back()))};
      return host_->recv(h, srcRank, tag);
    });
  }

  WorkPtr recvAnysource(Tensors& tensors, int tag) override {
    if (kind_ == Kind::GLOO) return forward_async(tensors, OpType::RECVANYSOURCE, [&] {
      auto h = host_views(tensors);
      return host_->recvAnysource(h, tag);
    });
    C10_THROW_ERROR(NotImplementedError, "ProcessGroupNCCL does not support recvAnysource");
  }

 private:
  // ProcessGroupNCCL::guessDeviceId: the bound device, else the first used, else global rank % local devices
  c10::DeviceIndex guess_device() {
    if (getBoundDeviceId().has_value()) return getBoundDeviceId()->index();
    std::lock_guard<std::mutex> g(mu_);
    if (!used_devices_.empty()) return *used_devices_.begin();
    return static_cast<c10::DeviceIndex>(global_rank_ % local_devices_);
  }

  WorkPtr allreduce_impl(at::Tensor& tensor, const c10d::AllreduceOptions& opts) {
    auto r = nccl_reduce(opts.reduceOp, tensor.scalar_type());
    return collective({tensor}, {tensor}, opts.asyncOp, OpType::ALLREDUCE, [&] {
      host_allreduce(host_view(tensor), r, opts.timeout);
    });
  }

  void host_allreduce(const at::Tensor& h, const HostReduce& r, std::chrono::milliseconds timeout) {
    at::Tensor x = reduce_input(h, r);  // in place on the in/out buffer unless a temporary is needed
    Tensors v{x};
    host_->allreduce(v, host_allreduce_opts(r, timeout))->wait();
    reduce_output(x, h, r, size_);
  }

  void host_broadcast(const at::Tensor& h, int64_t root, std::chrono::milliseconds timeout) {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = timeout;
    Tensors v{bytes(h)};
    host_->broadcast(v, o)->wait();
  }

  void host_allgather_base(const at::Tensor& out, const at::Tensor& in, std::chrono::milliseconds timeout) {
    c10d::AllgatherOptions o;
    o.timeout = timeout;
    at::Tensor ob = bytes(out), ib = bytes(in);
    host_->_allgather_base(ob, ib, o)->wait();
  }

  void host_reduce_scatter_base(const at::Tensor& out, const at::Tensor& in, const HostReduce& r,
                                std::chrono::milliseconds timeout) {
    at::Tensor x = reduce_input(in, r);  // the input is never written: a temporary when it must be transformed
    at::Tensor y = r.via_float ? out.to(at::kFloat) : out;
    c10d::ReduceScatterOptions o;
    o.reduceOp = r.op;
    o.timeout = timeout;
    at::Tensor yf = y.reshape({-1}), xf = x.reshape({-1});  // gloo splits dim 0: a list's [world, ...] input too
    host_->_reduce_scatter_base(yf, xf, o)->wait();
    reduce_output(y, out, r, size_);
  }

  c10::Device device_of(const Tensors& inputs, const Tensors& outputs) {
    for (const auto* v : {&inputs, &outputs})
      for (const auto& t : *v)
        if (t.defined() && t.is_cuda()) return t.device();
    return c10::Device(c10::DeviceType::CUDA, guess_device());
  }

  // ProcessGroupNCCL::collective: run (values: on the host, to completion), stash when asynchronous, enqueue.
  WorkPtr collective(const Tensors& inputs, const Tensors& outputs, bool async_op, OpType type,
                     const std::function<void()>& fn, const Tensors& post_stash = {}) {
    const c10::Device device = device_of(inputs, outputs);
    bool coalescing;
    {
      std::lock_guard<std::mutex> g(mu_);
      used_devices_.insert(device.index());
      coalescing = coalescing_;
      if (coalescing) {
        coalesced_async_ = async_op;
        if (!coalesced_device_) coalesced_device_ = device;
      } else {
        seq_++;
      }
    }
    if (values_) fn();
    auto work = c10::make_intrusive<SimWork>(rank_, type, outputs, device);
    if (async_op) {
      if (coalescing) {
        coalesced_->stash(inputs);
        coalesced_->stash(outputs);
        coalesced_->stash(post_stash);
      } else {
        work->shelf()->stash(inputs);
        work->shelf()->stash(outputs);
        work->shelf()->stash(post_stash);
      }
    }
    if (!coalescing) enqueue(work);
    return async_op ? WorkPtr(work) : WorkPtr();
  }

  // ProcessGroupNCCL::pointToPoint: recordStream on the pair's stream (no figure changes under the immediate bound),
  // no stash; the host transport runs asynchronously and the work waits for it.
  WorkPtr point_to_point(const at::Tensor& tensor, OpType type, const std::function<WorkPtr()>& fn) {
    WorkPtr host = values_ ? fn() : WorkPtr();
    bool coalescing;
    {
      std::lock_guard<std::mutex> g(mu_);
      used_devices_.insert(tensor.device().index());
      coalescing = coalescing_;
      if (coalescing) {
        coalesced_async_ = true;  // "For now, P2P ops are always put on internal stream"
        if (!coalesced_device_) coalesced_device_ = tensor.device();
        if (host) coalesced_host_.push_back(host);
      }
    }
    if (coalescing) return WorkPtr();
    auto work = c10::make_intrusive<SimWork>(rank_, type, Tensors{tensor}, tensor.device());
    if (host) work->add_host_work(host);
    enqueue(work);
    return work;
  }

  // ProcessGroupNCCL::workEnqueue: first unstash what the watchdog found complete (every earlier work: the device's
  // work completes at once), then hand this work's stash to the watchdog's copy.
  void enqueue(const c10::intrusive_ptr<SimWork>& work) {
    std::vector<std::shared_ptr<Shelf>> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      done.swap(watchdog_);
      if (!work->shelf()->empty()) watchdog_.push_back(work->shelf());
    }
    for (auto& s : done) s->clear();
  }

  // A gloo group's collective on device tensors: the same collective on host views, to completion; the work keeps
  // the device tensors, as gloo's does.
  WorkPtr forward(const Tensors& inputs, const Tensors& outputs, OpType type, const std::function<WorkPtr()>& fn) {
    for (const auto* v : {&inputs, &outputs})
      for (const auto& t : *v)
        TORCH_CHECK(!t.defined() || !t.is_cuda() || t.is_contiguous(t.suggest_memory_format()) ||
                        type == OpType::SEND || type == OpType::RECV,
                    "Tensors must be contiguous");
    if (values_) {
      auto w = fn();
      if (w) w->wait();
    }
    auto work = c10::make_intrusive<SimWork>(rank_, type, outputs, device_of(inputs, outputs));
    work->keep(inputs);
    work->keep(outputs);
    return work;
  }
  WorkPtr forward_async(const Tensors& tensors, OpType type, const std::function<WorkPtr()>& fn) {
    auto work = c10::make_intrusive<SimWork>(rank_, type, tensors, device_of(tensors, {}));
    work->keep(tensors);
    if (values_) work->add_host_work(fn());
    return work;
  }

  c10::intrusive_ptr<c10d::Backend> host_;
  const bool values_;
  const Kind kind_;
  const int local_devices_;
  const int global_rank_;
  const int64_t uid_;
  std::atomic<uint64_t> seq_{0};
  std::mutex mu_;
  std::set<c10::DeviceIndex> used_devices_;
  std::vector<std::shared_ptr<Shelf>> watchdog_;  // stashes of enqueued asynchronous works not waited for
  bool coalescing_ = false;
  bool coalesced_async_ = false;
  std::optional<c10::Device> coalesced_device_;
  std::shared_ptr<Shelf> coalesced_ = std::make_shared<Shelf>();
  std::vector<WorkPtr> coalesced_host_;
};

std::mutex g_wrap_mu;
std::vector<c10::intrusive_ptr<SimBackend>> g_wrappers;  // the gloo groups' device-side backends, kept alive

// DDP's timer for a CUDA module (torch/csrc/distributed/c10d/reducer_timer.hpp): a CUDA build registers one timing
// CUDA events (reducer_cuda.cpp), a CPU build none, and DDP's logger asserts it exists (logger.cpp: reducer_->timer_)
// in its first iterations. The device has no GPU time: host time, as the CPU timer measures it (reducer.cpp).
class SimCudaTimer : public c10d::Timer {
 public:
  explicit SimCudaTimer(c10::Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto a = getTimestamp(start), b = getTimestamp(end);
    if (!a || !b || *b < *a) return std::nullopt;
    return *b - *a;
  }
};

}  // namespace

namespace c10d {
// preferred: on a CUDA build of torch the device's timer replaces the CUDA one (the device runs no CUDA events)
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(TimerRegistry, c10::kCUDA, c10::REGISTRY_PREFERRED, SimCudaTimer);
}  // namespace c10d

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The simulated CUDA device's process group (simcuda/csrc/sim_dist.cpp)";
  py::class_<SimBackend, c10d::Backend, c10::intrusive_ptr<SimBackend>>(m, "ProcessGroupNCCL")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& host, int rank, int size, bool values,
                       int local_devices, int global_rank) {
             return c10::make_intrusive<SimBackend>(host, rank, size, values, Kind::NCCL, local_devices, global_rank);
           }),
           py::arg("host"), py::arg("rank"), py::arg("size"), py::arg("values"), py::arg("local_devices"),
           py::arg("global_rank"))
      .def_property_readonly("uid", &SimBackend::uid)
      .def_property_readonly("simulated", [](const SimBackend&) { return true; })
      .def_property_readonly("values", &SimBackend::values)
      .def("_group_start", [](SimBackend&) {})
      .def("_group_end", [](SimBackend&) {})
      .def("_add_ephemeral_timeout", [](SimBackend&, const std::chrono::milliseconds&) {})
      .def("_set_default_timeout", [](SimBackend& b, const std::chrono::milliseconds& t) { b.setTimeout(t); })
      .def("_is_initialized", [](SimBackend&) { return true; })
      .def("comm_split_count", [](SimBackend&) { return 0; })
      .def("_shutdown", [](SimBackend& b) { b.shutdown(); });
  m.def(
      "route_cuda_to_host",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool values, int local_devices, int global_rank) {
        // A gloo group's CUDA backend (the CPU one, reused: ProcessGroup::setBackend) becomes a SimBackend of kind
        // GLOO, registered as the CUDA device's backend under BackendType CUSTOM (setBackend reuses an existing
        // backend of the same type, so GLOO cannot name a second one). Returns whether it did.
        if (!pg->hasBackendForDeviceType(c10::DeviceType::CUDA)) return false;
        auto backend = pg->getBackend(c10::DeviceType::CUDA);
        if (dynamic_cast<SimBackend*>(backend.get()) != nullptr) return false;
        if (backend->getBackendName() != "gloo") return false;
        auto sim = c10::make_intrusive<SimBackend>(backend, backend->getRank(), backend->getSize(), values, Kind::GLOO,
                                                   local_devices, global_rank);
        pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, sim);
        std::lock_guard<std::mutex> g(g_wrap_mu);
        g_wrappers.push_back(sim);
        return pg->getBackend(c10::DeviceType::CUDA).get() == sim.get();
      },
      py::arg("pg"), py::arg("values"), py::arg("local_devices"), py::arg("global_rank"));
  m.def("collective_counts", [] {
    std::lock_guard<std::mutex> g(g_count_mu);
    return g_counts;
  });
}
