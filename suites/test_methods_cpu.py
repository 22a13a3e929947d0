"""The memory-saving methods of the RLHF literature side by side on DeepSpeed-Chat (CPU, tiny OPT, 2 ranks):
ZeRO-Offload, LoRA-PPO, Hydra-PPO, ReMax and GRPO, each checked against baselines/cpu/methods_cpu.yaml, and
the property that defines each method asserted on the real runs.

Device figures are simulated (CPU trace through the allocator model); host figures are measured. PPO's
none/zero2/zero3/zero3-offload cells come from the deepspeed_chat_cpu suite when it ran in the same session
(``iteration_result`` reuses them), else they run here.
"""

import math

import pytest

from pytest_rlhfmem.rlhf.scenario import ALGORITHM_PHASES, Scenario


def ppo(strategy: str) -> Scenario:
    return Scenario("deepspeed-chat", "tiny-opt", strategy, "none", 2)


def method(strategy: str, algorithm: str = "ppo", **overrides) -> Scenario:
    return Scenario("deepspeed-chat", "tiny-opt", strategy, "none", 2, overrides, algorithm)


@pytest.mark.matrix("methods_cpu", "methods_cpu_critic_free")
def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
    result = benchmarked_iteration(scenario, "cpu")
    assert result.simulated and result.capture == "cpu-trace-simulated"
    assert list(result.phases) == list(ALGORITHM_PHASES[scenario.algorithm])
    for rank in result["ranks"]:
        assert all(math.isfinite(v) for k, v in rank["recipe"].items() if k.endswith("_loss"))
        assert rank["host"]["measured"] and rank["total"]["host_peak_rss"] > 0  # host figures: measured
    memory_budget.check(result)


def init_state_bytes(result) -> int:
    """Live device bytes when ``init`` ends (every model built), max over ranks: the model states."""
    return max(rank["requested_at_phase_end"]["init"] for rank in result["ranks"])


@pytest.mark.parametrize("algorithm", ["remax", "grpo"])
def test_remax_and_grpo_build_no_critic(algorithm, iteration_result):
    result = iteration_result(method("none", algorithm, **({"group_size": 2} if algorithm == "grpo" else {})))
    assert "infer_critic" not in result.phases and "train_critic" not in result.phases
    for rank in result["ranks"]:
        assert rank["recipe"]["critic_built"] is False and "critic" not in rank["recipe"]["optimizer_states"]
    # three models instead of four: less model state at the end of init than PPO's
    assert init_state_bytes(result) < init_state_bytes(iteration_result(ppo("none")))
    if algorithm == "grpo":  # a group of 2 samples per prompt: batch 2 -> 4 sequences
        assert result["ranks"][0]["recipe"]["sequence_shape"][0] == 4
    else:
        assert "generate_greedy" in result.phases


def test_hydra_holds_one_backbone(iteration_result):
    hydra, four = iteration_result(method("hydra")), iteration_result(ppo("none"))
    recipe = hydra["ranks"][0]["recipe"]
    assert recipe["models_in_memory"] == 1 and recipe["adapters"] == ["actor", "critic"]
    assert init_state_bytes(hydra) < init_state_bytes(four)
    assert hydra.metrics["peak_allocated"] < four.metrics["peak_allocated"]


def test_lora_only_has_no_optimizer_state_for_frozen_weights(iteration_result):
    lora, full = iteration_result(method("lora")), iteration_result(ppo("none"))
    for rank in lora["ranks"]:
        for engine, st in rank["recipe"]["optimizer_states"].items():
            assert st["frozen_with_state"] == 0, engine
            assert st["frozen_elements"] > st["trainable_elements"], engine
            assert st["state_bytes"] == 2 * 4 * st["trainable_elements"], engine  # Adam's two fp32 moments only
    lora_state = lora["ranks"][0]["recipe"]["optimizer_states"]["actor"]["state_bytes"]
    # PPO none trains biases, norms and embeddings beside its LoRA weights (DeepSpeed-Chat without
    # --only_optimize_lora): LoRA-only holds state for less
    assert lora_state < full["ranks"][0]["recipe"]["optimizer_states"]["actor"]["state_bytes"]


def test_zero_offload_keeps_optimizer_states_on_the_host(iteration_result):
    offload, plain = iteration_result(method("zero2-offload")), iteration_result(ppo("zero2"))
    for rank in offload["ranks"]:
        states = sum(st["state_bytes"] for st in rank["recipe"]["optimizer_states"].values())
        assert states > 0 and rank["host_bytes_annotated"] >= states  # declared host-resident: out of the trace
        assert rank["total"]["host_pinned_peak"] >= states  # and held in host memory
    assert plain.metrics["host_pinned_peak"] == 0
    assert offload.metrics["peak_allocated"] < plain.metrics["peak_allocated"]


def test_zero3_offload_moves_memory_from_the_device_to_the_host(iteration_result):
    offload, plain = iteration_result(ppo("zero3-offload")), iteration_result(ppo("zero3"))
    assert offload.metrics["peak_reserved"] < plain.metrics["peak_reserved"]  # device: simulated
    assert offload.metrics["host_pinned_peak"] > plain.metrics["host_pinned_peak"] == 0  # host: measured
    # On a CPU the simulated device's tensors are host RSS too, so the process's peak RSS cannot show the
    # move; RSS minus the device trace's live bytes (host.py: host_rss_outside_device) can.
    assert offload.metrics["host_rss_outside_device"] > plain.metrics["host_rss_outside_device"]
