"""One PPO-style RLHF step in plain PyTorch: four small models, then generate / score / train.

    torchrun --standalone --nproc-per-node 2 examples/tiny_ppo.py                  # runs on its own
    rlhfmem capture --id tiny-ppo -- torchrun --standalone --nproc-per-node 2 examples/tiny_ppo.py
    python examples/tiny_ppo.py                                                    # one process, no torchrun

The ``rlhfmem`` lines (three phases and a flush point) are the only additions for memory budgets. They do nothing
unless the script runs under ``rlhfmem capture`` (or the ``rlhfmem_command`` fixture), so they can stay in production
code.
CPU + gloo without a GPU (then the memory figures are simulated), CUDA + nccl with one.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import pytest_rlhfmem as rlhfmem

VOCAB, HIDDEN, LAYERS, PROMPT_LEN, ANSWER_LEN = 1024, 256, 2, 16, 16
BATCH = 8  # prompts per rank (the README's quick start raises it to 32: the budget then fails)
KL_COEF, CLIP = 0.1, 0.2


class TinyLM(torch.nn.Module):
    """Token ids ``[B, T]`` -> ``[B, T, out]``: embedding, causal Transformer layers, a linear head.
    ``out = VOCAB`` for a policy (logits), ``out = 1`` for a value/reward model."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        layer = torch.nn.TransformerEncoderLayer(HIDDEN, nhead=4, dim_feedforward=4 * HIDDEN, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, LAYERS)
        self.head = torch.nn.Linear(HIDDEN, out)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.body(self.embed(ids), mask=mask, is_causal=True))


def log_probs_of(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token: ``[B, T-1]``."""
    return torch.gather(F.log_softmax(logits[:, :-1], -1), 2, seq[:, 1:, None]).squeeze(-1)


def main() -> None:
    cuda = torch.cuda.is_available()
    distributed = "WORLD_SIZE" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(1234 + rank)

    # The four models of PPO: actor and critic train (DDP), reference and reward only score.
    actor, critic = TinyLM(VOCAB).to(device), TinyLM(1).to(device)
    reference, reward_model = TinyLM(VOCAB).to(device).eval(), TinyLM(1).to(device).eval()
    if distributed:
        actor, critic = DDP(actor), DDP(critic)
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=1e-5)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-5)
    prompts = torch.randint(0, VOCAB, (BATCH, PROMPT_LEN), device=device)

    with rlhfmem.phase("generate"):  # sample answers token by token from the actor
        with torch.no_grad():
            seq = prompts
            for _ in range(ANSWER_LEN):
                next_logits = actor(seq)[:, -1]
                seq = torch.cat([seq, torch.multinomial(F.softmax(next_logits, -1), 1)], dim=1)
    rlhfmem.flush_point("after-generate")  # where a GPU run calls torch.cuda.empty_cache()
    if cuda:
        torch.cuda.empty_cache()

    with rlhfmem.phase("score"):  # experience: log-probs, KL-penalised reward, values, advantages
        with torch.no_grad():
            old_log_probs = log_probs_of(actor(seq), seq)
            ref_log_probs = log_probs_of(reference(seq), seq)
            rewards = -KL_COEF * (old_log_probs - ref_log_probs)
            rewards[:, -1] += reward_model(seq)[:, -1, 0]
            values = critic(seq)[:, :-1, 0]
            returns = rewards.flip(1).cumsum(1).flip(1)  # gamma = 1, no GAE: kept short
            advantages = returns - values

    with rlhfmem.phase("train"):  # one clipped policy update and one value update
        ratio = (log_probs_of(actor(seq), seq) - old_log_probs).exp()
        actor_loss = -torch.min(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages).mean()
        actor_loss.backward()
        actor_opt.step()
        actor_opt.zero_grad(set_to_none=True)
        critic_loss = F.mse_loss(critic(seq)[:, :-1, 0], returns)
        critic_loss.backward()
        critic_opt.step()
        critic_opt.zero_grad(set_to_none=True)

    if rank == 0:
        print(f"actor loss {actor_loss.item():.4f}, critic loss {critic_loss.item():.4f}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
