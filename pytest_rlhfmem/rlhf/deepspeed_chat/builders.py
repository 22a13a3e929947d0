"""DeepSpeed-Chat's models and engines (``dschat/utils/model/model_utils.py``, ``reward_model.py``,
``module/lora.py``, ``dschat/rlhf/rlhf_engine.py``), and Hydra-PPO's one model with two adapters.

Above ``configs.py`` and below the iterations: each builder makes one model or engine the way its
strategy says (ZeRO-3 partitions a model as it is built; offloaded buffers are declared host-resident to
the recorder) and allocates nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ...record.recorder import Recorder
from ...placement import deepspeed_offloaded_tensors
from ..common import convert_to_lora
from ..models import ModelPair, ModelSpec, build_base_model, build_causal_lm, output_width
from ..scenario import Scenario
from .configs import STRATEGY_SETTINGS, per_engine

class RewardModel(torch.nn.Module):
    """DeepSpeed-Chat's critic/reward: a base transformer plus ``v_head = Linear(hidden, 1, bias=False)``."""

    def __init__(self, base: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.config = base.config
        self.rwtransformer = base
        self.v_head = torch.nn.Linear(hidden, 1, bias=False)

    def gradient_checkpointing_enable(self) -> None:
        self.rwtransformer.gradient_checkpointing_enable()

    def forward_value(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      return_value_only: bool = False, prompt_length: int = 0) -> Any:
        """values ``[B, T]``; or the score at each sequence's last token ``[B]`` (fixed-length answers
        have no padding after the prompt, so DeepSpeed-Chat's ``chosen_end_scores`` is the last value)."""
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask, use_cache=False)[0]
        values = self.v_head(hidden).squeeze(-1)
        if return_value_only:
            return values
        return {"values": values, "chosen_end_scores": values[:, -1]}


def create_hf_model(spec: ModelSpec, ds_config: dict | None, path: str | None, dtype: torch.dtype,
                    dropout: float | None = None):
    """``create_hf_model``: under ZeRO-3 the model is partitioned as it is built (HfDeepSpeedConfig);
    ``dropout`` is ``--actor_dropout`` (None keeps the config's, as DeepSpeed-Chat)."""
    from transformers.integrations import HfDeepSpeedConfig

    dschf = HfDeepSpeedConfig(ds_config) if ds_config and ds_config["zero_optimization"]["stage"] == 3 else None
    model = build_causal_lm(spec, path, dropout).to(dtype)
    del dschf
    return model


def create_critic_model(spec: ModelSpec, ds_config: dict | None, path: str | None, dtype: torch.dtype):
    """``create_critic_model``: base model (no LM head) wrapped as a :class:`RewardModel`."""
    from transformers.integrations import HfDeepSpeedConfig

    dschf = HfDeepSpeedConfig(ds_config) if ds_config and ds_config["zero_optimization"]["stage"] == 3 else None
    base = build_base_model(spec, path)
    del dschf
    return RewardModel(base, output_width(base.config)).to(dtype)


def make_optimizer(model: torch.nn.Module, offload: bool, device: str):
    """DeepSpeedCPUAdam under offload, FusedAdam on CUDA, torch AdamW on CPU; betas (0.9, 0.95)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=1e-5, betas=(0.9, 0.95))
    if device == "cuda":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, lr=1e-5, betas=(0.9, 0.95))
    return torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), foreach=False)


def lora_critic(critic: RewardModel, pair, dim: int) -> None:
    """``--critic_lora_dim`` with ``--only_optimize_lora``: LoRA on the critic's backbone (``rwtransformer``),
    every other backbone weight frozen; the value head stays trainable (DeepSpeed-Chat's
    ``only_optimize_lora_parameters`` keeps ``v_head``)."""
    critic.rwtransformer = convert_to_lora(critic.rwtransformer, pair, dim, only_optimize_lora=True)


def optimizer_state_summary(engine) -> dict:
    """What the engine's optimizer holds state for: ``state_bytes`` (bytes of its state tensors, e.g. Adam's
    two moments), ``trainable_elements`` / ``frozen_elements`` of the module, and ``frozen_with_state``:
    how many frozen parameters have optimizer state (0 under LoRA-only training)."""
    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)
    state = getattr(inner, "state", {}) or {}
    frozen = {id(p) for p in engine.module.parameters() if not p.requires_grad}
    return {
        "state_bytes": sum(v.numel() * v.element_size() for st in state.values() for v in st.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0),
        "trainable_elements": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
        "frozen_elements": sum(p.numel() for p in engine.module.parameters() if not p.requires_grad),
        "frozen_with_state": sum(1 for p in state if id(p) in frozen),
    }


def offloaded_tensors(engine, offload: bool) -> list[torch.Tensor]:
    """Tensors DeepSpeed keeps in host memory under ZeRO-3 CPU offload: fp32 partitions and their grads,
    optimizer states, the flat gradient buffer, parameter partitions (``ds_tensor``). The shared rule of
    ``rlhfmem.deepspeed_offload``: :func:`pytest_rlhfmem.placement.deepspeed_offloaded_tensors`."""
    return deepspeed_offloaded_tensors(engine, offload)


def init_actor_and_ref(scenario: Scenario, pair: ModelPair, rec: Recorder, train_cfg: dict, eval_cfg: dict,
                       dtype: torch.dtype, device: str, lora_dim: int, only_lora: bool,
                       actor_dropout: float | None = None) -> tuple[Any, Any]:
    """The actor's and the reference's DeepSpeed engines (``rlhf_engine.py``: ``_init_actor``, ``_init_ref``):
    the actor with LoRA when ``lora_dim > 0`` and its optimizer (DeepSpeedCPUAdam under offload), the
    reference on the eval config (stage 3 only if the actor is). ``actor_dropout``: the actor's only
    (``--actor_dropout``). Offloaded buffers are declared host-resident (``Recorder.host_resident``)."""
    import deepspeed

    stage, offload, _ = STRATEGY_SETTINGS[scenario.strategy]
    train_cfg, eval_cfg = per_engine(train_cfg, "actor"), per_engine(eval_cfg, "reference")
    actor = create_hf_model(pair.actor, train_cfg, scenario.get("actor_path"), dtype, actor_dropout)
    if lora_dim > 0:
        actor = convert_to_lora(actor, pair, lora_dim, only_lora)
    with refuse_inference_kernels(device, allowed=bool(scenario.get("hybrid_engine_kernels"))):
        actor_engine, *_ = deepspeed.initialize(model=actor, optimizer=make_optimizer(actor, offload, device),
                                                config=train_cfg)
    rec.host_resident(offloaded_tensors(actor_engine, offload))
    ref = create_hf_model(pair.actor, eval_cfg, scenario.get("actor_path"), dtype)
    ref_engine, *_ = deepspeed.initialize(model=ref, config=eval_cfg)
    rec.host_resident(offloaded_tensors(ref_engine, offload and stage == 3))
    return actor_engine, ref_engine


HYBRID_ENGINE_INFERENCE_KERNELS = (
    "DeepSpeed's Hybrid Engine is replacing {layer} with its inference kernels: DeepSpeed {deepspeed} does so with "
    "transformers {transformers}, whose OPT decoder layer's forward takes neither cache_position nor "
    "past_key_values (5.24 renamed it cache); {route}. Install the pinned dependency set (constraints/deepspeed.txt: "
    "transformers 5.23, whose layer DeepSpeed keeps native)")
_ROUTES = {
    "cpu": "DeepSpeed's CPU accelerator has no such kernels",
    "cuda": "the budgets were recorded with the native layer, and these kernels (the transformer_inference op, "
            "JIT-built) run other code and allocate other memory",
}


@contextlib.contextmanager
def refuse_inference_kernels(device: str, allowed: bool = False) -> Iterator[None]:
    """While DeepSpeed builds the actor's engine: the Hybrid Engine injecting a layer
    (``DeepSpeedHybridEngine.new_inference_container``, ``runtime/hybrid_engine.py``, reached from
    ``populate_all_inference_policies`` when a newer transformers changes OPT's decoder layer) raises
    ``NotImplementedError``, one line naming the layer, the installed DeepSpeed and transformers versions and
    ``constraints/deepspeed.txt``, on every route (``device`` ``cpu`` or ``cuda``): on CPU instead of
    DeepSpeed's ``This op had not been implemented on CPU backend`` from deep inside the injection; on a GPU
    instead of an iteration that runs other kernels than its budgets assume. ``allowed``: the fake-CUDA route's
    ``hybrid_engine_kernels`` override, which injects them on purpose (``fakecuda/inference_kernels.py``)."""
    if allowed:
        yield
        return
    import deepspeed
    import transformers
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    original = DeepSpeedHybridEngine.new_inference_container

    def refuse(self: Any, orig_layer: Any, policy_cls: Any, layer_id: int) -> Any:
        raise NotImplementedError(HYBRID_ENGINE_INFERENCE_KERNELS.format(
            layer=type(orig_layer).__name__, deepspeed=deepspeed.__version__, transformers=transformers.__version__,
            route=_ROUTES.get(device, _ROUTES["cuda"])))

    DeepSpeedHybridEngine.new_inference_container = refuse
    try:
        yield
    finally:
        DeepSpeedHybridEngine.new_inference_container = original


EMA_BETA = 0.992  # dschat/utils/utils.py: moving_average(model, model_ema, beta=0.992, ...)


def init_ema(scenario: Scenario, pair: ModelPair, rec: Recorder, eval_cfg: dict, dtype: torch.dtype,
             lora_dim: int) -> Any:
    """The actor's moving-average copy (``rlhf_engine.py``: ``_init_ema``, with ``--enable_ema``): the actor's
    architecture on the reference's eval config (stage 3 only if the actor is; offloaded as the reference
    is), LoRA of the actor's rank converted (DeepSpeed-Chat's ``convert_linear_layer_to_lora``, no
    ``only_optimize_lora``), an engine without optimizer: a fifth model resident on the device."""
    import deepspeed

    stage, offload, _ = STRATEGY_SETTINGS[scenario.strategy]
    cfg = per_engine(eval_cfg, "ema")
    ema = create_hf_model(pair.actor, cfg, scenario.get("actor_path"), dtype)
    if lora_dim > 0:
        ema = convert_to_lora(ema, pair, lora_dim, only_optimize_lora=False)
    ema_engine, *_ = deepspeed.initialize(model=ema, config=cfg)
    rec.host_resident(offloaded_tensors(ema_engine, offload and stage == 3))
    return ema_engine


def moving_average(model: Any, model_ema: Any, zero_stage: int, beta: float = EMA_BETA) -> None:
    """``dschat/utils/utils.py: moving_average``, called by step 3's ``main.py`` after every ``train_rlhf`` when
    ``--enable_ema``: for each (actor, EMA) parameter pair, ZeRO-3 gathers the partitioned ones
    (``GatheredParameters``), then ``param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))``:
    one parameter-sized ``lerp`` result at a time, freed after the copy."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    with torch.no_grad():
        for param, param_ema in zip(model.parameters(), model_ema.parameters()):
            fetch = [p for p in (param, param_ema)
                     if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE] if zero_stage == 3 else []
            with deepspeed.zero.GatheredParameters(fetch, enabled=len(fetch) > 0):
                param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))


def init_reward(scenario: Scenario, pair: ModelPair, rec: Recorder, reward_cfg: dict, dtype: torch.dtype) -> Any:
    """The reward model's engine (``rlhf_engine.py``: ``_init_reward``): the critic's architecture on the
    eval config, stage 3 only if the critic is."""
    import deepspeed

    stage, offload, _ = STRATEGY_SETTINGS[scenario.strategy]
    reward_cfg = per_engine(reward_cfg, "reward")
    reward = create_critic_model(pair.critic, reward_cfg, scenario.get("critic_path"), dtype)
    reward_engine, *_ = deepspeed.initialize(model=reward, config=reward_cfg)
    rec.host_resident(offloaded_tensors(reward_engine, offload and stage == 3))
    return reward_engine


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


def adapter_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Both adapters' weights and head copies, whatever ``set_adapter`` left trainable."""
    return [p for n, p in model.named_parameters()
            if "lora_" in n or ("modules_to_save" in n and (".actor." in n or ".critic." in n))]
