"""What CUDA hardware this machine has, and the hardware profile name that keys its baselines."""

from __future__ import annotations

import re
from dataclasses import dataclass


# The rehearsal device: the CUDA route's own code (the launcher's CUDA path, the rank's CUDA recorder, its memory
# history and snapshot, the anchored replay) on the simulated CUDA device (simcuda/), with what needs real hardware
# stood in for, each named in one place (fakecuda/rehearsal.py). Its figures are simulated, labelled so
# (memory/events.py: CAPTURE_CUDA_REHEARSAL) and budgeted under REHEARSAL_PROFILE.
REHEARSAL_DEVICE = "cuda-rehearsal"
REHEARSAL_PROFILE = "cuda-rehearsal"


def code_device(device: str) -> str:
    """The device whose code a rank runs: ``cuda`` for the rehearsal device (its code is the CUDA route's),
    else ``device`` itself."""
    return "cuda" if device == REHEARSAL_DEVICE else device


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
    count = torch.cuda.device_count()  # hardware-only: the devices a CUDA driver enumerates (a CPU build has none)
    props = [torch.cuda.get_device_properties(i) for i in range(count)]  # hardware-only: as above
    return [CudaDevice(p.name, p.total_memory) for p in props]  # hardware-only: as above


def cuda_device_count() -> int:
    """How many CUDA devices torch sees here (``torch.cuda.device_count()``; 0 without torch, without CUDA,
    or without a GPU): what a run's ranks, one per device, can use."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def profile_name(devices: list[CudaDevice]) -> str:
    """``cpu`` without a GPU (figures are simulated), else ``cuda-<model>-x<count>``, e.g.
    ``cuda-nvidia-a100-sxm4-80gb-x4``."""
    if not devices:
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", devices[0].name.lower()).strip("-")
    return f"cuda-{slug}-x{len(devices)}"


GB = 10**9  # a card's size as sold: decimal gigabytes, bytes
# A card sold as N GB carries N GiB of memory and reports less (``cudaDeviceProp::totalGlobalMem``, which
# ``torch.cuda.get_device_properties(i).total_memory`` returns): ECC on (T4, A10G, L4) keeps 15/16 of it, the
# driver a few hundred MiB. The smallest totals seen are 98.9% of N x 10**9 B (a T4's 15,101 MiB as torch reports
# it on Colab, an A10G's 22,733 MiB, "22.20 GiB total capacity"); a card of the size below reports at most 91.4%
# of the next size sold (an 80 GB A100's 81,920 MiB of 94 GB; a 40 GB A100's 40,536 MiB is 88.5% of 48 GB, a
# 24 GB RTX 4090's 24,564 MiB 80.5% of 32 GB, a 16 GB V100's 16,160 MiB 84.7% of 20 GB). 96% lies between.
SOLD_GB_FRACTION = 0.96


def sold_size_bytes(min_memory_gb: float) -> int:
    """The least ``total_memory`` (bytes) of a card sold as ``min_memory_gb`` GB: ``SOLD_GB_FRACTION`` of
    ``min_memory_gb`` x 10**9 bytes (see :data:`SOLD_GB_FRACTION` for the cards it was checked against)."""
    return int(min_memory_gb * GB * SOLD_GB_FRACTION)


def gpu_shortfall(devices: list[CudaDevice], count: int, min_memory_gib: float | None = None,
                  min_memory_gb: float | None = None) -> str | None:
    """Why ``devices`` cannot run a test marked ``gpu(count, min_memory_gb=..., min_memory_gib=...)``, or
    ``None`` if they can.

    ``min_memory_gb``: GB as cards are sold; a device qualifies when its ``total_memory`` (bytes) is at least
    :func:`sold_size_bytes` of it, so every card sold as N GB runs a test marked N (an A10G "24 GB" reports
    23,028 MiB, an RTX 3090 24,268 MiB, an A100-40GB 40,536 MiB) and none sold a size smaller does.
    ``min_memory_gib``: exact binary GiB, ``total_memory >= min_memory_gib * 2**30`` (no card sold as 24 GB
    reports 24 GiB). The message names what was asked in the mark's unit and each device found: its
    ``total_memory`` in MiB for a GB mark, in GiB for a GiB mark."""
    if min_memory_gb:
        need = f"{count} CUDA device(s) sold as >= {min_memory_gb:g} GB each (total_memory >= " \
               f"{sold_size_bytes(min_memory_gb) / 2**20:,.0f} MiB)"
        usable = [d for d in devices if d.total_memory >= sold_size_bytes(min_memory_gb)]
        size = lambda d: f"{d.total_memory / 2**20:,.0f} MiB"  # noqa: E731
    else:
        need = f"{count} CUDA device(s)" + (f" with >= {min_memory_gib:g} GiB each" if min_memory_gib else "")
        usable = [d for d in devices if not min_memory_gib or d.total_memory >= min_memory_gib * 2**30]
        size = lambda d: f"{d.total_memory / 2**30:.1f} GiB"  # noqa: E731
    if len(usable) >= count:
        return None
    if not devices:
        found = "found no CUDA device"
    else:
        found = "found " + ", ".join(f"{d.name} ({size(d)})" for d in devices)
    return f"needs {need}; {found}"
