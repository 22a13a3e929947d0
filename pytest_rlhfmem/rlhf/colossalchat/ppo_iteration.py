"""The ColossalChat (coati V2) recipe's PPO iteration on ``colossalai.booster``, phase by phase.

Follows hpcaitech/ColossalAI ``applications/ColossalChat``: ``examples/training_scripts/train_ppo.py``
(plugins and four boosters), ``coati/models/critic.py`` and ``reward_model.py`` (base model + value head),
``coati/experience_maker/naive.py`` (experience: log-probs, reward, values, advantages),
``coati/experience_buffer/naive.py`` (experience buffered on CPU) and ``coati/trainer/ppo.py``
(inference models on the device for experience making, moved to CPU before learning; PolicyLoss and
ValueLoss with clip 0.2). Facts: ``shared/reference/rlhf-frameworks.md``.

Two deliberate departures, as in the study: generation uses Hugging Face's ``generate`` (sampling,
temperature 0.7, top-k 50, fixed length) instead of coati's own loop; the value head reads the backbone's
output width (``word_embed_proj_dim`` for OPT-350m, whose ``hidden_size`` differs). The rewards, GAE and
losses are the framework-free code of ``ppo.py`` shared with the DeepSpeed-Chat recipe.

On a CPU only ``TorchDDPPlugin`` runs (LowLevelZero and Gemini assert a CUDA/NPU accelerator): the
strategies ``none`` and ``grad-ckpt``. The others need CUDA (``builders.CPU_STRATEGIES``).
"""

from __future__ import annotations

import torch

from ...record.recorder import Recorder
from .. import ppo
from ..common import PhaseSteps, random_prompts, resolve_dtype
from ..models import get_pair
from ..scenario import Scenario
from .builders import CPU_DTYPE, STRATEGY_PLUGINS, boost_models, module_tensors
from .experience import infer_experience


def run_ppo_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """Build the four boosted models and run one PPO iteration under ``rec``; returns losses and settings."""
    pair = get_pair(scenario.models)
    kind, grad_ckpt = STRATEGY_PLUGINS[scenario.strategy]
    gemini = kind.startswith("gemini")
    dtype = resolve_dtype(scenario, device, cpu_default=CPU_DTYPE)
    batch = scenario.get("batch_size", 2)
    prompt_len = scenario.get("prompt_len", pair.prompt_len)
    answer_len = scenario.get("answer_len", pair.answer_len)
    lora_dim = scenario.get("lora_dim", pair.lora_dim)
    torch.manual_seed(scenario.get("seed", 1234) + rank)
    steps = PhaseSteps(scenario, rec, rank)

    with steps("init"):
        m = boost_models(scenario, pair, kind, dtype, device, lora_dim, grad_ckpt, with_critic=True)
        actor, actor_optim, actor_booster = m.actor, m.actor_optim, m.actor_booster
        critic, critic_optim, critic_booster = m.critic, m.critic_optim, m.critic_booster
        ref, reward = m.ref, m.reward

    prompts, prompt_mask, pad_id = random_prompts(pair, batch, prompt_len, device)  # [b, prompt_len], left-padded

    # ---- make_experience (coati/experience_maker/naive.py) -----------------------------------
    actor.eval()
    critic.eval()
    seq, attention_mask, _, log_probs, ref_log_probs = infer_experience(steps, actor, ref, prompts, prompt_mask,
                                                                        pad_id, answer_len)
    with torch.no_grad():
        with steps("infer_reward"):
            reward_score = reward(seq, attention_mask)[:, -1]  # [b]
        with steps("infer_critic"):
            values = critic(seq, attention_mask)[:, :-1]  # [b, prompt_len + answer_len - 1]
            start = prompt_len - 1  # the answer's log-probs start here
            action_mask = attention_mask[:, 1:]  # [b, prompt_len + answer_len - 1]
            rewards = ppo.compute_rewards(start, log_probs, ref_log_probs, reward_score, action_mask)
            advantages, returns = ppo.get_advantages_and_returns(values, rewards, start)  # [b, answer_len]
            experience = [seq, attention_mask, log_probs, values, advantages, returns]
            rec.moved_to_host(experience)  # the experience buffer keeps it on CPU (cpu_offload)

    # ---- learn (coati/trainer/ppo.py) --------------------------------------------------------
    if not gemini:  # offload_inference_models: Gemini places its own models
        ref.to("cpu")
        reward.to("cpu")
        rec.moved_to_host(module_tensors(ref, reward))
    actor.train()
    critic.train()
    rec.moved_to_device(experience)  # the sampled experience goes back to the device
    with steps("train_actor"):
        logits = actor(input_ids=seq, attention_mask=attention_mask)["logits"]
        new_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
        actor_loss = ppo.actor_loss_fn(new_log_probs[:, start:], log_probs[:, start:], advantages,
                                       action_mask[:, start:])
        actor_booster.backward(loss=actor_loss, optimizer=actor_optim)
        actor_optim.step()
        actor_optim.zero_grad()
        del logits, new_log_probs
    with steps("train_critic"):
        new_values = critic(seq, attention_mask)[:, :-1]
        critic_loss = ppo.critic_loss_fn(new_values[:, start:], values[:, start:], returns, action_mask[:, start:])
        critic_booster.backward(loss=critic_loss, optimizer=critic_optim)
        critic_optim.step()
        critic_optim.zero_grad()
        del new_values
    return {
        "algorithm": "ppo", "critic_built": True,
        "actor_loss": float(actor_loss.detach().float()),
        "critic_loss": float(critic_loss.detach().float()),
        "dtype": str(dtype).replace("torch.", ""), "plugin": kind, "gradient_checkpointing": grad_ckpt,
        "offload_inference_models": not gemini, "lora_dim": lora_dim, "batch_size": batch,
        "prompt_len": prompt_len, "answer_len": answer_len, "sequence_shape": list(seq.shape),
    }
