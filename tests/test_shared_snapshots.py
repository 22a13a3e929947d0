"""Real snapshots come from ../shared/snapshots (or $RLHFMEM_SNAPSHOTS_DIR), never from the repository."""

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem import shared_snapshots

ROOT = Path(__file__).resolve().parent.parent


def test_the_environment_variable_overrides_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv(shared_snapshots.ENV_VAR, raising=False)
    assert shared_snapshots.snapshots_dir() == (ROOT.parent / "shared" / "snapshots").resolve()
    monkeypatch.setenv(shared_snapshots.ENV_VAR, str(tmp_path))
    assert shared_snapshots.snapshot_path("eor_nn") == tmp_path.resolve() / "eor_nn.pickle"
    reason = shared_snapshots.missing_reason(shared_snapshots.snapshot_path("eor_nn"))
    assert str(tmp_path / "eor_nn.pickle") in reason and shared_snapshots.ENV_VAR in reason


def test_no_snapshot_pickle_is_tracked_by_git():
    p = subprocess.run(["git", "ls-files", "*.pickle"], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: {p.stderr.strip()}")
    assert p.stdout.split() == []


def test_without_shared_snapshots_exactly_the_snapshot_tests_skip_naming_the_path(tmp_path):
    missing = tmp_path / "moved-away"
    env = {**__import__("os").environ, shared_snapshots.ENV_VAR: str(missing)}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_snapshot_fidelity.py", "tests/test_cli_replay.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    skips = [ln for ln in p.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert skips and all(str(missing) in ln for ln in skips)
    # tests that bring their own input still ran
    assert " passed" in p.stdout.splitlines()[-1]
