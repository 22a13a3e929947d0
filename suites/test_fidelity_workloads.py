"""CPU capture vs GPU recording on public workloads (opt-in: part of the main job, `tox -e suite`).

Each test reruns a workload whose GPU recording is in ``shared/snapshots`` (the CS336 medium
Transformer LM of Wedsonlin/assignment2-systems, see ``pytest_rlhfmem/fidelity/workloads.py``) on CPU
under the recorder with the CUDA emulation on, replays it through the allocator model, and asserts the
recorded step's figures equal the GPU's: peak reserved, peak allocated and cudaMalloc count to the byte
(the inference step: the very same sequence of allocation sizes), or differ by exactly the residual
explained in docs/fidelity.md. Cost on this 2-core machine: about 4 min (inference) under load; training
2 min 26 s alone (about 30 min when seven jobs shared the cores) and 16 GiB of host memory, taken in a child
process (``capture_in_child``) so that the main job's pytest process does not keep it for the rest of the session.
"""

import pytest

from pytest_rlhfmem.memory.address_order import address_order_spread
from pytest_rlhfmem.fidelity.workloads import WORKLOADS, capture_in_child, captured_figures, compare, recorded_figures
from pytest_rlhfmem.record.emulation import EmulationSettings
from pytest_rlhfmem.shared_snapshots import missing_reason, snapshot_path


# Residuals that remain, explained to the allocation (docs/fidelity.md): in the training step the capture's
# own dispatch mode makes autograd take its out-of-place ("tensor subclass like") branches, so ONE extra
# 40,960,000 B logits-sized tensor (a 41,943,040 B block) is live at the peak, while the GPU holds a 4,096 B
# block where the capture holds two 512 B ones (4-byte tensors): +41,943,040 - 4,096 + 2 x 512 bytes.
# The training run's warm-ups create segments, and which of several equal-size free blocks best fit takes is
# decided by the segments' addresses, which the driver chooses (memory/address_order.py; README, "A CUDA
# script, unchanged"): its reserved figures are checked against the spread over 16 seeded placements.
ADDRESS_ORDER_DEPENDENT = ("wedson_medium_256_training",)
PEAK_ALLOCATED_RESIDUAL = {"wedson_medium_128_inference": 0,
                           "wedson_medium_256_training": 41_943_040 - 4_096 + 2 * 512}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_cpu_capture_matches_gpu_recording(name):
    path = snapshot_path(WORKLOADS[name].snapshot)
    reason = missing_reason(path)
    if reason:
        pytest.skip(reason)
    # The recordings were made with the default cuBLAS workspace of a pre-Hopper GPU.
    settings = EmulationSettings(compute_capability=None, cublas_workspace_config=None)
    trace = capture_in_child(name, settings)  # the run's host memory is the child's, returned when it ends
    cmp = compare(recorded_figures(path), captured_figures(trace))
    print(name, {k: v for k, v in cmp.items() if k != "allocations"}, cmp["allocations"])
    assert cmp["cuda_malloc_count"]["equal"], cmp["cuda_malloc_count"]
    if name in ADDRESS_ORDER_DEPENDENT:
        # what the warm-ups leave cached depends on where the driver mapped each segment (best fit breaks
        # ties by address): the recorded figure must be one outcome of the captured run under some placement
        spread = address_order_spread(trace, orders=16, seed=0)
        assert spread["model_order"]["peak_reserved"] == cmp["peak_reserved"]["captured"]
        assert cmp["peak_reserved"]["recorded"] in spread["peak_reserved"]["counts"], spread
    else:
        for figure in ("reserved_at_start", "peak_reserved", "fragmentation_at_peak"):
            assert cmp[figure]["equal"], f"{name}: {figure} recorded {cmp[figure]['recorded']} " \
                                         f"captured {cmp[figure]['captured']}"
    residual = cmp["peak_allocated"]["captured"] - cmp["peak_allocated"]["recorded"]
    assert residual == PEAK_ALLOCATED_RESIDUAL[name], cmp["peak_allocated"]
    if name == "wedson_medium_128_inference":
        assert cmp["allocations"]["same_sequence"], cmp["allocations"]
