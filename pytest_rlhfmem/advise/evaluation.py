"""Replaying the advisor's candidates on every rank: both cores, one process per core, traces shared by fork.

:class:`Evaluator` replays each candidate (:class:`~.candidates.Spec`) on every rank of a scenario, once
(a cache by spec), and aggregates the ranks as a run's result does (the maximum over ranks: budgets are per
GPU). The compiled replay core inserts a candidate's flushes itself (``flush_at``) when it supports the
setting; otherwise the Python model replays the event list with the flushes in it. Sizes are bytes.
"""

from __future__ import annotations

import gc
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..memory.allocator import AllocatorConfig
from ..memory.events import Trace
from ..memory.replay import FREE_RUNNING, PYTHON, replay
from ..memory.replay_engine import engine_for
from ..rollout import ALL_TAGS_ZERO, sizes_at, with_mapping_sizes
from .candidates import Spec
from .inputs import RankInput

_RANKS: list[RankInput] = []  # the ranks being evaluated: fork hands them to the pool's workers
# the device's bytes every candidate without its own capacity replays against (None: unlimited): set where the
# traces map device memory outside the caching allocator (a colocated engine) and a capacity is given
_DEVICE_CAPACITY: list[int | None] = [None]


def _spec_config(ri: RankInput, spec: Spec) -> AllocatorConfig:
    base = (ri.trace.allocator_settings or {}).get("PYTORCH_CUDA_ALLOC_CONF") or ""
    return AllocatorConfig.parse(",".join(c for c in (base, spec.alloc_conf) if c))


def _replay_one(job: tuple[Spec, int]) -> dict:
    """One candidate on one rank: the compiled engine inserts the flushes itself (``flush_at``) when it
    supports the setting; otherwise the Python model replays the event list with the flushes in it."""
    spec, r = job
    ri = _RANKS[r]
    positions: list[int] = []
    names: list[str] = []
    if spec.recorded:
        events, cols = ri.recorded, ri.recorded_columns
    else:
        events, cols = ri.program, ri.program_columns
        if spec.flushes:
            names = [n for n in spec.flushes if n in ri.boundaries.positions]
            positions = [ri.boundaries.positions[n] for n in names]
    capacity = spec.capacity if spec.capacity is not None else _DEVICE_CAPACITY[0]
    if spec.utilization is not None or spec.kv_cache is not None or spec.engine_expandable_segments is not None:
        # the engine's mappings as vLLM sizes them on the device at this utilization (unpinned), this pin, or with
        # expandable_segments stripped from its process (the sleep pool's records get the bytes)
        pin = (spec.kv_cache if spec.kv_cache is not None else
               None if spec.utilization is not None else ri.engine.get("kv_cache_memory_bytes"))
        u = spec.utilization if spec.utilization is not None else ri.engine["gpu_memory_utilization"]
        events, cols = with_mapping_sizes(events, {**ALL_TAGS_ZERO, **sizes_at(ri.engine, capacity, u, pin,
                                                                            spec.engine_expandable_segments)}), None
    # the columns carry the Trace they were built from (inputs._rank_input): the Python engine replays that
    trace = cols if cols is not None else Trace(events=events, initial_segments=ri.trace.initial_segments,
                                                allocator_settings=ri.trace.allocator_settings,
                                                capture=ri.trace.capture)
    res = replay(trace, config=_spec_config(ri, spec), mode=FREE_RUNNING, capacity=capacity,
                 record_series=False, engine="auto", flush_at=positions, flush_names=names)
    t = res.total
    return {"rank": ri.rank, "peak_reserved": t.peak_reserved, "fragmentation_at_peak": t.fragmentation_at_peak,
            "peak_phase": res.peak_phase, "cuda_malloc": t.cuda_malloc_count, "cuda_free": t.cuda_free_count,
            # bytes obtained from the driver: cudaMalloc'd segments plus, with expandable segments, mapped pages
            "bytes_acquired": sum(s for _, s in res.segment_allocs) + sum(s for _, s in res.segment_maps),
            "alloc_retries": t.alloc_retries,
            "ooms": t.ooms, "peak_allocated": t.peak_allocated,
            "flushes": len(res.flushes), "engine": res.engine,
            # a colocated engine's mappings that the device could not back (memory/events.py: EXTERNAL_MAP)
            "external_map_failures": len(res.external_map_failures), "peak_device_used": res.peak_device_used}


class ReplayWorkerDied(RuntimeError):
    """A replay process of the pool died (a signal, the out-of-memory killer); one line, nothing was advised."""


def _worker_init() -> None:
    """A pool worker leaves SIGINT to the parent, which stops the workers itself (:meth:`Evaluator.close`): a
    Ctrl-C then prints no traceback per worker and stops the command at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Evaluator:
    """Replays candidates on every rank, with a cache; ``processes`` > 1 uses a fork pool
    (``concurrent.futures.ProcessPoolExecutor``: a worker that dies breaks the pool, and :meth:`evaluate` raises
    :class:`ReplayWorkerDied` instead of waiting for its lost job). ``device_capacity`` (bytes): what candidates
    without their own capacity replay against (``None``: unlimited). On an exception (Ctrl-C included) its user
    calls ``close(abort=True)``, which terminates the workers rather than waiting for their replays."""

    def __init__(self, ranks: list[RankInput], processes: int, device_capacity: int | None = None) -> None:
        global _RANKS
        _RANKS = ranks
        _DEVICE_CAPACITY[0] = device_capacity
        self.device_capacity = device_capacity
        self.ranks = ranks
        self.cache: dict[Spec, dict] = {}
        self.replays = 0
        self.pool = None
        if processes > 1 and "fork" in multiprocessing.get_all_start_methods():
            # The workers inherit the ranks' columns and events by fork; freezing the objects made so far
            # keeps the workers' garbage collector from touching (and so copying) their pages.
            gc.collect()
            gc.freeze()
            self.pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"),
                                            initializer=_worker_init)

    def close(self, abort: bool = False) -> None:
        """End the pool: wait for its workers, or (``abort``) terminate them."""
        if self.pool is None:
            return
        pool, self.pool = self.pool, None
        try:
            if abort:
                _terminate_workers(pool)
            else:
                pool.shutdown(wait=True)
        finally:
            gc.unfreeze()

    def _engine(self, job: tuple[Spec, int]) -> str:
        spec, r = job
        ri = self.ranks[r]
        if spec.utilization is not None:
            return PYTHON  # resized mappings: the Python model replays every trace with them
        cols = ri.recorded_columns if spec.recorded else ri.program_columns
        return engine_for(cols, _spec_config(ri, spec), FREE_RUNNING)[0]

    def evaluate(self, specs: list[Spec]) -> list[dict]:
        todo = [s for s in dict.fromkeys(specs) if s not in self.cache]
        jobs = [(s, r) for s in todo for r in range(len(self.ranks))]
        # Python-engine replays (expandable segments) first, then the largest traces: better balance
        # across the two processes.
        jobs.sort(key=lambda j: (self._engine(j) != PYTHON, -len(self.ranks[j[1]].program)))
        if self.pool and len(jobs) > 1:
            try:
                outs = list(self.pool.map(_replay_one, jobs))
            except BrokenProcessPool:
                self.close(abort=True)
                raise ReplayWorkerDied(
                    "a replay worker process died (killed by a signal, or by the out-of-memory killer) while "
                    "replaying the candidates; nothing was advised (--processes 1 replays in this process)") from None
        else:
            outs = [_replay_one(j) for j in jobs]
        self.replays += len(jobs)
        per: dict[Spec, list[dict]] = {}
        for (s, _r), o in zip(jobs, outs):
            per.setdefault(s, []).append(o)
        for s, rows in per.items():
            self.cache[s] = _aggregate(rows)
        return [self.cache[s] for s in specs]


def _terminate_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate ``pool``'s worker processes and shut it down without waiting, so that nothing waits for a replay
    no one will read: ``terminate_workers`` from Python 3.14; before it, the executor's own process table (read
    before ``shutdown``, which drops it)."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.join(5)


def _aggregate(rows: list[dict]) -> dict:
    """Max over ranks per metric (as the run's result aggregates); the peak's phase from the peak rank."""
    rows = sorted(rows, key=lambda d: d["rank"])
    top = max(rows, key=lambda d: d["peak_reserved"])
    out = {k: max((d[k] or 0) for d in rows) for k in ("peak_reserved", "fragmentation_at_peak", "cuda_malloc",
                                                       "cuda_free", "bytes_acquired", "alloc_retries", "ooms",
                                                       "peak_allocated", "flushes", "external_map_failures",
                                                       "peak_device_used")}
    out["peak_phase"] = top["peak_phase"]
    out["peak_rank"] = top["rank"]
    engines = {d["engine"] for d in rows}
    out["engine"] = engines.pop() if len(engines) == 1 else "mixed"
    out["per_rank"] = [{k: d[k] for k in ("rank", "peak_reserved", "fragmentation_at_peak", "peak_phase",
                                          "cuda_malloc", "cuda_free")} for d in rows]
    return out
