"""One rank: build the recipe, run its phases under capture, write the rank's result JSON.

Started by ``launch.py`` through torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` come from it)::

    python -m torch.distributed.run --standalone --nproc-per-node N -m pytest_rlhfmem.rlhf.worker \
        --scenario '{...}' --out-dir DIR --device cpu

Files it writes in ``--out-dir`` (through ``pytest_rlhfmem/capture.py``, the per-rank capture ``rlhfmem capture``
uses too): ``progress-rank<R>.json`` at each phase start (pid, phase, host RSS: what a hung rank leaves
behind) and ``result-rank<R>.json`` at the end (also on a failure, with the phase, the error and the
memory figures up to it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..hardware import REHEARSAL_DEVICE, code_device


def main(argv: list[str] | None = None, extra: Callable[[], dict] | None = None) -> int:
    """One rank (see the module docstring). ``extra``: records merged into the rank's result at its end (the
    rehearsal's stand-ins: ``fakecuda/rehearsal.py``, which calls this with ``--device cuda-rehearsal``: the CUDA
    route's code, labelled simulated)."""
    ap = argparse.ArgumentParser(prog="pytest_rlhfmem.rlhf.worker")
    ap.add_argument("--scenario", required=True, help="scenario JSON")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda", REHEARSAL_DEVICE), required=True)
    ap.add_argument("--snapshot-dir", default=None)
    ap.add_argument("--no-capture", action="store_true", help="bare iteration: time it, record nothing")
    ap.add_argument("--cuda-emulation", choices=("on", "off"), default="on", help="CPU capture: emulate CUDA")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from ..record.rank import RankCapture
    from .common import engine_card_bytes
    from ..hostcpu import answer_deepspeed_dtype_checks, force_fp16_answer
    from .scenario import Scenario

    scenario = Scenario.from_dict(json.loads(args.scenario))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    threads = scenario.get("threads", 1)
    torch.set_num_threads(threads)  # the allocation sequence depends on it: pinned and recorded
    force_fp16_answer()  # $RLHFMEM_CPU_FP16_KERNELS: run as a CPU with (or without) fp16 kernels would
    description = {}
    if args.device == "cpu" and scenario.framework == "deepspeed-chat":
        # the GPU's precision on any CPU: DeepSpeed's fp16/bf16 checks ask for fast CPU kernels (hostcpu.py)
        description["deepspeed_dtype_checks"] = answer_deepspeed_dtype_checks()
        from .deepspeed_chat import record_deepspeed_empty_cache

        description["deepspeed_empty_cache"] = record_deepspeed_empty_cache()
    # The one capture path (rlhfmem capture uses it too): the recorder is the public API's active
    # handle, so rlhfmem.phase(...) inside a recipe or a library lands in the same trace as rec.phase.
    cap = RankCapture(scenario, args.device, Path(args.out_dir), rank, world_size, capture=not args.no_capture,
                      snapshot_dir=args.snapshot_dir, threads=threads, cuda_emulation=args.cuda_emulation,
                      description=description, capacity=engine_card_bytes(scenario), extra=extra)
    cap.progress("startup")
    device = code_device(args.device)  # the rehearsal runs the CUDA route's code
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device == "cuda" else "gloo"
    if scenario.framework == "deepspeed-chat":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
        from .deepspeed_chat import run_iteration
    else:
        import colossalai

        colossalai.launch_from_torch(backend=backend, seed=scenario.get("seed", 1234), verbose=False)
        import colossalai.booster  # noqa: F401 - imported before the iteration's clock starts
        from .colossalchat import run_iteration  # type: ignore[no-redef]
    error = None
    info = None
    rec = cap.start()
    try:
        info = run_iteration(scenario, rec, device, rank, world_size)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a structured result
        error = cap.error_from(exc)
    cap.finish(info, error)
    code = 1 if error else 0
    sys.stdout.flush()
    sys.stderr.flush()
    if not error and dist.is_initialized():
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001
            pass
    # Skip interpreter teardown: DeepSpeed's shm comm and gloo threads can abort at exit (SIGABRT)
    # after the work is done and written.
    _save_coverage()
    os._exit(code)


def _save_coverage() -> None:
    """A rank measured by coverage.py (the tests' report of the GPU route's lines: tests/gpu_route.py) saves its data
    before ``os._exit`` skips the interpreter's exit handlers; nothing otherwise."""
    coverage = sys.modules.get("coverage")
    current = coverage.Coverage.current() if coverage is not None else None
    if current is not None:
        current.stop()
        current.save()


if __name__ == "__main__":
    sys.exit(main())
