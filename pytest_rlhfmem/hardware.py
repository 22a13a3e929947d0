"""What CUDA hardware this machine has, and the hardware profile name that keys its baselines."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CudaDevice:
    name: str
    total_memory: int  # bytes


def detect_cuda_devices() -> list[CudaDevice]:
    """The visible CUDA devices (empty without torch, without CUDA, or without a GPU)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [CudaDevice(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


def profile_name(devices: list[CudaDevice]) -> str:
    """``cpu`` without a GPU (figures are simulated), else ``cuda-<model>-x<count>``, e.g.
    ``cuda-nvidia-a100-sxm4-80gb-x4``."""
    if not devices:
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", devices[0].name.lower()).strip("-")
    return f"cuda-{slug}-x{len(devices)}"


def gpu_shortfall(devices: list[CudaDevice], count: int, min_memory_gib: float | None) -> str | None:
    """Why ``devices`` cannot run a test marked ``gpu(count, min_memory_gib)``, or ``None`` if they can."""
    need = f"{count} CUDA device(s)" + (f" with >= {min_memory_gib:g} GiB each" if min_memory_gib else "")
    usable = [d for d in devices if not min_memory_gib or d.total_memory >= min_memory_gib * 2**30]
    if len(usable) >= count:
        return None
    if not devices:
        found = "found no CUDA device"
    else:
        found = "found " + ", ".join(f"{d.name} ({d.total_memory / 2**30:.1f} GiB)" for d in devices)
    return f"needs {need}; {found}"
