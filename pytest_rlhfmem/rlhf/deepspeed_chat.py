"""The DeepSpeed-Chat step-3 recipe: one PPO iteration on real DeepSpeed, phase by phase.

Follows microsoft/DeepSpeedExamples ``applications/DeepSpeed-Chat``: ``dschat/rlhf/rlhf_engine.py``
(engines and their ZeRO stages), ``dschat/utils/ds_utils.py`` (train/eval configs),
``dschat/utils/model/reward_model.py`` (critic = base model + v_head), ``dschat/utils/module/lora.py``
(LoRA on every Linear under ``decoder.layers.``; here through peft) and ``dschat/rlhf/ppo_trainer.py``
(``generate_experience`` and ``train_rlhf``). Facts: ``shared/reference/rlhf-frameworks.md``.

Reads top to bottom: build the four engines (phase ``init``), then ``generate``, the four inference
forwards, and the actor and critic updates. The recorder marks each phase; the flush policy empties
the cache where it says.
"""

from __future__ import annotations

from typing import Any

import torch

from ..memory.capture import Recorder
from ..placement import deepspeed_offloaded_tensors
from . import ppo
from .common import FaultHooks, convert_to_lora, maybe_flush, random_prompts, resolve_dtype
from .models import ModelPair, ModelSpec, build_base_model, build_causal_lm, get_pair, output_width
from .scenario import Scenario

# strategy -> (actor/critic ZeRO stage, CPU offload, gradient checkpointing)
STRATEGY_SETTINGS: dict[str, tuple[int, bool, bool]] = {
    "none": (0, False, False),
    "zero1": (1, False, False),
    "zero2": (2, False, False),
    "zero3": (3, False, False),
    "zero3-offload": (3, True, False),
    "grad-ckpt": (0, False, True),
    "all": (3, True, True),
    # Ren et al. 2021 (ZeRO-Offload, USENIX ATC): ZeRO-2 with fp32 states, gradients and the Adam step on the
    # host (DeepSpeedCPUAdam); DeepSpeed-Chat's --offload with --actor/critic_zero_stage 2.
    "zero2-offload": (2, True, False),
    # Santacroce et al. 2023 ("Efficient RLHF: Reducing the Memory Usage of PPO", LoRA-PPO): actor and critic
    # train only LoRA weights; DeepSpeed-Chat's --actor_lora_dim/--critic_lora_dim with --only_optimize_lora.
    "lora": (0, False, False),
    # Santacroce et al. 2023 (Hydra-PPO): one backbone, two adapters: deepspeed_chat_methods.py.
    "hydra": (0, False, False),
}


# ---------------------------------------------------------------------------------------------------
# DeepSpeed configs (dschat/utils/ds_utils.py)
# ---------------------------------------------------------------------------------------------------

def get_train_ds_config(stage: int, offload: bool, dtype: torch.dtype, micro_batch: int, world_size: int,
                        bucket_elements: int | None) -> dict:
    """``get_train_ds_config``: ZeRO stage, offload of params and optimizer, fp16/bf16, clipping 1.0."""
    device = "cpu" if offload else "none"
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    if bucket_elements is not None:  # tiny pairs only: see models.py
        zero.update(reduce_bucket_size=bucket_elements, allgather_bucket_size=bucket_elements,
                    stage3_prefetch_bucket_size=bucket_elements, stage3_max_live_parameters=bucket_elements,
                    stage3_max_reuse_distance=bucket_elements)
    cfg: dict[str, Any] = {
        "train_batch_size": micro_batch * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    cfg.update(_precision(dtype))
    return cfg


def get_eval_ds_config(stage: int, offload: bool, dtype: torch.dtype, micro_batch: int, world_size: int,
                       bucket_elements: int | None) -> dict:
    """``get_eval_ds_config``: inference engines; offload_param only acts at stage 3."""
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                            "offload_param": {"device": "cpu" if offload else "none"},
                            "memory_efficient_linear": False}
    if bucket_elements is not None:
        zero.update(stage3_prefetch_bucket_size=bucket_elements, stage3_max_live_parameters=bucket_elements,
                    stage3_max_reuse_distance=bucket_elements)
    cfg: dict[str, Any] = {"train_batch_size": micro_batch * world_size,
                           "train_micro_batch_size_per_gpu": micro_batch, "steps_per_print": 10**9,
                           "zero_optimization": zero, "wall_clock_breakdown": False}
    cfg.update(_precision(dtype))
    return cfg


def _precision(dtype: torch.dtype) -> dict:
    """DeepSpeed-Chat's precision block (``ds_utils.py``). One deviation, for fp16: the dynamic loss scale
    starts at 2**0 instead of DeepSpeed's 2**16, so the ONE measured iteration takes its optimizer step (and
    allocates the optimizer states) as every steady-state iteration of a real run does; at 2**16 a fresh
    run's first steps overflow and are skipped, and the iteration would show no optimizer state at all."""
    if dtype == torch.float16:
        return {"fp16": {"enabled": True, "loss_scale_window": 100, "initial_scale_power": 0}}
    if dtype == torch.bfloat16:
        return {"bf16": {"enabled": True}}
    return {}


# ---------------------------------------------------------------------------------------------------
# Models (dschat/utils/model/model_utils.py, reward_model.py, module/lora.py)
# ---------------------------------------------------------------------------------------------------

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


def create_hf_model(spec: ModelSpec, ds_config: dict | None, path: str | None, dtype: torch.dtype):
    """``create_hf_model``: under ZeRO-3 the model is partitioned as it is built (HfDeepSpeedConfig)."""
    from transformers.integrations import HfDeepSpeedConfig

    dschf = HfDeepSpeedConfig(ds_config) if ds_config and ds_config["zero_optimization"]["stage"] == 3 else None
    model = build_causal_lm(spec, path).to(dtype)
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


# ---------------------------------------------------------------------------------------------------
# One iteration
# ---------------------------------------------------------------------------------------------------

def init_actor_and_ref(scenario: Scenario, pair: ModelPair, rec: Recorder, train_cfg: dict, eval_cfg: dict,
                       dtype: torch.dtype, device: str, lora_dim: int, only_lora: bool) -> tuple[Any, Any]:
    """The actor's and the reference's DeepSpeed engines (``rlhf_engine.py``: ``_init_actor``, ``_init_ref``):
    the actor with LoRA when ``lora_dim > 0`` and its optimizer (DeepSpeedCPUAdam under offload), the
    reference on the eval config (stage 3 only if the actor is). Offloaded buffers are declared
    host-resident (``Recorder.host_resident``)."""
    import deepspeed

    stage, offload, _ = STRATEGY_SETTINGS[scenario.strategy]
    actor = create_hf_model(pair.actor, train_cfg, scenario.get("actor_path"), dtype)
    if lora_dim > 0:
        actor = convert_to_lora(actor, pair, lora_dim, only_lora)
    actor_engine, *_ = deepspeed.initialize(model=actor, optimizer=make_optimizer(actor, offload, device),
                                            config=train_cfg)
    rec.host_resident(offloaded_tensors(actor_engine, offload))
    ref = create_hf_model(pair.actor, eval_cfg, scenario.get("actor_path"), dtype)
    ref_engine, *_ = deepspeed.initialize(model=ref, config=eval_cfg)
    rec.host_resident(offloaded_tensors(ref_engine, offload and stage == 3))
    return actor_engine, ref_engine


def init_reward(scenario: Scenario, pair: ModelPair, rec: Recorder, reward_cfg: dict, dtype: torch.dtype) -> Any:
    """The reward model's engine (``rlhf_engine.py``: ``_init_reward``): the critic's architecture on the
    eval config, stage 3 only if the critic is."""
    import deepspeed

    stage, offload, _ = STRATEGY_SETTINGS[scenario.strategy]
    reward = create_critic_model(pair.critic, reward_cfg, scenario.get("critic_path"), dtype)
    reward_engine, *_ = deepspeed.initialize(model=reward, config=reward_cfg)
    rec.host_resident(offloaded_tensors(reward_engine, offload and stage == 3))
    return reward_engine


def run_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """Build the four engines and run one PPO iteration under ``rec``; returns losses and settings.
    ReMax, GRPO and Hydra-PPO run in :mod:`.deepspeed_chat_methods`."""
    import deepspeed

    if scenario.algorithm != "ppo" or scenario.strategy == "hydra":
        from .deepspeed_chat_methods import run_method_iteration

        return run_method_iteration(scenario, rec, device, rank, world_size)
    pair = get_pair(scenario.models)
    stage, offload, grad_ckpt = STRATEGY_SETTINGS[scenario.strategy]
    dtype = resolve_dtype(scenario, device)
    batch = scenario.get("batch_size", 2)
    prompt_len = scenario.get("prompt_len", pair.prompt_len)
    answer_len = scenario.get("answer_len", pair.answer_len)
    lora_dim = scenario.get("lora_dim", pair.lora_dim)
    lora_only = scenario.strategy == "lora"  # LoRA-PPO: LoRA on actor and critic, nothing else trains
    only_lora = scenario.get("only_optimize_lora", False) or lora_only
    buckets = pair.bucket_elements
    ref_stage = 3 if stage == 3 else 0  # rlhf_engine.py: reference follows the actor's stage 3
    reward_stage = 3 if stage == 3 else 0  # reward follows the critic's stage 3
    train_cfg = get_train_ds_config(stage, offload, dtype, batch, world_size, buckets)
    eval_cfg = get_eval_ds_config(ref_stage, offload, dtype, batch, world_size, buckets)
    torch.manual_seed(scenario.get("seed", 1234) + rank)
    hooks = FaultHooks(scenario, rank)

    with rec.phase("init"):
        actor_engine, ref_engine = init_actor_and_ref(scenario, pair, rec, train_cfg, eval_cfg, dtype, device,
                                                      lora_dim, only_lora)
        # critic (_init_critic): gradient checkpointing from the start
        critic = create_critic_model(pair.critic, train_cfg, scenario.get("critic_path"), dtype)
        if lora_only:
            lora_critic(critic, pair, lora_dim)
        if grad_ckpt:
            critic.gradient_checkpointing_enable()
        critic_engine, *_ = deepspeed.initialize(model=critic, optimizer=make_optimizer(critic, offload, device),
                                                 config=train_cfg)
        rec.host_resident(offloaded_tensors(critic_engine, offload))
        reward_engine = init_reward(scenario, pair, rec,
                                    get_eval_ds_config(reward_stage, offload, dtype, batch, world_size, buckets),
                                    dtype)
        hooks.at("init")

    prompts, prompt_mask, pad_id = random_prompts(pair, batch, prompt_len, device)  # left-padded

    # ---- generate_experience (ppo_trainer.py) -------------------------------------------------
    actor_engine.eval()
    with rec.phase("generate"):
        with torch.no_grad():
            seq = actor_engine.module.generate(
                prompts, attention_mask=prompt_mask, max_new_tokens=answer_len, min_new_tokens=answer_len,
                do_sample=True, pad_token_id=pad_id, synced_gpus=stage == 3, use_cache=True)
        hooks.at("generate")
    maybe_flush(scenario, rec, "generate")
    attention_mask = torch.cat([prompt_mask, torch.ones(batch, seq.shape[1] - prompt_len, dtype=prompt_mask.dtype,
                                                        device=device)], dim=1)
    with torch.no_grad():
        with rec.phase("infer_actor"):
            output = actor_engine(seq, attention_mask=attention_mask)
            hooks.at("infer_actor")
        maybe_flush(scenario, rec, "infer_actor")
        with rec.phase("infer_reference"):
            output_ref = ref_engine(seq, attention_mask=attention_mask)
            hooks.at("infer_reference")
        maybe_flush(scenario, rec, "infer_reference")
        with rec.phase("infer_reward"):
            reward_score = reward_engine.module.forward_value(seq, attention_mask,
                                                              prompt_length=prompt_len)["chosen_end_scores"]
            hooks.at("infer_reward")
        maybe_flush(scenario, rec, "infer_reward")
        with rec.phase("infer_critic"):
            values = critic_engine.module.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
            log_probs = ppo.gather_log_probs(output.logits[:, :-1, :], seq[:, 1:])
            ref_log_probs = ppo.gather_log_probs(output_ref.logits[:, :-1, :], seq[:, 1:])
            del output, output_ref
            hooks.at("infer_critic")
        maybe_flush(scenario, rec, "infer_critic")

    # ---- train_rlhf (ppo_trainer.py) ----------------------------------------------------------
    actor_engine.train()
    critic_engine.train()
    if grad_ckpt:
        actor_engine.module.gradient_checkpointing_enable()  # only for the update, as DeepSpeed-Chat
    start = prompt_len - 1
    action_mask = attention_mask[:, 1:]
    with rec.phase("train_actor"):
        with torch.no_grad():
            old_rewards = ppo.compute_rewards(start, log_probs, ref_log_probs, reward_score, action_mask)
            advantages, returns = ppo.get_advantages_and_returns(values, old_rewards, start)
        actor_logits = actor_engine(seq, attention_mask=attention_mask, use_cache=False).logits
        actor_log_prob = ppo.gather_log_probs(actor_logits[:, :-1, :], seq[:, 1:])
        actor_loss = ppo.actor_loss_fn(actor_log_prob[:, start:], log_probs[:, start:], advantages,
                                       action_mask[:, start:])
        actor_engine.backward(actor_loss)
        actor_engine.step()
        del actor_logits, actor_log_prob
        rec.host_resident(offloaded_tensors(actor_engine, offload))  # optimizer states appear at step 1
        hooks.at("train_actor")
    maybe_flush(scenario, rec, "train_actor")
    with rec.phase("train_critic"):
        value = critic_engine.module.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
        critic_loss = ppo.critic_loss_fn(value[:, start:], values[:, start:], returns, action_mask[:, start:])
        critic_engine.backward(critic_loss)
        critic_engine.step()
        del value
        rec.host_resident(offloaded_tensors(critic_engine, offload))
        hooks.at("train_critic")
    maybe_flush(scenario, rec, "train_critic")
    if grad_ckpt:
        actor_engine.module.gradient_checkpointing_disable()
    states = {"actor": optimizer_state_summary(actor_engine), "critic": optimizer_state_summary(critic_engine)}
    return {
        "algorithm": "ppo", "optimizer_states": states,
        "actor_loss": float(actor_loss.detach().float()),
        "critic_loss": float(critic_loss.detach().float()),
        "dtype": str(dtype).replace("torch.", ""),
        "zero_stage": stage, "reference_stage": ref_stage, "reward_stage": reward_stage,
        "offload": offload, "gradient_checkpointing": grad_ckpt, "lora_dim": lora_dim,
        "batch_size": batch, "prompt_len": prompt_len, "answer_len": answer_len,
        "bucket_elements": buckets, "sequence_shape": list(seq.shape),
    }
