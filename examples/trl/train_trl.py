"""A TRL trainer as a GPU runner's script would run it: a random-weight Llama from a config (saved to OUT_DIR/init;
no hub), on the GPU (TRL's default device), bf16, ``--max-steps`` steps. No rlhfmem import except the one line that
marks TRL's phases (without rlhfmem installed the script runs as it is).

    python train_trl.py --trainer grpo OUT_DIR      # GRPOTrainer
    python train_trl.py --trainer rloo OUT_DIR      # RLOOTrainer

Prints ``DONE {json}``: the steps run, the losses and the mean completion length logged.
"""

import argparse
import json

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--trainer", choices=("grpo", "rloo"), default="grpo")
p.add_argument("--completion-length", type=int, default=16)
p.add_argument("--max-steps", type=int, default=2)
args = p.parse_args()

vocab = {f"t{i}": i for i in range(256)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2",
                                    bos_token="t3")
tokenizer.padding_side = "left"
cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=1, eos_token_id=2, bos_token_id=3)
torch.manual_seed(0)
init = f"{args.out}/init"  # the trainers load the policy (and RLOO its reference) from a local path, as from a hub
LlamaForCausalLM(cfg).save_pretrained(init)
tokenizer.save_pretrained(init)
dataset = Dataset.from_dict({"prompt": [" ".join(f"t{(7 * i + j) % 250 + 4}" for j in range(8)) for i in range(16)]})


def reward_len(completions, **kwargs):
    """A reward that prefers 12-character completions (any reward does: memory depends on shapes)."""
    return [-abs(12 - len(c)) / 12 for c in completions]


common = dict(output_dir=args.out, per_device_train_batch_size=4, num_generations=4,
              max_completion_length=args.completion_length, max_steps=args.max_steps, bf16=True, logging_steps=1,
              report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0)
if args.trainer == "grpo":
    from trl import GRPOConfig as Config, GRPOTrainer as Trainer
else:
    from trl import RLOOConfig as Config, RLOOTrainer as Trainer
trainer = Trainer(model=init, reward_funcs=reward_len, args=Config(**common), train_dataset=dataset,
                  processing_class=tokenizer)
try:  # the one line a TRL user adds: generation, scoring, training step and optimizer step as phases
    from pytest_rlhfmem.integrations.trl import mark_phases
    mark_phases(trainer)
except ImportError:
    pass
trainer.train()
logged = [h for h in trainer.state.log_history if "loss" in h]
print("DONE " + json.dumps({"steps": trainer.state.global_step, "loss": [round(float(h["loss"]), 6) for h in logged],
                            "mean_length": [float(h.get("completions/mean_length", 0)) for h in logged]}))
