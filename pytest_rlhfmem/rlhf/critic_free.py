"""Framework-free maths of the critic-free RLHF algorithms, shared by both recipes (next to ``ppo.py``).

- ReMax (Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
  Large Language Models", ICML 2024, arXiv 2310.10505, Algorithm 1): REINFORCE whose baseline is the reward of the
  greedy (argmax) response to the same prompt; no value model. As in the authors' DeepSpeed-Chat-based
  code (``remax_trainer.py``), the per-token reward keeps DeepSpeed-Chat's KL penalty, the baseline score
  is subtracted from the sampled response's score, and the return of each token is the sum of the rewards
  from it to the end (gamma 1).
- GRPO (Shao et al., "DeepSeekMath", arXiv 2402.03300, 2024, Sec. 4.1): G samples per prompt; the
  advantage of every token of sample i is its group-normalised score ``(r_i - mean(r)) / std(r)``
  (outcome supervision); the loss is the clipped surrogate plus ``beta`` times the unbiased KL estimator
  ``pi_ref / pi - log(pi_ref / pi) - 1`` to the reference, averaged over each sample's tokens, then over
  samples; no value model.

Shapes: ``N`` sequences (GRPO: ``N = prompts * group_size``, a group's samples adjacent), ``A`` positions
with a log-prob, answers from ``start`` on (``L = A - start`` answer positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ppo import PPOHyperparams, compute_rewards


@dataclass(frozen=True)
class GRPOHyperparams:
    """DeepSeekMath's GRPO settings (Sec. 4.2: KL coefficient 0.04); the PPO clip range 0.2."""

    cliprange: float = 0.2
    beta: float = 0.04
    eps: float = 1e-4


def remax_returns(start: int, log_probs: torch.Tensor, ref_log_probs: torch.Tensor, reward_score: torch.Tensor,
                  baseline_score: torch.Tensor, action_mask: torch.Tensor,
                  hp: PPOHyperparams = PPOHyperparams()) -> torch.Tensor:
    """ReMax returns ``[N, L]``: KL-penalised per-token rewards (``ppo.compute_rewards``) whose final reward
    is the clipped sampled score minus the clipped greedy score, summed from each token to the end.
    ``reward_score`` and ``baseline_score`` are ``[N]``."""
    clip = hp.clip_reward_value
    score = torch.clamp(reward_score, -clip, clip) - torch.clamp(baseline_score, -clip, clip)
    no_clip = PPOHyperparams(kl_ctl=hp.kl_ctl, clip_reward_value=float("inf"))
    rewards = compute_rewards(start, log_probs, ref_log_probs, score, action_mask, no_clip)[:, start:]
    rewards = rewards * action_mask[:, start:]
    return torch.flip(torch.cumsum(torch.flip(rewards, [1]), 1), [1])


def reinforce_loss(logprobs: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ReMax's policy loss (a scalar): ``-sum(returns * logprobs * mask) / sum(mask)``; inputs ``[N, L]``."""
    return -torch.sum(returns.detach() * logprobs * mask) / mask.sum()


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = GRPOHyperparams.eps) -> torch.Tensor:
    """GRPO outcome advantages ``[N]`` from scores ``[N]``: each score minus its group's mean, divided by
    the group's standard deviation (+ ``eps``). Raises ``ValueError`` when ``group_size < 2`` or ``N`` is
    not a multiple of it."""
    if group_size < 2 or scores.numel() % group_size:
        raise ValueError(f"group_size must be >= 2 and divide the {scores.numel()} scores, got {group_size}")
    g = scores.float().view(-1, group_size)
    adv = (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """DeepSeekMath's KL estimator (Sec. 4.1; Schulman's k3), per token (>= 0):
    ``exp(ref - logp) - (ref - logp) - 1``."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
              advantages: torch.Tensor, mask: torch.Tensor, hp: GRPOHyperparams = GRPOHyperparams()) -> torch.Tensor:
    """GRPO objective, negated (a scalar): per token ``-(min(ratio * A, clip(ratio) * A) - beta * KL)``,
    averaged over each sample's answer tokens, then over samples. Per-token inputs ``[N, L]``,
    ``advantages`` ``[N]``."""
    ratio = torch.exp((logprobs - old_logprobs) * mask)
    adv = advantages.unsqueeze(1)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1.0 - hp.cliprange, 1.0 + hp.cliprange) * adv)
    per_token = -(surrogate - hp.beta * kl_k3(logprobs, ref_logprobs))
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
