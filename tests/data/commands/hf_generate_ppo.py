"""A plain Hugging Face generate + PPO loop, written for a GPU runner (device cuda, bf16 autocast, its own
torch.cuda calls), with no rlhfmem import: the four models of PPO-based RLHF (actor, reference, critic, reward)
from configs with random weights, a rollout that stops at EOS, the KL penalty, GAE, and the clipped actor and
critic losses, for ``--steps`` iterations.

Every line whose path depends on values is one a simulated device without values cannot run: the generation
loop's stopping criteria, the EOS position found with a boolean mask, ``.item()`` of the losses, and a
``torch.Event`` synchronized before the step's figures are read.
Prints ``FIGURES {...}`` (json): the rollout's lengths and the losses, rounded."""

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda", help="cuda (as written for the GPU runner); cpu for the CPU route")
p.add_argument("--steps", type=int, default=2)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--prompt-len", type=int, default=12)
p.add_argument("--max-new-tokens", type=int, default=24)
args = p.parse_args()
dev = args.device

torch.manual_seed(0)
EOS, PAD = 2, 0
cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, eos_token_id=EOS, pad_token_id=PAD,
                  bos_token_id=1)
actor = LlamaForCausalLM(cfg).to(dev)
reference = LlamaForCausalLM(cfg).to(dev).eval().requires_grad_(False)
reference.load_state_dict(actor.state_dict())
critic = LlamaForCausalLM(cfg).model.to(dev)  # the value model: a backbone and a scalar head
value_head = torch.nn.Linear(cfg.hidden_size, 1, device=dev)
reward_backbone = LlamaForCausalLM(cfg).model.to(dev).eval().requires_grad_(False)
reward_head = torch.nn.Linear(cfg.hidden_size, 1, device=dev).requires_grad_(False)
actor_opt = torch.optim.AdamW(actor.parameters(), lr=1e-5)
critic_opt = torch.optim.AdamW([*critic.parameters(), *value_head.parameters()], lr=1e-5)
kl_coef, gamma, lam, clip = 0.1, 1.0, 0.95, 0.2


def log_probs_of(logits, tokens):  # [b, t, vocab], [b, t] -> [b, t]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


figures = {"lengths": [], "actor_loss": [], "critic_loss": []}
for _step in range(args.steps):
    prompts = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_len), device=dev)  # [b, p]
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
        seq = actor.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                             max_new_tokens=args.max_new_tokens, eos_token_id=EOS, pad_token_id=PAD)  # [b, p + a]
    response = seq[:, args.prompt_len:]  # [b, a]
    is_eos = response == EOS
    eos_idx = torch.full((args.batch,), response.size(1), dtype=torch.long, device=dev)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]  # a boolean mask: nonzero
    positions = torch.arange(response.size(1), device=dev).expand(args.batch, -1)
    action_mask = (positions <= eos_idx.unsqueeze(1)).float()  # [b, a]: up to and including EOS
    attention = torch.cat([torch.ones_like(prompts), action_mask.long()], dim=1)  # [b, p + a]
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
        old_logp = log_probs_of(actor(seq, attention_mask=attention).logits[:, args.prompt_len - 1:-1], response)
        ref_logp = log_probs_of(reference(seq, attention_mask=attention).logits[:, args.prompt_len - 1:-1], response)
        hidden = critic(seq, attention_mask=attention).last_hidden_state[:, args.prompt_len - 1:-1]
        values = value_head(hidden).squeeze(-1).float()  # [b, a]
        last = reward_backbone(seq, attention_mask=attention).last_hidden_state[torch.arange(args.batch), -1]
        score = reward_head(last).squeeze(-1).float()  # [b]
    rewards = -kl_coef * (old_logp - ref_logp) * action_mask  # the KL penalty, per token
    rewards[torch.arange(args.batch), eos_idx.clamp(max=response.size(1) - 1)] += score
    advantages = torch.zeros_like(rewards)  # GAE, backwards over the response
    last_gae = torch.zeros(args.batch, device=dev)
    for t in reversed(range(response.size(1))):
        next_value = values[:, t + 1] if t + 1 < response.size(1) else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    returns = advantages + values
    with torch.autocast(dev, dtype=torch.bfloat16):
        logp = log_probs_of(actor(seq, attention_mask=attention).logits[:, args.prompt_len - 1:-1], response)
        ratio = torch.exp(logp - old_logp)
        actor_loss = -(torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
                       * action_mask).sum() / action_mask.sum()
    actor_loss.backward()
    actor_opt.step()
    actor_opt.zero_grad(set_to_none=True)
    with torch.autocast(dev, dtype=torch.bfloat16):
        new_values = value_head(critic(seq, attention_mask=attention).last_hidden_state[:, args.prompt_len - 1:-1])
        critic_loss = (((new_values.squeeze(-1).float() - returns) ** 2) * action_mask).sum() / action_mask.sum()
    critic_loss.backward()
    critic_opt.step()
    critic_opt.zero_grad(set_to_none=True)
    if dev == "cuda":  # the step's work done before its figures are read (a CPU has no events)
        done = torch.Event("cuda")
        done.record()
        done.synchronize()
    figures["lengths"].append((eos_idx + 1).clamp(max=response.size(1)).tolist())
    figures["actor_loss"].append(round(actor_loss.item(), 4))
    figures["critic_loss"].append(round(critic_loss.item(), 4))
if dev == "cuda":
    print(f"peak allocated {torch.cuda.max_memory_allocated()} B")
print("FIGURES " + json.dumps(figures))
