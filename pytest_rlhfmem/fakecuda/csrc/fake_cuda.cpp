// A CPU-only PyTorch build told that CUDA exists, for fake-tensor runs with device="cuda".
//
// Registers c10's test device guard (c10/core/impl/FakeGuardImpl.h) for DeviceType::CUDA and CUDA hooks
// (ATen/detail/CUDAHooksInterface.h) whose hasCUDA() is true. Nothing here computes or allocates on a
// device: it only lets autograd (InputMetadata needs a device guard), copy_/to("cuda") and fused
// optimizers accept fake CUDA tensors, which hold no storage.
//
// Must be loaded (ctypes, RTLD_GLOBAL) BEFORE `import torch`: torch creates its CUDA hooks object once,
// from the registry, during import; a library registered later is never asked.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {

struct FakeCUDAHooks final : public at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  c10::DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  bool isPinnedPtr(const void*) const override { return false; }
  // "Pinned" host memory is ordinary host memory here: only fake tensors ask, and they never allocate.
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void deviceSynchronize(c10::DeviceIndex) const override {}
};

}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
namespace at {
// Preferred over a CUDA build's own "CUDAHooks" (libtorch_cuda registers it at the default priority; c10's
// Registry exits the process on a second key of the same priority, and keeps the higher one in either order).
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED, FakeCUDAHooks);
}  // namespace at

extern "C" int rlhfmem_fake_cuda_loaded() { return 1; }
// On a CUDA build, after libtorch_cuda is loaded (memory/device_libs.py: load_built): its CUDA guard replaced
// this library's (the registry keeps the last one); register the fake guard again. Returns 0.
extern "C" int64_t rlhfmem_fake_cuda_take_over() {
  static c10::impl::DeviceGuardImplRegistrar guard(c10::DeviceType::CUDA,
                                                   new c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>());
  return 0;
}
