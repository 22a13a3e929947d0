"""One simulated rank of the fake-CUDA route, in a fresh process (the CUDA hooks load before torch).

    python -m pytest_rlhfmem.fakecuda.worker --scenario '{...}' --rank 0 --out result.json

Runs the project's recipe (``rlhf/deepspeed_chat/: run_iteration``, unchanged) with ``device="cuda"``
under ``FakeTensorMode``, on the ``fake`` process-group backend
(``torch.testing._internal.distributed.fake_pg``: collectives complete at once and move no data), as
rank ``--rank`` of ``scenario.world_size``. Only this rank runs: with a fake process group no rank
waits for another, and DeepSpeed-Chat's ranks differ only in partition padding. The result JSON has
the same shape as ``rlhf/worker.py``'s, with ``capture`` ``fake-cuda-simulated`` and the route's own
records: ``adjustments`` (cuBLAS workspaces added), ``scalar_answers`` (every ``.item()`` call site and
the fixed answer given), ``placement`` (offload annotations checked) and ``standins``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path


TENSORS = ("fake", "sim")
POLICY_FLUSH = "after-"  # rlhf/common.py PhaseSteps: the flush policy's FLUSH marks are "after-<phase>"
ENV_SAVE_TRACE = "RLHFMEM_FAKECUDA_SAVE_TRACE"  # set: write each run's trace beside its result (.rlhftrace)


def _sim_adjustments(result: dict) -> dict:
    """The simulated device's own additions (cuBLAS workspaces, kernels' temporaries), as the fake route's
    ``adjustments``."""
    d = result.get("capture_description", {}).get("simulated_cuda_device", {})
    return {"cublas_workspace": {"count": d.get("cublas_workspaces", 0)},
            "reduction_staging_buffers": {"count": d.get("reduction_staging_buffers", 0)},
            "index_put_sort_buffers": {"count": d.get("index_put_sort_buffers", 0)}}


def _rss_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_seconds() -> float:
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return round(u.ru_utime + u.ru_stime, 3)


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def without_policy_flushes(trace):  # noqa: ANN001, ANN201 - memory.trace.Trace
    """``trace`` without the flush policy's FLUSH marks (``after-<phase>``): the run's flush-none trace.
    DeepSpeed's own ``empty_cache()`` calls stay, as they would in a run without the policy. On the simulated
    device under ``until-sync`` the caller first rebuilds the trace without the policy's host waits
    (``SimCudaRows.rows(without_flush_syncs=True)``), so blocks they returned return at the next other wait."""
    from ..memory.trace import FLUSH, Trace

    return Trace(events=[e for e in trace.events if e.action != FLUSH or not e.name.startswith(POLICY_FLUSH)],
                 capture=trace.capture, source=trace.source)


def without_wake_up_flushes(trace):  # noqa: ANN001, ANN201 - memory.trace.Trace
    """``trace`` without the trainer's ``empty_cache()`` before each colocated engine's wake-up (FLUSH
    ``before-wake-up``, ``rollout/engine.py``): the run with ``flush_before_wake_up=False``. Exact on this route:
    a flush moves no allocation of the program, and the simulated device's host waits are not the flush's."""
    from ..memory.trace import FLUSH, Trace
    from ..rollout import FLUSH_BEFORE_WAKE_UP

    return Trace(events=[e for e in trace.events if e.action != FLUSH or e.name != FLUSH_BEFORE_WAKE_UP],
                 capture=trace.capture, source=trace.source)


def twin_without_flush(scenario):  # noqa: ANN001, ANN201 - rlhf.scenario.Scenario
    """The scenario whose run is ``scenario``'s trace without its flushes (``--without-flush-out``): with a colocated
    engine the one with ``flush_before_wake_up`` False (:func:`without_wake_up_flushes`), else the one with flush
    ``none`` (:func:`without_policy_flushes`). ``run.py`` keys the twin's result by its id."""
    from ..rlhf.scenario import Scenario

    if scenario.get("rollout_engine"):
        return Scenario.from_dict({**scenario.to_dict(), "overrides": {**scenario.overrides,
                                                                        "flush_before_wake_up": False}})
    return Scenario.from_dict({**scenario.to_dict(), "flush": "none"})


def _save_trace_beside(result_path: Path, trace) -> None:  # noqa: ANN001 - memory.trace.Trace
    """With ``$RLHFMEM_FAKECUDA_SAVE_TRACE`` set: ``trace`` beside its result (``.rlhftrace``), for replays of it
    (``rlhfmem replay``, ``rlhfmem advise``)."""
    if os.environ.get(ENV_SAVE_TRACE):
        from ..memory.trace_io import save_trace

        save_trace(result_path.with_suffix(".rlhftrace"), trace)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pytest_rlhfmem.fakecuda.worker")
    ap.add_argument("--scenario", required=True, help="scenario JSON")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--without-flush-out", default=None,
                    help="also write the result of the same trace replayed without its FLUSH events (the "
                         "scenario with flush 'none'; with a colocated engine, the scenario with "
                         "flush_before_wake_up False): a fake run's allocations do not depend on the flushes")
    ap.add_argument("--tensors", choices=TENSORS, default="fake",
                    help="fake: FakeTensorMode with the dispatcher recorder; sim: the simulated CUDA device "
                         "(real ATen tensors, meta kernels in C++, the device's own allocation log)")
    args = ap.parse_args(argv)
    sim = args.tensors == "sim"
    if sim:
        from ..simcuda.build import SIM_SOURCE, library_path
        from ..simcuda.library import load_before_torch

        load_before_torch(str(library_path(SIM_SOURCE)))  # before torch
    else:
        from ..simcuda import build

        build.load()  # before torch
    os.environ["DS_ACCELERATOR"] = "cuda"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t_start = time.perf_counter()

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..rlhf.common import engine_card_bytes
    from ..rlhf.scenario import Scenario
    from ..record.rank import rank_result
    from . import standins
    from .recorder import FakeCudaRecorder, sim_device_recorder

    scenario = Scenario.from_dict(json.loads(args.scenario))
    if scenario.framework != "deepspeed-chat":
        raise SystemExit(f"rlhfmem: error: the fake-CUDA route runs deepspeed-chat only, not {scenario.framework}")
    rank, world_size = args.rank, scenario.world_size
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))  # as torchrun sets them; DeepSpeed reads them
    threads = scenario.get("threads", 1)
    torch.set_num_threads(threads)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    if sim:
        from ..simcuda.library import library

        rec = sim_device_recorder()
        names = standins.install_sim(library(), rec.scalar_answers)
        tensor_mode = contextlib.nullcontext()
    else:
        rec = FakeCudaRecorder()
        names = standins.install(rec)
        tensor_mode = FakeTensorMode(allow_non_fake_inputs=True)
    import deepspeed
    import transformers  # noqa: F401 - imported outside the fake mode

    kernels = None
    if scenario.get("hybrid_engine_kernels"):  # run.py refuses it unless sim
        from . import inference_kernels

        kernels, kernel_names = inference_kernels.install()
        names += kernel_names

    from ..rlhf.deepspeed_chat import run_iteration

    deepspeed.init_distributed()
    startup_s = time.perf_counter() - t_start
    error = info = None
    t0, c0 = time.perf_counter(), time.process_time()
    with tensor_mode:
        rec.start()
        if sim:  # DeepSpeed's own torch.cuda.empty_cache() calls: FLUSH events named by their caller
            rec.intercept_empty_cache()
        try:
            info = run_iteration(scenario, rec, "cuda", rank, world_size)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a structured result
            error = {"phase": rec.phases[-1].name if rec.phases else "startup", "time": time.time(),
                     "type": type(exc).__name__, "message": str(exc)[:2000],
                     "traceback": traceback.format_exc()[-6000:]}
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        trace = rec.stop()
    card = engine_card_bytes(scenario)  # a colocated engine's card: the replay runs at it (None: unlimited)
    result = rank_result(scenario, rank, world_size, "cuda", rec, trace, info, error, threads, wall, card)
    result.update({
        "route": "sim-cuda" if sim else "fake-cuda",
        "tensors": args.tensors,
        "simulated": True,
        "adjustments": _sim_adjustments(result) if sim else rec.adjustments,
        "scalar_answers": rec.scalar_answers,
        "placement": rec.placement,
        # the simulated device's log has no Python call sites
        "live_by_site_at_phase_end": None if sim else rec.live_by_site(),
        "standins": names,
        # device memory a GPU run takes outside the caching allocator (raw cudaMalloc): not in the trace
        "outside_caching_allocator": kernels.raw_allocations if kernels else [],
        "inference_kernel_calls": kernels.calls if kernels else {},
        "startup_s": round(startup_s, 3),
        "iteration_cpu_s": round(cpu, 3),  # CPU time of the iteration (wall_s counts waiting for a shared core)
        "replay_s": round(time.perf_counter() - t0 - wall, 3),
        "host_rss_peak": _rss_peak_bytes(),
        "process_cpu_s": _cpu_seconds(),  # the worker's CPU time to here: startup, iteration, replay
    })
    extra = {k: result[k] for k in ("route", "tensors", "simulated", "adjustments", "scalar_answers", "placement",
                                    "standins", "outside_caching_allocator", "inference_kernel_calls",
                                    "live_by_site_at_phase_end", "startup_s", "iteration_cpu_s",
                                    "process_cpu_s", "host_rss_peak")}
    _write(Path(args.out), result)
    _save_trace_beside(Path(args.out), trace)
    if args.without_flush_out:
        t1 = time.perf_counter()
        recipe = info
        if scenario.get("rollout_engine"):  # the engine's run without the trainer's flush before each wake-up
            trace = without_wake_up_flushes(trace)
            recipe = info and {**info, "rollout_engine": {**info.get("rollout_engine", {}),
                                                          "flush_before_wake_up": False}}
            removed = "the trainer's FLUSH before each wake-up removed"
        else:
            if sim and getattr(rec.row_source, "flush_syncs", None):  # until-sync: held blocks the policy's waits
                trace = rec.trace_from_rows(rec.row_source.rows(without_flush_syncs=True), None)  # returned later
            trace = without_policy_flushes(trace)
            removed = "FLUSH events removed"
        other = rank_result(twin_without_flush(scenario), rank, world_size, "cuda", rec, trace, recipe, error,
                            threads, wall, card)
        other.update(extra, replay_s=round(time.perf_counter() - t1, 3),
                     derived_from=f"{scenario.id}: same trace, {removed}")
        _write(Path(args.without_flush_out), other)
        _save_trace_beside(Path(args.without_flush_out), trace)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if error else 0)  # skip teardown of DeepSpeed/fake-mode state: the result is written


if __name__ == "__main__":
    sys.exit(main())
