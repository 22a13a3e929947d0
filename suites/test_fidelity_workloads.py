"""CPU capture vs GPU recording on public workloads (opt-in: part of the main job, `tox -e suite`).

Each test reruns a workload whose GPU recording is in ``shared/snapshots`` (the CS336 medium
Transformer LM of Wedsonlin/assignment2-systems, see ``pytest_rlhfmem/fidelity/workloads.py``) on CPU
under the recorder with the CUDA emulation on, replays it through the allocator model, and asserts the
recorded step's figures equal the GPU's: peak reserved, peak allocated and cudaMalloc count to the
byte, and the very same sequence of allocation sizes. Cost on this 2-core machine: see docs/fidelity.md
(minutes per workload, about 10 GiB of host memory for the training step).
"""

import pytest

from pytest_rlhfmem.fidelity.workloads import WORKLOADS, capture, captured_figures, compare, recorded_figures
from pytest_rlhfmem.memory.emulation import EmulationSettings
from pytest_rlhfmem.shared_snapshots import missing_reason, snapshot_path


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_cpu_capture_matches_gpu_recording(name):
    path = snapshot_path(WORKLOADS[name].snapshot)
    reason = missing_reason(path)
    if reason:
        pytest.skip(reason)
    # The recordings were made with the default cuBLAS workspace of a pre-Hopper GPU.
    settings = EmulationSettings(compute_capability=None, cublas_workspace_config=None)
    trace, _rec, _seconds = capture(WORKLOADS[name], settings)
    cmp = compare(recorded_figures(path), captured_figures(trace))
    for figure in ("reserved_at_start", "peak_reserved", "peak_allocated", "cuda_malloc_count",
                   "fragmentation_at_peak"):
        assert cmp[figure]["equal"], f"{name}: {figure} recorded {cmp[figure]['recorded']:,} " \
                                     f"captured {cmp[figure]['captured']}"
    assert cmp["allocations"]["same_sequence"], cmp["allocations"]
