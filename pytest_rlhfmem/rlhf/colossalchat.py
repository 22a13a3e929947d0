"""The ColossalChat (coati V2) PPO recipe: one iteration on ``colossalai.booster``, phase by phase.

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
strategies ``none`` and ``grad-ckpt``. The others need CUDA (:data:`CPU_STRATEGIES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..memory.capture import Recorder
from . import ppo
from .common import FaultHooks, convert_to_lora, maybe_flush, random_prompts, resolve_dtype
from .models import ModelPair, ModelSpec, build_base_model, build_causal_lm, get_pair, output_width
from .scenario import Scenario

# strategy -> (plugin, gradient checkpointing); plugin kwargs below
STRATEGY_PLUGINS: dict[str, tuple[str, bool]] = {
    "none": ("ddp", False),  # TorchDDPPlugin (ColossalChat V1's DDPStrategy)
    "zero2": ("zero2", False),  # LowLevelZeroPlugin(stage=2)
    "zero2-offload": ("zero2_cpu", False),  # LowLevelZeroPlugin(stage=2, cpu_offload=True)
    "zero3": ("gemini", False),  # GeminiPlugin(placement_policy="static"), ~ZeRO-3
    "zero3-offload": ("gemini_cpu", False),  # Gemini with every offload fraction at 1.0 (old "cpu" placement)
    "grad-ckpt": ("ddp", True),
    "all": ("gemini_cpu", True),
}
CPU_STRATEGIES = ("none", "grad-ckpt")


def make_plugin(kind: str, dtype: torch.dtype):
    """The booster plugin for ``kind`` (``train_ppo.py``'s ``--plugin`` choices)."""
    from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin

    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
    if kind == "ddp":
        return TorchDDPPlugin()
    if kind in ("zero2", "zero2_cpu"):
        return LowLevelZeroPlugin(stage=2, precision=precision, initial_scale=2**16,
                                  cpu_offload=kind == "zero2_cpu")
    frac = 1.0 if kind == "gemini_cpu" else 0.0
    return GeminiPlugin(placement_policy="static", shard_param_frac=1.0, offload_optim_frac=frac,
                        offload_param_frac=frac, precision=precision, initial_scale=2**16)


class ValueModel(torch.nn.Module):
    """coati's ``Critic`` / ``RewardModel``: a base transformer plus ``value_head = Linear(width, 1)``."""

    def __init__(self, base: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.model = base
        self.config = base.config
        self.value_head = torch.nn.Linear(width, 1)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """values ``[B, T]``."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]
        return self.value_head(hidden).squeeze(-1)


def _value_model(spec: ModelSpec, path: str | None, dtype: torch.dtype) -> ValueModel:
    base = build_base_model(spec, path)
    return ValueModel(base, output_width(base.config)).to(dtype)


def _optimizer(model: torch.nn.Module, kind: str):
    """HybridAdam for the ZeRO plugins (as ``train_ppo.py``), torch AdamW for DDP."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "ddp":
        return torch.optim.AdamW(params, lr=1e-5, foreach=False)
    from colossalai.nn.optimizer import HybridAdam

    return HybridAdam(params, lr=1e-5)


def _settle_comm(device: str) -> None:
    """CPU only: wait until gloo's worker threads have finished DDP's parameter broadcast. Its flat bucket
    is freed by whichever thread drops the last reference (main or gloo), which made the simulated init
    peak vary by the size of the model's parameters between runs; a barrier makes it the main thread.
    Allocates nothing the recipe would not; on CUDA (NCCL, streams) it is skipped."""
    if device == "cpu":
        import torch.distributed as dist

        dist.barrier()


# TorchDDPPlugin (the one plugin that runs on CPU) does no mixed precision: on CPU the recipe keeps fp32, for
# PPO and the critic-free methods alike, so that their figures compare (the GPU's fp16 is left to CUDA runs).
CPU_DTYPE = "fp32"


def _tensors(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


@dataclass
class BoostedModels:
    """What :func:`boost_models` built: the boosted actor with its optimizer and booster, the critic with
    its own (``None`` without a critic), and the boosted reference and reward models in eval mode."""

    actor: Any
    actor_optim: Any
    actor_booster: Any
    critic: Any
    critic_optim: Any
    critic_booster: Any  # also boosts the reward model, as coati's train_ppo.py does
    ref: Any
    reward: Any


def boost_models(scenario: Scenario, pair: ModelPair, kind: str, dtype: torch.dtype, device: str, lora_dim: int,
                 grad_ckpt: bool, with_critic: bool) -> BoostedModels:
    """Build and boost the models of one iteration in the order of coati's ``train_ppo.py``: actor (LoRA when
    ``lora_dim > 0``), critic (PPO only), gradient checkpointing, reference, reward; then one booster for the
    actor and the reference, one for the critic and the reward (``make_plugin(kind)`` each), with a
    communication settle after every boost (:func:`_settle_comm`)."""
    from colossalai.booster import Booster

    actor = build_causal_lm(pair.actor, scenario.get("actor_path")).to(dtype)
    if lora_dim > 0:
        actor = convert_to_lora(actor, pair, lora_dim, scenario.get("only_optimize_lora", False))
    critic = _value_model(pair.critic, scenario.get("critic_path"), dtype) if with_critic else None
    if grad_ckpt:
        for model in (actor, critic) if critic is not None else (actor,):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = build_causal_lm(pair.actor, scenario.get("actor_path")).to(dtype)
    reward = _value_model(pair.critic, scenario.get("critic_path"), dtype)
    actor_booster = Booster(plugin=make_plugin(kind, dtype))
    critic_booster = Booster(plugin=make_plugin(kind, dtype))
    actor, actor_optim, *_ = actor_booster.boost(actor, _optimizer(actor, kind))
    _settle_comm(device)
    critic_optim = None
    if critic is not None:
        critic, critic_optim, *_ = critic_booster.boost(critic, _optimizer(critic, kind))
        _settle_comm(device)
    ref, *_ = actor_booster.boost(ref)
    _settle_comm(device)
    reward, *_ = critic_booster.boost(reward)
    _settle_comm(device)
    ref.eval()
    reward.eval()
    return BoostedModels(actor, actor_optim, actor_booster, critic, critic_optim, critic_booster, ref, reward)


def run_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """Build the four boosted models and run one PPO iteration under ``rec``; returns losses and settings."""

    if device == "cpu" and scenario.strategy not in CPU_STRATEGIES:
        raise RuntimeError(f"colossalchat strategy {scenario.strategy!r} needs CUDA (LowLevelZero and Gemini "
                           f"assert a CUDA/NPU accelerator); on CPU: {', '.join(CPU_STRATEGIES)}")
    if scenario.algorithm != "ppo":  # ReMax, GRPO: colossalchat_methods.py
        from .colossalchat_methods import run_critic_free_iteration

        return run_critic_free_iteration(scenario, rec, device, rank, world_size)
    pair = get_pair(scenario.models)
    kind, grad_ckpt = STRATEGY_PLUGINS[scenario.strategy]
    gemini = kind.startswith("gemini")
    dtype = resolve_dtype(scenario, device, cpu_default=CPU_DTYPE)
    batch = scenario.get("batch_size", 2)
    prompt_len = scenario.get("prompt_len", pair.prompt_len)
    answer_len = scenario.get("answer_len", pair.answer_len)
    lora_dim = scenario.get("lora_dim", pair.lora_dim)
    torch.manual_seed(scenario.get("seed", 1234) + rank)
    hooks = FaultHooks(scenario, rank)

    with rec.phase("init"):
        m = boost_models(scenario, pair, kind, dtype, device, lora_dim, grad_ckpt, with_critic=True)
        actor, actor_optim, actor_booster = m.actor, m.actor_optim, m.actor_booster
        critic, critic_optim, critic_booster = m.critic, m.critic_optim, m.critic_booster
        ref, reward = m.ref, m.reward
        hooks.at("init")

    prompts, prompt_mask, pad_id = random_prompts(pair, batch, prompt_len, device)

    # ---- make_experience (coati/experience_maker/naive.py) -----------------------------------
    actor.eval()
    critic.eval()
    with torch.no_grad():
        with rec.phase("generate"):
            seq = actor.unwrap(unwrap_peft=False).generate(
                prompts, attention_mask=prompt_mask, max_new_tokens=answer_len, min_new_tokens=answer_len,
                do_sample=True, temperature=0.7, top_k=50, pad_token_id=pad_id, use_cache=True)
            hooks.at("generate")
        maybe_flush(scenario, rec, "generate")
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
            reward_score = reward(seq, attention_mask)[:, -1]
            hooks.at("infer_reward")
        maybe_flush(scenario, rec, "infer_reward")
        with rec.phase("infer_critic"):
            values = critic(seq, attention_mask)[:, :-1]
            start = prompt_len - 1
            action_mask = attention_mask[:, 1:]
            rewards = ppo.compute_rewards(start, log_probs, ref_log_probs, reward_score, action_mask)
            advantages, returns = ppo.get_advantages_and_returns(values, rewards, start)
            experience = [seq, attention_mask, log_probs, values, advantages, returns]
            rec.moved_to_host(experience)  # the experience buffer keeps it on CPU (cpu_offload)
            hooks.at("infer_critic")
        maybe_flush(scenario, rec, "infer_critic")

    # ---- learn (coati/trainer/ppo.py) --------------------------------------------------------
    if not gemini:  # offload_inference_models: Gemini places its own models
        ref.to("cpu")
        reward.to("cpu")
        rec.moved_to_host(_tensors(ref, reward))
    actor.train()
    critic.train()
    rec.moved_to_device(experience)  # the sampled experience goes back to the device
    with rec.phase("train_actor"):
        logits = actor(input_ids=seq, attention_mask=attention_mask)["logits"]
        new_log_probs = ppo.gather_log_probs(logits[:, :-1, :], seq[:, 1:])
        actor_loss = ppo.actor_loss_fn(new_log_probs[:, start:], log_probs[:, start:], advantages,
                                       action_mask[:, start:])
        actor_booster.backward(loss=actor_loss, optimizer=actor_optim)
        actor_optim.step()
        actor_optim.zero_grad()
        del logits, new_log_probs
        hooks.at("train_actor")
    maybe_flush(scenario, rec, "train_actor")
    with rec.phase("train_critic"):
        new_values = critic(seq, attention_mask)[:, :-1]
        critic_loss = ppo.critic_loss_fn(new_values[:, start:], values[:, start:], returns, action_mask[:, start:])
        critic_booster.backward(loss=critic_loss, optimizer=critic_optim)
        critic_optim.step()
        critic_optim.zero_grad()
        del new_values
        hooks.at("train_critic")
    maybe_flush(scenario, rec, "train_critic")
    return {
        "algorithm": "ppo", "critic_built": True,
        "actor_loss": float(actor_loss.detach().float()),
        "critic_loss": float(critic_loss.detach().float()),
        "dtype": str(dtype).replace("torch.", ""), "plugin": kind, "gradient_checkpointing": grad_ckpt,
        "offload_inference_models": not gemini, "lora_dim": lora_dim, "batch_size": batch,
        "prompt_len": prompt_len, "answer_len": answer_len, "sequence_shape": list(seq.shape),
    }
