"""What this repository's suites share, in the one place pytest users look for it (the rootdir's conftest).

- ``@pytest.mark.matrix("name")`` on a suite test parametrizes its ``scenario`` argument with every cell of
  matrix ``name`` in ``suites/matrices.yaml`` (ids = scenario ids, gpu marks applied): see
  :func:`pytest_rlhfmem.matrix.load_matrix`.
- the ``benchmarked_iteration`` fixture: ``benchmarked_iteration(scenario, device)`` runs one iteration timed
  by pytest-benchmark, memory figures in ``extra_info``; the result is kept for the session.
- the ``iteration_result`` fixture: ``iteration_result(scenario, device="cpu")``, the session's result of that
  scenario if a suite test already ran it, else a fresh run: tests that compare scenarios (the methods
  suite's) reuse the budget tests' iterations instead of running them again.

Only this file is named ``conftest.py`` above ``tests/`` and ``suites/`` (which run in one session): the
helpers live in the package module ``pytest_rlhfmem.matrix``, never imported from a conftest by name.
"""

import os
from pathlib import Path

import pytest

from pytest_rlhfmem.matrix import load_matrix, run_benchmarked

MATRICES = Path(__file__).parent / "suites" / "matrices.yaml"


def _share_the_library_cache() -> None:
    """pytester gives every inner session a fresh HOME: pin the project's C++ library cache (``cbuild.py``: replay
    core, snapshot reader, CPU recorder, simulated device; ``~/.cache`` unless ``$RLHFMEM_CACHE_DIR`` names one) to
    this session's, so that no inner session builds them again (the CPU recorder alone takes ~17 s)."""
    from pytest_rlhfmem.cbuild import ENV_CACHE_DIR, cache_dir

    os.environ.setdefault(ENV_CACHE_DIR, str(cache_dir()))


_share_the_library_cache()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "matrix(name): parametrize `scenario` with matrix `name` of "
                            "suites/matrices.yaml")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for mark in metafunc.definition.iter_markers("matrix"):
        params = [p for name in mark.args for p in load_matrix(name, MATRICES)]
        metafunc.parametrize("scenario", params)


_RESULTS = pytest.StashKey[dict]()


def _results(config: pytest.Config) -> dict:
    if _RESULTS not in config.stash:
        config.stash[_RESULTS] = {}
    return config.stash[_RESULTS]


@pytest.fixture
def benchmarked_iteration(benchmark, ppo_iteration, request):
    """``benchmarked_iteration(scenario, device)`` -> :class:`~pytest_rlhfmem.results.IterationResult`."""
    def run(scenario, device):
        result = run_benchmarked(benchmark, ppo_iteration, scenario, device)
        _results(request.config)[(scenario.id, device)] = result
        return result

    return run


@pytest.fixture
def iteration_result(ppo_iteration, request):
    """``iteration_result(scenario, device="cpu")`` -> the session's result of ``scenario`` or a fresh run."""
    def get(scenario, device="cpu"):
        cache = _results(request.config)
        if (scenario.id, device) not in cache:
            cache[(scenario.id, device)] = ppo_iteration(
                scenario.framework, scenario.models, scenario.strategy, scenario.flush, scenario.world_size,
                device=device, algorithm=scenario.algorithm, **scenario.overrides)
        return cache[(scenario.id, device)]

    return get
