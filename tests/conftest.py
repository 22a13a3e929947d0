from pathlib import Path

import pytest
from helpers import SNAPSHOT_NAMES, shared_snapshot


@pytest.fixture(params=SNAPSHOT_NAMES)
def snapshot_path(request) -> Path:
    return shared_snapshot(request.param)
