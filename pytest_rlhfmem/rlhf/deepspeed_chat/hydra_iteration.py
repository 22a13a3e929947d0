"""Hydra-PPO on the DeepSpeed-Chat recipe: one backbone, two LoRA adapter sets.

Santacroce, Lu, Yu, Li, Shen, "Efficient RLHF: Reducing the Memory Usage of PPO", arXiv 2309.00754, 2023: one
backbone with a causal-LM head and a reward head (the Hydra-SFT model, ``builders.HydraModel``); the actor and
the critic are two LoRA adapter sets on it (peft's multi-adapter support: ``add_adapter`` / ``set_adapter``),
and the reference and the reward are the same model with LoRA turned off (``disable_adapter``): one model's
weights in memory instead of four. Each adapter has its own copy of the reward head for values
(``modules_to_save``), so the critic's head trains while the reward head stays frozen. One DeepSpeed engine
carries the model; its optimizer holds both adapters (peft's ``set_adapter`` freezes the inactive one, so each
update moves only its own adapter). No ZeRO (stage 0), as PPO's ``none``.
"""

from __future__ import annotations

import torch

from ...record.recorder import Recorder
from .. import ppo
from ..common import PhaseSteps, full_attention_mask, random_prompts
from ..scenario import Scenario
from .builders import adapter_params, build_hydra, make_optimizer, optimizer_state_summary
from .configs import get_train_ds_config, scenario_settings
from .experience import generate


def run_hydra_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """One Hydra-PPO iteration under ``rec``: one model, adapters ``actor`` and ``critic``; the reference and
    the reward are the model with its adapters off. Returns the losses and settings."""
    import deepspeed

    st = scenario_settings(scenario, device)
    pair, dtype, batch, prompt_len, answer_len = (st["pair"], st["dtype"], st["batch"], st["prompt_len"],
                                                  st["answer_len"])
    lora_dim = st["lora_dim"] or 8  # the pair's model family was checked by Scenario (HYDRA_FAMILIES)
    train_cfg = get_train_ds_config(0, False, dtype, batch, world_size, pair.bucket_elements)
    torch.manual_seed(scenario.get("seed", 1234) + rank)
    steps = PhaseSteps(scenario, rec, rank)

    with steps("init"):
        model, hydra = build_hydra(pair, lora_dim, dtype, scenario.get("actor_path"))
        params = adapter_params(model)
        for p in model.parameters():  # only adapters train (the backbone and the reward head are Hydra-SFT's)
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        optimizer = make_optimizer(torch.nn.ParameterList(params), False, device)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=train_cfg)
        model.set_adapter("actor")

    for _ in steps.iterations():  # iteration 1..N on the engine built once (iterations=N)
        prompts, prompt_mask, pad_id = random_prompts(pair, batch, prompt_len, device)  # [b, prompt_len], left-padded
        engine.eval()
        seq, _ = generate(steps, hydra.lm, prompts, prompt_mask, pad_id, answer_len)  # [b, prompt_len + answer_len]
        attention_mask = full_attention_mask(prompt_mask, seq)  # [b, prompt_len + answer_len]
        with torch.no_grad():  # log-probs and values: [b, prompt_len + answer_len - 1]; the reward score: [b]
            with steps("infer_actor"):
                log_probs = ppo.sequence_log_probs(engine(seq, attention_mask=attention_mask, head="lm"), seq)
            with model.disable_adapter():  # LoRA off: the Hydra-SFT model is the reference and the reward
                with steps("infer_reference"):
                    ref_log_probs = ppo.sequence_log_probs(engine(seq, attention_mask=attention_mask, head="lm"), seq)
                with steps("infer_reward"):
                    reward_score = engine(seq, attention_mask=attention_mask, head="value")[:, -1]
            with steps("infer_critic"):
                model.set_adapter("critic")
                values = engine(seq, attention_mask=attention_mask, head="value")[:, :-1]

        engine.train()
        start = prompt_len - 1  # the answer's log-probs start here
        action_mask = attention_mask[:, 1:]  # [b, prompt_len + answer_len - 1]
        with steps("train_actor"):
            model.set_adapter("actor")
            with torch.no_grad():
                rewards = ppo.compute_rewards(start, log_probs, ref_log_probs, reward_score, action_mask)
                advantages, returns = ppo.get_advantages_and_returns(values, rewards, start)  # [b, answer_len]
            logits = engine(seq, attention_mask=attention_mask, head="lm")
            new_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
            actor_loss = ppo.actor_loss_fn(new_log_probs[:, start:], log_probs[:, start:], advantages,
                                           action_mask[:, start:])
            engine.backward(actor_loss)
            engine.step()
            del logits, new_log_probs
        with steps("train_critic"):
            model.set_adapter("critic")
            value = engine(seq, attention_mask=attention_mask, head="value")[:, :-1]
            critic_loss = ppo.critic_loss_fn(value[:, start:], values[:, start:], returns, action_mask[:, start:])
            engine.backward(critic_loss)
            engine.step()
            del value
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
