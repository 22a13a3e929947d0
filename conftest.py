"""What this repository's suites share, in the one place pytest users look for it (the rootdir's conftest).

- ``@pytest.mark.matrix("name")`` on a suite test parametrizes its ``scenario`` argument with every cell of
  matrix ``name`` in ``suites/matrices.yaml`` (ids = scenario ids, gpu marks applied): see
  :func:`pytest_rlhfmem.matrix.load_matrix`.
- the ``benchmarked_iteration`` fixture: ``benchmarked_iteration(scenario, device)`` runs one iteration timed
  by pytest-benchmark, memory figures in ``extra_info``; the result is kept for the session.
- the ``iteration_result`` fixture: ``iteration_result(scenario, device="cpu")``, the session's result of that
  scenario if a suite test already ran it, else a fresh run: tests that compare scenarios (the methods
  suite's) reuse the budget tests' iterations instead of running them again.
- the ``package_files``, ``project_wheel`` and ``wheel_venv`` fixtures: the package's tracked files, the project's
  wheel, and a fresh virtual environment whose only pytest_rlhfmem is that wheel (tests/test_packaging.py; the TRL
  suite runs its scripts from one).

Only this file is named ``conftest.py`` above ``tests/`` and ``suites/`` (which run in one session): the
helpers live in the package module ``pytest_rlhfmem.matrix``, never imported from a conftest by name.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
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


def pytest_report_header(config: pytest.Config) -> str:
    """One line on the real GPU snapshots (``../shared/snapshots``, docs/shared-snapshots.md): where they were found,
    or that the tests reading them skip and how to fetch them."""
    from pytest_rlhfmem.shared_snapshots import ENV_VAR, snapshots_dir

    where = snapshots_dir()
    found = sorted(where.glob("*.pickle")) if where.is_dir() else []
    if found:
        return f"rlhfmem: real GPU snapshots: {len(found)} in {where}"
    return (f"rlhfmem: real GPU snapshots: none in {where} (${ENV_VAR} or ../shared/snapshots beside the checkout): "
            "the fidelity tests that replay them skip, each naming its file; python scripts/fetch_shared_snapshots.py "
            "fetches them (docs/shared-snapshots.md)")


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


def tracked_package_files() -> list[str]:
    """The package's files as git tracks them (in an sdist, the files on disk), relative to the rootdir."""
    root = Path(__file__).parent
    tracked = subprocess.run(["git", "ls-files", "pytest_rlhfmem"], cwd=root, capture_output=True, text=True,
                             check=False).stdout.split()
    if not tracked:  # not a git checkout (an sdist): the files on disk are the package
        tracked = [str(p.relative_to(root)) for p in (root / "pytest_rlhfmem").rglob("*") if p.is_file()
                   and "__pycache__" not in p.parts]
    return tracked


@pytest.fixture(scope="session")
def package_files() -> list[str]:
    """:func:`tracked_package_files`, for the tests that check what a wheel carries."""
    return tracked_package_files()


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory) -> Path:
    """The project's wheel, built by setuptools (``pip wheel --no-build-isolation``) from a copy of the tracked files,
    so that its build/ stays out of the checkout."""
    root = Path(__file__).parent
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    for f in tracked_package_files() + ["pyproject.toml", "setup.py", "README.md", "LICENSE"]:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(out), str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("pytest_rlhfmem-*.whl")
    return built


@pytest.fixture
def wheel_venv(project_wheel, tmp_path) -> Path:
    """A new virtual environment (its directory) whose only pytest_rlhfmem is :func:`project_wheel` (no editable
    install, no checkout on the path); its dependencies (torch, transformers ...) come from this environment's
    site-packages through a ``.pth`` line, written after the install (a ``.pth`` line adds the directory, not the
    editable finder installed there). Run it with ``PYTHONPATH`` unset, from outside the checkout."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                    str(project_wheel)], check=True, capture_output=True, timeout=300)
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")  # after: pip saw no other install
    where = subprocess.run([str(py), "-c", "import pytest_rlhfmem; print(pytest_rlhfmem.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout
    return env_dir
