"""The host CPU's properties that could move a CPU-path figure, and the precision checks the recipes answer.

A CPU-path figure (simulated device memory, host memory) must not depend on which CPU ran it: a budget
recorded on one x86-64 machine has to hold on every other. This module names what of the host could still
change one, so every result records it (:func:`host_cpu_profile`) and a budget failure or ``rlhfmem diff``
can say where two runs' hosts differ (:func:`host_differences`):

- ``aten_cpu_capability``: the vector ISA ATen dispatches its CPU kernels to
  (``torch.backends.cpu.get_cpu_capability()``: ``DEFAULT``, ``AVX2``, ``AVX512``, ...); the environment
  variable ``ATEN_CPU_CAPABILITY=default|avx2|avx512`` lowers it (``aten/src/ATen/native/DispatchStub.cpp``).
- ``onednn_max_cpu_isa``: oneDNN's ISA cap (environment ``ONEDNN_MAX_CPU_ISA``, e.g. ``AVX2``,
  ``AVX512_CORE``; ``native`` when unset; oneDNN's ``dnnl_set_max_cpu_isa`` documentation).
- ``mkldnn_fp16`` / ``mkldnn_bf16``: whether oneDNN has fp16/bf16 kernels on this CPU
  (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX-FP16;
  ``_is_mkldnn_bf16_supported()``), the answer DeepSpeed's CPU accelerator gives for ``is_fp16_supported``.
  ``RLHFMEM_CPU_FP16_KERNELS=supported|unsupported`` forces DeepSpeed's answer in a worker
  (:func:`force_fp16_answer`), so both machines' paths run on one.
- ``cpu_model``, ``machine``, ``intraop_threads``: the processor, its architecture, torch's intra-op threads.

Why the recipes answer DeepSpeed's dtype checks themselves (:func:`answer_deepspeed_dtype_checks`):
``DeepSpeedEngine._do_sanity_check`` (deepspeed/runtime/engine.py) raises "Type fp16 is not supported on your
device." when the CPU accelerator's ``is_fp16_supported()`` is False, i.e. on every CPU without AVX512-FP16 /
AMX-FP16 kernels. That check is about the speed of CPU kernels; fp16 tensors exist, and PyTorch computes
them (converting internally) on any x86-64 CPU. The GPU's precision is what decides the model-state buffers
a budget gates, so the recipe runs it everywhere, answers the check "supported" inside its worker only, and
says so in every result's ``capture_description`` (``deepspeed_dtype_checks``). Where a dtype truly cannot
compute (an op with no kernel for it: PyTorch's ``"... not implemented for 'Half'"``), the run fails with
:func:`dtype_failure`'s message naming the dtype, the op and ``--dtype fp32`` (whose figures are not
comparable with an fp16 budget).
"""

from __future__ import annotations

import os
import platform
import re

# What a result records of its host, in the order reports list them.
HOST_CPU_PROPERTIES = ("machine", "cpu_model", "aten_cpu_capability", "onednn_max_cpu_isa", "mkldnn_fp16",
                       "mkldnn_bf16", "intraop_threads")
ENV_FP16_KERNELS = "RLHFMEM_CPU_FP16_KERNELS"  # auto (default) | supported | unsupported
FP16_ANSWERS = ("auto", "supported", "unsupported")
# The capture_description entry of a DeepSpeed-Chat CPU run: the same on every machine, so budgets compare.
DEEPSPEED_DTYPE_CHECKS = ("answered supported in the worker (fp16, bf16): CPU kernels' speed is not measured; "
                          "the host's own answer is in host_cpu")
# Forced settings that run this machine as a weaker or different CPU would (the portability tests'): ATEN_CPU_CAPABILITY
# lowers the ISA ATen dispatches its CPU kernels to, ONEDNN_MAX_CPU_ISA caps oneDNN's, RLHFMEM_CPU_FP16_KERNELS
# forces DeepSpeed's fp16 answer. name -> (environment, what a result then records in host_cpu).
FORCED_CPU_SETTINGS = {
    "aten-default_onednn-sse41_no-fp16": (
        {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", ENV_FP16_KERNELS: "unsupported"},
        {"aten_cpu_capability": "DEFAULT", "onednn_max_cpu_isa": "SSE41", "mkldnn_fp16": "forced unsupported"}),
    "aten-avx2_onednn-avx2_fp16": (
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", ENV_FP16_KERNELS: "supported"},
        {"aten_cpu_capability": "AVX2", "onednn_max_cpu_isa": "AVX2", "mkldnn_fp16": "forced supported"}),
}
_NOT_IMPLEMENTED = re.compile(r"""["']?([\w:.]+)["']? not implemented for '(Half|BFloat16|Float8\w*)'""")


# torch before 2.6 names ATen's lowest dispatch level "NO AVX" (aten/src/ATen/native/DispatchStub.cpp); later
# releases "DEFAULT". One name, so two torch versions at the same level compare equal.
_CAPABILITY_ALIASES = {"NO AVX": "DEFAULT"}


def aten_cpu_capability() -> str:
    """ATen's CPU dispatch level (``torch.backends.cpu.get_cpu_capability()``): ``DEFAULT``, ``AVX2``,
    ``AVX512``, ... (``NO AVX`` of torch < 2.6 reported as ``DEFAULT``)."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    return _CAPABILITY_ALIASES.get(cap, cap)


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``'s ``model name``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fp16_answer() -> str:
    """The forced fp16 answer from ``$RLHFMEM_CPU_FP16_KERNELS`` (``auto`` when unset).
    Raises ``ValueError`` naming the variable and the allowed values."""
    value = os.environ.get(ENV_FP16_KERNELS, "auto").strip().lower() or "auto"
    if value not in FP16_ANSWERS:
        raise ValueError(f"${ENV_FP16_KERNELS}={value!r}: allowed values: {', '.join(FP16_ANSWERS)}")
    return value


def force_fp16_answer() -> str:
    """Apply ``$RLHFMEM_CPU_FP16_KERNELS`` in this process: ``supported``/``unsupported`` becomes the answer
    of DeepSpeed's CPU accelerator (``CPU_Accelerator.is_fp16_supported`` and ``supported_dtypes``, which ask
    ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``; the op itself is left alone: torch reads attributes of
    it). ATen's own kernel choice is not changed (``ONEDNN_MAX_CPU_ISA`` caps oneDNN's). Returns the answer
    applied (``auto`` = the host's); without DeepSpeed there is no Python caller to answer."""
    answer = fp16_answer()
    if answer == "auto":
        return answer
    try:
        import torch
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    except ImportError:
        return answer
    value = answer == "supported"
    CPU_Accelerator.is_fp16_supported = lambda self: value
    CPU_Accelerator.supported_dtypes = lambda self: [torch.float, torch.bfloat16] + ([torch.float16] if value else [])
    return answer


def _mkldnn(name: str) -> bool | None:
    import torch

    try:
        return bool(getattr(torch.ops.mkldnn, name)())
    except Exception:  # noqa: BLE001 - a build without oneDNN
        return None


def host_cpu_profile(threads: int | None = None) -> dict:
    """This process's :data:`HOST_CPU_PROPERTIES` (strings, booleans, an int); imports torch. An fp16 answer
    forced by ``$RLHFMEM_CPU_FP16_KERNELS`` is recorded as ``forced supported``/``forced unsupported``."""
    import torch

    forced = fp16_answer()
    fp16 = _mkldnn("_is_mkldnn_fp16_supported")
    return {
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "aten_cpu_capability": aten_cpu_capability(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "native").upper(),
        "mkldnn_fp16": fp16 if forced == "auto" else f"forced {forced}",
        "mkldnn_bf16": _mkldnn("_is_mkldnn_bf16_supported"),
        "intraop_threads": threads if threads is not None else torch.get_num_threads(),
    }


def host_differences(mine: dict | None, theirs: dict | None) -> list[str]:
    """``"name: A vs B"`` for each host property that both record and that differs (``mine`` first); an
    empty list when either side recorded none (results and budgets written before hosts were recorded)."""
    if not mine or not theirs:
        return []
    return [f"{k}: {mine[k]} vs {theirs[k]}" for k in HOST_CPU_PROPERTIES
            if k in mine and k in theirs and mine[k] != theirs[k]]


def answer_deepspeed_dtype_checks() -> str:
    """Make DeepSpeed's CPU accelerator answer ``is_fp16_supported``/``is_bf16_supported`` True and list
    fp16/bf16 in ``supported_dtypes`` for the rest of this process (the worker); returns the
    ``capture_description`` text (:data:`DEEPSPEED_DTYPE_CHECKS`). Follows deepspeed/accelerator/
    cpu_accelerator.py (the class whose methods are replaced) and runtime/engine.py ``_do_sanity_check``."""
    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True
    CPU_Accelerator.is_bf16_supported = lambda self: True
    CPU_Accelerator.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]
    return DEEPSPEED_DTYPE_CHECKS


def dtype_failure(message: str, dtype: str | None) -> str | None:
    """For an error message of PyTorch's "<op> not implemented for 'Half'" kind: one line naming the dtype
    and the op and what to do; ``None`` for any other message."""
    m = _NOT_IMPLEMENTED.search(message)
    if not m:
        return None
    op, kind = m.groups()
    name = {"Half": "fp16", "BFloat16": "bf16"}.get(kind, kind)
    return (f"dtype {name} cannot compute on this CPU build: op {op} has no {kind} kernel "
            f"(torch {_torch_version()}{', recipe dtype ' + dtype if dtype else ''}); run with --dtype fp32 "
            "(its figures are not comparable with an fp16/bf16 budget) or a torch build with that kernel")


def _torch_version() -> str:
    import torch

    return torch.__version__
