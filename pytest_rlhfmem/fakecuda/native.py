"""The fake-CUDA route's device library: built and loaded by ``memory/device_libs.py`` (shared with the
simulated CUDA device of ``rlhfmem capture --device cuda-sim``). Never imports torch."""

from ..memory.device_libs import SIM_SOURCE, SOURCE, FakeCudaUnavailable, library_path, load

__all__ = ["SIM_SOURCE", "SOURCE", "FakeCudaUnavailable", "library_path", "load"]
