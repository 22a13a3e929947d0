"""The simulated CUDA device beside a CUDA build's own registrations (``simcuda/build.py: load_built``,
``simcuda/csrc/sim_cuda.cpp``: "on a CUDA build of torch").

A CUDA build's libtorch_cuda registers, while torch is imported, the "CUDAHooks" class (c10's Registry exits the
process on a second key of the same priority), real CUDA kernels (a direct kernel wins over the device's fallback
and over the composite kernels a CPU build runs for CUDA), and DispatchStub pointers. CI has only the CPU build, so
these tests load, in libtorch_cuda's place, a library built here that registers exactly those kinds of things the
way libtorch_cuda does (its kernels raise: they would need a GPU). The check on a real CUDA build (torch 2.14.1+cu130
and the GPU machine's 2.11) is ``benchmarks/sim_cuda_cuda_build.py``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem.command.run import sim_cuda_library
from pytest_rlhfmem.cbuild import build_library
from pytest_rlhfmem.simcuda.build import FakeCudaUnavailable

# What libtorch_cuda registers, one of each kind; every kernel raises (a GPU kernel cannot run here).
STANDIN = r"""
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/native/transformers/attention.h>
#include <torch/library.h>

namespace {
struct GpuHooks final : public at::CUDAHooksInterface {
  explicit GpuHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return false; }  // no GPU is visible
};
at::Tensor gpu_kernel(const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, "a CUDA build's GPU kernel ran"); }
at::Tensor gpu_mm(const at::Tensor& a, const at::Tensor& b) { return gpu_kernel(a, b); }
at::Tensor gpu_add(const at::Tensor& a, const at::Tensor& b, const at::Scalar&) { return gpu_kernel(a, b); }
at::Scalar gpu_item(const at::Tensor&) { TORCH_CHECK(false, "a CUDA build's GPU kernel ran"); }
int64_t gpu_sdp_choice(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                       double, bool, std::optional<double>, bool) { return 1; }  // flash attention
struct Stub { Stub() { at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&gpu_sdp_choice); } } g_stub;
}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", GpuHooks);  // default priority, as CUDAHooks.cpp
}

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("mm", TORCH_FN(gpu_mm));                   // a structured op: NonFunctional composite on a CPU build
  m.impl("add.Tensor", TORCH_FN(gpu_add));
  m.impl("silu_backward", TORCH_FN(gpu_kernel));    // CompositeImplicitAutograd: AutogradCUDA's entry changes
  m.impl("_local_scalar_dense", TORCH_FN(gpu_item));  // one of the device's own kernels
}
"""

# One process: the device's allocation sizes for a forward, backward, attention and .item() (the CPU build's
# answers), and what load_built took over.
SCRIPT = r"""
import json, sys
from pathlib import Path
from pytest_rlhfmem.simcuda.build import load_built
from pytest_rlhfmem.simcuda import library as sim_cuda
took = load_built(sys.argv[1], cuda_libraries=[Path(p) for p in sys.argv[2:]])
import os; os.environ[sim_cuda.ENV_LIBRARY] = sys.argv[1]
import torch
torch.cuda._lazy_init = lambda: None  # torch.cuda's Python side, as simcuda/torch_cuda.py answers it
lib = sim_cuda.library()
x = torch.ones(4, 8, device="cuda", requires_grad=True)
z = x @ x.t() + 1
y = torch.nn.functional.silu(z)
q = torch.ones(1, 2, 16, 8, device="cuda")
a = torch.nn.functional.scaled_dot_product_attention(q, q, q)
loss = y.sum() + a.sum()
loss.backward()
g = torch.ops.aten.silu_backward(y, z.detach().requires_grad_())  # AutogradCUDA's own entry
value = loss.item()
rows = sim_cuda.SimCudaRows()
events = rows.events(0)
print("RESULT " + json.dumps({"took": took, "sizes": [e[2] for e in events], "actions": [e[0] for e in events],
                              "value": value, "grad": list(x.grad.shape),
                              "accelerator": str(torch.accelerator.current_accelerator())}), flush=True)
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cudabuild")
    src = d / "standin_torch_cuda.cpp"
    src.write_text(STANDIN)
    # the project's one build function (cached by content): the stand-in links torch as the device libraries do
    return build_library(src, FakeCudaUnavailable, ("-O0", "-shared", "-fPIC", "-std=c++20", "-w"), torch=True)


def run(*cuda_libraries: Path) -> tuple[subprocess.CompletedProcess, dict | None]:
    # built (or found built) under the file lock every route takes: another xdist worker may be building it now
    proc = subprocess.run([sys.executable, "-c", SCRIPT, sim_cuda_library(), *map(str, cuda_libraries)],
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return proc, json.loads(line.removeprefix("RESULT ")) if line else None


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_the_device_runs_as_on_a_cpu_build_beside_a_cuda_builds_hooks_kernels_and_stubs(standin):
    cpu_proc, cpu = run()
    assert cpu is not None, cpu_proc.stderr[-3000:]
    assert cpu["took"] == {}  # a CPU build's path: nothing loaded, nothing taken over
    proc, got = run(standin)
    # before the fix: "Key already registered with the same priority: CUDAHooks", exit status 1, at the load
    assert got is not None, proc.stderr[-3000:]
    assert "Key already registered" not in proc.stderr
    took = got.pop("took")
    assert took["cuda_kernels_to_composite"] >= 3  # mm, add.Tensor, silu_backward (+ nothing else registered)
    assert took["autograd_cuda_to_composite"] == 1  # silu_backward: CompositeImplicitAutograd, as the CPU build
    cpu.pop("took")
    # the same allocations and frees, in the same order, and the device's own answers (its CUDA hooks, .item())
    assert got == cpu
    assert got["accelerator"] == "cuda" and got["value"] == 1.0 and got["grad"] == [4, 8]
    assert len(got["sizes"]) > 20
