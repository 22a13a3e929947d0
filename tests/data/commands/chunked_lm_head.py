"""An RL trainer's step with a chunked LM-head loss, written for a GPU runner (device cuda, bf16 autocast, activation
checkpointing): the policy's per-token log-probabilities and entropy are computed over chunks of the vocabulary,
never as a ``[tokens, vocab]`` tensor, as PrimeIntellect-ai/prime-rl's fused LM head does (its
``fused_lm_head_chunk_size``, whose default went 2048 -> 8192 in its PR 1892; docs/incidents.md, incident 1). The
chunked function is this script's own (an online logsumexp over vocabulary chunks, the chunk's logits computed again
in backward); prime-rl's code is not copied.

Model: a Qwen3-shaped causal LM from a transformers config with random weights (no download): ``--model
qwen3-0.6b`` (Qwen/Qwen3-0.6B's published shape: vocab 151,936, hidden 1,024, 28 layers, 16 heads, 8 KV heads,
head dim 128, tied embeddings) or ``tiny`` (the CI scale). fp32 parameters and AdamW states, bf16 autocast, each
decoder layer checkpointed; ``--micro-batches`` packed sequences of ``--seq-len`` tokens accumulate their gradients
before one optimizer step.

Phases (``pytest_rlhfmem.phase``, which does nothing outside a capture): ``forward`` (the decoder stack, its
final hidden states ``[1, seq, hidden]``), ``lm_head`` (the chunked log-probabilities, the policy-gradient loss
and their backward into the hidden states and the head's weight), ``backward`` (the decoder stack's backward, each
layer recomputed), ``optimizer_step``. Prints ``DONE {...}`` (json): the settings. It reads no device value, so it
runs on a simulated device without values (``--sim-values off``) at any scale the host's memory allows.
"""

import argparse
import json

import torch

import pytest_rlhfmem as rlhfmem

# Qwen/Qwen3-0.6B's config.json (its model card's shape); built with random weights, never downloaded
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_parameters={"rope_theta": 1000000.0,
                                                                                     "rope_type": "default"})
TINY = dict(vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=8192,
            rms_norm_eps=1e-6)
MODELS = {"qwen3-0.6b": QWEN3_0_6B, "tiny": TINY}


class ChunkedLogprobEntropy(torch.autograd.Function):
    """Per-token ``(logprobs [N], entropy [N])`` (fp32) of ``labels [N]`` under ``softmax(hidden [N, H] @ weight
    [V, H]^T * inv_temperature [N, 1])``, over chunks of ``chunk`` vocabulary rows: the running max, the running sum
    of exponentials and of exponentials times logits (an online logsumexp), so no ``[N, V]`` tensor exists; the
    largest temporaries are ``[N, chunk]``. Backward computes each chunk's logits again; the entropy has no
    gradient (it is logged)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temperature, chunk):  # noqa: ANN001, ANN205
        n, vocab = hidden.shape[0], weight.shape[0]
        run_max = torch.full((n,), float("-inf"), device=hidden.device, dtype=torch.float32)  # [N]
        run_sum = torch.zeros(n, device=hidden.device, dtype=torch.float32)  # [N]: sum of exp(logit - max)
        run_dot = torch.zeros(n, device=hidden.device, dtype=torch.float32)  # [N]: sum of exp(logit - max) * logit
        picked = torch.zeros(n, device=hidden.device, dtype=torch.float32)  # [N]: the label's logit
        scale = inv_temperature.float().unsqueeze(1)  # [N, 1] fp32
        for lo in range(0, vocab, chunk):
            w = weight[lo:lo + chunk]  # [C, H]
            logits = (hidden @ w.t()).float() * scale  # [N, C] fp32
            new_max = torch.maximum(run_max, logits.amax(dim=1))  # [N]
            decay = torch.exp(run_max - new_max)  # [N]
            e = torch.exp(logits - new_max.unsqueeze(1))  # [N, C]
            run_sum = run_sum * decay + e.sum(dim=1)
            run_dot = run_dot * decay + (e * logits).sum(dim=1)
            run_max = new_max
            inside = (labels >= lo) & (labels < lo + w.shape[0])  # [N]: the label is in this chunk
            at = (labels - lo).clamp(0, w.shape[0] - 1).unsqueeze(1)  # [N, 1]
            picked = torch.where(inside, logits.gather(1, at).squeeze(1), picked)
        logz = run_max + torch.log(run_sum)  # [N]
        ctx.save_for_backward(hidden, weight, labels, inv_temperature, logz)
        ctx.chunk = chunk
        return picked - logz, logz - run_dot / run_sum

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # noqa: ANN001, ANN205
        hidden, weight, labels, inv_temperature, logz = ctx.saved_tensors
        g = grad_logprobs.float()  # [N]
        scale = inv_temperature.float().unsqueeze(1)  # [N, 1] fp32
        grad_hidden = torch.zeros_like(hidden)  # [N, H]
        grad_weight = torch.zeros_like(weight)  # [V, H]
        for lo in range(0, weight.shape[0], ctx.chunk):
            w = weight[lo:lo + ctx.chunk]  # [C, H]
            logits = (hidden @ w.t()).float() * scale  # [N, C] fp32, again
            probs = torch.exp(logits - logz.unsqueeze(1))  # [N, C]: softmax
            grad_logits = -g.unsqueeze(1) * probs  # d logprob / d logit = onehot(label) - softmax
            inside = (labels >= lo) & (labels < lo + w.shape[0])
            at = (labels - lo).clamp(0, w.shape[0] - 1).unsqueeze(1)
            grad_logits.scatter_add_(1, at, torch.where(inside, g, torch.zeros_like(g)).unsqueeze(1))
            grad_logits = (grad_logits * scale).to(hidden.dtype)  # [N, C], the matmuls' dtype
            grad_hidden.add_(grad_logits @ w)
            grad_weight[lo:lo + w.shape[0]].add_(grad_logits.t() @ hidden)
        return grad_hidden, grad_weight, None, None, None


def chunked_logprobs(hidden, weight, labels, inv_temperature, chunk):  # noqa: ANN001, ANN201
    """``(logprobs, entropy)`` ([N] fp32 each) of :class:`ChunkedLogprobEntropy`, the matmuls in ``hidden``'s
    dtype (the head's weight cast to it once)."""
    return ChunkedLogprobEntropy.apply(hidden, weight.to(hidden.dtype), labels, inv_temperature, chunk)


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # noqa: ANN001, ANN201, ANN003
    """FlashAttention-2's contract, as prime-rl's trainer runs it (``--model.attn flash_attention_2``): causal, no
    mask tensor, so the ``[seq, seq]`` mask a long packed sequence would otherwise build never exists. ``query``
    ``[b, heads, seq, head_dim]``, ``key``/``value`` ``[b, kv_heads, seq, head_dim]`` (repeated to the query's heads,
    as transformers' SDPA path does without ``enable_gqa``); returns ``([b, seq, heads, head_dim], None)``."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def main() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface, Qwen3Config, Qwen3ForCausalLM

    AttentionInterface.register("causal", causal_attention)
    AttentionMaskInterface.register("causal", lambda *args, **kwargs: None)

    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed micro batch")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=512, help="vocabulary rows per LM-head chunk")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.chunk_size < 1 or args.seq_len < 1 or args.micro_batches < 1:
        p.error("--chunk-size, --seq-len and --micro-batches are whole numbers >= 1")
    dev = torch.device(args.device)
    torch.manual_seed(0)
    cfg = Qwen3Config(**MODELS[args.model])
    cfg._attn_implementation = "causal"
    with dev:  # built on the device: no host copy of the weights
        model = Qwen3ForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    head = model.lm_head.weight  # [V, H], tied to the embeddings
    for _micro in range(args.micro_batches):
        tokens = torch.randint(0, cfg.vocab_size, (1, args.seq_len + 1), device=dev)  # [1, seq + 1]
        inputs, labels = tokens[:, :-1], tokens[:, 1:].reshape(-1)  # [1, seq], [seq]
        advantages = torch.randn(args.seq_len, device=dev)  # [seq]: one per token, as a packed RL batch has
        inv_temperature = torch.ones(args.seq_len, device=dev)  # [seq]: 1 / sampling temperature
        with rlhfmem.phase("forward"), torch.autocast(dev.type, dtype=torch.bfloat16):
            hidden = model.model(input_ids=inputs).last_hidden_state  # [1, seq, H]
        with rlhfmem.phase("lm_head"), torch.autocast(dev.type, dtype=torch.bfloat16):
            h = hidden.detach().to(torch.bfloat16).reshape(args.seq_len, -1).requires_grad_()  # [seq, H]
            logprobs, entropy = chunked_logprobs(h, head, labels, inv_temperature, args.chunk_size)
            loss = -(advantages * torch.exp(logprobs - logprobs.detach())).mean() / args.micro_batches
            loss.backward()  # into h.grad [seq, H] and the head's weight
        with rlhfmem.phase("backward"):
            hidden.backward(h.grad.reshape(hidden.shape).to(hidden.dtype))
        del hidden, h, logprobs, entropy, loss
    with rlhfmem.phase("optimizer_step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    print("DONE " + json.dumps({"model": args.model, "seq_len": args.seq_len, "micro_batches": args.micro_batches,
                                "chunk_size": args.chunk_size}), flush=True)


if __name__ == "__main__":
    main()
