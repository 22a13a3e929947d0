"""Read a scenario matrix (``suites/matrices.yaml``) into pytest parameters (ids = scenario ids), and run a
scenario under pytest-benchmark. Used by the repository's root ``conftest.py`` (``@pytest.mark.matrix``)."""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest
import yaml

from pytest_rlhfmem.rlhf.scenario import Scenario

_KEYS = ("description", "framework", "models", "strategies", "algorithms", "flush", "world_size", "marks",
         "overrides", "needs_cuda")


def load_matrix(name: str, path: str | Path) -> list:
    """``pytest.param(Scenario, id=scenario.id, marks=...)`` for every cell of matrix ``name`` in the YAML
    file ``path``: the cross product of ``models``, ``strategies``, ``algorithms`` (default ``[ppo]``) and
    ``flush``. ``overrides`` apply to every cell; a ``group_size`` override only to ``grpo`` cells.

    Raises ``ValueError`` naming the file, matrix and key for an unknown matrix or key; unknown
    framework/model/strategy/algorithm names are refused by :class:`Scenario` with the valid values.
    """
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    if name not in data:
        raise ValueError(f"{path}: no matrix {name!r}; available: {', '.join(data)}")
    m = data[name]
    for k in m:
        if k not in _KEYS:
            raise ValueError(f"{path}: matrix {name!r}: unknown key {k!r}; allowed: {', '.join(_KEYS)}")
    marks = []
    gpu = (m.get("marks") or {}).get("gpu")
    if gpu:
        marks.append(pytest.mark.gpu(**gpu))
    params = []
    for models, strategy, algorithm, flush in product(m["models"], m["strategies"], m.get("algorithms") or ["ppo"],
                                                      m["flush"]):
        if strategy == "hydra" and algorithm != "ppo":  # Hydra-PPO is a PPO layout
            continue
        overrides = {k: v for k, v in (m.get("overrides") or {}).items() if k != "group_size" or algorithm == "grpo"}
        s = Scenario(m["framework"], models, strategy, flush, int(m["world_size"]), overrides, algorithm)
        cell = list(marks)
        if strategy in (m.get("needs_cuda") or []):  # the framework runs this strategy only on CUDA
            cell.append(pytest.mark.gpu(count=s.world_size))
        params.append(pytest.param(s, id=s.id, marks=cell))
    return params


def run_benchmarked(benchmark, ppo_iteration, scenario: Scenario, device: str):
    """One iteration timed by pytest-benchmark (one round: ``--benchmark-compare-fail`` works on time as
    budgets do on memory), with the memory figures in ``extra_info``."""
    kwargs = {"device": device, **scenario.overrides}
    if scenario.algorithm != "ppo":
        kwargs["algorithm"] = scenario.algorithm
    result = benchmark.pedantic(ppo_iteration, args=(scenario.framework, scenario.models, scenario.strategy,
                                                     scenario.flush, scenario.world_size),
                                kwargs=kwargs, rounds=1, iterations=1)
    benchmark.extra_info.update({"scenario_id": result.scenario_id, "capture": result.capture,
                                 "simulated": result.simulated, "iteration_wall_s": result["iteration_wall_s"],
                                 "time_rounds": result.data.get("time_rounds"),  # --rlhfmem-time-rounds
                                 "memory": result.metrics, "memory_units": "bytes for sizes, plain counts",
                                 "host_figures": "measured (host_peak_rss, host_anon_growth, host_pinned_peak)"})
    return result


# Figures a CPU must not move: compared by :func:`run_as_other_cpu`.
PORTABLE_FIGURES = ("peak_reserved", "peak_allocated", "fragmentation_at_peak", "cuda_malloc_count", "alloc_retries")


# What two runs of one scenario may differ by on the same machine, with or without a forced setting: races between
# a recipe's threads, seen and explained. ZeRO-2's communication threads free one 512-byte block at slightly
# different moments (peak allocated, fragmentation at peak). ColossalChat: in about 1 run in 5 one rank frees
# DDP's parameter-broadcast bucket after the Reducer's gradient bucket is allocated (a gloo thread's free;
# baselines/cpu/colossalchat_cpu.yaml's notes): that rank's init peaks move by up to 14 MiB reserved, about
# 10.5 MiB allocated and two cudaMallocs. ZeRO-3 stages: whether a block freed by a communication thread is
# already free when empty_cache() runs decides whether its segment is released, so the cudaMalloc count moved by
# up to 3 (zero3-offload after-inference: 9, 10 and 12 in three runs); with DeepSpeed's own empty_cache() calls
# recorded (zero/utils.py, in init) that holds with no flush policy too; and two of those 512-byte blocks can land
# on either side of the peak (zero3-offload flush-none, native vs forced weakest CPU: fragmentation at peak
# 13,336,576 vs 13,335,552 B in the clean-clone CI of bb96af6; peak reserved and allocated equal). Those blocks are
# not only 512 B: ZeRO-3's threads free blocks of 512 B, 2 KiB, 128 KiB, 256 KiB and 512 KiB at moments that vary
# (two traces of one machine differ by 441 reordered stretches on rank 0, 586 on rank 1), and a 256 KiB one lands
# on either side of the peak: `rlhfmem run --strategy zero3-offload --flush after-inference --world-size 2 --device
# cpu` three times on 62604d1 gave peak allocated 28,287,488 / 28,549,632 / 28,287,488 B, fragmentation at peak
# 13,598,720 / 13,336,576 / 13,598,720 B, cudaMalloc 12 / 9 / 12, peak reserved 32 MiB each (the clean-clone CI of
# 55fef3b, native vs forced avx2 + fp16: 13,336,576 vs 13,598,720 B). Peak allocated's bound is the largest such
# block, 512 KiB. Fragmentation at peak also moves when such a free decides whether empty_cache() releases a small
# segment (2 MiB, kSmallBuffer) that later allocations reuse: `all` after-inference x2 gave 4,171,776 B in five runs
# here on 407648b (three native, two forced to the weakest CPU) and 4,826,112 B (+639 KiB, peak allocated equal) in
# one forced run of `tox -e suite` on ec00212; its bound is one small segment. Everything else is exact.
ZERO2_RACE = {"peak_allocated": 512, "fragmentation_at_peak": 512}
ZERO3_FLUSH_RACE = {"peak_allocated": 512 * 1024, "fragmentation_at_peak": 2 * 2**20, "cuda_malloc_count": 3}
DDP_RACE = {"peak_reserved": 14 * 2**20, "peak_allocated": 11 * 2**20, "fragmentation_at_peak": 14 * 2**20,
            "cuda_malloc_count": 2}


def known_race(scenario) -> dict[str, int]:
    """The figure -> bytes (or count) that ``scenario`` may move by between two runs on one machine."""
    if scenario.framework == "colossalchat":
        return DDP_RACE
    if scenario.strategy in ("zero3", "zero3-offload", "all"):  # DeepSpeed's own flushes: any flush policy
        return ZERO3_FLUSH_RACE
    return ZERO2_RACE if scenario.strategy in ("zero1", "zero2") else {}


def run_as_other_cpu(scenario, setting: str, iteration_result, ppo_iteration, monkeypatch) -> tuple[dict, dict]:
    """Run ``scenario`` as the CPU of ``hostcpu.FORCED_CPU_SETTINGS[setting]`` would and compare it with this
    machine's own run (``iteration_result``: the suite's, when it ran earlier in the session).

    Returns ``(moved, unapplied)``: the :data:`PORTABLE_FIGURES` that differ beyond the scenario's
    :func:`known_race` as ``{figure: (native, forced)}``, and the host properties the workers did not record as
    forced (``{property: recorded}``; a CPU without AVX2 cannot be raised to it, so that one is not required)."""
    from .hostcpu import FORCED_CPU_SETTINGS

    native = iteration_result(scenario)
    env, expected_host = FORCED_CPU_SETTINGS[setting]
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the launcher passes its environment to the torchrun workers
    forced = ppo_iteration(scenario.framework, scenario.models, scenario.strategy, scenario.flush,
                           scenario.world_size, device="cpu")
    host = forced["host_cpu"] or {}
    unapplied = {k: host.get(k) for k, v in expected_host.items() if host.get(k) != v
                 and not (k == "aten_cpu_capability" and native["host_cpu"][k] == "DEFAULT")}
    if forced["capture_description"] != native["capture_description"]:
        unapplied["capture_description"] = forced["capture_description"]
    moved = {}
    for m in PORTABLE_FIGURES:
        a, b = native.metrics[m] or 0, forced.metrics[m] or 0
        if abs(a - b) > known_race(scenario).get(m, 0):
            moved[m] = (a, b)
    return moved, unapplied
