"""The CS336 Transformer language model and its profiled steps, rebuilt op for op (fp32).

The fidelity benchmark holds a CPU capture of a workload against a GPU recording of the SAME workload.
Two of the shared real snapshots record this model (``wedson_medium_128_inference``,
``wedson_medium_256_training``, see ``shared/snapshots/README.md``): the Stanford CS336 (2025)
assignment-1 model as shipped in assignment 2's ``cs336-basics`` (``cs336_basics/model.py``,
``nn_utils.py``, ``optimizer.py``), profiled by ``cs336_systems/nsys_profile.py`` (``memory_profile``) in
Wedsonlin/assignment2-systems at 8630bcf. This module is written from those facts; what decides the
allocations is kept exactly:

- every linear map is ``torch.einsum("...i,oi->...o", x, W)`` (no bias), not ``F.linear``;
- RMSNorm computes ``rsqrt(mean(x**2) + eps)`` in separate ops, then ``x * rms`` and ``weight * x``;
- RoPE splits the head dimension into interleaved pairs (views), rotates with four products, two
  sums and a ``cat``; the cos/sin table (2, context, d_head/2) is a buffer built at construction;
- attention: causal mask from ``arange`` (``q >= k``), scores ``einsum / sqrt(d_k)``,
  ``where(mask, scores, -inf)``, a hand-written softmax (``x - max``, ``exp``, ``/ sum``), then
  ``einsum`` with V; heads are merged with a reshape of the permuted output (a copy);
- SwiGLU ``w2(silu(w1 x) * w3 x)`` with ``silu(x) = x * sigmoid(x)``;
- the loss is a hand-written log-softmax cross-entropy; the optimizer is CS336's AdamW (fresh
  ``m_t``/``v_t`` tensors each step, ``state.get(key, zeros_like(grad))`` evaluating its default).

Shapes: token ids (batch, context) int64; logits (batch, context, vocab) fp32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LMConfig:
    """One CS336 model size (assignment 2's table, section 1.1.2)."""

    vocab_size: int = 10_000
    context_length: int = 128
    d_model: int = 1024
    d_ff: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    rope_theta: float = 10_000.0


SIZES = {  # assignment 2, Table 1 ("medium" is the one the shared snapshots record)
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
}


def lm_config(size: str, context_length: int, **overrides) -> LMConfig:
    """The config of a named size; raises ``ValueError`` naming the allowed sizes."""
    if size not in SIZES:
        raise ValueError(f"model size {size!r}: allowed values are {', '.join(SIZES)}")
    return LMConfig(context_length=context_length, **{**SIZES[size], **overrides})


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        std = math.sqrt(2 / (d_in + d_out))
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(d_out, d_in), std=std, a=-3 * std, b=3 * std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(vocab_size, d_model), std=1.0, a=-3, b=3))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids, :]


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.float32)
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x * rms
        return (self.weight * x).to(in_dtype)


class Rotary(nn.Module):
    """RoPE on interleaved pairs; the (2, context, d_head/2) cos/sin table is a non-persistent buffer."""

    def __init__(self, context_length: int, d_head: int, theta: float):
        super().__init__()
        inv = torch.tensor(theta) ** -(torch.arange(0, d_head, 2) / d_head)
        angles = torch.outer(torch.arange(context_length).float(), inv)
        self.register_buffer("table", torch.stack((angles.cos(), angles.sin())), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (-1, 2)).movedim(-1, 0)  # (2, ..., seq, d/2): views
        x1, x2 = pairs.unbind(0)
        cos, sin = self.table[:, : x.size(-2), :].unbind(0)
        first = cos * x1 - sin * x2
        second = sin * x1 + cos * x2
        return torch.cat((first, second), dim=-1)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    shifted = x - torch.max(x, dim=dim, keepdim=True)[0]
    e = torch.exp(shifted)
    return e / torch.sum(e, dim=dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    x_max = torch.max(x, dim=dim, keepdim=True)[0]
    x = x - x_max
    return x - torch.log(torch.sum(torch.exp(x), dim=dim, keepdim=True))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) x3 and a (..., seq, seq) bool mask -> (..., seq, d). The scores and the weights
    are locals: both are freed when this returns (their lifetime is part of the allocation sequence)."""
    scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(k.shape[-1])
    scores = torch.where(mask, scores, float("-inf"))
    weights = softmax(scores, dim=-1)
    return torch.einsum("...qk,...kd->...qd", weights, v)


class Attention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, rope: Rotary):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model)
        self.v_proj = Linear(d_model, d_model)
        self.output_proj = Linear(d_model, d_model)
        self.rope = rope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *batch, seq, _ = x.shape
        # All three projections first, then the head split (views), as the original: the order of the
        # autograd nodes decides the backward's order (the three view copies before the projections' bmm)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(-3, -2) for t in (q, k, v))
        q = self.rope(q)
        k = self.rope(k)
        pos = torch.arange(seq, device=x.device)
        mask = (pos[:, None] >= pos[None, :])[(None,) * len(batch)]
        out = scaled_dot_product_attention(q, k, v, mask)
        out = out.transpose(-3, -2).reshape(*batch, seq, -1).contiguous()  # merge heads: a copy
        return self.output_proj(out)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig, rope: Rotary):
        super().__init__()
        self.attn = Attention(cfg.d_model, cfg.num_heads, rope)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)
        self.ln1 = RMSNorm(cfg.d_model)
        self.ln2 = RMSNorm(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sub-layer outputs stay referenced until the block returns, as in the original.
        attn_out = self.attn(self.ln1(x))
        h = x + attn_out
        ffn_out = self.ffn(self.ln2(h))
        return h + ffn_out


class TransformerLM(nn.Module):
    """Pre-norm decoder: embedding, ``num_layers`` blocks, final RMSNorm, untied LM head.

    Module registration order follows the original (it decides the order of ``.to(device)``):
    token embedding, the shared RoPE module, the blocks, the final norm, the head.
    """

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.token_embeddings = Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = Rotary(cfg.context_length, cfg.d_model // cfg.num_heads, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg, self.rope) for _ in range(cfg.num_layers))
        self.ln_final = RMSNorm(cfg.d_model)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.token_embeddings(token_ids)  # referenced until forward returns, as in the original
        x = embedded
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood with a hand-written log-softmax (as CS336's ``nn_utils``)."""
    negative_log_probs = -log_softmax(logits)
    return torch.mean(torch.gather(negative_log_probs, -1, targets.unsqueeze(-1)))


class AdamW(torch.optim.Optimizer):
    """CS336's AdamW: per step and parameter, new ``m``/``v`` tensors replace the old ones.

    The decoupled weight decay runs first in each parameter's update: the GPU recording of the training
    workload (``wedson_medium_256_training``) shows, for every parameter, one parameter-sized temporary
    allocated and freed before the two ``zeros_like`` defaults (the staff ``cs336_basics/optimizer.py``
    applies it last, which would put that pair after the update's temporaries)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def step(self, closure=None):
        # Names are kept apart on purpose: the previous step's m/v (prev_m, prev_v) and this step's
        # (m_t, v_t) stay referenced until the next parameter's iteration rebinds them.
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                lr = group["lr"]
                p.data -= lr * group["weight_decay"] * p.data
                grad = p.grad.data
                state = self.state[p]
                b1, b2 = group["betas"]
                eps = group["eps"]
                t = state.get("t", 1)
                prev_m = state.get("m", torch.zeros_like(grad))  # the default is built every time
                prev_v = state.get("v", torch.zeros_like(grad))
                m_t = b1 * prev_m + ((1 - b1) * grad)
                v_t = b2 * prev_v + ((1 - b2) * torch.square(grad))
                step_size = lr * (math.sqrt(1 - b2**t) / (1 - b1**t))
                p.data -= step_size * m_t / (torch.sqrt(v_t) + eps)
                state["m"] = m_t
                state["v"] = v_t
                state["t"] = t + 1


def module_to_order(model: nn.Module) -> Iterator[torch.Tensor]:
    """Tensors in the order ``model.to(device)`` copies them: ``Module._apply`` recurses into children
    first, then the module's own parameters, then its buffers; a shared module's tensors are moved once
    (torch/nn/modules/module.py, ``_apply``)."""
    seen: set[int] = set()

    def visit(m: nn.Module) -> Iterator[torch.Tensor]:
        for child in m.children():
            yield from visit(child)
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                yield t

    yield from visit(model)
