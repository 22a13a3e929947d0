"""One rank of the GPU route's rehearsal (``--device cuda-rehearsal`` for the recipes): ``rlhf/worker.py``, unchanged,
on the CUDA route's code, with the simulated CUDA device under it.

Started by ``rlhf/launch.py`` through torchrun in ``worker.py``'s place, with ``worker.py``'s arguments::

    python -m torch.distributed.run ... -m pytest_rlhfmem.fakecuda.rehearsal --scenario '{...}' --out-dir DIR \
        --device cuda-rehearsal

The rank's code is the GPU's: ``RankCapture`` with the CUDA recorder (``CudaHistory``: ``_record_memory_history``,
the phase marks on the allocator's clock, ``memory_stats()`` per phase, ``_snapshot()``, the anchored replay), the
progress file's CUDA peaks, DeepSpeed's CUDA accelerator and the recipe's ``device="cuda"`` paths. What needs real
hardware is stood in for, and each stand-in is named here and in the rank's result (``rehearsal``):

- the GPU: the simulated CUDA device (``simcuda/``), loaded before torch; its ``torch.cuda`` answers
  (``simcuda/torch_cuda.py``: statistics and memory history from the device's own log) and one device per local
  rank (``device_count()`` is the local world size: the launcher's GPU-count refusal does not apply);
- nvcc's op builds (``FusedAdam``, ``DeepSpeedCPUAdam``, ``transformer_inference``): the fake-CUDA route's optimizer
  stand-ins (``standins.py``), with its other stand-ins for what a CPU build of torch lacks on DeepSpeed's CUDA
  paths;
- NCCL: the fake-CUDA route's ``fake`` process group (collectives complete at once and move nothing), initialised
  before DeepSpeed asks for ``nccl``; every rank runs on its own, as rank 0 does on the fake-CUDA route.

The figures are simulated and labelled so (``cuda-rehearsal-simulated``), budgeted under the ``cuda-rehearsal``
profile; a run is held to the fake-CUDA route's ``sim`` tensors to the byte (tests/test_rehearsal.py).
"""

from __future__ import annotations

import os
import sys

STANDS_IN_FOR = {
    "GPU": "the simulated CUDA device (simcuda/): its log through the caching allocator model; device_count() = the "
           "local world size",
    "nvcc op builds": "the fake-CUDA route's optimizer stand-ins (FusedAdam -> AdamW(fused=True), DeepSpeedCPUAdam -> "
                      "AdamW on the host partitions)",
    "NCCL": "the fake process group (torch.testing._internal.distributed.fake_pg): collectives move nothing",
}


def main(argv: list[str] | None = None) -> int:
    from ..simcuda.build import SIM_SOURCE, library_path
    from ..simcuda.library import ENV_LIBRARY, load_before_torch

    load_before_torch(os.environ.get(ENV_LIBRARY) or str(library_path(SIM_SOURCE)))  # before torch
    os.environ["DS_ACCELERATOR"] = "cuda"

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..rlhf import worker
    from ..simcuda.library import library
    from ..simcuda.torch_cuda import install
    from . import standins

    scalar_answers: dict[str, dict] = {}
    names = standins.install_sim(library(), scalar_answers)  # the fake-CUDA route's sim stand-ins, DeepSpeed's too
    names += install(count_scalar_reads=False)  # the device's own torch.cuda answers: statistics, memory history
    dist.init_process_group("fake", store=FakeStore(), rank=int(os.environ.get("RANK", "0")),
                            world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return worker.main(argv, extra=lambda: {"rehearsal": {"stands_in_for": STANDS_IN_FOR, "standins": names},
                                            "scalar_answers": scalar_answers})


if __name__ == "__main__":
    sys.exit(main())
