"""The DeepSpeed-Chat step-3 recipe's PPO iteration on real DeepSpeed, phase by phase.

Follows microsoft/DeepSpeedExamples ``applications/DeepSpeed-Chat``: ``dschat/rlhf/rlhf_engine.py``
(engines and their ZeRO stages), ``dschat/utils/ds_utils.py`` (train/eval configs),
``dschat/utils/model/reward_model.py`` (critic = base model + v_head), ``dschat/utils/module/lora.py``
(LoRA on every Linear under ``decoder.layers.``; here through peft) and ``dschat/rlhf/ppo_trainer.py``
(``generate_experience`` and ``train_rlhf``). Facts: ``shared/reference/rlhf-frameworks.md``.

Reads top to bottom: build the four engines (phase ``init``: ``builders.py``), then ``generate``, the four
inference forwards, and the actor and critic updates: one iteration, or ``iterations=N`` of them on the same engines
(``common.PhaseSteps.iterations``). Each phase is a step (``common.PhaseSteps``): the recorder
marks it, the fault hook fires at its end, and the flush policy empties the cache after it where it says.

Settings that DeepSpeed-Chat's step-3 script for the pair passes (``configs.ppo_setting``; for ``opt-1.3b``
``run_1.3b.sh``: batch 4, the Hybrid Engine, EMA, actor dropout 0) are the defaults; the Hybrid Engine is
DeepSpeed's own ``DeepSpeedHybridEngine`` (what it does here: ``configs.hybrid_engine_block``).
"""

from __future__ import annotations

import torch

from ...record.recorder import Recorder
from .. import ppo
from ...rollout import NEXT_ROLLOUT
from ..common import PhaseSteps, full_attention_mask, random_prompts, resolve_dtype, rollout_stand_in
from ..models import get_pair
from ..scenario import Scenario
from .builders import (
    create_critic_model, init_actor_and_ref, init_ema, init_reward, lora_critic, make_optimizer, moving_average,
    offloaded_tensors, optimizer_state_summary,
)
from .configs import (
    STRATEGY_SETTINGS, get_eval_ds_config, get_train_ds_config, largest_parameter, per_engine, ppo_setting,
)
from .experience import generate, reward_scores


def run_ppo_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """Build the four engines and run one PPO iteration under ``rec``; returns losses and settings."""
    import deepspeed

    pair = get_pair(scenario.models)
    stage, offload, grad_ckpt = STRATEGY_SETTINGS[scenario.strategy]
    dtype = resolve_dtype(scenario, device)
    batch = ppo_setting(scenario, "batch_size")  # per-device generation = training batch
    prompt_len = scenario.get("prompt_len", pair.prompt_len)
    answer_len = scenario.get("answer_len", pair.answer_len)
    lora_dim = scenario.get("lora_dim", pair.lora_dim)
    actor_dropout = ppo_setting(scenario, "actor_dropout")  # --actor_dropout (None: the config's)
    lora_only = scenario.strategy == "lora"  # LoRA-PPO: LoRA on actor and critic, nothing else trains
    only_lora = scenario.get("only_optimize_lora", False) or lora_only
    buckets = pair.bucket_elements
    ref_stage = 3 if stage == 3 else 0  # rlhf_engine.py: reference follows the actor's stage 3
    reward_stage = 3 if stage == 3 else 0  # reward follows the critic's stage 3
    nvme = largest_parameter(pair) if offload == "nvme" else None  # staging buffers hold the largest parameter
    train_cfg = get_train_ds_config(stage, offload, dtype, batch, world_size, buckets, nvme)
    eval_cfg = get_eval_ds_config(ref_stage, offload, dtype, batch, world_size, buckets, nvme)
    hybrid_engine = bool(ppo_setting(scenario, "hybrid_engine"))  # --enable_hybrid_engine: the actor's only
    actor_cfg = (get_train_ds_config(stage, offload, dtype, batch, world_size, buckets, nvme,
                                     hybrid_engine_max_out_tokens=prompt_len + answer_len)
                 if hybrid_engine else train_cfg)
    ema = bool(ppo_setting(scenario, "ema"))  # --enable_ema
    torch.manual_seed(scenario.get("seed", 1234) + rank)
    steps = PhaseSteps(scenario, rec, rank)

    with steps("init"):
        actor_engine, ref_engine = init_actor_and_ref(scenario, pair, rec, actor_cfg, eval_cfg, dtype, device,
                                                      lora_dim, only_lora, actor_dropout)
        # rlhf_engine.py builds actor, reference, EMA, critic, reward in that order
        ema_engine = init_ema(scenario, pair, rec, eval_cfg, dtype, lora_dim) if ema else None
        # critic (_init_critic): gradient checkpointing from the start
        critic_cfg = per_engine(train_cfg, "critic")
        critic = create_critic_model(pair.critic, critic_cfg, scenario.get("critic_path"), dtype)
        if lora_only:
            lora_critic(critic, pair, lora_dim)
        if grad_ckpt:
            critic.gradient_checkpointing_enable()
        critic_engine, *_ = deepspeed.initialize(model=critic, optimizer=make_optimizer(critic, offload, device),
                                                 config=critic_cfg)
        rec.host_resident(offloaded_tensors(critic_engine, offload))
        reward_engine = init_reward(scenario, pair, rec,
                                    get_eval_ds_config(reward_stage, offload, dtype, batch, world_size, buckets,
                                                       nvme),
                                    dtype)
        rollout = rollout_stand_in(scenario, rec, actor_engine.module, dtype)  # LLM(...) last, as TRL; or None

    for _ in steps.iterations():  # iteration 1..N on the engines built once (iterations=N)
        prompts, prompt_mask, pad_id = random_prompts(pair, batch, prompt_len, device)  # [b, prompt_len], left-padded

        # ---- generate_experience (ppo_trainer.py) -------------------------------------------------
        for engine in (actor_engine, critic_engine, reward_engine, ref_engine):  # self.eval(); the Hybrid Engine's
            engine.eval()  # eval() empties the cache under ZeRO-3
        seq, _ = generate(steps, actor_engine.module, prompts, prompt_mask, pad_id, answer_len, rollout=rollout,
                          synced_gpus=stage == 3)  # [b, prompt_len + answer_len]
        actor_engine.train()  # self.train(): the experience forwards of actor and critic run in train mode
        critic_engine.train()  # (dropout on, under no_grad), as ppo_trainer.py does
        attention_mask = full_attention_mask(prompt_mask, seq)  # [b, prompt_len + answer_len]
        with torch.no_grad():  # the full outputs are kept until the critic's forward, as generate_experience does
            with steps("infer_actor"):
                output = actor_engine(seq, attention_mask=attention_mask)  # logits [b, prompt_len + answer_len, vocab]
            with steps("infer_reference"):
                output_ref = ref_engine(seq, attention_mask=attention_mask)  # likewise
            with steps("infer_reward"):
                reward_score = reward_scores(reward_engine, seq, attention_mask, prompt_len)  # [b]
            with steps("infer_critic"):
                # [b, prompt_len + answer_len - 1] each: values, and the log-prob of each token after the first
                values = critic_engine.module.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
                log_probs = ppo.sequence_log_probs(output.logits, seq)
                ref_log_probs = ppo.sequence_log_probs(output_ref.logits, seq)
                del output, output_ref

        # ---- train_rlhf (ppo_trainer.py): actor and critic are still in train mode ------------------
        if grad_ckpt:
            actor_engine.module.gradient_checkpointing_enable()  # only for the update, as DeepSpeed-Chat
        start = prompt_len - 1  # the answer's log-probs start here
        action_mask = attention_mask[:, 1:]  # [b, prompt_len + answer_len - 1]
        with steps("train_actor"):
            with torch.no_grad():
                old_rewards = ppo.compute_rewards(start, log_probs, ref_log_probs, reward_score, action_mask)
                advantages, returns = ppo.get_advantages_and_returns(values, old_rewards, start)  # [b, answer_len]
            actor_logits = actor_engine(seq, attention_mask=attention_mask, use_cache=False).logits  # kept to the step
            # [b, prompt_len + answer_len - 1]
            actor_log_prob = ppo.gather_log_probs(actor_logits[:, :-1, :], seq[:, 1:])
            actor_loss = ppo.actor_loss_fn(actor_log_prob[:, start:], log_probs[:, start:], advantages,
                                           action_mask[:, start:])
            actor_engine.backward(actor_loss)
            actor_engine.step()
            del actor_logits, actor_log_prob
            rec.host_resident(offloaded_tensors(actor_engine, offload))  # optimizer states appear at step 1
        with steps("train_critic"):
            value = critic_engine.module.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
            critic_loss = ppo.critic_loss_fn(value[:, start:], values[:, start:], returns, action_mask[:, start:])
            critic_engine.backward(critic_loss)
            critic_engine.step()
            del value
            rec.host_resident(offloaded_tensors(critic_engine, offload))
        if ema_engine is not None:  # step 3's main.py: after each train_rlhf
            with rec.phase("ema"):  # marked only: not one of the scenario's phases (no fault hook, no flush)
                moving_average(actor_engine, ema_engine, zero_stage=stage)
        if grad_ckpt:
            actor_engine.module.gradient_checkpointing_disable()
        if rollout is not None:  # the next iteration begins by waking the engine up beside what training left cached
            with rec.phase(NEXT_ROLLOUT):
                rollout.wake_up()
    states = {"actor": optimizer_state_summary(actor_engine), "critic": optimizer_state_summary(critic_engine)}
    return {
        "algorithm": "ppo", "optimizer_states": states,
        "actor_loss": float(actor_loss.detach().float()),
        "critic_loss": float(critic_loss.detach().float()),
        "dtype": str(dtype).replace("torch.", ""),
        "zero_stage": stage, "reference_stage": ref_stage, "reward_stage": reward_stage,
        "offload": offload, "gradient_checkpointing": grad_ckpt, "lora_dim": lora_dim, "ema": ema,
        "actor_dropout": actor_dropout,
        "hybrid_engine": type(actor_engine).__name__ if hybrid_engine else None,
        "batch_size": batch, "prompt_len": prompt_len, "answer_len": answer_len,
        "bucket_elements": buckets, "sequence_shape": list(seq.shape),
        **({"rollout_engine": rollout.describe()} if rollout is not None else {}),
    }
