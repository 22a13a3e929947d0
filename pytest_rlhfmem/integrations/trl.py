"""Phase marks for a Hugging Face ``Trainer`` and TRL's online RLHF trainers (``GRPOTrainer``, ``RLOOTrainer``), in
one line after the trainer is built:

    from pytest_rlhfmem.integrations.trl import mark_phases
    mark_phases(trainer)

The phases, rows of the per-phase table (phases nest; a name repeated over steps is one row):

- ``train_step``: ``Trainer.training_step``: one step's experience (TRL makes it inside), loss and backward;
- ``experience``: TRL's ``_generate_and_score_completions``: the rollout, the reward and the reference's and the
  old policy's log-probs (the inference phases of PPO-style RLHF);
- ``generate``: TRL's ``_generate``: sampling the completions (the generation phase);
- ``score_reward``: TRL's ``_calculate_rewards``: the reward functions or reward models;
- ``optimizer_step``: from ``on_pre_optimizer_step`` to ``on_optimizer_step`` (``TrainerCallback``): the optimizer's
  step, where its states appear at the first step.

Methods are wrapped on the instance, by name (TRL 1.x's ``trl/trainer/grpo_trainer.py`` and ``rloo_trainer.py``);
one the trainer lacks is skipped. Without an active capture (the script runs outside ``rlhfmem capture`` or the
``rlhfmem_command`` fixture) every mark is a no-op.
"""

from __future__ import annotations

import functools
from typing import Any

from ..record.api import begin_phase, end_phase, phase

METHOD_PHASES = {  # trainer method -> phase, outermost first
    "training_step": "train_step",
    "_generate_and_score_completions": "experience",
    "_generate": "generate",
    "_calculate_rewards": "score_reward",
}
OPTIMIZER_PHASE = "optimizer_step"


def mark_phases(trainer: Any) -> list[str]:
    """Mark ``trainer``'s phases (see the module docstring); returns the phases marked, in
    :data:`METHOD_PHASES` order, then ``optimizer_step``. Call once, before ``trainer.train()``. Raises
    ``TypeError`` for an object without ``add_callback`` (not a ``transformers.Trainer``)."""
    if not callable(getattr(trainer, "add_callback", None)):
        raise TypeError(f"mark_phases(trainer): a transformers.Trainer (or a TRL trainer) is needed, got "
                        f"{type(trainer).__name__}")
    marked = []
    for method, name in METHOD_PHASES.items():
        bound = getattr(trainer, method, None)
        if bound is None:
            continue
        setattr(trainer, method, _in_phase(bound, name))
        marked.append(name)
    trainer.add_callback(optimizer_step_callback())
    return [*marked, OPTIMIZER_PHASE]


def _in_phase(method: Any, name: str) -> Any:
    @functools.wraps(method)
    def marked(*args: Any, **kwargs: Any) -> Any:
        with phase(name):
            return method(*args, **kwargs)

    return marked


def optimizer_step_callback() -> Any:
    """A ``transformers.TrainerCallback`` whose ``on_pre_optimizer_step`` opens the phase ``optimizer_step`` and
    ``on_optimizer_step`` closes it (``rlhfmem.begin_phase`` / ``end_phase``)."""
    from transformers import TrainerCallback

    class OptimizerStepPhase(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            begin_phase(OPTIMIZER_PHASE)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            end_phase(OPTIMIZER_PHASE)

    return OptimizerStepPhase()
