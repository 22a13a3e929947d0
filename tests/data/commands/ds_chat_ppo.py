"""A DeepSpeed-Chat step-3 PPO script as a user writes it for a GPU machine, with no rlhfmem import: the four models
of DeepSpeed-Chat's RLHF engine (rlhf_engine.py: actor, reference, critic, reward; the shipped recipe's tiny-opt pair:
an OPT actor of hidden 256 / 4 layers and an OPT critic of hidden 128 / 2 layers, vocab 1024, random weights from
configs), each from the user's own ``deepspeed.initialize`` (ZeRO stage 2 or 3, bf16; reference and reward
without an optimizer), then per step as ppo_trainer.py does: generate (the actor, ``synced_gpus`` under ZeRO-3),
score (reference log-probs, reward, critic values), train the actor (clipped PPO loss) and the critic (clipped value
loss). Under torchrun:

    torchrun --nproc-per-node 2 ds_chat_ppo.py --stage 2|3 [--batch N] [--answer-len N] [--steps N] [--device cpu]

``--device cpu`` for the CPU route (``DS_ACCELERATOR=cpu``, gloo). Prints ``FIGURES {...}`` (json) per rank: the
actor and critic losses, rounded.
"""

import argparse
import json
import os

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, choices=(2, 3), default=3)
p.add_argument("--device", default="cuda", help="cuda (as written for the GPU runner); cpu for the CPU route")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--prompt-len", type=int, default=16)
p.add_argument("--answer-len", type=int, default=16)
p.add_argument("--steps", type=int, default=1)
args = p.parse_args()
if args.device == "cpu":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402 - after DS_ACCELERATOR
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import OPTConfig, OPTForCausalLM, OPTModel  # noqa: E402

deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
rank = int(os.environ["RANK"])
if args.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

VOCAB, PAD, EOS = 1024, 1, 2
actor_cfg = OPTConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, ffn_dim=1024, num_attention_heads=4,
                      max_position_embeddings=128, word_embed_proj_dim=256, pad_token_id=PAD, eos_token_id=EOS)
critic_cfg = OPTConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, ffn_dim=512, num_attention_heads=4,
                       max_position_embeddings=128, word_embed_proj_dim=128, pad_token_id=PAD, eos_token_id=EOS)


class ValueModel(torch.nn.Module):
    """DeepSpeed-Chat's RewardModel: an OPT body and a scalar head (``v_head``), one value per token."""

    def __init__(self) -> None:
        super().__init__()
        self.rwtransformer = OPTModel(critic_cfg)
        self.v_head = torch.nn.Linear(critic_cfg.hidden_size, 1, bias=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.v_head(self.rwtransformer(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)


def ds_config(train: bool) -> dict:
    zero = {"stage": args.stage, "reduce_bucket_size": 2 * 10**5, "allgather_bucket_size": 2 * 10**5,
            "stage3_prefetch_bucket_size": 2 * 10**5, "stage3_param_persistence_threshold": 10**4}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": zero if (train or args.stage == 3) else {"stage": 0},
              "gradient_clipping": 1.0, "steps_per_print": 1 << 30}
    if train:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}
    return config


def engine(model: torch.nn.Module, train: bool):
    if train:
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(True))[0]
    return deepspeed.initialize(model=model, config=ds_config(False))[0]


torch.manual_seed(0)
actor = engine(OPTForCausalLM(actor_cfg), True)
reference = engine(OPTForCausalLM(actor_cfg), False)
critic = engine(ValueModel(), True)
reward = engine(ValueModel(), False)
device = actor.device


def log_probs(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    return torch.gather(F.log_softmax(logits[:, :-1].float(), -1), 2, seq[:, 1:, None]).squeeze(-1)


g = torch.Generator().manual_seed(1 + rank)
figures = {"rank": rank, "actor_loss": [], "critic_loss": []}
for _ in range(args.steps):
    prompts = torch.randint(4, VOCAB, (args.batch, args.prompt_len), generator=g).to(device)
    # generate (ppo_trainer.py: _generate_sequence): exactly answer-len new tokens
    actor.eval()
    with torch.no_grad():
        seq = actor.module.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.answer_len,
                                    min_new_tokens=args.answer_len, do_sample=True, pad_token_id=PAD,
                                    synced_gpus=args.stage == 3)
        mask = seq.ne(PAD).long()
        # score (generate_experience): old log-probs, reference log-probs, reward, values
        old = log_probs(actor(seq, attention_mask=mask).logits, seq)
        ref = log_probs(reference(seq, attention_mask=mask).logits, seq)
        score = reward(seq, mask)[:, -1].float()
        old_values = critic(seq, mask)[:, :-1].float()
    actor.train()
    start = args.prompt_len - 1
    rewards = -0.1 * (old - ref)
    rewards[:, -1] += score.clamp(-5, 5)
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(score)
    for t in reversed(range(start, rewards.shape[1])):  # GAE, gamma 1, lambda 0.95
        nxt = old_values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(score)
        last = rewards[:, t] + nxt - old_values[:, t] + 0.95 * last
        advantages[:, t] = last
    returns = advantages + old_values
    # train the actor (actor_loss_fn: the clipped surrogate)
    new = log_probs(actor(seq, attention_mask=mask).logits, seq)
    ratio = torch.exp(new[:, start:] - old[:, start:])
    adv = advantages[:, start:]
    actor_loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    actor.backward(actor_loss)
    actor.step()
    # train the critic (critic_loss_fn: the clipped value loss)
    values = critic(seq, mask)[:, :-1].float()[:, start:]
    clipped = values.clamp(old_values[:, start:] - 0.2, old_values[:, start:] + 0.2)
    critic_loss = 0.5 * torch.max((values - returns[:, start:]) ** 2, (clipped - returns[:, start:]) ** 2).mean()
    critic.backward(critic_loss)
    critic.step()
    figures["actor_loss"].append(round(actor_loss.item(), 4))
    figures["critic_loss"].append(round(critic_loss.item(), 4))
print("FIGURES " + json.dumps(figures), flush=True)
