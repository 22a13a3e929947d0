"""ColossalChat's plugins, models and boosters (coati's ``train_ppo.py``, ``coati/models/critic.py`` and
``reward_model.py``): the bottom of the recipe, shared by its PPO and critic-free iterations.

What each memory strategy turns on (:data:`STRATEGY_PLUGINS`), which of them run on a CPU
(:data:`CPU_STRATEGIES`: ``TorchDDPPlugin`` only; LowLevelZero and Gemini assert a CUDA/NPU accelerator), the
value model (base model + value head), and :func:`boost_models`, which builds and boosts one iteration's
models in ``train_ppo.py``'s order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..common import convert_to_lora
from ..models import ModelPair, ModelSpec, build_base_model, build_causal_lm, output_width
from ..scenario import Scenario

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


def module_tensors(*modules: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``modules`` (what moves when a module goes to CPU)."""
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

def check_device(scenario: Scenario, device: str) -> None:
    """Raise ``RuntimeError`` for a strategy that cannot run on ``device`` (on CPU: :data:`CPU_STRATEGIES`)."""
    if device == "cpu" and scenario.strategy not in CPU_STRATEGIES:
        raise RuntimeError(f"colossalchat strategy {scenario.strategy!r} needs CUDA (LowLevelZero and Gemini "
                           f"assert a CUDA/NPU accelerator); on CPU: {', '.join(CPU_STRATEGIES)}")
