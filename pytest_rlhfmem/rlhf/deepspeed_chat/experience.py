"""The experience every DeepSpeed-Chat iteration makes the same way: the actor's answers and the reward model's scores.

``dschat/rlhf/ppo_trainer.py``: ``_generate_sequence`` (the actor's ``generate``, ``synced_gpus`` under ZeRO-3;
here every answer is ``answer_len`` tokens long: ``min_new_tokens = max_new_tokens``) and, in
``generate_experience``, the reward model's ``forward_value(...)["chosen_end_scores"]``. ReMax's baseline
(``remax_trainer.py``) is the same ``generate`` with ``do_sample=False``.

The PPO (``ppo_iteration.py``), critic-free (``critic_free_iteration.py``) and Hydra-PPO (``hydra_iteration.py``)
iterations call these. The log-prob forwards stay in each iteration, because they differ in what they keep:
PPO holds the actor's and the reference's full outputs until the critic's forward, as ``generate_experience``
does; ReMax, GRPO and Hydra-PPO reduce each forward to its log-probs at once.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..common import PhaseSteps


def generate(steps: PhaseSteps, model: Any, prompts: torch.Tensor, prompt_mask: torch.Tensor, pad_id: int,
             answer_len: int, *, greedy: bool = False, rollout: Any = None,
             **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Phase ``generate``: ``model.generate`` samples an answer to each prompt, without gradients; with ``greedy``
    then phase ``generate_greedy``: ReMax's baseline, the argmax answer to each prompt. ``prompts`` and
    ``prompt_mask`` are ``[b, prompt_len]`` (left-padded: ``common.random_prompts``); ``options`` go to both
    ``generate`` calls (the engines' ``synced_gpus``). ``rollout``: a colocated engine's stand-in
    (``rollout.EngineStandIn``): it wakes up inside ``generate`` and the sampling (with ``greedy`` the argmax
    answers too) is its work (what the actor's ``generate`` allocates and frees there leaves the trace), then it
    sleeps, inside the last generation's phase. Returns the sampled sequences and the
    greedy ones (None without ``greedy``), each ``[b, prompt_len + answer_len]``."""
    kwargs = {"attention_mask": prompt_mask, "max_new_tokens": answer_len, "min_new_tokens": answer_len,
              "pad_token_id": pad_id, "use_cache": True, **options}
    baseline = None
    with contextlib.ExitStack() as engine:  # a rollout engine serves both generations, then sleeps
        with steps("generate"), torch.no_grad():
            if rollout is not None:
                engine.enter_context(rollout.rollout())
            seq = model.generate(prompts, do_sample=True, **kwargs)  # [b, prompt_len + answer_len]
            if not greedy:
                engine.close()
        if greedy:
            with steps("generate_greedy"), torch.no_grad():
                baseline = model.generate(prompts, do_sample=False, **kwargs)  # [b, prompt_len + answer_len]
                engine.close()
    return seq, baseline


def reward_scores(reward_engine: Any, seq: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_len: int) -> torch.Tensor:
    """The reward model's score of each sequence, ``[b]``: its value at the last answer token (``reward_model.py``:
    ``forward_value``'s ``chosen_end_scores``). ``seq`` and ``attention_mask`` are ``[b, prompt_len + answer_len]``.
    The caller holds ``torch.no_grad()``."""
    return reward_engine.module.forward_value(seq, attention_mask, prompt_length=prompt_len)["chosen_end_scores"]
