from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SNAPSHOTS = DATA / "snapshots"
SNAPSHOT_NAMES = ("eor_nn", "select_n_a", "cs336_ctx256_fwd")


@pytest.fixture(params=SNAPSHOT_NAMES)
def snapshot_path(request) -> Path:
    return SNAPSHOTS / f"{request.param}.pickle"
