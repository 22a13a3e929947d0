"""What this repository's suites share, in the one place pytest users look for it (the rootdir's conftest).

- ``@pytest.mark.matrix("name")`` on a suite test parametrizes its ``scenario`` argument with every cell of
  matrix ``name`` in ``suites/matrices.yaml`` (ids = scenario ids, gpu marks applied): see
  :func:`pytest_rlhfmem.matrix.load_matrix`.
- the ``benchmarked_iteration`` fixture: ``benchmarked_iteration(scenario, device)`` runs one iteration timed
  by pytest-benchmark, memory figures in ``extra_info``.

Only this file is named ``conftest.py`` above ``tests/`` and ``suites/`` (which run in one session): the
helpers live in the package module ``pytest_rlhfmem.matrix``, never imported from a conftest by name.
"""

from pathlib import Path

import pytest

from pytest_rlhfmem.matrix import load_matrix, run_benchmarked

MATRICES = Path(__file__).parent / "suites" / "matrices.yaml"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "matrix(name): parametrize `scenario` with matrix `name` of "
                            "suites/matrices.yaml")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for mark in metafunc.definition.iter_markers("matrix"):
        params = [p for name in mark.args for p in load_matrix(name, MATRICES)]
        metafunc.parametrize("scenario", params)


@pytest.fixture
def benchmarked_iteration(benchmark, ppo_iteration):
    """``benchmarked_iteration(scenario, device)`` -> :class:`~pytest_rlhfmem.results.IterationResult`."""
    return lambda scenario, device: run_benchmarked(benchmark, ppo_iteration, scenario, device)
