"""A Hugging Face transformers.Trainer run, unchanged: tiny GPT-2 from a config (random weights), a
dataset made in memory, four steps on CPU. No rlhfmem import."""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
args = TrainingArguments(output_dir=sys.argv[1] if len(sys.argv) > 1 else "hf-out", max_steps=4,
                         per_device_train_batch_size=4, learning_rate=1e-4, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(32, 32, 1000))
out = trainer.train()
print(f"trained {out.global_step} steps, loss {out.training_loss:.4f}")
