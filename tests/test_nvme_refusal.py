"""ZeRO-Infinity (``zero3-nvme``) needs libaio for DeepSpeed's async I/O op: without it a run is refused in one
line that says what to install, before any worker starts (no traceback, no work directory)."""

import ctypes.util

import pytest

from pytest_rlhfmem.rlhf import launch
from pytest_rlhfmem.rlhf.deepspeed_chat.configs import get_train_ds_config, largest_parameter
from pytest_rlhfmem.rlhf.models import get_pair
from pytest_rlhfmem.rlhf.scenario import Scenario, ScenarioError


def test_without_libaio_a_zero3_nvme_run_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # a machine without libaio
    with pytest.raises(ScenarioError) as exc:
        launch.run_scenario(Scenario("deepspeed-chat", "tiny-opt", "zero3-nvme", "none", 2), device="cpu",
                            work_dir=tmp_path / "work")
    message = str(exc.value)
    assert "\n" not in message and "apt-get install libaio-dev" in message and "zero3-nvme" in message
    assert not (tmp_path / "work").exists()  # refused before anything started


def test_the_nvme_config_swaps_params_and_optimizer_with_buffers_that_hold_the_largest_parameter():
    import torch

    pair = get_pair("tiny-opt")
    cfg = get_train_ds_config(3, "nvme", torch.float16, 2, 2, pair.bucket_elements, largest_parameter(pair))
    zero = cfg["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"]
    assert zero["offload_param"]["buffer_size"] == largest_parameter(pair) == 1024 * 256  # tiny actor's embedding
    assert cfg["aio"]["block_size"] == 1 << 20
