// The CUDA hooks and device guard both device libraries register: a CPU-only PyTorch build told that CUDA exists.
//
// Registers c10's test device guard (c10/core/impl/FakeGuardImpl.h) for DeviceType::CUDA and CUDA hooks
// (ATen/detail/CUDAHooksInterface.h) whose hasCUDA() is true, at a priority above a CUDA build's own "CUDAHooks".
// Included once by each of fake_cuda.cpp (the fake-CUDA route: fake tensors, no storage) and sim_cuda.cpp (the
// simulated device: real tensors, a logging allocator); the registrations are static objects of the including
// library. Must be loaded (ctypes, RTLD_GLOBAL) BEFORE `import torch`: torch creates its CUDA hooks object once,
// from the registry, during import; a library registered later is never asked.
#pragma once

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace rlhfmem {

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
  static c10::impl::DeviceGuardImplRegistrar guard(c10::DeviceType::CUDA,
                                                   new c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>());
}

}  // namespace rlhfmem

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
namespace at {
// Preferred over a CUDA build's own "CUDAHooks" (libtorch_cuda registers it at the default priority; c10's
// Registry exits the process on a second key of the same priority, and keeps the higher one in either order).
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED,
                                       rlhfmem::DeviceCUDAHooks);
}  // namespace at
