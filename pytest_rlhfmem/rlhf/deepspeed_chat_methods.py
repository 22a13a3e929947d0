"""The memory-saving methods of the RLHF literature on the DeepSpeed-Chat recipe: ReMax, GRPO (critic-free
algorithms, maths in ``critic_free.py``) and Hydra-PPO (one backbone, two LoRA adapter sets).

Engines, configs and ZeRO stage rules are ``deepspeed_chat.py``'s (DeepSpeed-Chat's ``rlhf_engine.py`` and
``ds_utils.py``); only the models built and the iteration differ:

- ReMax (Li et al. 2023, Algorithm 1): actor, reference, reward; no critic. One sampled and one greedy
  generation per prompt (phase ``generate_greedy``), the reward model scores both (``infer_reward``), one
  REINFORCE update (``train_actor``). The authors' code is DeepSpeed-Chat's step 3 with the critic removed.
- GRPO (Shao et al. 2024, Sec. 4.1): actor, reference, reward; no critic. ``group_size`` samples per prompt
  (``batch_size * group_size`` sequences), group-normalised scores, clipped surrogate with a KL term.
- Hydra-PPO (Santacroce, Lu, Yu, Li, Shen, "Efficient RLHF: Reducing the Memory Usage of PPO", arXiv
  2309.00754, 2023): one backbone
  with a causal-LM head and a reward head (the Hydra-SFT model); the actor and the critic are two LoRA
  adapter sets on it (peft's multi-adapter support: ``add_adapter`` / ``set_adapter``), and the reference
  and the reward are the same model with LoRA turned off (``disable_adapter``): one model's weights in
  memory instead of four. Each adapter has its own copy of the reward head for values
  (``modules_to_save``), so the critic's head trains while the reward head stays frozen. One DeepSpeed
  engine carries the model; its optimizer holds both adapters (peft's ``set_adapter`` freezes the inactive
  one, so each update moves only its own adapter). No ZeRO (stage 0), as PPO's ``none``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..memory.capture import Recorder
from . import critic_free, ppo
from .common import FaultHooks, maybe_flush, random_prompts, resolve_dtype
from .deepspeed_chat import (
    STRATEGY_SETTINGS, get_eval_ds_config, get_train_ds_config,
    init_actor_and_ref, init_reward, make_optimizer, offloaded_tensors, optimizer_state_summary,
)
from .models import ModelPair, build_causal_lm, get_pair, output_width
from .scenario import DEFAULT_GROUP_SIZE, Scenario


class HydraModel(torch.nn.Module):
    """Hydra-SFT's model: one causal LM whose backbone also feeds a reward head ``v_head = Linear(hidden, 1)``.

    ``forward(input_ids, attention_mask, head="lm")`` returns the LM logits ``[B, T, V]``; ``head="value"``
    returns one value per token ``[B, T]`` from the backbone's last hidden states."""

    def __init__(self, lm: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.config = lm.config
        self.lm = lm
        self.v_head = torch.nn.Linear(hidden, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head: str = "lm") -> torch.Tensor:
        if head == "lm":
            return self.lm(input_ids, attention_mask=attention_mask, use_cache=False).logits
        hidden = self.lm.base_model(input_ids, attention_mask=attention_mask, use_cache=False)[0]
        return self.v_head(hidden).squeeze(-1)


def build_hydra(pair: ModelPair, lora_dim: int, dtype: torch.dtype, path: str | None):
    """The Hydra model with adapters ``actor`` and ``critic`` (rank ``lora_dim``), through peft. Returns
    ``(peft_model, hydra)``: the peft wrapper (adapters, ``disable_adapter``) and the inner model."""
    from peft import LoraConfig, get_peft_model

    lm = build_causal_lm(pair.actor, path)
    hydra = HydraModel(lm, output_width(lm.config)).to(dtype)  # the reward head reads the backbone's width
    cfg = LoraConfig(r=lora_dim, lora_alpha=1, lora_dropout=0.0, target_modules=list(pair.lora_targets),
                     fan_in_fan_out=pair.actor.family == "gpt2", bias="none", modules_to_save=["v_head"])
    model = get_peft_model(hydra, cfg, adapter_name="actor")
    model.add_adapter("critic", cfg)
    return model, hydra


def _adapter_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Both adapters' weights and head copies, whatever ``set_adapter`` left trainable."""
    return [p for n, p in model.named_parameters()
            if "lora_" in n or ("modules_to_save" in n and (".actor." in n or ".critic." in n))]


def run_method_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """One iteration of ``scenario.algorithm`` (ReMax or GRPO) or of Hydra-PPO under ``rec``; returns the
    losses and settings (``optimizer_states`` per engine: see ``optimizer_state_summary``)."""
    if scenario.strategy == "hydra":
        return _hydra_ppo(scenario, rec, device, rank, world_size)
    return _critic_free(scenario, rec, device, rank, world_size)


def _settings(scenario: Scenario, device: str) -> dict[str, Any]:
    pair = get_pair(scenario.models)
    return {"pair": pair, "dtype": resolve_dtype(scenario, device), "batch": scenario.get("batch_size", 2),
            "prompt_len": scenario.get("prompt_len", pair.prompt_len),
            "answer_len": scenario.get("answer_len", pair.answer_len),
            "lora_dim": scenario.get("lora_dim", pair.lora_dim)}


# ---------------------------------------------------------------------------------------------------
# ReMax and GRPO: actor, reference, reward; no critic
# ---------------------------------------------------------------------------------------------------

def _critic_free(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:

    st = _settings(scenario, device)
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


# ---------------------------------------------------------------------------------------------------
# Hydra-PPO: one backbone, adapters "actor" and "critic"; reference and reward = adapters off
# ---------------------------------------------------------------------------------------------------

def _hydra_ppo(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    import deepspeed

    st = _settings(scenario, device)
    pair, dtype, batch, prompt_len, answer_len = (st["pair"], st["dtype"], st["batch"], st["prompt_len"],
                                                  st["answer_len"])
    lora_dim = st["lora_dim"] or 8  # the pair's model family was checked by Scenario (HYDRA_FAMILIES)
    train_cfg = get_train_ds_config(0, False, dtype, batch, world_size, pair.bucket_elements)
    torch.manual_seed(scenario.get("seed", 1234) + rank)
    hooks = FaultHooks(scenario, rank)

    with rec.phase("init"):
        model, hydra = build_hydra(pair, lora_dim, dtype, scenario.get("actor_path"))
        params = _adapter_params(model)
        for p in model.parameters():  # only adapters train (the backbone and the reward head are Hydra-SFT's)
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        optimizer = make_optimizer(torch.nn.ParameterList(params), False, device)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=train_cfg)
        model.set_adapter("actor")
        hooks.at("init")

    prompts, prompt_mask, pad_id = random_prompts(pair, batch, prompt_len, device)
    engine.eval()
    with rec.phase("generate"):
        with torch.no_grad():
            seq = hydra.lm.generate(prompts, attention_mask=prompt_mask, max_new_tokens=answer_len,
                                    min_new_tokens=answer_len, do_sample=True, pad_token_id=pad_id, use_cache=True)
        hooks.at("generate")
    maybe_flush(scenario, rec, "generate")
    attention_mask = torch.cat([prompt_mask, torch.ones(batch, seq.shape[1] - prompt_len, dtype=prompt_mask.dtype,
                                                        device=device)], dim=1)
    with torch.no_grad():
        with rec.phase("infer_actor"):
            logits = engine(seq, attention_mask=attention_mask, head="lm")
            log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
            del logits
            hooks.at("infer_actor")
        maybe_flush(scenario, rec, "infer_actor")
        with model.disable_adapter():  # LoRA off: the Hydra-SFT model is the reference and the reward
            with rec.phase("infer_reference"):
                logits = engine(seq, attention_mask=attention_mask, head="lm")
                ref_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
                del logits
                hooks.at("infer_reference")
            maybe_flush(scenario, rec, "infer_reference")
            with rec.phase("infer_reward"):
                reward_score = engine(seq, attention_mask=attention_mask, head="value")[:, -1]
                hooks.at("infer_reward")
            maybe_flush(scenario, rec, "infer_reward")
        with rec.phase("infer_critic"):
            model.set_adapter("critic")
            values = engine(seq, attention_mask=attention_mask, head="value")[:, :-1]
            hooks.at("infer_critic")
        maybe_flush(scenario, rec, "infer_critic")

    engine.train()
    start = prompt_len - 1
    action_mask = attention_mask[:, 1:]
    with rec.phase("train_actor"):
        model.set_adapter("actor")
        with torch.no_grad():
            rewards = ppo.compute_rewards(start, log_probs, ref_log_probs, reward_score, action_mask)
            advantages, returns = ppo.get_advantages_and_returns(values, rewards, start)
        logits = engine(seq, attention_mask=attention_mask, head="lm")
        new_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
        actor_loss = ppo.actor_loss_fn(new_log_probs[:, start:], log_probs[:, start:], advantages,
                                       action_mask[:, start:])
        engine.backward(actor_loss)
        engine.step()
        del logits, new_log_probs
        hooks.at("train_actor")
    maybe_flush(scenario, rec, "train_actor")
    with rec.phase("train_critic"):
        model.set_adapter("critic")
        value = engine(seq, attention_mask=attention_mask, head="value")[:, :-1]
        critic_loss = ppo.critic_loss_fn(value[:, start:], values[:, start:], returns, action_mask[:, start:])
        engine.backward(critic_loss)
        engine.step()
        del value
        hooks.at("train_critic")
    maybe_flush(scenario, rec, "train_critic")
    backbone = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n and "modules_to_save" not in n)
    return {
        "algorithm": "ppo", "layout": "hydra", "adapters": sorted(model.peft_config), "critic_built": True,
        "models_in_memory": 1, "backbone_elements": backbone,
        "actor_loss": float(actor_loss.detach().float()), "critic_loss": float(critic_loss.detach().float()),
        "optimizer_states": {"hydra": optimizer_state_summary(engine)},
        "dtype": str(dtype).replace("torch.", ""), "zero_stage": 0, "offload": False, "lora_dim": lora_dim,
        "batch_size": batch, "prompt_len": prompt_len, "answer_len": answer_len,
        "sequence_shape": list(seq.shape),
    }
