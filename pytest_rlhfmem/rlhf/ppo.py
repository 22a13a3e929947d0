"""Framework-free PPO maths of one RLHF iteration, shared by both recipes.

Follows DeepSpeed-Chat's ``dschat/rlhf/ppo_trainer.py`` (``compute_rewards``,
``get_advantages_and_returns``, ``actor_loss_fn``, ``critic_loss_fn``) and ``dschat/utils/utils.py``
(``gather_log_probs``); ColossalChat's ``coati`` computes the same quantities (KL-penalised reward,
GAE with gamma 1.0 and lambda 0.95, clipped policy and value losses).

Shapes: ``B`` sequences, ``T`` tokens (prompt + answer), ``A = T - 1`` positions with a log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PPOHyperparams:
    """DeepSpeed-Chat's defaults (``ppo_trainer.py``)."""

    kl_ctl: float = 0.1
    clip_reward_value: float = 5.0
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95


def gather_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label. logits ``[B, A, V]``, labels ``[B, A]`` -> ``[B, A]``."""
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def sequence_log_probs(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token of ``seq`` after the first, under the logits of a forward over ``seq``
    (position ``t`` predicts token ``t + 1``): logits ``[B, T, V]``, seq ``[B, T]`` -> ``[B, A]``, ``A = T - 1``.
    ``generate_experience``'s ``gather_log_probs(logits[:, :-1, :], seq[:, 1:])``."""
    return gather_log_probs(logits[:, :-1, :], seq[:, 1:])


def compute_rewards(start: int, log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                    reward_score: torch.Tensor, action_mask: torch.Tensor,
                    hp: PPOHyperparams = PPOHyperparams()) -> torch.Tensor:
    """KL-penalised per-token rewards ``[B, A]``: ``-kl_ctl * (logp - ref_logp)`` everywhere, plus the
    clipped reward-model score ``[B]`` at the last answer token. ``start`` = prompt length - 1."""
    rewards = -hp.kl_ctl * (log_probs - ref_log_probs)
    ends = start + action_mask[:, start:].sum(1) + 1
    clipped = torch.clamp(reward_score, -hp.clip_reward_value, hp.clip_reward_value)
    for j in range(log_probs.shape[0]):
        rewards[j, start:ends[j]][-1] += clipped[j]
    return rewards


def get_advantages_and_returns(values: torch.Tensor, rewards: torch.Tensor, start: int,
                               hp: PPOHyperparams = PPOHyperparams()) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the answer: values, rewards ``[B, A]`` -> advantages and
    returns ``[B, A - start]`` (Schulman et al. 2016, eq. 11-16)."""
    lastgaelam = 0
    advantages_reversed = []
    length = rewards.size(-1)
    for t in reversed(range(start, length)):
        nextvalues = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + hp.gamma * nextvalues - values[:, t]
        lastgaelam = delta + hp.gamma * hp.lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values[:, start:]
    return advantages.detach(), returns


def actor_loss_fn(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, hp: PPOHyperparams = PPOHyperparams()) -> torch.Tensor:
    """Clipped PPO policy loss (a scalar); all inputs ``[B, A - start]``."""
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - hp.cliprange, 1.0 + hp.cliprange)
    return torch.sum(torch.max(pg_loss1, pg_loss2) * mask) / mask.sum()


def critic_loss_fn(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                   mask: torch.Tensor, hp: PPOHyperparams = PPOHyperparams()) -> torch.Tensor:
    """Clipped value loss, ``0.5 * max(squared errors)`` (a scalar); inputs ``[B, A - start]``."""
    values_clipped = torch.clamp(values, old_values - hp.cliprange_value, old_values + hp.cliprange_value)
    vf_loss1 = (values - returns) ** 2
    vf_loss2 = (values_clipped - returns) ** 2
    return 0.5 * torch.sum(torch.max(vf_loss1, vf_loss2) * mask) / mask.sum()
