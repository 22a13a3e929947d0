"""Model pairs as data: (actor = reference, critic = reward) built from published configs, random weights.

Memory depends on shapes, not on weight values, so nothing is ever downloaded: each config below is the
published ``config.json`` of the named Hugging Face model, reduced to the fields that set shapes. A local
checkpoint directory may be given instead (``actor_path`` / ``critic_path`` overrides); its weights are
loaded with ``from_pretrained(local_files_only=True)``.

| pair | actor / reference | critic / reward | LoRA dim | sequence (prompt + answer) |
|---|---|---|---|---|
| ``opt-1.3b`` | facebook/opt-1.3b | facebook/opt-350m | 128 | 256 + 256 |
| ``opt-6.7b`` | facebook/opt-6.7b | facebook/opt-350m | 128 | 256 + 256 |
| ``gpt2-xl`` | gpt2-xl | gpt2-medium | 128 | 256 + 256 |
| ``llama-2-7b`` | meta-llama/Llama-2-7b-hf | meta-llama/Llama-2-7b-hf (*) | 128 | 256 + 256 |
| ``opt-125m`` | facebook/opt-125m | facebook/opt-125m | 128 | 64 + 64 |
| ``tiny-opt`` | OPT, hidden 256, 4 layers, vocab 1024 | OPT, hidden 128, 2 layers | 8 | 16 + 16 |
| ``tiny-gpt2`` | GPT-2, hidden 256, 4 layers, vocab 1024 | GPT-2, hidden 128, 2 layers | 8 | 16 + 16 |

(*) Llama-2 has no small sibling of the same tokenizer; DeepSpeed-Chat's own Llama-2 step-3 scripts train
a Llama-2-7b critic, so we do too.

Tiny pairs also scale DeepSpeed's communication buckets with the model (``bucket_elements``): DeepSpeed's
defaults (5e8 elements) are allocated whatever the model size, so at tiny scale the buckets would be the
whole peak and no budget could see a model-side regression. The study's pairs keep DeepSpeed-Chat's
settings (it sets no bucket sizes, so DeepSpeed's defaults apply).

``opt-125m`` is the mid-size pair for CPU runs where the large pool is exercised (its 768 x 50272 embedding
and logits are tens of MiB). It keeps the study's ratio of bucket to actor size: 5e8 elements against
OPT-1.3b's 1.3e9 parameters is 0.38, so 5e7 elements against OPT-125m's 1.25e8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """One model: architecture family and the shape fields of its config."""

    family: str  # "opt" | "gpt2" | "llama"
    config: dict[str, Any]
    source: str  # the published model this mirrors, or "tiny"


@dataclass(frozen=True)
class ModelPair:
    name: str
    actor: ModelSpec
    critic: ModelSpec
    lora_dim: int
    prompt_len: int
    answer_len: int
    bucket_elements: int | None = None  # None: DeepSpeed's defaults
    lora_targets: tuple[str, ...] = field(default=())


_OPT_COMMON = {"vocab_size": 50272, "max_position_embeddings": 2048, "do_layer_norm_before": True,
               "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "activation_function": "relu",
               "enable_bias": True}
OPT_1_3B = ModelSpec("opt", {**_OPT_COMMON, "hidden_size": 2048, "ffn_dim": 8192, "num_hidden_layers": 24,
                             "num_attention_heads": 32, "word_embed_proj_dim": 2048}, "facebook/opt-1.3b")
OPT_6_7B = ModelSpec("opt", {**_OPT_COMMON, "hidden_size": 4096, "ffn_dim": 16384, "num_hidden_layers": 32,
                             "num_attention_heads": 32, "word_embed_proj_dim": 4096}, "facebook/opt-6.7b")
OPT_350M = ModelSpec("opt", {**_OPT_COMMON, "hidden_size": 1024, "ffn_dim": 4096, "num_hidden_layers": 24,
                             "num_attention_heads": 16, "word_embed_proj_dim": 512,
                             "do_layer_norm_before": False}, "facebook/opt-350m")
OPT_125M = ModelSpec("opt", {**_OPT_COMMON, "hidden_size": 768, "ffn_dim": 3072, "num_hidden_layers": 12,
                             "num_attention_heads": 12, "word_embed_proj_dim": 768}, "facebook/opt-125m")
_GPT2_COMMON = {"vocab_size": 50257, "n_positions": 1024, "bos_token_id": 50256, "eos_token_id": 50256,
                "activation_function": "gelu_new"}
GPT2_XL = ModelSpec("gpt2", {**_GPT2_COMMON, "n_embd": 1600, "n_layer": 48, "n_head": 25}, "gpt2-xl")
GPT2_MEDIUM = ModelSpec("gpt2", {**_GPT2_COMMON, "n_embd": 1024, "n_layer": 24, "n_head": 16}, "gpt2-medium")
LLAMA_2_7B = ModelSpec("llama", {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                                 "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1,
                                 "eos_token_id": 2, "pad_token_id": 0}, "meta-llama/Llama-2-7b-hf")

_TINY_OPT = {"vocab_size": 1024, "max_position_embeddings": 128, "do_layer_norm_before": True,
             "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "activation_function": "relu",
             "enable_bias": True}
TINY_OPT_ACTOR = ModelSpec("opt", {**_TINY_OPT, "hidden_size": 256, "ffn_dim": 1024, "num_hidden_layers": 4,
                                   "num_attention_heads": 4, "word_embed_proj_dim": 256}, "tiny")
TINY_OPT_CRITIC = ModelSpec("opt", {**_TINY_OPT, "hidden_size": 128, "ffn_dim": 512, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "word_embed_proj_dim": 128}, "tiny")
_TINY_GPT2 = {"vocab_size": 1024, "n_positions": 128, "bos_token_id": 1023, "eos_token_id": 1023,
              "activation_function": "gelu_new"}
TINY_GPT2_ACTOR = ModelSpec("gpt2", {**_TINY_GPT2, "n_embd": 256, "n_layer": 4, "n_head": 4}, "tiny")
TINY_GPT2_CRITIC = ModelSpec("gpt2", {**_TINY_GPT2, "n_embd": 128, "n_layer": 2, "n_head": 4}, "tiny")

# LoRA targets: DeepSpeed-Chat converts every nn.Linear under "decoder.layers."; GPT-2 uses Conv1D,
# which peft adapts too (fan_in_fan_out).
OPT_LORA = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
GPT2_LORA = ("c_attn", "c_proj", "c_fc")
LLAMA_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

MODEL_PAIRS: dict[str, ModelPair] = {
    "opt-1.3b": ModelPair("opt-1.3b", OPT_1_3B, OPT_350M, 128, 256, 256, None, OPT_LORA),
    "opt-6.7b": ModelPair("opt-6.7b", OPT_6_7B, OPT_350M, 128, 256, 256, None, OPT_LORA),
    "gpt2-xl": ModelPair("gpt2-xl", GPT2_XL, GPT2_MEDIUM, 128, 256, 256, None, GPT2_LORA),
    "llama-2-7b": ModelPair("llama-2-7b", LLAMA_2_7B, LLAMA_2_7B, 128, 256, 256, None, LLAMA_LORA),
    "opt-125m": ModelPair("opt-125m", OPT_125M, OPT_125M, 128, 64, 64, 5 * 10**7, OPT_LORA),
    "tiny-opt": ModelPair("tiny-opt", TINY_OPT_ACTOR, TINY_OPT_CRITIC, 8, 16, 16, 2 * 10**5, OPT_LORA),
    "tiny-gpt2": ModelPair("tiny-gpt2", TINY_GPT2_ACTOR, TINY_GPT2_CRITIC, 8, 16, 16, 2 * 10**5, GPT2_LORA),
}


def get_pair(name: str) -> ModelPair:
    """The pair called ``name``; raises ``ValueError`` listing the valid names."""
    try:
        return MODEL_PAIRS[name]
    except KeyError:
        raise ValueError(f"unknown model pair {name!r}; valid: {', '.join(MODEL_PAIRS)}") from None


def hf_config(spec: ModelSpec):
    """A transformers config object for ``spec`` (no network access)."""
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    cls = {"opt": OPTConfig, "gpt2": GPT2Config, "llama": LlamaConfig}[spec.family]
    cfg = cls(**spec.config)
    cfg.use_cache = True
    return cfg


def output_width(config) -> int:
    """Width of a backbone's last hidden state, from a transformers config object: what a value head
    reads. OPT projects to ``word_embed_proj_dim`` (512 for OPT-350m, whose ``hidden_size`` is 1024);
    GPT-2 names it ``n_embd``; others ``hidden_size``. Taken from the model actually built, so a
    ``critic_path`` checkpoint of another width gets a value head that fits it."""
    for name in ("word_embed_proj_dim", "hidden_size", "n_embd"):
        width = getattr(config, name, None)
        if width:
            return int(width)
    raise ValueError(f"{type(config).__name__} names no output width (word_embed_proj_dim, hidden_size, n_embd)")


def configure_dropout(config, dropout: float | None):
    """DeepSpeed-Chat's ``configure_dropout`` (``dschat/utils/model/model_utils.py``): with ``dropout`` not
    None, set each of ``dropout``, ``attention_dropout``, ``hidden_dropout``, ``activation_dropout`` the config
    has to it; returns ``config``."""
    if dropout is not None:
        for key in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout"):
            if hasattr(config, key):
                setattr(config, key, dropout)
    return config


def build_causal_lm(spec: ModelSpec, path: str | None = None, dropout: float | None = None):
    """The actor/reference: a causal LM with random weights (or local weights from ``path``); ``dropout``
    as :func:`configure_dropout` (None keeps the config's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path:
        config = configure_dropout(AutoConfig.from_pretrained(path, local_files_only=True), dropout)
        return AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True)
    return AutoModelForCausalLM.from_config(configure_dropout(hf_config(spec), dropout))


def build_base_model(spec: ModelSpec, path: str | None = None):
    """The critic/reward backbone (no LM head), as DeepSpeed-Chat's ``create_critic_model`` uses."""
    from transformers import AutoModel

    if path:
        return AutoModel.from_pretrained(path, local_files_only=True)
    return AutoModel.from_config(hf_config(spec))
