"""The ColossalChat (coati V2) recipe: one iteration on ``colossalai.booster``, phase by phase, chosen by the scenario.

Follows hpcaitech/ColossalAI ``applications/ColossalChat`` (facts: ``shared/reference/rlhf-frameworks.md``).
One small package, read bottom up; each module imports only those below it:

- ``builders.py``: what each memory strategy turns on (:data:`STRATEGY_PLUGINS`, :data:`CPU_STRATEGIES`), the
  booster plugins, the value model, and the boosted models of one iteration (``train_ppo.py``'s order);
- ``experience.py``: the experience both iterations make the same way (coati's experience maker up to the
  reward model: phases ``generate``, ``generate_greedy``, ``infer_actor``, ``infer_reference``), a ``Rollout``;
- ``ppo_iteration.py``: PPO (coati's experience maker, experience buffer and ``PPOTrainer``);
  ``critic_free_iteration.py``: ReMax and GRPO;
- this module: :func:`run_iteration`, the one entry (the rank worker calls it).

Every phase is a step of ``common.PhaseSteps`` (``with steps("infer_actor"):``): the recorder marks it, the fault
hook fires at its end, the flush policy empties the cache after it.

The rewards, advantages and losses are the framework-free code of ``rlhf/ppo.py`` and ``rlhf/critic_free.py``,
shared with the DeepSpeed-Chat recipe; the two recipes import nothing from each other.
"""

from __future__ import annotations

from ...record.recorder import Recorder
from ..scenario import Scenario
from .builders import CPU_STRATEGIES, STRATEGY_PLUGINS, check_device
from .critic_free_iteration import run_critic_free_iteration
from .ppo_iteration import run_ppo_iteration

__all__ = ["CPU_STRATEGIES", "STRATEGY_PLUGINS", "run_iteration"]


def run_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """Build the scenario's boosted models and run one iteration of its algorithm under ``rec``: ReMax or GRPO
    for those algorithms, PPO otherwise. Raises ``RuntimeError`` for a strategy the device cannot run."""
    check_device(scenario, device)
    if scenario.algorithm != "ppo":
        return run_critic_free_iteration(scenario, rec, device, rank, world_size)
    return run_ppo_iteration(scenario, rec, device, rank, world_size)
