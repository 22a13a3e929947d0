"""A colocated rollout engine's device memory (vLLM's sleep mode), as a stand-in: ``engine.py``.

docs/colocated-rollout.md says which semantics are followed and where they were read.
"""

from .engine import (
    CUDA_GRAPH, FLUSH_BEFORE_WAKE_UP, KV_CACHE, NEXT_ROLLOUT, SLEEP_LEVELS, WEIGHTS, ColocatedEngine,
    EngineSettingsError, EngineStandIn, colocated_trace, kv_cache_bytes, sizes_at, with_mapping_sizes,
)

__all__ = ["CUDA_GRAPH", "FLUSH_BEFORE_WAKE_UP", "KV_CACHE", "NEXT_ROLLOUT", "SLEEP_LEVELS", "WEIGHTS",
           "ColocatedEngine", "EngineSettingsError", "EngineStandIn", "colocated_trace", "kv_cache_bytes", "sizes_at",
           "with_mapping_sizes"]
