"""A stand-in dependency at two releases (tests/test_deps_diff.py installs it as version 1.0 or 2.0): 2.0's
``forward`` materialises a 16 MiB attention-bias cache for the call, as a library upgrade may start doing in one
phase (transformers 5's masks, a new kernel's workspace). ``VERSION`` is replaced when it is installed."""

import torch

__version__ = "VERSION"
CACHE_BYTES = 16 * 2**20 if __version__.startswith("2.") else 0


def forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model(x)``; 2.0 adds its cache (zeros, freed when the call returns)."""
    out = model(x)
    if CACHE_BYTES:
        cache = torch.zeros(CACHE_BYTES // 4)
        out = out + cache[: out.numel()].view_as(out)
    return out
