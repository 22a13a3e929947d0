"""Issue 12 without a run: the critic-free maths (ReMax, GRPO), the scenario rules of the new algorithms and
strategies (one clear error for bad input), the host-memory meter on this very process, and the matrix
loader's algorithm axis. The runs themselves are in suites/test_methods_cpu.py."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_rlhfmem.record import host as host_mod
from pytest_rlhfmem.record.host import RSS_HWM, RSS_SAMPLED, HostMemory
from pytest_rlhfmem.rlhf import critic_free
from pytest_rlhfmem.rlhf.models import MODEL_PAIRS, ModelPair, ModelSpec
from pytest_rlhfmem.rlhf.scenario import Scenario, ScenarioError

MATRICES = Path(__file__).parents[1] / "suites" / "matrices.yaml"


# ---- maths ----------------------------------------------------------------------------------------

def test_group_advantages_are_normalised_within_each_group():
    scores = torch.tensor([1.0, 3.0, 10.0, 10.0, -2.0, 2.0])
    adv = critic_free.group_advantages(scores, 2)
    assert torch.allclose(adv.view(-1, 2).sum(1), torch.zeros(3), atol=1e-6)  # zero mean per group
    assert adv[0] < 0 < adv[1] and adv[2] == adv[3] == 0  # equal scores: no signal
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        critic_free.group_advantages(scores, 1)


def test_kl_k3_is_zero_at_the_reference_and_positive_elsewhere():
    logp = torch.log(torch.tensor([0.2, 0.5, 0.9]))
    assert torch.allclose(critic_free.kl_k3(logp, logp), torch.zeros(3))
    assert (critic_free.kl_k3(logp, logp + 0.3) > 0).all()


def test_remax_returns_carry_the_score_minus_the_greedy_baseline_to_every_token():
    n, a, start = 2, 6, 2
    zeros = torch.zeros(n, a)
    mask = torch.ones(n, a, dtype=torch.long)  # attention-mask dtype, as in the recipes
    returns = critic_free.remax_returns(start, zeros, zeros, torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), mask)
    assert returns.shape == (n, a - start)
    assert torch.allclose(returns[0], torch.ones(a - start)) and torch.allclose(returns[1], torch.zeros(a - start))
    logp = torch.zeros(n, a - start, requires_grad=True)
    critic_free.reinforce_loss(logp, returns, mask[:, start:]).backward()
    assert logp.grad[0].lt(0).all() and logp.grad[1].eq(0).all()  # raise the better-than-greedy sample only


def test_grpo_loss_at_the_old_policy_is_minus_the_mean_advantage_plus_kl():
    n, length = 4, 3
    logp = torch.zeros(n, length)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss = critic_free.grpo_loss(logp, logp, logp, adv, torch.ones(n, length))
    assert torch.isclose(loss, -adv.mean())


# ---- scenario rules -----------------------------------------------------------------------------------

def test_ppo_ids_are_unchanged_and_other_algorithms_add_a_segment():
    ppo = Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 2)
    assert ppo.id == "deepspeed-chat/tiny-opt/zero3/flush-none/x2"
    assert Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 2, {"group_size": 2}, "grpo").id == \
        "deepspeed-chat/tiny-opt/zero2/grpo/flush-none/x2/group_size=2"
    assert Scenario("colossalchat", "tiny-opt", "none", "none", 2, {}, "remax").id == \
        "colossalchat/tiny-opt/none/remax/flush-none/x2"
    assert Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 2, {"ema": True}).id == \
        "deepspeed-chat/tiny-opt/zero3/flush-none/x2/ema=True"


@pytest.mark.parametrize("kwargs, message", [
    ({"framework": "colossalchat", "algorithm": "dpo"},
     "unknown algorithm for colossalchat 'dpo'; valid: ppo, remax, grpo"),
    ({"algorithm": "grpo", "overrides": {"group_size": 1}}, "group_size >= 2"),
    ({"overrides": {"group_size": 4}}, "group_size applies to algorithm grpo only"),
    ({"strategy": "hydra", "algorithm": "grpo"}, "strategy 'hydra' is Hydra-PPO: algorithm must be ppo"),
    ({"framework": "colossalchat", "strategy": "hydra"}, "unknown strategy for colossalchat 'hydra'; valid: none"),
    ({"framework": "colossalchat", "overrides": {"ema": True}},
     "override ema is a flag of DeepSpeed-Chat's PPO script: framework must be deepspeed-chat"),
    ({"algorithm": "remax", "overrides": {"ema": True}}, "and algorithm ppo, got 'deepspeed-chat' / 'remax'"),
    ({"overrides": {"ema": 1}}, "override ema=1 must be of type bool"),
])
def test_bad_input_is_one_clear_error_naming_the_valid_values(kwargs, message):
    args = {"framework": "deepspeed-chat", "models": "tiny-opt", "strategy": "none", "flush": "none", "world_size": 2,
            **kwargs}
    with pytest.raises(ScenarioError) as e:
        Scenario(**args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_hydra_refuses_a_model_family_peft_cannot_adapt(monkeypatch):
    bloom = ModelSpec("bloom", {"vocab_size": 1024, "hidden_size": 64, "n_layer": 2, "n_head": 2}, "tiny")
    monkeypatch.setitem(MODEL_PAIRS, "tiny-bloom", ModelPair("tiny-bloom", bloom, bloom, 8, 16, 16, None, ()))
    with pytest.raises(ScenarioError, match="strategy 'hydra' needs a model family peft can adapt with LoRA; "
                                            "'tiny-bloom' is 'bloom'; valid families: opt, gpt2, llama"):
        Scenario("deepspeed-chat", "tiny-bloom", "hydra", "none", 2)


def test_cli_refuses_a_group_size_below_2_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--algorithm", "grpo", "--group-size", "1"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("rlhfmem: error:") and "group_size >= 2" in lines[0]


def test_matrix_algorithm_axis_skips_hydra_for_critic_free_and_gives_group_size_to_grpo_only():
    from pytest_rlhfmem.matrix import load_matrix

    ids = [p.id for p in load_matrix("methods_study", MATRICES)]
    assert "deepspeed-chat/opt-1.3b/hydra/flush-none/x4" in ids
    assert not any("/hydra/remax/" in i or "/hydra/grpo/" in i for i in ids)
    assert "deepspeed-chat/opt-1.3b/zero2/remax/flush-none/x4" in ids  # no group_size on ReMax
    assert "deepspeed-chat/opt-1.3b/zero2/grpo/flush-none/x4/group_size=4" in ids


# ---- host memory ----------------------------------------------------------------------------------------

def _touch(n_bytes: int) -> bytearray:
    buf = bytearray(n_bytes)
    for i in range(0, n_bytes, 4096):  # make the pages resident
        buf[i] = 1
    return buf


@pytest.mark.parametrize("refuse_clear_refs", [False, True])
def test_host_meter_sees_a_phase_peak_and_resets_between_phases(refuse_clear_refs, monkeypatch):
    if refuse_clear_refs:
        monkeypatch.setattr(host_mod, "_reset_hwm", lambda: False)
    h = HostMemory("cpu")
    h.start()
    assert h.rss_method == (RSS_SAMPLED if refuse_clear_refs else RSS_HWM)
    mib = 2**20
    h.begin_phase("big")
    buf = _touch(96 * mib)
    if refuse_clear_refs:
        import time

        time.sleep(0.05)  # the sampler polls every millisecond
    h.end_phase("big")
    del buf
    h.begin_phase("small")
    h.end_phase("small")
    h.stop()
    big, small = h.phases["big"]["host_peak_rss"], h.phases["small"]["host_peak_rss"]
    assert big - small >= 64 * mib  # the peak was reset at the phase start: the small phase does not inherit it
    assert h.peak_rss >= big


def test_offloaded_bytes_count_while_the_buffers_live():
    h = HostMemory("cpu")
    h.start()
    h.begin_phase("train")
    states = [torch.zeros(1024, 256), torch.zeros(1024, 256)]  # 2 x 1 MiB
    h.note_offloaded(states)
    h.end_phase("train")
    del states
    h.begin_phase("after")
    h.end_phase("after")
    h.stop()
    assert h.phases["train"]["host_pinned_peak"] == 2 * 2**20 and h.phases["after"]["host_pinned_peak"] == 0


def test_host_windows_are_the_device_trace_windows_root_nested_and_repeated():
    """rlhfmem capture's windows: time outside every phase is the root window's, an outer phase resumes
    after a nested one, and a repeated name keeps the largest of its windows' peaks."""
    mib = 2**20
    h = HostMemory("cpu", root="run")
    h.start()
    buf = _touch(96 * mib)  # in the root window, before any phase
    del buf
    h.begin_phase("step")
    h.begin_phase("inner")
    h.end_phase("inner")
    buf = _touch(64 * mib)  # "step" resumed after "inner"
    h.end_phase("step")
    del buf
    h.begin_phase("step")  # a later, smaller window of "step" does not overwrite its peak
    h.end_phase("step")
    h.stop()
    run, step, inner = (h.phases[n]["host_peak_rss"] for n in ("run", "step", "inner"))
    assert run - inner >= 64 * mib  # the root window kept its 96 MiB peak; "inner" did not inherit it
    assert step - inner >= 40 * mib  # the resumed "step" window's 64 MiB, not overwritten by a smaller window
    assert h.peak_rss == max(run, step, inner)
