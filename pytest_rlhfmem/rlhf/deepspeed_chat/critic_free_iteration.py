"""ReMax and GRPO on the DeepSpeed-Chat recipe: critic-free algorithms (maths in ``rlhf/critic_free.py``).

Engines, configs and ZeRO stage rules are the PPO iteration's (``builders.py``, ``configs.py``); only the
models built and the iteration differ:

- ReMax (Li et al. 2023, Algorithm 1): actor, reference, reward; no critic. One sampled and one greedy
  generation per prompt (phase ``generate_greedy``), the reward model scores both (``infer_reward``), one
  REINFORCE update (``train_actor``). The authors' code is DeepSpeed-Chat's step 3 with the critic removed.
- GRPO (Shao et al. 2024, Sec. 4.1): actor, reference, reward; no critic. ``group_size`` samples per prompt
  (``batch_size * group_size`` sequences), group-normalised scores, clipped surrogate with a KL term.
"""

from __future__ import annotations

import torch

from ...record.recorder import Recorder
from .. import critic_free, ppo
from ..common import FaultHooks, maybe_flush, random_prompts
from ..scenario import DEFAULT_GROUP_SIZE, Scenario
from .builders import init_actor_and_ref, init_reward, offloaded_tensors, optimizer_state_summary
from .configs import STRATEGY_SETTINGS, get_eval_ds_config, get_train_ds_config, scenario_settings


def run_critic_free_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """One ReMax or GRPO iteration (``scenario.algorithm``) under ``rec``: actor, reference and reward, no
    critic; returns the loss and settings (``critic_built`` False)."""
    st = scenario_settings(scenario, device)
    pair, dtype, prompt_len, answer_len, lora_dim = (st["pair"], st["dtype"], st["prompt_len"], st["answer_len"],
                                                     st["lora_dim"])
    grpo = scenario.algorithm == "grpo"
    group = scenario.get("group_size", DEFAULT_GROUP_SIZE) if grpo else 1
    batch = st["batch"] * group  # sequences per rank: GRPO samples a group per prompt
    stage, offload, grad_ckpt = STRATEGY_SETTINGS[scenario.strategy]
    only_lora = scenario.get("only_optimize_lora", False) or scenario.strategy == "lora"
    ref_stage = reward_stage = 3 if stage == 3 else 0
    buckets = pair.bucket_elements
    train_cfg = get_train_ds_config(stage, offload, dtype, batch, world_size, buckets)
    eval_cfg = get_eval_ds_config(ref_stage, offload, dtype, batch, world_size, buckets)
    torch.manual_seed(scenario.get("seed", 1234) + rank)
    hooks = FaultHooks(scenario, rank)

    with rec.phase("init"):
        actor_engine, ref_engine = init_actor_and_ref(scenario, pair, rec, train_cfg, eval_cfg, dtype, device,
                                                      lora_dim, only_lora)
        reward_engine = init_reward(scenario, pair, rec,
                                    get_eval_ds_config(reward_stage, offload, dtype, batch, world_size, buckets),
                                    dtype)
        hooks.at("init")

    prompts, prompt_mask, pad_id = random_prompts(pair, st["batch"], prompt_len, device)
    if grpo:  # a group of samples per prompt, adjacent
        prompts, prompt_mask = prompts.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
    gen = {"attention_mask": prompt_mask, "max_new_tokens": answer_len, "min_new_tokens": answer_len,
           "pad_token_id": pad_id, "synced_gpus": stage == 3, "use_cache": True}
    actor_engine.eval()
    with rec.phase("generate"):
        with torch.no_grad():
            seq = actor_engine.module.generate(prompts, do_sample=True, **gen)
        hooks.at("generate")
    maybe_flush(scenario, rec, "generate")
    greedy = None
    if not grpo:
        with rec.phase("generate_greedy"):  # ReMax's baseline: the argmax response
            with torch.no_grad():
                greedy = actor_engine.module.generate(prompts, do_sample=False, **gen)
            hooks.at("generate_greedy")
        maybe_flush(scenario, rec, "generate_greedy")
    attention_mask = torch.cat([prompt_mask, torch.ones(batch, seq.shape[1] - prompt_len, dtype=prompt_mask.dtype,
                                                        device=device)], dim=1)
    with torch.no_grad():
        with rec.phase("infer_actor"):
            logits = actor_engine(seq, attention_mask=attention_mask).logits
            log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
            del logits
            hooks.at("infer_actor")
        maybe_flush(scenario, rec, "infer_actor")
        with rec.phase("infer_reference"):
            logits = ref_engine(seq, attention_mask=attention_mask).logits
            ref_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
            del logits
            hooks.at("infer_reference")
        maybe_flush(scenario, rec, "infer_reference")
        with rec.phase("infer_reward"):
            score = reward_engine.module.forward_value(seq, attention_mask, prompt_length=prompt_len)
            score = score["chosen_end_scores"]
            baseline = None
            if greedy is not None:
                baseline = reward_engine.module.forward_value(greedy, attention_mask, prompt_length=prompt_len)
                baseline = baseline["chosen_end_scores"]
            hooks.at("infer_reward")
        maybe_flush(scenario, rec, "infer_reward")

    actor_engine.train()
    if grad_ckpt:
        actor_engine.module.gradient_checkpointing_enable()
    start = prompt_len - 1
    action_mask = attention_mask[:, 1:]
    with rec.phase("train_actor"):
        with torch.no_grad():
            if grpo:
                advantages = critic_free.group_advantages(score, group)
            else:
                returns = critic_free.remax_returns(start, log_probs, ref_log_probs, score, baseline, action_mask)
        logits = actor_engine(seq, attention_mask=attention_mask, use_cache=False).logits
        new_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
        mask = action_mask[:, start:]
        if grpo:
            actor_loss = critic_free.grpo_loss(new_log_probs[:, start:], log_probs[:, start:],
                                               ref_log_probs[:, start:], advantages, mask)
        else:
            actor_loss = critic_free.reinforce_loss(new_log_probs[:, start:], returns, mask)
        actor_engine.backward(actor_loss)
        actor_engine.step()
        del logits, new_log_probs
        rec.host_resident(offloaded_tensors(actor_engine, offload))
        hooks.at("train_actor")
    maybe_flush(scenario, rec, "train_actor")
    if grad_ckpt:
        actor_engine.module.gradient_checkpointing_disable()
    return {
        "algorithm": scenario.algorithm, "critic_built": False, "group_size": group if grpo else None,
        "actor_loss": float(actor_loss.detach().float()),
        "optimizer_states": {"actor": optimizer_state_summary(actor_engine)},
        "dtype": str(dtype).replace("torch.", ""), "zero_stage": stage, "reference_stage": ref_stage,
        "reward_stage": reward_stage, "offload": offload, "gradient_checkpointing": grad_ckpt, "lora_dim": lora_dim,
        "batch_size": st["batch"], "sequences": batch, "prompt_len": prompt_len, "answer_len": answer_len,
        "bucket_elements": buckets, "sequence_shape": list(seq.shape),
    }
