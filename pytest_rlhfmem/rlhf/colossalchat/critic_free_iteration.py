"""ReMax and GRPO on the ColossalChat recipe (maths in ``rlhf/critic_free.py``): the PPO iteration's plugins,
boosters and placement rules (``builders.py``), without the critic.

- ReMax (Li et al. 2023, Algorithm 1): actor, reference, reward boosted; a sampled and a greedy generation
  (phase ``generate_greedy``), the reward model scores both, one REINFORCE update.
- GRPO (Shao et al. 2024, Sec. 4.1): actor, reference, reward boosted; ``group_size`` samples per prompt,
  group-normalised scores, clipped surrogate with a KL term to the reference.

As for PPO, the reference and the reward go to CPU before learning unless Gemini manages them, and the
experience is buffered on CPU (coati's ``NaiveExperienceBuffer``), both declared to the recorder.
"""

from __future__ import annotations

import torch

from ...record.recorder import Recorder
from .. import critic_free, ppo
from ..common import PhaseSteps, random_prompts, resolve_dtype
from ..models import get_pair
from ..scenario import DEFAULT_GROUP_SIZE, Scenario
from .builders import CPU_DTYPE, STRATEGY_PLUGINS, boost_models, module_tensors
from .experience import infer_experience


def run_critic_free_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """One ReMax or GRPO iteration under ``rec``; returns the loss and settings (``critic_built`` False)."""
    pair = get_pair(scenario.models)
    kind, grad_ckpt = STRATEGY_PLUGINS[scenario.strategy]
    gemini = kind.startswith("gemini")
    dtype = resolve_dtype(scenario, device, cpu_default=CPU_DTYPE)  # as PPO's
    grpo = scenario.algorithm == "grpo"
    group = scenario.get("group_size", DEFAULT_GROUP_SIZE) if grpo else 1
    prompts_n = scenario.get("batch_size", 2)
    batch = prompts_n * group
    prompt_len = scenario.get("prompt_len", pair.prompt_len)
    answer_len = scenario.get("answer_len", pair.answer_len)
    lora_dim = scenario.get("lora_dim", pair.lora_dim)
    torch.manual_seed(scenario.get("seed", 1234) + rank)
    steps = PhaseSteps(scenario, rec, rank)

    with steps("init"):
        m = boost_models(scenario, pair, kind, dtype, device, lora_dim, grad_ckpt, with_critic=False)
        actor, actor_optim, actor_booster, ref, reward = m.actor, m.actor_optim, m.actor_booster, m.ref, m.reward

    prompts, prompt_mask, pad_id = random_prompts(pair, prompts_n, prompt_len, device)  # [prompts_n, prompt_len]
    if grpo:  # a group of samples per prompt, adjacent: [b, prompt_len], b = prompts_n * group_size
        prompts, prompt_mask = prompts.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
    actor.eval()
    seq, attention_mask, greedy, log_probs, ref_log_probs = infer_experience(
        steps, actor, ref, prompts, prompt_mask, pad_id, answer_len, greedy=not grpo)
    with torch.no_grad(), steps("infer_reward"):
        score = reward(seq, attention_mask)[:, -1]  # [b]
        start = prompt_len - 1  # the answer's log-probs start here
        action_mask = attention_mask[:, 1:]  # [b, prompt_len + answer_len - 1]
        if grpo:  # GRPO's advantages, [b]
            target = critic_free.group_advantages(score, group)
        else:  # ReMax's returns, [b, answer_len]
            baseline = reward(greedy, attention_mask)[:, -1]  # [b]
            target = critic_free.remax_returns(start, log_probs, ref_log_probs, score, baseline, action_mask)
        experience = [seq, attention_mask, log_probs, ref_log_probs, target]
        rec.moved_to_host(experience)  # the experience buffer keeps it on CPU

    if not gemini:
        ref.to("cpu")
        reward.to("cpu")
        rec.moved_to_host(module_tensors(ref, reward))
    actor.train()
    rec.moved_to_device(experience)
    with steps("train_actor"):
        logits = actor(input_ids=seq, attention_mask=attention_mask)["logits"]
        new_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
        mask = action_mask[:, start:]
        if grpo:
            actor_loss = critic_free.grpo_loss(new_log_probs[:, start:], log_probs[:, start:],
                                               ref_log_probs[:, start:], target, mask)
        else:
            actor_loss = critic_free.reinforce_loss(new_log_probs[:, start:], target, mask)
        actor_booster.backward(loss=actor_loss, optimizer=actor_optim)
        actor_optim.step()
        actor_optim.zero_grad()
        del logits, new_log_probs
    return {
        "algorithm": scenario.algorithm, "critic_built": False, "group_size": group if grpo else None,
        "actor_loss": float(actor_loss.detach().float()),
        "dtype": str(dtype).replace("torch.", ""), "plugin": kind, "gradient_checkpointing": grad_ckpt,
        "offload_inference_models": not gemini, "lora_dim": lora_dim, "batch_size": prompts_n, "sequences": batch,
        "prompt_len": prompt_len, "answer_len": answer_len, "sequence_shape": list(seq.shape),
    }
