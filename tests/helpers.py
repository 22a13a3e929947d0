"""Paths and runners shared by the tests (a plain module: conftest modules must not be imported by name)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem.shared_snapshots import missing_reason, snapshot_path

DATA = Path(__file__).parent / "data"
SNAPSHOT_NAMES = ("eor_nn", "select_n_a", "cs336_ctx256_fwd")


def shared_snapshot(name: str) -> Path:
    """The real snapshot ``name`` from ../shared/snapshots (or $RLHFMEM_SNAPSHOTS_DIR); skips the calling
    test, naming the missing path, when it is not there."""
    path = snapshot_path(name)
    reason = missing_reason(path)
    if reason:
        pytest.skip(reason)
    return path


def rlhfmem_cli(*args: str, env: dict | None = None, cwd: Path | None = None,
                timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m pytest_rlhfmem.cli ARGS`` in a fresh process, output captured as text; hubs offline, ``env``
    added to this process's environment."""
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
