"""DeepSpeed-Chat's settings: what each memory strategy turns on, and its DeepSpeed configs (``ds_utils.py``).

The bottom of the recipe: every engine builder and iteration above reads its ZeRO stage, offload and
gradient checkpointing from :data:`STRATEGY_SETTINGS` and its configs from :func:`get_train_ds_config` /
:func:`get_eval_ds_config`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..common import resolve_dtype
from ..models import get_pair
from ..scenario import Scenario

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
    # Santacroce et al. 2023 (Hydra-PPO): one backbone, two adapters: hydra_iteration.py.
    "hydra": (0, False, False),
}


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


def scenario_settings(scenario: Scenario, device: str) -> dict[str, Any]:
    """The model pair, dtype, batch (prompts per rank), prompt and answer lengths and LoRA rank the scenario
    asks for (the pair's defaults otherwise)."""
    pair = get_pair(scenario.models)
    return {"pair": pair, "dtype": resolve_dtype(scenario, device), "batch": scenario.get("batch_size", 2),
            "prompt_len": scenario.get("prompt_len", pair.prompt_len),
            "answer_len": scenario.get("answer_len", pair.answer_len),
            "lora_dim": scenario.get("lora_dim", pair.lora_dim)}
