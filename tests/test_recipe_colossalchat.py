"""The ColossalChat recipe on real colossalai 0.5.0 (CPU, gloo, 2 torchrun ranks, tiny OPT). Runs in the
`colossalai` tox environment, which pins colossalai's torch/transformers/peft."""

import math
import subprocess
import sys

import pytest

from pytest_rlhfmem.rlhf.launch import run_scenario
from pytest_rlhfmem.rlhf.scenario import PHASES, Scenario, ScenarioError


def test_rlhfmem_run_colossalchat_prints_the_phase_table(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--framework", "colossalchat",
                        "--models", "tiny-opt", "--strategy", "none", "--world-size", "2", "--device", "cpu",
                        "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "colossalchat/tiny-opt/none/flush-none/x2 on cpu x2 (simulated" in p.stdout
    for phase in PHASES:
        assert phase in p.stdout
    import json

    r = json.loads(out.read_text())
    assert r["versions"]["colossalai"] == "0.5.0" and r["simulated"]
    for rank in r["ranks"]:
        assert math.isfinite(rank["recipe"]["actor_loss"]) and rank["recipe"]["plugin"] == "ddp"
        assert rank["recipe"]["offload_inference_models"] is True


def test_grad_ckpt_runs_and_flush_points_follow_the_policy(tmp_path):
    r = run_scenario(Scenario("colossalchat", "tiny-opt", "grad-ckpt", "after-training", 2), device="cpu", timeout=600,
                     work_dir=tmp_path)  # under pytest's temp dir, not a leftover rlhfmem-* in /tmp
    assert r["status"] == "ok", r["failure"]
    for rank in r["ranks"]:
        assert [f["name"] for f in rank["flushes"]] == ["after-train_actor", "after-train_critic"]
        assert rank["recipe"]["gradient_checkpointing"] is True


def test_strategies_that_need_cuda_are_refused_on_cpu_naming_what_runs():
    with pytest.raises(ScenarioError, match="needs CUDA.*on CPU: none, grad-ckpt"):
        run_scenario(Scenario("colossalchat", "tiny-opt", "zero3", "none", 2), device="cpu")


def test_unknown_strategy_lists_the_recipes_own():
    with pytest.raises(ScenarioError, match="valid: none, zero2, zero2-offload, zero3, zero3-offload, grad-ckpt, all"):
        Scenario("colossalchat", "tiny-opt", "zero1", "none", 2)
