"""The advisor's candidates: which flush placements and allocator settings are worth a replay.

A candidate (:class:`Spec`) is a set of flush boundaries (or the trace's recorded flushes), an extra
``PYTORCH_CUDA_ALLOC_CONF`` and the device capacity it assumes. Generated here, replayed by
``evaluation.py``, ranked by ``ranking.py``:

- flush placements: none; the trace as recorded (its own flushes); the study's four policies (flush
  after each inference phase, after each training phase, after both); every single boundary (the best set
  of at most K boundaries is searched for by ``ranking.py``);
- allocator settings (on the trace without flushes): ``max_split_size_mb`` at values around the trace's
  large requests, ``garbage_collection_threshold`` (needs a device capacity), ``roundup_power2_divisions``,
  and ``expandable_segments:True`` (a setting the model does not accept is listed under ``not_evaluated``,
  never dropped);
- combinations: the best flush placement with the best setting of each family (``ranking.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..memory.allocator import AllocatorConfig, AllocatorConfigError, MiB, kLargeBuffer
from ..memory.events import ALLOC, FLUSH
from .inputs import RankInput, ScenarioInput

STUDY_POLICIES = ("none", "after-inference", "after-training", "after-both")
INFERENCE_PHASES = ("generate", "infer_actor", "infer_reference", "infer_reward", "infer_critic")
TRAINING_PHASES = ("train_actor", "train_critic")
DEFAULT_MAX_FLUSHES = 3
GC_THRESHOLDS = (0.5, 0.8)
ROUNDUP_DIVISIONS = (4, 8)


@dataclass(frozen=True)
class Spec:
    """A candidate: flush boundaries (or the recorded flushes), an alloc-conf string, a capacity (bytes)."""

    flushes: tuple[str, ...] = ()
    alloc_conf: str = ""
    capacity: int | None = None
    recorded: bool = False
    # a colocated engine's gpu_memory_utilization: its KV cache resized as vLLM would size it on the device
    # (rollout/engine.py: sizes_at), unpinned; None: as recorded
    utilization: float | None = None
    # a colocated engine's kv_cache_memory_bytes pin (bytes; the vLLM versions that have it); None: as above
    kv_cache: int | None = None
    # False: expandable_segments stripped from the engine's process (rollout/engine.py:
    # without_engine_expandable_segments); None: as recorded
    engine_expandable_segments: bool | None = None


def policy_boundaries(policy: str, names: list[str]) -> list[str] | None:
    """The boundaries a study policy flushes at (in ``names``), or ``None`` if the trace has none of its
    phases (the policy does not apply: not a recipe trace)."""
    inf = [n for n in names if n.split("#")[0] in INFERENCE_PHASES]
    tr = [n for n in names if n.split("#")[0] in TRAINING_PHASES]
    if not inf and not tr:
        return None
    return {"none": [], "after-inference": inf, "after-training": tr, "after-both": inf + tr}[policy]


def common_boundaries(ranks: list[RankInput]) -> list[str]:
    """The boundaries every rank has, in the first rank's order."""
    names = list(ranks[0].boundaries.positions)
    for ri in ranks[1:]:
        names = [n for n in names if n in ri.boundaries.positions]
    return names


def flush_candidates(si: ScenarioInput, names: list[str]
                     ) -> tuple[dict[str, tuple[str, Spec]], dict[str, str | None], dict[str, str]]:
    """``(specs, policies, policy_names)``: candidate id -> (kind, spec) for no flush, the flushes as
    recorded, the study's policies and every single boundary; study policy -> its candidate id (``None``:
    not applicable); a policy candidate's id -> its policy."""
    specs: dict[str, tuple[str, Spec]] = {"none": ("flush", Spec())}
    if any(e.action == FLUSH for ri in si.ranks for e in ri.recorded):
        specs["as-recorded"] = ("recorded", Spec(recorded=True))
    policies: dict[str, str | None] = {}
    policy_names: dict[str, str] = {}
    for p in STUDY_POLICIES:
        b = policy_boundaries(p, names)
        if b is None:
            policies[p] = "none" if p == "none" else None
            continue
        cid = "none" if not b else f"policy:{p}"
        policy_names[cid] = p
        if b:
            specs[cid] = ("policy", Spec(flushes=tuple(b)))
        policies[p] = cid
    for n in names:
        specs[f"flush:{n}"] = ("flush", Spec(flushes=(n,)))
    return specs, policies, policy_names


def large_request_mib(ranks: list[RankInput]) -> list[int]:
    """max_split_size_mb values around the trace's large requests: the 50th/90th percentile and the largest
    request above 20 MiB (kLargeBuffer), in MiB rounded up, plus one below the largest; the smallest allowed
    value (21) when no request is that large."""
    sizes = sorted(e.size for ri in ranks for e in ri.program if e.action == ALLOC and e.size > kLargeBuffer)
    if not sizes:
        return [21]
    picks = {sizes[len(sizes) // 2], sizes[min(len(sizes) - 1, int(len(sizes) * 0.9))], sizes[-1]}
    out = sorted({max(21, math.ceil(s / MiB)) for s in picks} | {max(21, math.ceil(sizes[-1] / MiB) - 1)})
    return out[:4]


def setting_families(ranks: list[RankInput], settings: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The allocator settings tried, by family (``settings``: the user's extra ones, family ``requested``)."""
    families: dict[str, list[str]] = {
        "max_split_size_mb": [f"max_split_size_mb:{v}" for v in large_request_mib(ranks)],
        "garbage_collection_threshold": [f"garbage_collection_threshold:{v}" for v in GC_THRESHOLDS],
        "roundup_power2_divisions": [f"roundup_power2_divisions:{v}" for v in ROUNDUP_DIVISIONS],
        "expandable_segments": ["expandable_segments:True"],
    }
    if settings:
        families["requested"] = list(settings)
    return families


def setting_candidates(families: dict[str, list[str]], gc_capacity: int, specs: dict[str, tuple[str, Spec]]
                       ) -> list[dict]:
    """Add one ``setting:<conf>`` candidate per setting the model accepts to ``specs`` (a
    ``garbage_collection_threshold`` one assumes a device of ``gc_capacity`` bytes); return the others
    as ``not_evaluated`` entries, with the reason."""
    not_evaluated = []
    for fam, confs in families.items():
        for conf in confs:
            try:
                AllocatorConfig.parse(conf)
            except AllocatorConfigError as exc:
                not_evaluated.append({"setting": conf, "reason": f"not evaluated (not modelled): {exc}"})
                continue
            cap = gc_capacity if fam == "garbage_collection_threshold" else None
            specs[f"setting:{conf}"] = ("setting", Spec(alloc_conf=conf, capacity=cap))
    return not_evaluated


def check_settings(settings: tuple[str, ...] | list[str]) -> None:
    """Refuse an extra setting with an unknown key or a bad value (:class:`AllocatorConfigError`); a
    setting the model does not implement (``expandable_segments:True``) is kept and listed as not evaluated."""
    for conf in settings:
        try:
            AllocatorConfig.parse(conf)
        except AllocatorConfigError as exc:
            if "not modelled" not in str(exc):
                raise


def describe(spec: Spec, wake_up: frozenset[str] = frozenset()) -> str:
    """A candidate in words, e.g. ``flush after infer_actor and train_critic + PYTORCH_CUDA_ALLOC_CONF=...``; a
    boundary in ``wake_up`` (right before a colocated engine's wake-up: ``inputs.wake_up_boundaries``) is named so,
    ``flush after train_critic (before the engine's wake_up)``."""
    parts = []
    if spec.recorded:
        parts.append("flushes as recorded")
    elif spec.flushes:
        parts.append("flush after " + _join([f"{n} (before the engine's wake_up)" if n in wake_up else n
                                             for n in spec.flushes]))
    if spec.alloc_conf:
        parts.append(f"PYTORCH_CUDA_ALLOC_CONF={spec.alloc_conf}")
    return " + ".join(parts) or "no flush, settings as recorded"


def _join(names: tuple[str, ...] | list[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
