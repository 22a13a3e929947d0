"""DeepSpeed-Chat's settings: what each memory strategy turns on, and its DeepSpeed configs (``ds_utils.py``).

The bottom of the recipe: every engine builder and iteration above reads its ZeRO stage, offload and
gradient checkpointing from :data:`STRATEGY_SETTINGS` and its configs from :func:`get_train_ds_config` /
:func:`get_eval_ds_config`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

import torch

from ..common import resolve_dtype
from ..models import get_pair
from ..scenario import Scenario

# strategy -> (actor/critic ZeRO stage, offload (False, True = to the host, "nvme"), gradient checkpointing)
STRATEGY_SETTINGS: dict[str, tuple[int, bool | str, bool]] = {
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
    # Rajbhandari et al. 2021 (ZeRO-Infinity): ZeRO-3 with parameters and optimizer state swapped to NVMe through
    # DeepSpeed's async I/O (libaio), pinned staging buffers in host memory; MemAscend's baseline.
    "zero3-nvme": (3, "nvme", False),
    # Santacroce et al. 2023 ("Efficient RLHF: Reducing the Memory Usage of PPO", LoRA-PPO): actor and critic
    # train only LoRA weights; DeepSpeed-Chat's --actor_lora_dim/--critic_lora_dim with --only_optimize_lora.
    "lora": (0, False, False),
    # Santacroce et al. 2023 (Hydra-PPO): one backbone, two adapters: hydra_iteration.py.
    "hydra": (0, False, False),
}


NVME_BUFFER_COUNT = 5  # DeepSpeed's default offload_param buffer_count
AIO = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True}


def nvme_dir() -> str:
    """This process's NVMe swap directory (``$RLHFMEM_NVME_DIR``, else the temp dir): created on first use,
    removed at exit."""
    global _NVME_DIR
    if _NVME_DIR is None:
        base = os.environ.get("RLHFMEM_NVME_DIR") or None
        _NVME_DIR = tempfile.mkdtemp(prefix=f"rlhfmem-nvme-{os.getpid()}-", dir=base)
        atexit.register(shutil.rmtree, _NVME_DIR, True)
    return _NVME_DIR


_NVME_DIR: str | None = None


def per_engine(cfg: dict, engine: str) -> dict:
    """``cfg`` for one engine: under NVMe offload a copy whose swap path is the engine's own subdirectory.
    DeepSpeed's swappers name their files by rank and parameter id under ``nvme_path/zero_stage_3/`` only, so
    two engines of one process (actor and critic share the train config) would overwrite each other's swap
    files; otherwise ``cfg`` itself."""
    zero = cfg.get("zero_optimization", {})
    if zero.get("offload_param", {}).get("device") != "nvme":
        return cfg
    import copy

    from .swap_buffers import track

    track()  # the engine's swappers (built in zero.Init and initialize) count in the host meter's staging figures
    out = copy.deepcopy(cfg)
    path = os.path.join(nvme_dir(), engine)
    os.makedirs(path, exist_ok=True)
    for key in ("offload_param", "offload_optimizer"):
        if out["zero_optimization"].get(key, {}).get("device") == "nvme":
            out["zero_optimization"][key]["nvme_path"] = path
    return out


def _offload_blocks(offload: bool | str, buffer_elements: int | None) -> tuple[dict, dict]:
    """(``offload_param``, ``offload_optimizer``): none, to the host (``cpu``), or swapped to NVMe with pinned
    staging buffers of ``buffer_elements`` elements each (DeepSpeed requires the largest parameter to fit)."""
    if offload == "nvme":
        path = nvme_dir()
        # max_in_cpu 0: no parameter kept in host memory besides the staging buffers (DeepSpeed's default, 1e9
        # elements, would hold a whole small model on the host and swap nothing)
        return ({"device": "nvme", "nvme_path": path, "buffer_count": NVME_BUFFER_COUNT,
                 "buffer_size": int(buffer_elements or 10**8), "max_in_cpu": 0},
                {"device": "nvme", "nvme_path": path, "buffer_count": 4})
    device = "cpu" if offload else "none"
    return {"device": device}, {"device": device}


def get_train_ds_config(stage: int, offload: bool | str, dtype: torch.dtype, micro_batch: int, world_size: int,
                        bucket_elements: int | None, nvme_buffer_elements: int | None = None,
                        hybrid_engine_max_out_tokens: int | None = None) -> dict:
    """``get_train_ds_config``: ZeRO stage, offload of params and optimizer (host or NVMe), fp16/bf16,
    clipping 1.0; with ``hybrid_engine_max_out_tokens`` (prompt + answer tokens), the ``hybrid_engine`` block
    of :func:`hybrid_engine_block` (the actor's config under ``--enable_hybrid_engine``)."""
    offload_param, offload_optimizer = _offload_blocks(offload, nvme_buffer_elements)
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": offload_param,
        "offload_optimizer": offload_optimizer,
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
    if offload == "nvme":
        cfg["aio"] = dict(AIO)
    if hybrid_engine_max_out_tokens is not None:
        cfg["hybrid_engine"] = hybrid_engine_block(hybrid_engine_max_out_tokens)
    cfg.update(_precision(dtype))
    return cfg


def hybrid_engine_block(max_out_tokens: int) -> dict:
    """DeepSpeed-Chat's ``hybrid_engine`` config block with its step-3 ``main.py`` defaults
    (``ds_utils.get_train_ds_config``; ``--inference_tp_size 1``, ``--release_inference_cache`` off,
    ``--unpin_actor_parameters`` off so ``pin_parameters`` is on, ``--tp_gather_partition_size 8``);
    ``max_out_tokens`` is ``max_prompt_seq_len + max_answer_seq_len``.

    What DeepSpeed 0.19.8 does with it (``runtime/hybrid_engine.py``): the actor becomes a
    ``DeepSpeedHybridEngine``, which broadcasts the RNG state at init and, under ZeRO-3, calls
    ``gc.collect()`` and ``empty_cache()`` in every ``eval()``. Its inference kernels replace no OPT layer with
    transformers 5 (``populate_all_inference_policies`` skips OPT decoders whose ``forward`` takes
    ``past_key_values``: "The injected OPT layer only implements the legacy tuple-cache contract"), so
    generation is Hugging Face's own, and no inference workspace or KV cache is allocated."""
    return {"enabled": True, "max_out_tokens": max_out_tokens, "inference_tp_size": 1,
            "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8}


# What DeepSpeed-Chat's own step-3 script for a pair runs, where it differs from the recipe's defaults (batch 2,
# no Hybrid Engine, no EMA, the model config's dropout: the study's text, Sec. 2). opt-1.3b:
# ``training_scripts/opt/single_node/run_1.3b.sh`` (DeepSpeedExamples 1c6f9895: ``--per_device_generation_batch_size
# 4 --per_device_training_batch_size 4 --actor_dropout 0.0 --enable_hybrid_engine --enable_ema``; it passes no
# LoRA flag, the pair keeps the study's LoRA dim 128). A scenario's own override wins; the earlier behaviour is
# selected by overriding these, and the override is then part of the scenario id.
STUDY_SCRIPT_SETTINGS: dict[str, dict[str, Any]] = {
    "opt-1.3b": {"batch_size": 4, "hybrid_engine": True, "ema": True, "actor_dropout": 0.0},
}
RECIPE_DEFAULTS: dict[str, Any] = {"batch_size": 2, "hybrid_engine": False, "ema": False, "actor_dropout": None,
                                   "hybrid_engine_kernels": False}


def ppo_setting(scenario: Scenario, key: str) -> Any:
    """``key`` (one of :data:`RECIPE_DEFAULTS`) for a DeepSpeed-Chat PPO scenario: its override, else what
    the pair's step-3 script runs (:data:`STUDY_SCRIPT_SETTINGS`), else the recipe's default."""
    return scenario.get(key, STUDY_SCRIPT_SETTINGS.get(scenario.models, {}).get(key, RECIPE_DEFAULTS[key]))


def get_eval_ds_config(stage: int, offload: bool | str, dtype: torch.dtype, micro_batch: int, world_size: int,
                       bucket_elements: int | None, nvme_buffer_elements: int | None = None) -> dict:
    """``get_eval_ds_config``: inference engines; offload_param only acts at stage 3."""
    offload_param = _offload_blocks(offload, nvme_buffer_elements)[0] if stage == 3 else {"device": "none"}
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                            "offload_param": offload_param if offload else {"device": "none"},
                            "memory_efficient_linear": False}
    if bucket_elements is not None:
        zero.update(stage3_prefetch_bucket_size=bucket_elements, stage3_max_live_parameters=bucket_elements,
                    stage3_max_reuse_distance=bucket_elements)
    cfg: dict[str, Any] = {"train_batch_size": micro_batch * world_size,
                           "train_micro_batch_size_per_gpu": micro_batch, "steps_per_print": 10**9,
                           "zero_optimization": zero, "wall_clock_breakdown": False}
    if offload_param.get("device") == "nvme":
        cfg["aio"] = dict(AIO)
    cfg.update(_precision(dtype))
    return cfg


def largest_parameter(pair) -> int:  # noqa: ANN001 - a models.ModelPair
    """Elements of the pair's largest parameter (embeddings, positions or an FFN matrix): the NVMe staging
    buffer must hold it."""
    out = 0
    for spec in (pair.actor, pair.critic):
        c = spec.config
        hidden = c.get("hidden_size", 0)
        out = max(out, c.get("vocab_size", 0) * max(hidden, c.get("word_embed_proj_dim", 0)),
                  (c.get("max_position_embeddings", 0) + 2) * hidden, hidden * c.get("ffn_dim", 0))
    return out


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
    """The model pair, dtype, batch (prompts per rank: :func:`ppo_setting`'s, so a method runs the batch PPO
    runs beside it), prompt and answer lengths and LoRA rank the scenario asks for (the pair's defaults
    otherwise)."""
    pair = get_pair(scenario.models)
    return {"pair": pair, "dtype": resolve_dtype(scenario, device), "batch": ppo_setting(scenario, "batch_size"),
            "prompt_len": scenario.get("prompt_len", pair.prompt_len),
            "answer_len": scenario.get("answer_len", pair.answer_len),
            "lora_dim": scenario.get("lora_dim", pair.lora_dim)}
