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
                                 "host_figures": "measured (host_peak_rss, host_pinned_peak)"})
    return result
