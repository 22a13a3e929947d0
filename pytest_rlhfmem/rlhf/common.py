"""What both recipes share besides the PPO maths: precision, LoRA through peft, prompts and their attention
mask, and the phase step (:class:`PhaseSteps`: the phase mark, the fault-injection hook that tests the launcher,
the flush policy)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from ..record.recorder import PhaseRecord, Recorder
from ..rollout import DEFAULT_VLLM, ColocatedEngine, EngineStandIn
from .models import ModelPair
from .scenario import Scenario

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_dtype(scenario: Scenario, device: str, cpu_default: str = "fp16") -> torch.dtype:
    """The scenario's ``dtype`` override, else the GPU's precision: fp16, DeepSpeed-Chat's default
    (``--dtype fp16``, ``dschat/utils/ds_utils.py``), on CUDA and on CPU alike, so that a CPU run allocates
    the model-state buffers a GPU run allocates (fp16 weights and gradients, fp32 masters and Adam states).
    ``cpu_default`` lets a recipe keep another CPU precision. Raises ``ValueError`` naming the valid values."""
    name = scenario.get("dtype") or ("fp16" if device == "cuda" else cpu_default)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def convert_to_lora(model: torch.nn.Module, pair: ModelPair, dim: int, only_optimize_lora: bool):
    """LoRA of rank ``dim`` (scaling 1/dim, as DeepSpeed-Chat's ``lora_scaling=1``) on the decoder layers'
    linear maps, through peft. Base weights of adapted layers are frozen; biases, embeddings and norms
    stay trainable unless ``only_optimize_lora``."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=dim, lora_alpha=1, lora_dropout=0.0, target_modules=list(pair.lora_targets),
                     fan_in_fan_out=pair.actor.family == "gpt2", bias="none")
    # One dtype for every parameter: DeepSpeed's fp16/bf16 engines flatten (ZeRO-1/2) or defragment
    # (ZeRO-3, ``zero/utils.py: defragment``) the parameters into buffers of a single dtype, so the adapters
    # take the base model's dtype (peft would otherwise keep them in fp32).
    dtype = next(model.parameters()).dtype
    model = get_peft_model(model, cfg, autocast_adapter_dtype=False)
    for name, p in model.named_parameters():
        if "lora_" in name and p.dtype != dtype:
            p.data = p.data.to(dtype)
    if not only_optimize_lora:
        for name, p in model.named_parameters():
            if "lora_" not in name and not name.endswith("base_layer.weight"):
                p.requires_grad_(True)
    return model


def random_prompts(pair: ModelPair, batch: int, prompt_len: int, device: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random token ids ``[batch, prompt_len]`` with the first sequence left-padded by a quarter, its
    attention mask, and the pad id. Memory depends on shapes, not on text."""
    vocab = pair.actor.config["vocab_size"]
    pad_id = pair.actor.config.get("pad_token_id", 0) or 0
    prompts = torch.randint(3, vocab, (batch, prompt_len), device=device)
    mask = torch.ones_like(prompts)
    mask[0, : prompt_len // 4] = 0
    prompts[0, : prompt_len // 4] = pad_id
    return prompts, mask, pad_id


def full_attention_mask(prompt_mask: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """The attention mask of generated sequences, ``[b, prompt_len + answer_len]``: the prompts' mask
    ``prompt_mask`` ``[b, prompt_len]`` (0 on the left padding) followed by ones over the answers, which
    have no padding (both recipes generate with ``min_new_tokens = max_new_tokens``). ``seq`` is
    ``[b, prompt_len + answer_len]``; the ones take ``prompt_mask``'s dtype and device."""
    b, prompt_len = prompt_mask.shape
    answers = torch.ones(b, seq.shape[1] - prompt_len, dtype=prompt_mask.dtype, device=prompt_mask.device)
    return torch.cat([prompt_mask, answers], dim=1)


class FaultHooks:
    """Test hooks for the launcher's failure handling: ``inject_crash`` / ``inject_hang`` name a phase
    (optionally ``phase:rank``) at whose end this rank raises or sleeps forever."""

    def __init__(self, scenario: Scenario, rank: int) -> None:
        self.crash = self._parse(scenario.get("inject_crash"), rank)
        self.hang = self._parse(scenario.get("inject_hang"), rank)

    @staticmethod
    def _parse(spec: str | None, rank: int) -> str | None:
        if not spec:
            return None
        phase, _, r = spec.partition(":")
        return phase if (not r or int(r) == rank) else None

    def at(self, phase: str) -> None:
        if self.crash == phase:
            raise RuntimeError(f"injected crash in phase {phase} (inject_crash)")
        if self.hang == phase:
            while True:
                time.sleep(3600)


class PhaseSteps:
    """The phase step of both recipes: ``steps = PhaseSteps(scenario, rec, rank)``, then
    ``with steps("infer_actor"): ...`` around each phase of the iteration. In this order:

    1. the phase opens (:meth:`Recorder.phase`: a PHASE mark in the trace, the phase's clock starts);
    2. the body runs;
    3. the fault hook (:meth:`FaultHooks.at`): at the body's normal end, inside the phase, so an injected
       crash is an error of that phase and an injected hang holds it open;
    4. the phase closes;
    5. the flush policy: :meth:`Recorder.flush` ``("after-<phase>")`` (``torch.cuda.empty_cache()`` on CUDA, a
       FLUSH mark on CPU) where the scenario's policy says so (:meth:`Scenario.flush_after`).

    When the body raises, the phase closes with the error (the rank's failure names it) and neither the hook
    nor the flush runs. The policy is read from the scenario once, here: :attr:`flush_after` holds those of
    the scenario's phases (:attr:`Scenario.phases`) after which the cache is emptied (no policy names
    ``init``). The step marks any name; a recipe marks a phase outside the scenario's (DeepSpeed-Chat's
    ``ema``) with :meth:`Recorder.phase` itself: no fault hook, no flush.
    """

    def __init__(self, scenario: Scenario, rec: Recorder, rank: int) -> None:
        self.rec = rec
        self.hooks = FaultHooks(scenario, rank)
        self.flush_after = frozenset(p for p in scenario.phases if scenario.flush_after(p))
        self.n_iterations = scenario.iterations

    def iterations(self) -> Iterator[int]:
        """The iterations of the run on the engines built once (the scenario's override ``iterations``, default 1):
        yields 1..N. With N > 1 each begins with :meth:`Recorder.iteration` (per-iteration figures, their growth:
        ``iterations.py``); a single iteration marks nothing, so its trace and figures are what they always were."""
        for k in range(1, self.n_iterations + 1):
            if self.n_iterations > 1:
                self.rec.iteration()
            yield k

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[PhaseRecord]:
        with self.rec.phase(name) as record:
            yield record
            self.hooks.at(name)
        if name in self.flush_after:
            self.rec.flush(f"after-{name}")


DEFAULT_CAPACITY_MIB = 81920  # an 80 GiB card: what a colocated engine sizes its KV cache against by default


def engine_card_bytes(scenario: Scenario) -> int | None:
    """The card a colocated rollout engine's scenario runs on (bytes: override ``capacity_mib``, default
    :data:`DEFAULT_CAPACITY_MIB`); ``None`` without an engine (the replay runs unlimited). The engine sized its KV
    cache against this card, so the simulated replay runs at it: the trainer's retries and OOMs, and a wake-up the
    card cannot back, are what such a scenario is for (``record/rank.py: rank_result``'s ``capacity``)."""
    if not scenario.get("rollout_engine"):
        return None
    return int(scenario.get("capacity_mib", DEFAULT_CAPACITY_MIB)) * 2**20


def rollout_stand_in(scenario: Scenario, rec: Recorder, actor: torch.nn.Module, dtype: torch.dtype
                     ) -> EngineStandIn | None:
    """A colocated rollout engine for ``scenario`` (override ``rollout_engine``; ``None`` without it), started now:
    its weights the actor's parameters in ``dtype`` (bytes; ZeRO-3's ``ds_numel``: the whole parameter, as vLLM
    holds it), ``gpu_memory_utilization`` (default 0.3, TRL's), ``sleep_level`` (default 1; 0: never sleeps),
    ``flush_before_wake_up`` (default True: TRL's ``empty_cache()`` before ``wake_up``), its KV cache sized against
    ``capacity_mib`` (default an 80 GiB card) by ``vllm``'s rules (default ``rollout.DEFAULT_VLLM``) or pinned by
    ``kv_cache_memory_bytes``, ``engine_expandable_segments`` in its process. Raises ``rollout.EngineSettingsError``
    when no KV cache fits or vLLM's start check fails."""
    if not scenario.get("rollout_engine"):
        return None
    elements = sum(int(getattr(p, "ds_numel", p.numel())) for p in actor.parameters())
    engine = ColocatedEngine(weights_bytes=elements * torch.empty((), dtype=dtype).element_size(),
                             gpu_memory_utilization=scenario.get("gpu_memory_utilization", 0.3),
                             sleep_level=scenario.get("sleep_level", 1) or None,
                             flush_before_wake_up=scenario.get("flush_before_wake_up", True),
                             vllm=scenario.get("vllm", DEFAULT_VLLM),
                             kv_cache_memory_bytes=scenario.get("kv_cache_memory_bytes"),
                             expandable_segments=scenario.get("engine_expandable_segments", False))
    stand_in = EngineStandIn(engine, rec, engine_card_bytes(scenario))
    stand_in.start()
    return stand_in
