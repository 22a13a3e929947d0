"""The Hybrid Engine with DeepSpeed's inference kernels injected into OPT, as the study's DeepSpeed ran it.

DeepSpeed-Chat's ``--enable_hybrid_engine`` replaced each ``OPTDecoderLayer`` of the actor with DeepSpeed's
inference layer (``DeepSpeedTransformerInference``, its ``transformer_inference`` CUDA op) for generation.
DeepSpeed 0.19.8 no longer does so for transformers 5's OPT (``runtime/hybrid_engine.py:
populate_all_inference_policies`` keeps a decoder whose ``forward`` takes ``past_key_values`` on the native
path, PR 8523: "The injected OPT layer only implements the legacy tuple-cache contract"). On the fake-CUDA
route with the simulated device (``tensors=sim``), :func:`install` runs that injected path with DeepSpeed's own
Python (policy, container, ``DeepSpeedHybridEngine.generate``, ``ds_transformer.py``, ``ds_attention.py``,
``ds_mlp.py``, the ``op_binding`` wrappers); only these parts are stand-ins, each named in the result's
``standins``:

- :class:`InferenceKernels`, the ``transformer_inference`` op: every kernel the OPT layer calls makes exactly
  the caching-allocator allocations its C++ makes (``csrc/transformer/inference/csrc/pt_binding.cpp``, DeepSpeed
  0.19.8): ``qkv_gemm``, ``linear_layer``, ``softmax_context``, ``vector_matmul`` and ``mlp_gemm`` return
  ``at::from_blob`` views of the workspace (no allocation), ``residual_add_bias`` works in place, ``layer_norm``
  makes one ``at::empty_like(input)``. The workspace itself is one raw ``cudaMalloc``
  (``inference_context.h: GenWorkSpace``), which lowers the device's free memory but is not ``reserved``: it is
  not in the trace; :attr:`InferenceKernels.raw_allocations` keeps its size (the result's
  ``outside_caching_allocator``). The views are ``meta`` tensors: shapes without storage, as the kernels' outputs
  are storage the caching allocator never sees.
- the legacy cache contract: transformers 4's OPT decoder passed each layer its ``(key, value)`` and took the
  layer's ``presents`` back; transformers 5's passes a ``DynamicCache``. :func:`_legacy_cache_bridge` gives the
  injected layer the call it was written for and puts its ``presents`` (views of the workspace's KV cache) into
  the ``DynamicCache`` without a copy, so the decoder sees the sequence length.
- LoRA fusion: DeepSpeed fuses DeepSpeed-Chat's own LoRA layers (``lora_right_weight``); the recipe's LoRA is
  peft's, so the engine's ``_fuse_lora_layer`` / ``_unfuse_lora_layer`` merge and unmerge that layer's peft
  adapters. Both compute ``scaling * (B @ A)`` into two weight-sized temporaries and add it in place
  (``containers/features/hybrid_engine.py: fuse_lora``; peft ``lora/layer.py: merge``).
"""

from __future__ import annotations

from typing import Any

import torch

MIB = 2**20


class InferenceKernels:
    """DeepSpeed's ``transformer_inference`` op for the injected OPT layer on the simulated device.

    Kernel names as bound in ``pt_binding.cpp`` (each ``_fp16``/``_bf16``/``_fp32``; ``layer_norm`` also plain);
    any other name raises ``AttributeError``, as a missing symbol does (the ``op_binding`` wrapper then takes
    its torch fallback: :attr:`calls` shows which kernels ran). Token bookkeeping follows ``InferenceContext``:
    a prompt (more than one token) resets the count to its length; a decode step adds one token after the last
    layer.
    """

    KERNELS = ("allocate_workspace", "qkv_gemm", "linear_layer", "softmax_context", "vector_matmul", "mlp_gemm",
               "residual_add_bias", "layer_norm")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.raw_allocations: list[dict] = []  # raw cudaMalloc calls: {"name", "bytes"}
        self.kv_cache: torch.Tensor | None = None  # [layers, 2, batch, heads, max_out_tokens, head_dim], meta
        self.tokens = 0

    DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # the kernels' name suffixes

    def __getattr__(self, name: str) -> Any:
        base, _, suffix = name.rpartition("_") if name.endswith(tuple(self.DTYPES)) else (name, "", "fp16")
        if base in self.KERNELS:
            kernel = getattr(self, f"_{base}")

            def counted(*args: Any) -> Any:
                self.count(base)
                if base == "allocate_workspace":  # sizeof(T) of the template instance
                    return kernel(*args, dtype=self.DTYPES[suffix])
                return kernel(*args)

            return counted
        if name in ("release_workspace", "retake_workspace", "reset_cache"):
            return getattr(self, f"_{name}")
        raise AttributeError(f"DeepSpeed's transformer_inference op has no stand-in for {name}")

    def count(self, name: str) -> None:
        """One more call of ``name`` in :attr:`calls`."""
        self.calls[name] = self.calls.get(name, 0) + 1

    # ---- workspace (inference_context.h: GenWorkSpace, release_workspace, retake_workspace) ----------------------
    def _allocate_workspace(self, hidden: int, heads: int, prompt_len: int, batch: int, num_layers: int,
                            mp_size: int, external_cache: bool, rank: int, max_out_tokens: int,
                            min_out_tokens: int, dtype: torch.dtype) -> None:
        """``GenWorkSpace``: ``(act + temp + cache) * max_out_tokens`` elements of ``dtype`` in one
        raw ``cudaMalloc``, with ``act = 10 * heads * d_eff * batch``, ``temp = batch * heads / mp *
        max_out_tokens`` (the unfused attention scores), ``cache = layers * batch * heads * d_eff / mp * 2``
        (keys and values); ``d_eff`` is the head size rounded up to 32, 64 or 128. The count of free memory that
        caps the length is not modelled (the Hybrid Engine asks for ``min_out_tokens == max_out_tokens``)."""
        head = hidden // heads
        d_eff = next((d for d in (32, 64, 128) if head <= d), head)
        act = 10 * heads * d_eff * batch
        temp = batch * (heads // mp_size) * max_out_tokens
        cache = 0 if external_cache else num_layers * batch * (heads * d_eff // mp_size) * 2
        nbytes = (act + temp + cache) * max_out_tokens * dtype.itemsize
        if self.raw_allocations and self.raw_allocations[-1]["bytes"] >= nbytes:
            return  # a smaller request keeps the buffer
        self.raw_allocations.append({"name": "InferenceContext workspace (cudaMalloc)", "bytes": nbytes,
                                     "shape": {"batch": batch, "layers": num_layers, "max_out_tokens": max_out_tokens,
                                               "hidden": hidden, "heads": heads}})
        self.kv_cache = torch.empty((num_layers, 2, batch, heads // mp_size, max_out_tokens, head), device="meta",
                                    dtype=dtype)

    def _release_workspace(self) -> None:
        self.raw_allocations.append({"name": "InferenceContext workspace (cudaFree)",
                                     "bytes": -self.raw_allocations[0]["bytes"]})

    def _retake_workspace(self) -> bool:
        self.raw_allocations.append({"name": "InferenceContext workspace (cudaMalloc again)",
                                     "bytes": self.raw_allocations[0]["bytes"]})
        return True

    def _reset_cache(self) -> None:
        self.tokens = 0

    # ---- kernels: outputs are views of the workspace (at::from_blob) ---------------------------------------------
    @staticmethod
    def _view(like: torch.Tensor, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype, device="meta")

    def _qkv_gemm(self, input: torch.Tensor, weight: torch.Tensor, *rest: Any) -> list[torch.Tensor]:
        """``ds_qkv_gemm``: output ``[B, S, 3H]`` and the normed input ``[B, S, H]``, both in the workspace
        (transposed mode: ``out = weight.size(0)``)."""
        b, s = input.shape[:2]
        return [self._view(input, b, s, weight.shape[0]), self._view(input, b, s, input.shape[2])]

    def _linear_layer(self, input: torch.Tensor, weight: torch.Tensor, *rest: Any) -> list[torch.Tensor]:
        """``ds_linear_layer`` (post-LN models' QKV): ``[B, S, 3H]`` in the workspace."""
        b, s = input.shape[:2]
        return [self._view(input, b, s, weight.shape[0])]

    def _softmax_context(self, qkv: torch.Tensor, attn_mask: Any, rotary_dim: int, rotate_half: bool,
                         rotate_every_two: bool, heads: int, num_kv: int, norm_factor: float,
                         triangular: bool, local: bool, window: int, no_masking: bool, layer_id: int,
                         num_layers: int, *rest: Any) -> list[torch.Tensor]:
        """``ds_softmax_context``: the context ``[B, S, H]`` and this layer's keys and values so far
        ``[B, heads, T, head_dim]``, all in the workspace (the KV cache is written in place)."""
        b, s = qkv.shape[:2]
        hidden = qkv.shape[2] // 3
        if s > 1:  # a prompt: InferenceContext::reset_tokens(seq_len)
            tokens = s
            if layer_id == num_layers - 1:
                self.tokens = s
        else:
            tokens = self.tokens + 1
            if layer_id == num_layers - 1:  # advance_tokens()
                self.tokens += 1
        cache = self.kv_cache
        assert cache is not None, "softmax_context before allocate_workspace"
        keys, values = cache[layer_id, 0, :b, :, :tokens], cache[layer_id, 1, :b, :, :tokens]
        return [self._view(qkv, b, s, hidden), keys, values]

    def _vector_matmul(self, input: torch.Tensor, weight: torch.Tensor, *rest: Any) -> torch.Tensor:
        """``ds_vector_matmul``: ``[B, S, out]`` in the workspace."""
        return self._view(input, input.shape[0], input.shape[1], weight.shape[0])

    def _mlp_gemm(self, input: torch.Tensor, residual: torch.Tensor, *rest: Any) -> list[torch.Tensor]:
        """``ds_mlp_gemm``: the MLP's output and the normed input, ``[B, S, H]`` each, in the workspace."""
        shape = (input.shape[0], input.shape[1], input.shape[2])
        return [self._view(input, *shape), self._view(input, *shape)]

    def _residual_add_bias(self, *args: Any) -> None:
        """``residual_add_bias``: writes the residual in place."""

    def _layer_norm(self, vals: torch.Tensor, *rest: Any) -> torch.Tensor:
        """``ds_layer_norm``: ``at::empty_like(input)``, through the caching allocator."""
        return torch.empty_like(vals)


def _legacy_cache_bridge(layer_forward: Any) -> Any:
    """``DeepSpeedTransformerInference.forward`` as transformers 4's OPT decoder called it, for transformers 5's:
    the layer keeps its keys and values in the workspace and returns them as ``presents``; they go into the
    ``DynamicCache`` layer as they are (no copy), and the hidden states are returned alone."""

    def forward(self: Any, hidden_states: torch.Tensor, attention_mask: Any = None, past_key_values: Any = None,
                use_cache: bool = False, **kwargs: Any) -> torch.Tensor:
        if past_key_values is None:  # transformers 5.24 renamed the decoder layer's argument
            past_key_values = kwargs.get("cache")
        out = layer_forward(self, hidden_states, attention_mask=attention_mask, use_cache=use_cache)
        if isinstance(out, tuple) and isinstance(out[0], tuple):  # return_tuple around (output, presents)
            out = out[0]
        output = out[0] if isinstance(out, tuple) else out
        if use_cache and past_key_values is not None:
            layer = past_key_values.layers[self.config.layer_id]
            layer.keys, layer.values = out[1]
            layer.is_initialized = True
        return output

    return forward


def _peft_lora_layers(layer: torch.nn.Module) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in layer.modules() if isinstance(m, LoraLayer)]


def install() -> tuple[InferenceKernels, list[str]]:
    """Install the injected Hybrid Engine (see the module docstring) before the actor's engine is built.
    Returns the op stand-in (its calls and raw allocations are read after the iteration) and the stand-ins'
    names."""
    from deepspeed.model_implementations.transformers.ds_transformer import DeepSpeedTransformerInference
    from deepspeed.module_inject.layers import EmbeddingLayer, LinearLayer, Normalize, OPTEmbedding
    from deepspeed.module_inject.replace_policy import HFOPTLayerPolicy
    from deepspeed.ops.transformer.inference.op_binding.base import BaseOp
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    from transformers.models.opt.modeling_opt import OPTDecoderLayer, OPTLearnedPositionalEmbedding

    kernels = InferenceKernels()
    BaseOp.inference_module = kernels
    populate = DeepSpeedHybridEngine.populate_all_inference_policies

    def populate_with_opt(self: Any) -> None:
        """DeepSpeed's policies, with OPT's layer policy and the auxiliary ones it adds with it (the same
        function before PR 8523's check)."""
        populate(self)
        if any(isinstance(m, OPTDecoderLayer) for m in self.module.modules()):
            self.inference_policies.update({
                OPTDecoderLayer: (self.new_inference_container, HFOPTLayerPolicy),
                torch.nn.Linear: (LinearLayer,), torch.nn.Embedding: (EmbeddingLayer,),
                torch.nn.LayerNorm: (Normalize,), OPTLearnedPositionalEmbedding: (OPTEmbedding,)})

    create = getattr(DeepSpeedHybridEngine.create_inference_module, "__wrapped__",  # not standins' refusal
                     DeepSpeedHybridEngine.create_inference_module)

    def create_with_peft_lora(self: Any) -> None:
        """The engine's containers, then each layer's peft LoRA parameters where DeepSpeed keeps DeepSpeed-Chat's
        (``layer_lora_params``, ``all_lora_params``), so ``generate()`` gathers and fuses them."""
        create(self)
        self._peft_lora = [_peft_lora_layers(m) for m in self._orig_modules]
        for layer_id, loras in enumerate(self._peft_lora):
            params = [p for m in loras for n, p in m.named_parameters() if "lora_" in n]
            self.layer_lora_params[layer_id] = params
            self.all_lora_params.extend(params)

    def fuse(self: Any, layer_id: int) -> None:
        for m in self._peft_lora[layer_id]:
            m.merge()
            kernels.count("fuse_lora (peft merge)")

    def unfuse(self: Any, layer_id: int) -> None:
        for m in self._peft_lora[layer_id]:
            m.unmerge()
            kernels.count("unfuse_lora (peft unmerge)")

    DeepSpeedHybridEngine.populate_all_inference_policies = populate_with_opt
    DeepSpeedHybridEngine.create_inference_module = create_with_peft_lora
    DeepSpeedHybridEngine._fuse_lora_layer = fuse
    DeepSpeedHybridEngine._unfuse_lora_layer = unfuse
    DeepSpeedTransformerInference.forward = _legacy_cache_bridge(DeepSpeedTransformerInference.forward)
    return kernels, [
        "Hybrid Engine with its inference kernels injected into OPT (the study's DeepSpeed; 0.19.8 keeps "
        "transformers 5's OPT native): transformer_inference kernels as allocation stand-ins (outputs are views "
        "of the raw-cudaMalloc workspace; layer_norm's empty_like), the legacy (key, value) cache contract "
        "bridged to DynamicCache, peft's LoRA fused where DeepSpeed fuses DeepSpeed-Chat's"]
