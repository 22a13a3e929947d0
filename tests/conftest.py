import os
from pathlib import Path

import pytest
from helpers import SNAPSHOT_NAMES, shared_snapshot


def _share_the_extension_cache() -> None:
    """pytester gives every inner session a fresh HOME, so torch's JIT builds (DeepSpeed's CPU ops, the
    allocation recorder) would be rebuilt in each one: pin ``TORCH_EXTENSIONS_DIR`` to the directory this
    session's builds use, before any HOME changes. Inherited by every worker the tests start."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:  # no torch in this environment: nothing is built
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.normpath(_get_build_directory(".", verbose=False))  # the root


_share_the_extension_cache()



@pytest.fixture(params=SNAPSHOT_NAMES)
def snapshot_path(request) -> Path:
    return shared_snapshot(request.param)


# -- the GPU route's coverage (tests/gpu_route.py) --------------------------------------------------------------
def pytest_configure(config) -> None:
    """Before xdist starts its workers (they inherit the environment): the directory for the measured processes'
    coverage data (made by the first measured test, so a session that measures nothing leaves none), unless
    coverage.py is missing or this is a worker."""
    import gpu_route

    if hasattr(config, "workerinput") or gpu_route.data_dir() is not None:
        return
    try:
        import coverage  # noqa: F401
    except ImportError:
        return
    import secrets
    import tempfile

    d = Path(tempfile.gettempdir()) / f"rlhfmem-gpu-route-coverage-{secrets.token_hex(6)}"
    os.environ[gpu_route.ENV_DIR] = str(d)
    config.stash[_GPU_ROUTE_DIR] = d


_GPU_ROUTE_DIR = pytest.StashKey[Path]()


@pytest.fixture(autouse=True)
def _gpu_route_coverage(request):
    """In the GPU route's test modules: coverage.py measures this process and, through $COVERAGE_PROCESS_START and
    coverage's .pth hook, every process the test starts."""
    import gpu_route

    d = gpu_route.data_dir()
    if d is None or request.path.name not in gpu_route.MEASURED_MODULES:
        yield
        return
    import coverage

    if coverage.Coverage.current() is not None:  # the whole session is measured already: leave it be
        yield
        return
    d.mkdir(exist_ok=True)
    rc = str(d / "coveragerc")
    if not (d / "coveragerc").exists():
        tmp = d / f"coveragerc.{os.getpid()}"
        tmp.write_text(gpu_route.config_text(d))
        tmp.replace(d / "coveragerc")
    cov = coverage.Coverage(config_file=rc, data_suffix=True)
    before = os.environ.get("COVERAGE_PROCESS_START")
    os.environ["COVERAGE_PROCESS_START"] = rc
    cov.start()
    try:
        yield
    finally:
        cov.stop()
        cov.save()
        if before is None:
            os.environ.pop("COVERAGE_PROCESS_START", None)
        else:
            os.environ["COVERAGE_PROCESS_START"] = before


def pytest_terminal_summary(terminalreporter, config) -> None:
    """The GPU route's report: the lines of tests/gpu_route.py's units no measured test executed (the controller,
    once every worker ended); the data directory is removed afterwards."""
    import shutil

    import gpu_route

    d = config.stash.get(_GPU_ROUTE_DIR, None)
    if d is None or not d.is_dir():
        return
    try:
        if any(p.name.startswith(".coverage.") for p in d.iterdir()):
            terminalreporter.section("rlhfmem: GPU route coverage")
            for line in gpu_route.report(d):
                terminalreporter.write_line(line)
    finally:
        shutil.rmtree(d, ignore_errors=True)
