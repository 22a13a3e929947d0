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

__all__ = ["STRATEGY_SETTINGS", "create_critic_model", "run_iteration"]


def run_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """Build the scenario's engines and run one iteration of its algorithm under ``rec``: Hydra-PPO for the
    ``hydra`` strategy, ReMax or GRPO for those algorithms, PPO otherwise. Returns losses and settings."""
    if scenario.strategy == "hydra":
        return run_hydra_iteration(scenario, rec, device, rank, world_size)
    if scenario.algorithm != "ppo":
        return run_critic_free_iteration(scenario, rec, device, rank, world_size)
    return run_ppo_iteration(scenario, rec, device, rank, world_size)
