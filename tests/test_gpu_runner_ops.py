"""What the GPU route builds, refuses and passes on before its ranks start (issue 35, items 3, 8 and 9): the JIT
ops it prebuilds and times, a failed build in one line, the Hybrid Engine's inference kernels refused on every
route, and a user's command run in the user's own environment (the recipes alone go offline)."""

import json
import os

import pytest
import torch

from pytest_rlhfmem.command.run import run_command
from pytest_rlhfmem.rlhf.launch import _worker_env, jit_ops, prebuild_ops, run_scenario
from pytest_rlhfmem.rlhf.scenario import Scenario, ScenarioError


@pytest.mark.parametrize("models, strategy, algorithm, device, ops", [
    ("tiny-opt", "zero2", "ppo", "cuda", ["FusedAdamBuilder"]),  # DeepSpeed-Chat: FusedAdam unless --offload
    ("tiny-opt", "hydra", "ppo", "cuda", ["FusedAdamBuilder"]),
    ("tiny-opt", "zero3-offload", "ppo", "cuda", ["CPUAdamBuilder"]),  # DeepSpeedCPUAdam
    ("tiny-opt", "zero3-nvme", "ppo", "cuda", ["CPUAdamBuilder", "AsyncIOBuilder"]),
    # run_1.3b.sh's --enable_hybrid_engine: its WorkspaceOp loads transformer_inference even with nothing injected
    ("opt-1.3b", "zero3", "ppo", "cuda", ["FusedAdamBuilder", "InferenceBuilder"]),
    ("opt-1.3b", "all", "ppo", "cuda", ["CPUAdamBuilder", "InferenceBuilder"]),
    ("opt-1.3b", "zero3", "grpo", "cuda", ["FusedAdamBuilder"]),  # no Hybrid Engine outside PPO
    ("tiny-opt", "zero2", "ppo", "cpu", ["ShareMemCommBuilder"]),
    ("tiny-opt", "zero3-offload", "ppo", "cpu", ["ShareMemCommBuilder", "CPUAdamBuilder"]),
])
def test_the_ops_a_scenarios_ranks_would_jit_build_are_prebuilt(models, strategy, algorithm, device, ops):
    assert jit_ops(Scenario("deepspeed-chat", models, strategy, algorithm=algorithm), device) == ops
    assert jit_ops(Scenario("colossalchat", "tiny-opt", "zero2"), device) == []


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """A fresh extension cache (nothing built yet) and a C++ compiler that fails: every JIT build fails here."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    monkeypatch.setenv("CXX", "/bin/false")


@pytest.mark.parametrize("device, op, needs", [
    ("cuda", "FusedAdamBuilder", "needs nvcc: set CUDA_HOME / install the CUDA toolkit (pip's torch brings neither)"),
    ("cpu", "ShareMemCommBuilder", "needs a C++ compiler (c++, or $CXX) and ninja"),
])
def test_a_failed_op_build_is_one_line_naming_the_op_its_error_and_what_it_needs(no_compiler, device, op, needs):
    """It escaped the fixture as a CalledProcessError traceback (``check=True``). On this machine DeepSpeed's
    accelerator is its CPU one, whose FusedAdamBuilder fails as CUDA's would without nvcc: the build itself."""
    with pytest.raises(ScenarioError) as e:
        prebuild_ops(device, [op])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"building DeepSpeed's {op} (JIT, before the ranks start) failed: ")
    assert "/bin/false" in msg and msg.endswith(f"; {needs}")


def test_a_result_keeps_the_time_its_op_builds_took(tmp_path):
    # its work directory under tmp_path: a run's caller removes it (finish_work); none may stay in the temp dir
    res = run_scenario(Scenario("deepspeed-chat", "tiny-opt", "none", world_size=1), device="cpu", timeout=600,
                       work_dir=tmp_path / "work")
    assert res["status"] == "ok", res["failure"]
    assert isinstance(res["op_build_s"], float) and 0 < res["op_build_s"] < res["wall_s"]


class OPTDecoderLayer(torch.nn.Module):
    """Stands in for the layer DeepSpeed would replace (transformers >= 5.24's OPT decoder layer)."""


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_hybrid_engines_inference_kernels_are_refused_on_the_gpu_route_too(device):
    """With transformers >= 5.24 DeepSpeed's Hybrid Engine injects its kernels on a GPU: other code than the
    budgets assume, and a JIT build of transformer_inference. The refusal existed on CPU only."""
    import deepspeed
    import transformers
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    from pytest_rlhfmem.rlhf.deepspeed_chat.builders import refuse_inference_kernels

    original = DeepSpeedHybridEngine.new_inference_container
    with refuse_inference_kernels(device):
        with pytest.raises(NotImplementedError) as e:
            DeepSpeedHybridEngine.new_inference_container(None, OPTDecoderLayer(), None, 0)
    assert DeepSpeedHybridEngine.new_inference_container is original  # restored once the engine is built
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("DeepSpeed's Hybrid Engine is replacing OPTDecoderLayer with its inference kernels: "
                          f"DeepSpeed {deepspeed.__version__} does so with transformers {transformers.__version__}")
    assert msg.endswith("Install the pinned dependency set (constraints/deepspeed.txt: transformers 5.23, whose layer "
                        "DeepSpeed keeps native)")
    assert ("transformer_inference" in msg) == (device == "cuda")
    with refuse_inference_kernels("cuda", allowed=True):  # the fake-CUDA route's hybrid_engine_kernels override
        assert DeepSpeedHybridEngine.new_inference_container is original


PRINT_ENV = """
import json, os, torch
x = torch.ones(1024)
print("ENV " + json.dumps({k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}))
"""


def test_a_users_command_gets_the_users_hub_settings_and_only_the_recipes_go_offline(tmp_path, monkeypatch):
    """A trainer that downloads failed: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE=1 were forced on users' commands."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    script = tmp_path / "print_env.py"
    script.write_text(PRINT_ENV)
    res = run_command([str(script)], "print-env", device="cpu", work_dir=tmp_path / "work")
    assert res["status"] == "ok", res["failure"]
    line = next(ln for ln in open(res["log"]).read().splitlines() if ln.startswith("ENV "))
    assert json.loads(line[4:]) == {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": None}
    recipe = _worker_env("cpu", 1)  # random weights from configs: nothing to download
    assert recipe["HF_HUB_OFFLINE"] == recipe["TRANSFORMERS_OFFLINE"] == "1"
    assert os.environ["HF_HUB_OFFLINE"] == "0"

