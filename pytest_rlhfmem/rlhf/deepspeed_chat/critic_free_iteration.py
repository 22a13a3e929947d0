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
from ...rollout import NEXT_ROLLOUT
from ..common import PhaseSteps, full_attention_mask, random_prompts, rollout_stand_in
from ..scenario import DEFAULT_GROUP_SIZE, Scenario
from .builders import init_actor_and_ref, init_reward, offloaded_tensors, optimizer_state_summary
from .configs import STRATEGY_SETTINGS, get_eval_ds_config, get_train_ds_config, scenario_settings
from .experience import generate, reward_scores


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
    steps = PhaseSteps(scenario, rec, rank)

    with steps("init"):
        actor_engine, ref_engine = init_actor_and_ref(scenario, pair, rec, train_cfg, eval_cfg, dtype, device,
                                                      lora_dim, only_lora)
        reward_engine = init_reward(scenario, pair, rec,
                                    get_eval_ds_config(reward_stage, offload, dtype, batch, world_size, buckets),
                                    dtype)
        rollout = rollout_stand_in(scenario, rec, actor_engine.module, dtype)  # LLM(...) last, as TRL; or None

    for _ in steps.iterations():  # iteration 1..N on the engines built once (iterations=N)
        prompts, prompt_mask, pad_id = random_prompts(pair, st["batch"], prompt_len, device)  # [prompts, prompt_len]
        if grpo:  # a group of samples per prompt, adjacent: [b, prompt_len], b = prompts * group_size
            prompts, prompt_mask = prompts.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
        actor_engine.eval()
        # [b, prompt_len + answer_len] each; ReMax's argmax answers are its baseline (None for GRPO)
        seq, greedy = generate(steps, actor_engine.module, prompts, prompt_mask, pad_id, answer_len, greedy=not grpo,
                               rollout=rollout, synced_gpus=stage == 3)
        attention_mask = full_attention_mask(prompt_mask, seq)  # [b, prompt_len + answer_len]
        with torch.no_grad():  # the actor stays in eval mode; each forward is reduced to its log-probs at once
            with steps("infer_actor"):  # [b, prompt_len + answer_len - 1]
                log_probs = ppo.sequence_log_probs(actor_engine(seq, attention_mask=attention_mask).logits, seq)
            with steps("infer_reference"):  # [b, prompt_len + answer_len - 1]
                ref_log_probs = ppo.sequence_log_probs(ref_engine(seq, attention_mask=attention_mask).logits, seq)
            with steps("infer_reward"):  # [b] each
                score = reward_scores(reward_engine, seq, attention_mask, prompt_len)
                baseline = None if greedy is None else reward_scores(reward_engine, greedy, attention_mask, prompt_len)

        actor_engine.train()
        if grad_ckpt:
            actor_engine.module.gradient_checkpointing_enable()
        start = prompt_len - 1  # the answer's log-probs start here
        action_mask = attention_mask[:, 1:]  # [b, prompt_len + answer_len - 1]
        with steps("train_actor"):
            with torch.no_grad():
                if grpo:
                    advantages = critic_free.group_advantages(score, group)  # [b]
                else:
                    returns = critic_free.remax_returns(start, log_probs, ref_log_probs, score, baseline,
                                                        action_mask)  # [b, answer_len]
            logits = actor_engine(seq, attention_mask=attention_mask, use_cache=False).logits  # kept to the step
            new_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])  # [b, prompt_len + answer_len - 1]
            mask = action_mask[:, start:]  # [b, answer_len]
            if grpo:
                actor_loss = critic_free.grpo_loss(new_log_probs[:, start:], log_probs[:, start:],
                                                   ref_log_probs[:, start:], advantages, mask)
            else:
                actor_loss = critic_free.reinforce_loss(new_log_probs[:, start:], returns, mask)
            actor_engine.backward(actor_loss)
            actor_engine.step()
            del logits, new_log_probs
            rec.host_resident(offloaded_tensors(actor_engine, offload))
        if grad_ckpt:
            actor_engine.module.gradient_checkpointing_disable()
        if rollout is not None:  # the next iteration begins by waking the engine up beside what training left cached
            with rec.phase(NEXT_ROLLOUT):
                rollout.wake_up()
    return {
        "algorithm": scenario.algorithm, "critic_built": False, "group_size": group if grpo else None,
        "actor_loss": float(actor_loss.detach().float()),
        "optimizer_states": {"actor": optimizer_state_summary(actor_engine)},
        "dtype": str(dtype).replace("torch.", ""), "zero_stage": stage, "reference_stage": ref_stage,
        "reward_stage": reward_stage, "offload": offload, "gradient_checkpointing": grad_ckpt, "lora_dim": lora_dim,
        "batch_size": st["batch"], "sequences": batch, "prompt_len": prompt_len, "answer_len": answer_len,
        "bucket_elements": buckets, "sequence_shape": list(seq.shape),
        **({"rollout_engine": rollout.describe()} if rollout is not None else {}),
    }
