"""The experience both ColossalChat iterations make the same way, up to the reward model: generation and the
actor's and the reference's log-probs.

``coati/experience_maker/naive.py`` (``NaiveExperienceMaker.make_experience``): under ``torch.no_grad()``, the
actor generates (Hugging Face's ``generate`` here: sampling, temperature 0.7, top-k 50, answers of a fixed
``answer_len``), then the actor and the reference score every token of the sequences. ReMax's baseline is the
same ``generate`` with ``do_sample=False``. The PPO iteration (``ppo_iteration.py``) goes on with the reward model
and the critic, the critic-free one (``critic_free_iteration.py``) with the reward model and its targets.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import ppo
from ..common import PhaseSteps, full_attention_mask


class Rollout(NamedTuple):
    """What :func:`infer_experience` hands the reward model and the update; ``b`` sequences (GRPO: a group of
    samples per prompt, adjacent), ``prompt_len + answer_len`` tokens each."""

    seq: torch.Tensor  # [b, prompt_len + answer_len]: the left-padded prompts, then the sampled answers
    attention_mask: torch.Tensor  # [b, prompt_len + answer_len]: 0 on the prompts' left padding
    greedy: torch.Tensor | None  # [b, prompt_len + answer_len]: ReMax's argmax answers; None otherwise
    log_probs: torch.Tensor  # [b, prompt_len + answer_len - 1]: the actor's log-prob of each token after the first
    ref_log_probs: torch.Tensor  # [b, prompt_len + answer_len - 1]: the reference's


def infer_experience(steps: PhaseSteps, actor: Any, ref: Any, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                     pad_id: int, answer_len: int, *, greedy: bool = False) -> Rollout:
    """Phases ``generate``, ``generate_greedy`` (with ``greedy``: ReMax's baseline), ``infer_actor`` and
    ``infer_reference``, without gradients. ``actor`` and ``ref`` are the boosted models, the actor already in
    eval mode; ``prompts`` and ``prompt_mask`` are ``[b, prompt_len]`` (left-padded: ``common.random_prompts``)."""
    gen = {"attention_mask": prompt_mask, "max_new_tokens": answer_len, "min_new_tokens": answer_len,
           "pad_token_id": pad_id, "use_cache": True}
    model = actor.unwrap(unwrap_peft=False)
    baseline = None
    with torch.no_grad():
        with steps("generate"):
            seq = model.generate(prompts, do_sample=True, temperature=0.7, top_k=50, **gen)
        if greedy:
            with steps("generate_greedy"):
                baseline = model.generate(prompts, do_sample=False, **gen)
        attention_mask = full_attention_mask(prompt_mask, seq)
        with steps("infer_actor"):
            log_probs = ppo.sequence_log_probs(actor(input_ids=seq, attention_mask=attention_mask)["logits"], seq)
        with steps("infer_reference"):
            ref_log_probs = ppo.sequence_log_probs(ref(input_ids=seq, attention_mask=attention_mask)["logits"], seq)
    return Rollout(seq, attention_mask, baseline, log_probs, ref_log_probs)
