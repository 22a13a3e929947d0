"""Paths shared by the tests (a plain module: conftest modules must not be imported by name)."""

from pathlib import Path

DATA = Path(__file__).parent / "data"
SNAPSHOTS = DATA / "snapshots"
SNAPSHOT_NAMES = ("eor_nn", "select_n_a", "cs336_ctx256_fwd")
