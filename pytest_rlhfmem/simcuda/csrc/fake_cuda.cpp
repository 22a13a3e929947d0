// A CPU-only PyTorch build told that CUDA exists, for fake-tensor runs with device="cuda" (the fake-CUDA route).
//
// Registers a device guard and CUDA hooks whose hasCUDA() is true (cuda_hooks.h, shared with sim_cuda.cpp). Nothing here computes or allocates on a device: it only lets autograd (InputMetadata needs a
// device guard), copy_/to("cuda") and fused optimizers accept fake CUDA tensors, which hold no storage.
//
// Must be loaded (ctypes, RTLD_GLOBAL) BEFORE `import torch`: torch creates its CUDA hooks object once,
// from the registry, during import; a library registered later is never asked.
#include <cstdint>

#include "cuda_hooks.h"

extern "C" int rlhfmem_fake_cuda_loaded() { return 1; }
// On a CUDA build, after libtorch_cuda is loaded (simcuda/build.py: load_built): register the fake guard again.
// Returns 0.
extern "C" int64_t rlhfmem_fake_cuda_take_over() {
  rlhfmem::register_fake_cuda_guard_again();
  return 0;
}
