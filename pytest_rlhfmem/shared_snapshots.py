"""Where the real GPU memory snapshots live: ONE setting for tests, benchmarks and the README's examples.

The real snapshots are other people's files (recorded on their GPUs, taken from their public
repositories; provenance in ``shared/snapshots/README.md``). They are never committed to this
repository: they stay in the ``shared/snapshots`` directory that sits beside a checkout, on every
development machine and in CI.

- Default: ``<repository root>/../shared/snapshots``.
- Override: the environment variable ``RLHFMEM_SNAPSHOTS_DIR`` (a directory path).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "RLHFMEM_SNAPSHOTS_DIR"
REPO_ROOT = Path(__file__).resolve().parent.parent


def snapshots_dir() -> Path:
    """The directory holding the shared real snapshots (it may not exist: callers check)."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser().resolve()
    return (REPO_ROOT.parent / "shared" / "snapshots").resolve()


def snapshot_path(name: str) -> Path:
    """``<snapshots_dir()>/<name>.pickle`` (``name`` without the suffix); the file may be missing."""
    return snapshots_dir() / f"{name}.pickle"


def missing_reason(path: Path) -> str | None:
    """``None`` if ``path`` exists, else a skip reason naming the missing path and the setting."""
    if path.is_file():
        return None
    return (f"real GPU snapshot {path} not found (shared snapshots are read from ../shared/snapshots beside the "
            f"checkout, or from ${ENV_VAR})")
