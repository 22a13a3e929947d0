"""The DeepSpeed-Chat step-3 recipe: one iteration on real DeepSpeed, phase by phase, chosen by the scenario.

Follows microsoft/DeepSpeedExamples ``applications/DeepSpeed-Chat`` (facts: ``shared/reference/rlhf-frameworks.md``).
One small package, read bottom up; each module imports only those below it:

- ``configs.py``: what each memory strategy turns on (:data:`STRATEGY_SETTINGS`) and DeepSpeed-Chat's
  train/eval configs (``dschat/utils/ds_utils.py``);
- ``builders.py``: the models and engines (``rlhf_engine.py``: actor, reference, critic, reward; the
  critic/reward model of ``reward_model.py``; LoRA), and Hydra-PPO's one model with two adapters;
- ``ppo_iteration.py``: PPO (``ppo_trainer.py``: ``generate_experience``, ``train_rlhf``);
  ``critic_free_iteration.py``: ReMax and GRPO; ``hydra_iteration.py``: Hydra-PPO;
- this module: :func:`run_iteration`, the one entry (the rank worker and the fake-CUDA route call it).

The rewards, advantages and losses are the framework-free code of ``rlhf/ppo.py`` and ``rlhf/critic_free.py``,
shared with the ColossalChat recipe; the two recipes import nothing from each other.
"""

from __future__ import annotations

from ...memory.capture import Recorder
from ..scenario import Scenario
from .builders import create_critic_model
from .configs import STRATEGY_SETTINGS
from .critic_free_iteration import run_critic_free_iteration
from .hydra_iteration import run_hydra_iteration
from .ppo_iteration import run_ppo_iteration

__all__ = ["STRATEGY_SETTINGS", "create_critic_model", "record_deepspeed_empty_cache", "run_iteration"]

# The capture_description entry of a DeepSpeed-Chat CPU run: DeepSpeed's own empty_cache() calls.
DEEPSPEED_EMPTY_CACHE = "recorded as flushes where CUDA's accelerator calls torch.cuda.empty_cache()"


def record_deepspeed_empty_cache() -> str:
    """On the CPU route: make DeepSpeed's CPU accelerator's ``empty_cache()`` (a no-op,
    ``accelerator/cpu_accelerator.py``) do what its CUDA accelerator's does (``accelerator/cuda_accelerator.py``:
    ``torch.cuda.empty_cache()``), so the capture records the flushes DeepSpeed makes on a GPU: ZeRO's own
    calls and the Hybrid Engine's in ``eval()`` under ZeRO-3, each named ``empty_cache@<DeepSpeed file>:<line>``
    by the capture's interception (``Recorder.intercept_empty_cache``); without CUDA the call does nothing else.
    Returns the ``capture_description`` text."""
    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    def empty_cache(self: CPU_Accelerator) -> None:
        torch.cuda.empty_cache()  # looked up at call time: the capture's interception

    CPU_Accelerator.empty_cache = empty_cache
    return DEEPSPEED_EMPTY_CACHE


def run_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """Build the scenario's engines and run one iteration of its algorithm under ``rec``: Hydra-PPO for the
    ``hydra`` strategy, ReMax or GRPO for those algorithms, PPO otherwise. Returns losses and settings."""
    if scenario.strategy == "hydra":
        return run_hydra_iteration(scenario, rec, device, rank, world_size)
    if scenario.algorithm != "ppo":
        return run_critic_free_iteration(scenario, rec, device, rank, world_size)
    return run_ppo_iteration(scenario, rec, device, rank, world_size)
