// The CUDA hooks and device guard both device libraries register: a CPU-only PyTorch build told that CUDA exists.
//
// Registers a device guard (DeviceGuard: c10's FakeGuardImpl, with synchronisation) for DeviceType::CUDA and CUDA hooks
// (ATen/detail/CUDAHooksInterface.h) whose hasCUDA() is true, at a priority above a CUDA build's own "CUDAHooks".
// Included once by each of fake_cuda.cpp (the fake-CUDA route: fake tensors, no storage) and sim_cuda.cpp (the
// simulated device: real tensors, a logging allocator); the registrations are static objects of the including
// library. Must be loaded (ctypes, RTLD_GLOBAL) BEFORE `import torch`: torch creates its CUDA hooks object once,
// from the registry, during import; a library registered later is never asked.
#pragma once

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <torch/version.h>

#include <array>

namespace rlhfmem {

// The CUDA device guard: c10's FakeGuardImpl (c10/core/impl/FakeGuardImpl.h: a current device and a current stream
// per device, thread-local), and what FakeGuardImpl leaves to the base class's "Backend doesn't support ...":
// synchronizing a stream, an event or the device returns at once (no work runs anywhere), and the time between
// two events is 0.0 ms. `torch.Event("cuda")` and `torch.cuda.Event` then run as on a GPU whose work is done.
struct DeviceGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    current_device_ = d.index();
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::CUDA, current_device_); }
  void setDevice(c10::Device d) const override { current_device_ = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device_ = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::UNSAFE, d, streams()[d.index()]);
  }
  // A stream "from the pool" is the device's current one (no work runs anywhere; allocations are tagged with the
  // stream Python makes current: simcuda/streams.py). c10::ivalue::Future's callbacks (`then`) ask for one.
  c10::Stream getStreamFromGlobalPool(const c10::Device d, bool = false) const override { return getStream(d); }
  c10::Stream getNewStream(c10::Device d, int = 0) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    auto old = streams()[s.device_index()];
    streams()[s.device_index()] = s.id();
    return c10::Stream(c10::Stream::UNSAFE, s.device(), old);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return c10::impl::kFakeGuardImplMaxDevices; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
  void synchronizeDevice(const c10::DeviceIndex) const override {}
#endif
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }

  // The calling thread's current device (as cudaGetDevice: per host thread): where a new allocation lands.
  static c10::DeviceIndex current() { return current_device_; }

 private:
  static std::array<c10::StreamId, c10::impl::kFakeGuardImplMaxDevices>& streams() {
    thread_local std::array<c10::StreamId, c10::impl::kFakeGuardImplMaxDevices> s{};
    return s;
  }
  static inline thread_local c10::DeviceIndex current_device_ = 0;
};

struct DeviceCUDAHooks final : public at::CUDAHooksInterface {
  explicit DeviceCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  c10::DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  bool isPinnedPtr(const void*) const override { return false; }
  // "Pinned" host memory is ordinary host memory here (no transfer engine to pin it for).
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void deviceSynchronize(c10::DeviceIndex) const override {}
};

// On a CUDA build, after libtorch_cuda is loaded (simcuda/build.py: load_built): its CUDA guard replaced the
// library's (the registry keeps the last one); register the fake guard again.
inline void register_fake_cuda_guard_again() {
  static c10::impl::DeviceGuardImplRegistrar guard(c10::DeviceType::CUDA, new DeviceGuard());
}

}  // namespace rlhfmem

C10_REGISTER_GUARD_IMPL(CUDA, rlhfmem::DeviceGuard);
namespace at {
// Preferred over a CUDA build's own "CUDAHooks" (libtorch_cuda registers it at the default priority; c10's
// Registry exits the process on a second key of the same priority, and keeps the higher one in either order).
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED,
                                       rlhfmem::DeviceCUDAHooks);
}  // namespace at
