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
