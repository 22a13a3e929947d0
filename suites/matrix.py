"""Read a scenario matrix from suites/matrices.yaml into pytest parameters (ids = scenario ids)."""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest
import yaml

from pytest_rlhfmem.rlhf.scenario import Scenario

MATRICES = Path(__file__).with_name("matrices.yaml")
_KEYS = ("description", "framework", "models", "strategies", "flush", "world_size", "marks", "overrides", "needs_cuda")


def load_matrix(name: str) -> list:
    """``pytest.param(Scenario, id=scenario.id, marks=...)`` for every cell of matrix ``name``.

    Raises ``ValueError`` naming the file, matrix and key for an unknown matrix or key; unknown
    framework/model/strategy names are refused by :class:`Scenario` with the valid values.
    """
    data = yaml.safe_load(MATRICES.read_text()) or {}
    if name not in data:
        raise ValueError(f"{MATRICES}: no matrix {name!r}; available: {', '.join(data)}")
    m = data[name]
    for k in m:
        if k not in _KEYS:
            raise ValueError(f"{MATRICES}: matrix {name!r}: unknown key {k!r}; allowed: {', '.join(_KEYS)}")
    marks = []
    gpu = (m.get("marks") or {}).get("gpu")
    if gpu:
        marks.append(pytest.mark.gpu(**gpu))
    params = []
    for models, strategy, flush in product(m["models"], m["strategies"], m["flush"]):
        s = Scenario(m["framework"], models, strategy, flush, int(m["world_size"]), dict(m.get("overrides") or {}))
        cell = list(marks)
        if strategy in (m.get("needs_cuda") or []):  # the framework runs this strategy only on CUDA
            cell.append(pytest.mark.gpu(count=s.world_size))
        params.append(pytest.param(s, id=s.id, marks=cell))
    return params


def run_benchmarked(benchmark, ppo_iteration, scenario: Scenario, device: str):
    """One iteration timed by pytest-benchmark (one round: ``--benchmark-compare-fail`` works on time as
    budgets do on memory), with the memory figures in ``extra_info``."""
    result = benchmark.pedantic(ppo_iteration, args=(scenario.framework, scenario.models, scenario.strategy,
                                                     scenario.flush, scenario.world_size),
                                kwargs={"device": device, **scenario.overrides}, rounds=1, iterations=1)
    benchmark.extra_info.update({"scenario_id": result.scenario_id, "capture": result.capture,
                                 "simulated": result.simulated, "iteration_wall_s": result["iteration_wall_s"],
                                 "time_rounds": result.data.get("time_rounds"),  # --rlhfmem-time-rounds
                                 "memory": result.metrics, "memory_units": "bytes for sizes, plain counts"})
    return result
