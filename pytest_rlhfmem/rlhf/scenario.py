"""A scenario = framework x model pair x memory strategy x algorithm x flush policy x world size (+ overrides).

Its ``id`` is stable across runs and machines and keys every baseline entry, e.g.
``deepspeed-chat/tiny-opt/zero3/flush-after-inference/x2``. PPO scenarios keep exactly that form; another
algorithm adds a segment after the strategy: ``deepspeed-chat/tiny-opt/zero2/grpo/flush-none/x2``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..hardware import REHEARSAL_DEVICE
from ..rollout import DEFAULT_VLLM, ColocatedEngine, EngineSettingsError

FRAMEWORKS = ("deepspeed-chat", "colossalchat")
STRATEGIES = ("none", "zero1", "zero2", "zero3", "zero3-offload", "grad-ckpt", "all",
              "zero2-offload", "lora", "hydra", "zero3-nvme")
COLOSSAL_STRATEGIES = ("none", "zero2", "zero2-offload", "zero3", "zero3-offload", "grad-ckpt", "all")
FRAMEWORK_STRATEGIES = {"deepspeed-chat": STRATEGIES, "colossalchat": COLOSSAL_STRATEGIES}
FLUSH_POLICIES = ("none", "after-inference", "after-training", "after-both")
DEVICES = ("auto", "cpu", "cuda", REHEARSAL_DEVICE)  # cuda-rehearsal: hardware.py
INFERENCE_PHASES = ("generate", "infer_actor", "infer_reference", "infer_reward", "infer_critic")
TRAINING_PHASES = ("train_actor", "train_critic")
PHASES = ("init",) + INFERENCE_PHASES + TRAINING_PHASES  # PPO's
# Algorithms (sources in critic_free.py): ReMax adds a greedy generation and builds no critic; GRPO
# generates group_size samples per prompt and builds no critic.
ALGORITHMS = ("ppo", "remax", "grpo")
FRAMEWORK_ALGORITHMS = {"deepspeed-chat": ALGORITHMS, "colossalchat": ALGORITHMS}
ALGORITHM_PHASES = {
    "ppo": PHASES,
    "remax": ("init", "generate", "generate_greedy", "infer_actor", "infer_reference", "infer_reward", "train_actor"),
    "grpo": ("init", "generate", "infer_actor", "infer_reference", "infer_reward", "train_actor"),
}
DEFAULT_GROUP_SIZE = 4
HYDRA_FAMILIES = ("opt", "gpt2", "llama")  # families whose LoRA targets models.py names (peft adapts them)

# Overrides a scenario may carry, with their types; anything else is refused by name.
OVERRIDES: dict[str, type] = {
    "batch_size": int, "prompt_len": int, "answer_len": int, "lora_dim": int, "only_optimize_lora": bool,
    "actor_path": str, "critic_path": str, "seed": int, "threads": int, "dtype": str, "group_size": int,
    "inject_crash": str, "inject_hang": str,  # test hooks: "<phase>" or "<phase>:<rank>"
    "ema": bool,  # DeepSpeed-Chat's --enable_ema: the actor's moving-average copy, updated after training
    "hybrid_engine": bool,  # DeepSpeed-Chat's --enable_hybrid_engine: the actor is DeepSpeed's DeepSpeedHybridEngine
    "actor_dropout": float,  # DeepSpeed-Chat's --actor_dropout (configure_dropout on the actor's config)
    # the Hybrid Engine injects DeepSpeed's inference kernels into OPT, as the study's DeepSpeed did (0.19.8 keeps
    # transformers 5's OPT native); fake-CUDA route only (fakecuda/inference_kernels.py)
    "hybrid_engine_kernels": bool,
    # a colocated rollout engine (vLLM's sleep mode, a stand-in: pytest_rlhfmem/rollout/engine.py) generates the
    # rollout; DeepSpeed-Chat's PPO only, the CPU route (docs/colocated-rollout.md)
    "rollout_engine": bool,
    "sleep_level": int,  # 1 or 2 (Worker.sleep(level)); 0: the engine never sleeps
    "gpu_memory_utilization": float,  # vLLM's, in (0, 1]; default 0.3 (TRL's vllm_gpu_memory_utilization)
    "kv_cache_memory_bytes": int,  # vLLM's pin of the KV cache (bytes), where the vllm version has it
    # the engine's environment, not the scenario's identity (out of its id, as a dependency's version is): whose
    # rules (rollout/engine.py: VLLM_VERSIONS) and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in its process
    "vllm": str,
    "engine_expandable_segments": bool,
    "flush_before_wake_up": bool,  # the trainer's empty_cache() right before wake_up (TRL's sync_weights)
    "capacity_mib": int,  # the device the engine sizes its KV cache against (MiB; default 81920, an 80 GiB card)
    # iterations on the same engines (default 1): per-iteration figures, and from 3 their growth (iterations.py)
    "iterations": int,
}
ROLLOUT_ENGINE_SETTINGS = ("sleep_level", "gpu_memory_utilization", "flush_before_wake_up", "capacity_mib",
                           "kv_cache_memory_bytes")
ROLLOUT_ENGINE_ENVIRONMENT = ("vllm", "engine_expandable_segments")
SLEEP_LEVELS = (0, 1, 2)  # 0: never sleeps
NULLABLE = ("actor_dropout",)  # None: not set (actor_dropout None keeps the model config's dropout)
# overrides that are a DeepSpeed-Chat training-script flag
DEEPSPEED_CHAT_ONLY = ("ema", "hybrid_engine", "actor_dropout", "hybrid_engine_kernels")
# the colocated rollout engine: wired into DeepSpeed-Chat's PPO and critic-free iterations
ROLLOUT_ENGINE_ALGORITHMS = ("ppo", "grpo", "remax")


class ScenarioError(ValueError):
    """A scenario with an unknown name or override; the message lists the valid values."""


def _check(kind: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ScenarioError(f"unknown {kind} {value!r}; valid: {', '.join(allowed)}")


@dataclass(frozen=True)
class Scenario:
    framework: str
    models: str
    strategy: str
    flush: str = "none"
    world_size: int = 2
    overrides: dict[str, Any] = field(default_factory=dict)
    algorithm: str = "ppo"

    def __post_init__(self) -> None:
        from .models import MODEL_PAIRS

        _check("framework", self.framework, FRAMEWORKS)
        _check("model pair", self.models, tuple(MODEL_PAIRS))
        _check(f"strategy for {self.framework}", self.strategy, FRAMEWORK_STRATEGIES[self.framework])
        _check("flush policy", self.flush, FLUSH_POLICIES)
        _check(f"algorithm for {self.framework}", self.algorithm, FRAMEWORK_ALGORITHMS[self.framework])
        if self.strategy == "hydra":
            pair = MODEL_PAIRS[self.models]
            if pair.actor.family not in HYDRA_FAMILIES or not pair.lora_targets:
                raise ScenarioError(f"strategy 'hydra' needs a model family peft can adapt with LoRA; {self.models!r} "
                                    f"is {pair.actor.family!r}; valid families: {', '.join(HYDRA_FAMILIES)}")
        if self.strategy == "hydra" and self.algorithm != "ppo":
            raise ScenarioError(f"strategy 'hydra' is Hydra-PPO: algorithm must be ppo, got {self.algorithm!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ScenarioError(f"world_size must be a positive integer, got {self.world_size!r}")
        for k, v in self.overrides.items():
            if k not in OVERRIDES:
                raise ScenarioError(f"unknown scenario override {k!r}; valid: {', '.join(OVERRIDES)}")
            if v is None and k in NULLABLE:
                continue
            kind = (int, float) if OVERRIDES[k] is float else OVERRIDES[k]  # 0 is a valid dropout
            if not isinstance(v, kind) or (OVERRIDES[k] in (int, float) and isinstance(v, bool)):
                raise ScenarioError(f"override {k}={v!r} must be of type {OVERRIDES[k].__name__}")
        for k in DEEPSPEED_CHAT_ONLY:
            if k in self.overrides and (self.framework != "deepspeed-chat" or self.algorithm != "ppo"):
                raise ScenarioError(f"override {k} is a flag of DeepSpeed-Chat's PPO script: framework must be "
                                    f"deepspeed-chat and algorithm ppo, got {self.framework!r} / {self.algorithm!r}")
        for k in ("rollout_engine", *ROLLOUT_ENGINE_SETTINGS, *ROLLOUT_ENGINE_ENVIRONMENT):
            if k in self.overrides and (self.framework != "deepspeed-chat"
                                        or self.algorithm not in ROLLOUT_ENGINE_ALGORITHMS):
                raise ScenarioError(f"override {k} sets the colocated rollout engine, wired into DeepSpeed-Chat's "
                                    f"iterations of {', '.join(ROLLOUT_ENGINE_ALGORITHMS)}: got "
                                    f"{self.framework!r} / {self.algorithm!r}")
        if self.overrides.get("hybrid_engine_kernels") and self.overrides.get("hybrid_engine") is False:
            raise ScenarioError("override hybrid_engine_kernels=True injects the Hybrid Engine's kernels: it needs "
                                "hybrid_engine True (or unset where the pair's script enables it), got False")
        if self.overrides.get("iterations", 1) < 1:
            raise ScenarioError(f"override iterations={self.overrides['iterations']!r}: allowed values are whole "
                                "numbers >= 1")
        if self.overrides.get("iterations", 1) > 1 and self.framework != "deepspeed-chat":
            raise ScenarioError(f"override iterations={self.overrides['iterations']!r}: several iterations run on "
                                "the deepspeed-chat recipe; colossalchat's moves its reference and reward models "
                                "between host and device every iteration, which the recipe does not follow yet: "
                                "allowed for colossalchat: 1")
        self._check_rollout_engine()
        if "group_size" in self.overrides:
            if self.algorithm != "grpo":
                raise ScenarioError(f"override group_size applies to algorithm grpo only, not {self.algorithm!r}")
            if self.overrides["group_size"] < 2:
                raise ScenarioError(f"override group_size={self.overrides['group_size']!r}: GRPO normalises rewards "
                                    "within a group, so it needs at least 2 samples per prompt (group_size >= 2)")

    def _check_rollout_engine(self) -> None:
        """The colocated engine's overrides: one line naming the allowed values."""
        o = self.overrides
        given = [k for k in (*ROLLOUT_ENGINE_SETTINGS, *ROLLOUT_ENGINE_ENVIRONMENT) if k in o]
        if given and not o.get("rollout_engine"):
            raise ScenarioError(f"override {given[0]} sets the colocated rollout engine: it needs rollout_engine=True")
        if o.get("sleep_level", 1) not in SLEEP_LEVELS:
            raise ScenarioError(f"override sleep_level={o['sleep_level']!r}: allowed values are 0 (never sleeps), 1, 2")
        u = o.get("gpu_memory_utilization", 0.3)
        if not 0.0 < u <= 1.0:
            raise ScenarioError(f"override gpu_memory_utilization={u!r}: allowed values are in (0, 1]")
        if o.get("capacity_mib", 1) <= 0:
            raise ScenarioError(f"override capacity_mib={o['capacity_mib']!r}: allowed values are 1 MiB or more")
        try:  # vllm, kv_cache_memory_bytes: the engine's own one line (rollout/engine.py)
            ColocatedEngine(0, vllm=o.get("vllm", DEFAULT_VLLM), kv_cache_memory_bytes=o.get("kv_cache_memory_bytes"))
        except EngineSettingsError as exc:
            raise ScenarioError(f"override {exc}") from None
        if o.get("rollout_engine") and self.strategy == "hydra":
            raise ScenarioError("override rollout_engine=True: the colocated engine is wired into DeepSpeed-Chat's "
                                "PPO iteration, not Hydra-PPO's (strategy hydra)")

    @property
    def id(self) -> str:
        alg = "" if self.algorithm == "ppo" else f"/{self.algorithm}"  # PPO ids stay as they always were
        base = f"{self.framework}/{self.models}/{self.strategy}{alg}/flush-{self.flush}/x{self.world_size}"
        shape = [f"{k}={self.overrides[k]}" for k in sorted(self.overrides)
                 if k in ("batch_size", "prompt_len", "answer_len", "lora_dim", "only_optimize_lora", "dtype",
                          "group_size", "ema", "hybrid_engine", "actor_dropout", "hybrid_engine_kernels",
                          "rollout_engine", *ROLLOUT_ENGINE_SETTINGS, "iterations")
                 and (k, self.overrides[k]) != ("iterations", 1)]  # one iteration: the id it always had
        return base + ("/" + ",".join(shape) if shape else "")

    def get(self, key: str, default: Any = None) -> Any:
        return self.overrides.get(key, default)

    @property
    def iterations(self) -> int:
        """The iterations to run on the same engines (override ``iterations``, default 1)."""
        return int(self.overrides.get("iterations", 1))

    def flush_after(self, phase: str) -> bool:
        """Does the flush policy call empty_cache at the end of ``phase``?"""
        if phase in INFERENCE_PHASES or phase == "generate_greedy":
            return self.flush in ("after-inference", "after-both")
        if phase in TRAINING_PHASES:
            return self.flush in ("after-training", "after-both")
        return False

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases of this scenario's algorithm, in order."""
        return ALGORITHM_PHASES[self.algorithm]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["id"] = self.id
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Scenario:
        return cls(d["framework"], d["models"], d["strategy"], d.get("flush", "none"), int(d.get("world_size", 2)),
                   dict(d.get("overrides") or {}), d.get("algorithm", "ppo"))
