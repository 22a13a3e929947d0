from pathlib import Path

import pytest
from helpers import SNAPSHOT_NAMES, SNAPSHOTS


@pytest.fixture(params=SNAPSHOT_NAMES)
def snapshot_path(request) -> Path:
    return SNAPSHOTS / f"{request.param}.pickle"
