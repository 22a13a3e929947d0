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
from ..common import FaultHooks, maybe_flush, random_prompts, resolve_dtype
from ..models import get_pair
from ..scenario import DEFAULT_GROUP_SIZE, Scenario
from .builders import CPU_DTYPE, STRATEGY_PLUGINS, boost_models, module_tensors


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
    hooks = FaultHooks(scenario, rank)

    with rec.phase("init"):
        m = boost_models(scenario, pair, kind, dtype, device, lora_dim, grad_ckpt, with_critic=False)
        actor, actor_optim, actor_booster, ref, reward = m.actor, m.actor_optim, m.actor_booster, m.ref, m.reward
        hooks.at("init")

    prompts, prompt_mask, pad_id = random_prompts(pair, prompts_n, prompt_len, device)
    if grpo:
        prompts, prompt_mask = prompts.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
    gen = {"attention_mask": prompt_mask, "max_new_tokens": answer_len, "min_new_tokens": answer_len,
           "pad_token_id": pad_id, "use_cache": True}
    actor.eval()
    greedy = None
    with torch.no_grad():
        with rec.phase("generate"):
            seq = actor.unwrap(unwrap_peft=False).generate(prompts, do_sample=True, temperature=0.7, top_k=50, **gen)
            hooks.at("generate")
        maybe_flush(scenario, rec, "generate")
        if not grpo:
            with rec.phase("generate_greedy"):
                greedy = actor.unwrap(unwrap_peft=False).generate(prompts, do_sample=False, **gen)
                hooks.at("generate_greedy")
            maybe_flush(scenario, rec, "generate_greedy")
        attention_mask = torch.cat([prompt_mask, torch.ones(batch, seq.shape[1] - prompt_len,
                                                            dtype=prompt_mask.dtype, device=device)], dim=1)
        with rec.phase("infer_actor"):
            logits = actor(input_ids=seq, attention_mask=attention_mask)["logits"]
            log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
            del logits
            hooks.at("infer_actor")
        maybe_flush(scenario, rec, "infer_actor")
        with rec.phase("infer_reference"):
            logits = ref(input_ids=seq, attention_mask=attention_mask)["logits"]
            ref_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
            del logits
            hooks.at("infer_reference")
        maybe_flush(scenario, rec, "infer_reference")
        with rec.phase("infer_reward"):
            score = reward(seq, attention_mask)[:, -1]
            start = prompt_len - 1
            action_mask = attention_mask[:, 1:]
            if grpo:
                target = critic_free.group_advantages(score, group)
            else:
                baseline = reward(greedy, attention_mask)[:, -1]
                target = critic_free.remax_returns(start, log_probs, ref_log_probs, score, baseline, action_mask)
            experience = [seq, attention_mask, log_probs, ref_log_probs, target]
            rec.moved_to_host(experience)  # the experience buffer keeps it on CPU
            hooks.at("infer_reward")
        maybe_flush(scenario, rec, "infer_reward")

    if not gemini:
        ref.to("cpu")
        reward.to("cpu")
        rec.moved_to_host(module_tensors(ref, reward))
    actor.train()
    rec.moved_to_device(experience)
    with rec.phase("train_actor"):
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
        hooks.at("train_actor")
    maybe_flush(scenario, rec, "train_actor")
    return {
        "algorithm": scenario.algorithm, "critic_built": False, "group_size": group if grpo else None,
        "actor_loss": float(actor_loss.detach().float()),
        "dtype": str(dtype).replace("torch.", ""), "plugin": kind, "gradient_checkpointing": grad_ckpt,
        "offload_inference_models": not gemini, "lora_dim": lora_dim, "batch_size": prompts_n, "sequences": batch,
        "prompt_len": prompt_len, "answer_len": answer_len, "sequence_shape": list(seq.shape),
    }
