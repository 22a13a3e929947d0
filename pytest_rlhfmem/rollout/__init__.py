"""A colocated rollout engine's device memory (vLLM's sleep mode), as a stand-in: ``engine.py``.

docs/colocated-rollout.md says which semantics are followed and where they were read; docs/incidents.md which vLLM
versions' rules are modelled (:data:`VLLM_VERSIONS`).
"""

from .engine import (
    ALL_TAGS_ZERO, CUDA_GRAPH, DEFAULT_VLLM, FLUSH_BEFORE_WAKE_UP, INIT_SNAPSHOT, KV_CACHE, KV_CACHE_EXPANDABLE,
    NEXT_ROLLOUT, SLEEP_LEVELS, TORCH_PEAK, VLLM_VERSIONS, WEIGHTS, WEIGHTS_EXPANDABLE, ColocatedEngine,
    EngineSettingsError, EngineStandIn, VllmRules, check_free_at_init, colocated_trace, engine_of, kv_cache_bytes,
    oom_causes, sizes_at, with_mapping_sizes, without_engine_expandable_segments,
)

__all__ = ["ALL_TAGS_ZERO", "CUDA_GRAPH", "DEFAULT_VLLM", "FLUSH_BEFORE_WAKE_UP", "INIT_SNAPSHOT", "KV_CACHE",
           "KV_CACHE_EXPANDABLE", "NEXT_ROLLOUT", "SLEEP_LEVELS", "TORCH_PEAK", "VLLM_VERSIONS", "WEIGHTS",
           "WEIGHTS_EXPANDABLE", "ColocatedEngine", "EngineSettingsError", "EngineStandIn", "VllmRules",
           "check_free_at_init", "colocated_trace", "engine_of", "kv_cache_bytes", "oom_causes", "sizes_at",
           "with_mapping_sizes", "without_engine_expandable_segments"]
