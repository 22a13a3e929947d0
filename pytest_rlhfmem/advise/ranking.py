"""The advisor's sweep on one scenario, and its ranking: which candidate cuts the peak, at what cost.

Cost of a candidate, relative to no flush under the default settings (allocator terms, max over ranks):
extra cudaMalloc calls, extra cudaFree calls, bytes re-acquired (the extra bytes obtained from the driver:
cudaMalloc'd, or mapped with expandable segments; negative = fewer than without the change). Candidates
rank by: no OOM, then peak reserved, then extra allocator calls, bytes re-acquired, fewer changes
(:func:`cost_key`).

Search for the best set of at most K boundaries (not enumeration: 2^B sets): start from the best single
boundary; at each step, replay the current set plus each boundary that lies before the current peak (a
flush after the peak cannot lower it) and keep the addition that lowers peak reserved most (ties: lower
cost); stop at K boundaries or when no addition lowers the peak. At most K x B replays, each a full replay
(flushes interact: one flush changes what the next can release).

A time is given only where the result carries measured CUDA flush durations (``flush_cost.measured_flush_s``);
it is then an ESTIMATE (extra cudaFree x the measured mean per released segment; cudaMalloc time is not
measured and is left out, so the estimate is a lower bound). CPU runs give no time: a cudaMalloc's duration
is a GPU figure. All sizes are bytes; the JSON schema (:data:`SCHEMA`) is documented in ``docs/advise.md``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..memory.allocator import alloc_conf_variable
from ..memory.events import CAPTURE_CUDA
from ..rollout import DEFAULT_VLLM, KV_CACHE, KV_CACHE_EXPANDABLE, VLLM_VERSIONS, EngineSettingsError, sizes_at
from ..units import format_size
from .candidates import (
    DEFAULT_MAX_FLUSHES, Spec, check_settings, common_boundaries, describe, flush_candidates, setting_candidates,
    setting_families,
)
from .evaluation import Evaluator
from .inputs import MARKS_HINT, ScenarioInput, is_unmarked, load_inputs

SCHEMA = "rlhfmem-advise/1"
_KIND_ORDER = {"flush": 0, "flush-set": 1, "setting": 2, "combination": 3, "policy": 4, "recorded": 5}

Row = Callable[[str, str, Spec], dict]  # (candidate id, kind, spec) -> its row, compared with no flush


def cost_key(c: dict) -> tuple:
    """Rank: no OOM, then peak reserved, then extra allocator calls, bytes re-acquired, fewer changes; among
    equals, flushes right before a colocated engine's wake-up first (where the frameworks put them)."""
    return (c["ooms"] > 0, c["peak_reserved"], c["extra_cuda_malloc"] + c["extra_cuda_free"], c["bytes_reacquired"],
            len(c["flushes_at"]) + bool(c["alloc_conf"]), not c.get("before_wake_up"), _KIND_ORDER.get(c["kind"], 9))


def candidate_row(si: ScenarioInput, evaluator: Evaluator, base: dict, policy_names: dict[str, str], cid: str,
                  kind: str, spec: Spec) -> dict:
    """One candidate's row: its replayed figures (max over ranks), its description and its cost against
    ``base`` (the no-flush candidate's figures)."""
    c = dict(evaluator.cache[spec])
    wake = wake_up_names(si)
    desc = describe(spec, wake)
    if kind == "policy":
        desc = f"study policy {policy_names.get(cid, cid)} ({len(spec.flushes)} flushes)"
    elif kind == "recorded":
        desc = f"flushes as recorded ({si.flush_policy or 'the program'}'s)"
    c.update({"id": cid, "kind": kind, "description": desc, "flushes_at": list(spec.flushes),
              "before_wake_up": bool(spec.flushes) and all(n in wake for n in spec.flushes),
              "alloc_conf": spec.alloc_conf, "capacity": spec.capacity,
              "delta_peak_reserved": c["peak_reserved"] - base["peak_reserved"],
              "delta_peak_pct": (100.0 * (c["peak_reserved"] - base["peak_reserved"]) / base["peak_reserved"]
                                 if base["peak_reserved"] else 0.0),
              "extra_cuda_malloc": c["cuda_malloc"] - base["cuda_malloc"],
              "extra_cuda_free": c["cuda_free"] - base["cuda_free"],
              "bytes_reacquired": c["bytes_acquired"] - base["bytes_acquired"]})
    c["time_estimate"] = _time_estimate(si, c)
    return c


def greedy_flush_set(si: ScenarioInput, evaluator: Evaluator, names: list[str], row: Row, base: dict,
                     max_flushes: int) -> tuple[tuple[str, ...], list[dict]]:
    """Greedy forward selection of at most ``max_flushes`` boundaries (the module docstring): the set found
    (empty when no single flush lowers the peak) and the search's steps."""
    singles = sorted((row(f"flush:{n}", "flush", Spec(flushes=(n,))) for n in names), key=cost_key)
    search_steps: list[dict] = []
    best_set: tuple[str, ...] = ()
    if not (singles and max_flushes > 0 and singles[0]["peak_reserved"] < base["peak_reserved"]):
        return best_set, search_steps
    best_set = tuple(singles[0]["flushes_at"])
    best = singles[0]
    search_steps.append({"set": list(best_set), "peak_reserved": best["peak_reserved"]})
    while len(best_set) < max_flushes:
        peak_rank = si.ranks[[ri.rank for ri in si.ranks].index(best["peak_rank"])]
        limit = peak_rank.boundaries.phase_starts.get(best["peak_phase"] or "", None)
        if limit is None and peak_rank.boundaries.kind == "window":
            limit = len(peak_rank.program)
        tries = [n for n in names if n not in best_set
                 and (limit is None or peak_rank.boundaries.positions.get(n, 0) <= limit)]
        if not tries:
            break
        cand_specs = [Spec(flushes=tuple(n2 for n2 in names if n2 in best_set or n2 == n)) for n in tries]
        evaluator.evaluate(cand_specs)
        rows = sorted((row("search", "flush", s) for s in cand_specs), key=cost_key)
        if rows[0]["peak_reserved"] >= best["peak_reserved"]:
            break
        best = rows[0]
        best_set = tuple(best["flushes_at"])
        search_steps.append({"set": list(best_set), "peak_reserved": best["peak_reserved"]})
    return best_set, search_steps


def add_combinations(rows_by_id: dict[str, dict], families: dict[str, list[str]], evaluator: Evaluator, row: Row,
                     base: dict) -> None:
    """When the best flush placement lowers the peak: replay it with the best setting of each family and
    add those rows to ``rows_by_id``."""
    flush_rows = [r for r in rows_by_id.values() if r["kind"] in ("flush", "policy", "flush-set") and r["flushes_at"]]
    best_flush = min(flush_rows, key=cost_key) if flush_rows else None
    if not (best_flush and best_flush["peak_reserved"] < base["peak_reserved"]):
        return
    combos: list[Spec] = []
    for fam in families:
        fam_rows = [rows_by_id[f"setting:{c}"] for c in families[fam] if f"setting:{c}" in rows_by_id]
        if not fam_rows:
            continue
        b = min(fam_rows, key=cost_key)
        combos.append(Spec(flushes=tuple(best_flush["flushes_at"]), alloc_conf=b["alloc_conf"],
                           capacity=b["capacity"]))
    evaluator.evaluate(combos)
    for s in combos:
        cid = f"combination:{'+'.join(s.flushes)}|{s.alloc_conf}"
        rows_by_id[cid] = row(cid, "combination", s)


def wake_up_names(si: ScenarioInput) -> frozenset[str]:
    """The boundaries right before a colocated engine's wake-up on every rank (``inputs.wake_up_boundaries``)."""
    return frozenset.intersection(*(ri.wake_up_boundaries for ri in si.ranks)) if si.ranks else frozenset()


UTILIZATIONS = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05 .. 0.95: vLLM's gpu_memory_utilization


def engine_search(si: ScenarioInput, evaluator: Evaluator, row: Row) -> dict | None:
    """A colocated rollout engine's settings, at the device's capacity (``evaluator.device_capacity``):
    the trainer's flush right before every wake-up (the boundaries :func:`wake_up_names` finds; TRL's
    ``sync_weights`` and verl's ``rollout_mode`` call ``empty_cache()`` there), costed as any flush (extra
    cudaMalloc/cudaFree against the unchanged program; a time only where CUDA flushes were measured), and
    ``gpu_memory_utilization`` from 0.05 to 0.95 in steps of 0.05 (and the recorded one), then of 0.01 where a
    setting's OOMs begin, with and without that flush, each rank's KV cache sized as the recorded vLLM version sizes
    it on that device, unpinned (``rollout/engine.py: sizes_at``). Where every rank's vLLM has
    ``kv_cache_memory_bytes`` (:func:`pin_search`), the largest pin that fits; where the engine held its memory
    through sleep (``expandable_segments`` in its process: ``held_through_sleep_bytes``), the run with it stripped
    (``"expandable_segments"``). ``"fix"``: the change that removes the unchanged program's OOMs, in words, where
    one of these does (the recommendation names it when no flush or allocator setting does). ``None`` where the
    input records no engine (every rank's ``recipe.rollout_engine``), has no capacity, or no wake-up boundary. The
    largest utilization without an OOM is reported for each; OOMs are taken as they come at each point (no
    monotonicity assumed). Sizes are bytes."""
    records = [ri.engine for ri in si.ranks]
    capacity = evaluator.device_capacity
    wake = tuple(n for n in common_boundaries(si.ranks) if n in wake_up_names(si))
    if capacity is None or not all(records) or not wake:
        return None
    evaluator.evaluate([Spec(flushes=wake)])
    flush = row("engine:flush-before-wake-up", "flush", Spec(flushes=wake))
    recorded = records[0]["gpu_memory_utilization"]
    points, specs = [], []

    def kv_at(u: float) -> int:  # the largest rank's KV cache at u, unpinned; EngineSettingsError where vLLM raises
        return max(_kv_bytes(sizes_at(r, capacity, u, None)) for r in records)

    for u in sorted(set(UTILIZATIONS) | {recorded}):
        try:
            kv = kv_at(u)
        except EngineSettingsError as exc:  # "No available memory for the cache blocks", or the start check
            points.append({"utilization": u, "kv_cache": None, "refused": str(exc)})
            continue
        points.append({"utilization": u, "kv_cache": kv})
        specs += [Spec(utilization=u), Spec(flushes=wake, utilization=u)]
    evaluator.evaluate(specs)

    def fit(spec: Spec) -> dict:
        r = evaluator.cache[spec]
        return {k: r[k] for k in ("ooms", "alloc_retries", "external_map_failures", "peak_reserved",
                                  "peak_device_used")}

    def fill(pt: dict) -> None:
        for key, fl in (("no_flush", ()), ("flush_before_wake_up", wake)):
            pt[key] = fit(Spec(flushes=fl, utilization=pt["utilization"]))

    for pt in points:
        if pt["kv_cache"] is not None:
            fill(pt)
    # to 0.01 where a setting's OOMs begin: between the last point that fits and the next
    extra: list[dict] = []
    sized = [p for p in points if p["kv_cache"] is not None]
    for key in ("no_flush", "flush_before_wake_up"):
        for lo, hi in zip(sized, sized[1:]):
            if lo[key]["ooms"] == 0 and hi[key]["ooms"] > 0:
                for k in range(1, round((hi["utilization"] - lo["utilization"]) * 100)):
                    u = round(lo["utilization"] + 0.01 * k, 2)
                    if all(p["utilization"] != u for p in points + extra):
                        extra.append({"utilization": u, "kv_cache": kv_at(u)})
    evaluator.evaluate([Spec(flushes=fl, utilization=p["utilization"]) for p in extra for fl in ((), wake)])
    for pt in extra:
        fill(pt)
    points = sorted(points + extra, key=lambda p: p["utilization"])

    def largest(key: str) -> dict | None:
        fits = [p for p in points if p["kv_cache"] is not None and p[key]["ooms"] == 0]
        return max(fits, key=lambda p: p["utilization"]) if fits else None

    best, plain = largest("flush_before_wake_up"), largest("no_flush")
    at = next(p for p in points if p["utilization"] == recorded)
    cost = (f"{flush['extra_cuda_malloc']:+d} cudaMalloc, {flush['extra_cuda_free']:+d} cudaFree"
            + (f", ~{flush['time_estimate']['seconds'] * 1e3:.1f} ms (est.)" if flush.get("time_estimate") else
               ", time not measured (a CPU or simulated capture)"))

    starts = [p["utilization"] for p in points if p["kv_cache"] is not None]
    floor = (f" (below {starts[0]:.2f} vLLM finds no memory for a KV cache at all)" if starts and starts[0] > 0.05
             else "")
    refused_above = [p for p in points if p["kv_cache"] is None and starts and p["utilization"] > starts[-1]]
    ceiling = (f"; from {refused_above[0]['utilization']:.2f} vLLM refuses to start: {refused_above[0]['refused']}"
               if refused_above else "")

    def fit_text(p: dict | None, how: str) -> str:
        return (f"no gpu_memory_utilization from 0.05 to 0.95 fits {how}{floor}" if p is None else
                f"gpu_memory_utilization up to {p['utilization']:.2f} fits {how} "
                f"(KV cache {format_size(p['kv_cache'])})")

    vllm = records[0].get("vllm", DEFAULT_VLLM)
    pinned = records[0].get("kv_cache_memory_bytes")
    text = (f"on a {format_size(capacity)} device, vLLM {vllm}'s {VLLM_VERSIONS[vllm].sizing} sizing"
            + (f" (the run pins kv_cache_memory_bytes={pinned}; the utilizations below are unpinned)" if pinned
               else "")
            + f": {fit_text(best, 'with the flush before wake_up')}; {fit_text(plain, 'without it')}{ceiling}; "
            f"the run's {recorded:.2f} "
            + ("cannot start the engine (vLLM raises)" if at["kv_cache"] is None else
               f"(KV cache {format_size(at['kv_cache'])}) has {at['no_flush']['ooms']} OOM(s) without the flush, "
               f"{at['flush_before_wake_up']['ooms']} with it")
            + f". The flush before wake_up (after {', '.join(wake)}) costs {cost}")
    out = {"capacity": capacity, "wake_up_boundaries": list(wake), "flush": flush, "recorded_utilization": recorded,
           "vllm": vllm, "points": points,
           "largest_fitting": {"flush_before_wake_up": best and best["utilization"],
                               "no_flush": plain and plain["utilization"]},
           "pin": None, "expandable_segments": None, "fix": None, "text": text}
    base = evaluator.cache[Spec()]
    fixes = []
    if all(VLLM_VERSIONS[r.get("vllm", DEFAULT_VLLM)].kv_cache_memory_bytes for r in records):
        out["pin"] = pin_search(records, capacity, wake, evaluator, fit)
        pin = out["pin"]["largest_fitting"]
        if pin["no_flush"] or pin["flush_before_wake_up"]:
            kv, how = ((pin["no_flush"], "as the program runs") if pin["no_flush"] else
                       (pin["flush_before_wake_up"], "with the flush before wake_up"))
            out["text"] += (f". kv_cache_memory_bytes takes precedence over gpu_memory_utilization in vLLM {vllm}: "
                            f"the largest pin that fits {how} is kv_cache_memory_bytes={kv} ({format_size(kv)})")
            fixes.append(f"pin the engine's KV cache: kv_cache_memory_bytes={kv} ({format_size(kv)}, the largest "
                         f"that fits {how} on the {format_size(capacity)} device; vLLM {vllm} sized "
                         f"{format_size(max(_kv_bytes(r['mappings']) for r in records))} at gpu_memory_utilization "
                         f"{recorded:.2f})")
        else:
            out["text"] += ". No kv_cache_memory_bytes pin fits: " + out["pin"]["why"]
    held = max(r.get("held_through_sleep_bytes", 0) for r in records)
    if held:
        plain_spec, flushed_spec = (Spec(engine_expandable_segments=False),
                                    Spec(flushes=wake, engine_expandable_segments=False))
        evaluator.evaluate([plain_spec, flushed_spec])
        stripped = fit(plain_spec)
        out["expandable_segments"] = {"held_through_sleep": held, "stripped": stripped,
                                      "stripped_with_flush": fit(flushed_spec)}
        strip = ("strip expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF (and PYTORCH_ALLOC_CONF) in the "
                 "engine's process (OpenRLHF PR 1274 does it in each rollout actor), or run a vLLM whose "
                 "use_memory_pool turns it off (cumem.py at 010c211)")
        out["text"] += (f". Sleep freed 0 B: with expandable_segments:True in the engine's process, vLLM {vllm}'s "
                        f"CuMemAllocator never sees the engine's {format_size(held)} (PyTorch's alloc_block maps its "
                        f"own expandable segments inside the MemPool), which stay through training; {strip}: then "
                        f"each sleep releases them, and the run has {stripped['ooms']} OOM(s) "
                        f"({base['ooms']} as recorded)")
        if not stripped["ooms"]:
            fixes.insert(0, f"{strip}: the engine's sleep then releases {format_size(held)}")
    if at["kv_cache"] is not None and not held:
        ok = [p for p in points if p["kv_cache"] is not None and p["no_flush"]["ooms"] == 0]
        if ok:
            u = max(ok, key=lambda p: p["utilization"])
            fixes.append(f"lower the engine's gpu_memory_utilization to {u['utilization']:.2f} (KV cache "
                         f"{format_size(u['kv_cache'])})")
    if base["ooms"] and fixes:
        out["fix"] = {"candidate": "engine", "text": (" or ".join(fixes) + f": removes the {base['ooms']} OOM(s) of "
                                                      "the unchanged program at the device's capacity")}
    return out


def _kv_bytes(sizes: dict[str, int]) -> int:
    """A colocated engine's KV cache bytes in ``sizes`` (by tag), wherever its memory was held."""
    return sizes.get(KV_CACHE) or sizes.get(KV_CACHE_EXPANDABLE, 0)


def pin_search(records: list[dict], capacity: int, wake: tuple[str, ...], evaluator: Evaluator,
               fit: Callable[[Spec], dict]) -> dict:
    """The largest ``kv_cache_memory_bytes`` (bytes, a 2 MiB multiple) without an OOM at ``capacity``, with and
    without the flush before wake-up (``wake``), found by bisection between 2 MiB and the capacity (OOMs taken not
    to decrease as the KV cache grows; every answer is a replay). vLLM's start check still applies to the
    recorded utilization: where it refuses, no pin fits (``"why"``). Returns ``{"largest_fitting": {"no_flush":
    bytes | None, "flush_before_wake_up": bytes | None}, "replays": int, "why": str}``."""
    step = 2 * 2**20
    out = {"largest_fitting": {}, "replays": 0, "why": ""}
    try:
        for r in records:
            sizes_at(r, capacity, r["gpu_memory_utilization"], step)
    except EngineSettingsError as exc:
        out["largest_fitting"] = {"no_flush": None, "flush_before_wake_up": None}
        out["why"] = str(exc)
        return out
    for key, fl in (("no_flush", ()), ("flush_before_wake_up", wake)):
        lo, hi = 0, capacity // step  # in steps: lo fits (0: none yet), hi + 1 never does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            evaluator.evaluate([Spec(flushes=fl, kv_cache=mid * step)])
            out["replays"] += 1
            if fit(Spec(flushes=fl, kv_cache=mid * step))["ooms"] == 0:
                lo = mid
            else:
                hi = mid - 1
        out["largest_fitting"][key] = lo * step if lo else None
    if not any(out["largest_fitting"].values()):
        out["why"] = "even a 2 MiB KV cache leaves an OOM (the trainer alone does not fit)"
    return out


def rank_rows(rows_by_id: dict[str, dict], policies: dict[str, str | None]
              ) -> tuple[list[dict], dict[str, str | None]]:
    """One row per distinct candidate, best first, numbered from 1 (a duplicate's id goes to the kept row's
    ``same_as``), and the study policies pointing at the kept rows."""
    ranked, seen = [], {}
    for r in sorted(rows_by_id.values(), key=cost_key):
        key = (tuple(r["flushes_at"]), r["alloc_conf"], r["capacity"], r["kind"] == "recorded")
        if key in seen:
            seen[key].setdefault("same_as", []).append(r["id"])
            policies = {p: (seen[key]["id"] if c == r["id"] else c) for p, c in policies.items()}
            continue
        seen[key] = r
        ranked.append(r)
    for i, r in enumerate(ranked):
        r["rank"] = i + 1
    return ranked, policies


def advise_scenario(si: ScenarioInput, evaluator: Evaluator, max_flushes: int = DEFAULT_MAX_FLUSHES,
                    budget: int | None = None, capacity: int | None = None, top: int = 8,
                    settings: tuple[str, ...] = ()) -> dict:
    """Run the sweep on one scenario; returns its JSON section (see ``docs/advise.md``)."""
    t0 = time.perf_counter()
    names = common_boundaries(si.ranks)
    specs, policies, policy_names = flush_candidates(si, names)
    evaluator.evaluate([s for _, s in specs.values()])
    base = evaluator.cache[Spec()]
    row: Row = functools.partial(candidate_row, si, evaluator, base, policy_names)

    best_set, search_steps = greedy_flush_set(si, evaluator, names, row, base, max_flushes)
    if len(best_set) > 1:
        specs["flush-set:" + "+".join(best_set)] = ("flush-set", Spec(flushes=best_set))

    # Allocator settings, on the trace without flushes.
    gc_capacity = capacity or budget or base["peak_reserved"]
    cap_source = ("--capacity" if capacity else "--budget" if budget else
                  "the no-flush peak reserved (a device exactly as large as the unchanged program needs)")
    families = setting_families(si.ranks, settings)
    not_evaluated = setting_candidates(families, gc_capacity, specs)
    evaluator.evaluate([s for _, s in specs.values()])

    rows_by_id = {cid: row(cid, kind, spec) for cid, (kind, spec) in specs.items()}
    add_combinations(rows_by_id, families, evaluator, row, base)
    ranked, policies = rank_rows(rows_by_id, policies)
    engine = engine_search(si, evaluator, row)
    recommendation = _recommend(ranked[0], base, si.torch_version, ranked)
    if engine and engine["fix"] and recommendation["candidate"] == "none":  # only the engine's settings remove them
        recommendation = dict(engine["fix"])
    if engine and "expandable_segments:True" in recommendation["text"]:
        engine["text"] += (". Expandable segments beside an engine: vLLM turns them off inside its own pool, SGLang's "
                           "torch_memory_saver refuses them in PYTORCH_CUDA_ALLOC_CONF, verl switches them off around "
                           "each wake-up (docs/colocated-rollout.md)")
    return {
        "scenario_id": si.scenario_id,
        "capture": si.capture,
        "simulated": si.capture != CAPTURE_CUDA,
        "ranks": len(si.ranks),
        "events": [len(ri.program) for ri in si.ranks],
        "boundaries": names,
        "boundary_kind": si.ranks[0].boundaries.kind,
        "hint": MARKS_HINT if all(is_unmarked(ri.boundaries) for ri in si.ranks) else None,
        "baseline": rows_by_id["none"],  # (the rows below are the same dicts as in candidates)
        "as_recorded": rows_by_id.get("as-recorded"),
        "policies": policies,
        "candidates": ranked,
        "not_evaluated": not_evaluated,
        "assumptions": {"gc_capacity": gc_capacity, "gc_capacity_source": cap_source,
                        "replay": ("free-running (the model's own cudaMalloc/cudaFree decisions, no device "
                                   "limit except for garbage_collection_threshold candidates)"
                                   if evaluator.device_capacity is None else
                                   "free-running at "
                                   f"{'--capacity' if capacity else 'the card the engine was sized for'} "
                                   f"{format_size(evaluator.device_capacity)} for every candidate: the trace maps "
                                   "device memory outside the caching allocator (a colocated rollout engine), which "
                                   "fits or not only against a device")},
        "search": {"method": "greedy forward selection over boundaries before the current peak",
                   "max_flushes": max_flushes, "steps": search_steps},
        "premise": _premise(si, evaluator, rows_by_id),
        "recommendation": recommendation,
        "budget": _fit_budget(ranked, base, budget) if budget is not None else None,
        "colocated_engine": engine,
        "top": top,
        "replays": evaluator.replays,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _time_estimate(si: ScenarioInput, c: dict) -> dict | None:
    if not si.measured_flush_s or not si.flush_segments_released:
        return None
    per_free = sum(si.measured_flush_s) / si.flush_segments_released
    return {"seconds": round(max(c["extra_cuda_free"], 0) * per_free, 6), "estimate": True,
            "basis": f"extra cudaFree x {per_free * 1e6:.0f} us (measured mean per released segment of this "
                     "run's flushes); cudaMalloc time not measured, so a lower bound"}


def _premise(si: ScenarioInput, ev: Evaluator, rows: dict) -> dict:
    """The premise, and what the advisor can check itself: the replay of the trace as recorded against the
    run's measured peak reserved and fragmentation."""
    text = ("a flush changes the allocator's state, not the program's allocations: every candidate replays the "
            "same allocations. This holds for the recipes (tests/test_advise.py); a program that reads "
            "memory_reserved() or catches OOM to allocate differently would not follow these predictions.")
    out: dict = {"text": text, "measured_check": None}
    m = si.measured
    rec = rows.get("as-recorded") or rows["none"]
    if m:
        same = (m.get("peak_reserved") == rec["peak_reserved"]
                and (m.get("fragmentation_at_peak") or 0) == (rec["fragmentation_at_peak"] or 0))
        out["measured_check"] = {
            "measured_peak_reserved": m.get("peak_reserved"), "replayed_peak_reserved": rec["peak_reserved"],
            "measured_fragmentation_at_peak": m.get("fragmentation_at_peak"),
            "replayed_fragmentation_at_peak": rec["fragmentation_at_peak"], "equal": same,
            "note": ("the replay of the trace as recorded reproduces the run's figures" if same else
                     "the replay of the trace as recorded does NOT reproduce the run's figures: on CUDA the model "
                     "replays free-running (its own segment decisions); treat the deltas, not the absolute "
                     "figures, as the prediction"),
        }
    return out


def _smallest(rows: list[dict]) -> dict:
    """The candidate of ``rows`` with the fewest changes (flushes and settings), then the fewest extra allocator
    calls, bytes re-acquired, a flush before a colocated engine's wake-up, lower peak reserved."""
    return min(rows, key=lambda r: (len(r["flushes_at"]) + bool(r["alloc_conf"]),
                                    r["extra_cuda_malloc"] + r["extra_cuda_free"], r["bytes_reacquired"],
                                    not r.get("before_wake_up"), r["peak_reserved"]))


def _recommend(best: dict, base: dict, torch_version: str | None = None, ranked: list[dict] | None = None) -> dict:
    """The best candidate in words; a setting also names the environment variable the run's PyTorch reads
    (``env``: ``allocator.alloc_conf_variable``; unknown version for a snapshot). Where the unchanged program has
    OOMs at the device's capacity, the recommendation is the smallest change of ``ranked`` without any
    (:func:`_smallest`: a fix first), and the lowest peak among them is named beside it when it is another."""
    fits = [r for r in (ranked or [best]) if not r["ooms"] and r["id"] != "none"]
    engine = (f", {base['external_map_failures']} of them a colocated engine's wake-up"
              if base.get("external_map_failures") else "")
    if base["ooms"] and not fits:
        return {"candidate": "none",
                "text": (f"no flush placement or evaluated setting removes the {base['ooms']} OOM(s) of the unchanged "
                         f"program at the device's capacity{engine}: it needs less memory (a smaller batch or "
                         "sequence, a ZeRO stage or offload, a colocated engine's lower gpu_memory_utilization) or "
                         "a larger device")}
    if base["ooms"]:  # at the device's capacity: what makes it fit, the smallest change
        fix = _smallest(fits)
        lowest = (f"; the lowest peak without OOMs: {best['description']} ({format_size(best['peak_reserved'])}, "
                  f"{best['extra_cuda_malloc']:+d} cudaMalloc, {best['extra_cuda_free']:+d} cudaFree)"
                  if best["id"] != fix["id"] and not best["ooms"] else "")
        return {"candidate": fix["id"],
                "text": (f"{fix['description']}: removes the {base['ooms']} OOM(s) of the unchanged program at "
                         f"the device's capacity{engine}, the smallest change (peak reserved "
                         f"{format_size(fix['peak_reserved'])}, {fix['extra_cuda_malloc']:+d} cudaMalloc, "
                         f"{fix['extra_cuda_free']:+d} cudaFree){lowest}")}
    if best["peak_reserved"] >= base["peak_reserved"] or best["id"] == "none":
        return {"candidate": "none", "text": (f"no flush placement or evaluated setting lowers peak reserved below "
                                               f"{format_size(base['peak_reserved'])}: keep the program as it is")}
    text = (f"{best['description']}: {best['delta_peak_pct']:+.1f}% peak reserved "
            f"({format_size(base['peak_reserved'])} -> {format_size(best['peak_reserved'])}), "
            f"{best['extra_cuda_malloc']:+d} cudaMalloc, {best['extra_cuda_free']:+d} cudaFree")
    out = {"candidate": best["id"], "text": text}
    if best["alloc_conf"]:
        variable, why = alloc_conf_variable(torch_version, best["alloc_conf"])
        out["env"] = {"variable": variable, "value": best["alloc_conf"], "why": why}
    return out


def _fit_budget(ranked: list[dict], base: dict, budget: int) -> dict:
    fits = [r for r in ranked if r["peak_reserved"] <= budget and r["ooms"] == 0]
    if not fits:
        return {"size": budget, "candidate": None,
                "text": f"no evaluated change fits {format_size(budget)}; the lowest peak reserved is "
                        f"{format_size(ranked[0]['peak_reserved'])} ({ranked[0]['description']})"}
    cheapest = min(fits, key=lambda r: (r["extra_cuda_malloc"] + r["extra_cuda_free"], r["bytes_reacquired"],
                                        len(r["flushes_at"]) + bool(r["alloc_conf"]), r["peak_reserved"]))
    what = "no change needed" if cheapest["id"] == "none" else cheapest["description"]
    return {"size": budget, "candidate": cheapest["id"],
            "text": f"cheapest change that fits {format_size(budget)}: {what} (peak reserved "
                    f"{format_size(cheapest['peak_reserved'])}, {cheapest['extra_cuda_malloc']:+d} cudaMalloc, "
                    f"{cheapest['extra_cuda_free']:+d} cudaFree)"}


def advise(path: str | Path, max_flushes: int = DEFAULT_MAX_FLUSHES, budget: int | None = None,
           capacity: int | None = None, processes: int | None = None, settings: tuple[str, ...] = ()) -> dict:
    """The whole advisor: one JSON document for every scenario of INPUT (see ``docs/advise.md``).

    ``settings``: extra ``PYTORCH_CUDA_ALLOC_CONF`` strings to evaluate. Raises :class:`AdviseInputError`
    for an input it cannot use, :class:`AllocatorConfigError` for a bad extra setting.
    """
    check_settings(settings)
    inputs = load_inputs(path)
    procs = processes if processes is not None else min(2, os.cpu_count() or 1)
    sections = []
    for si in inputs:
        # a colocated engine's mappings only matter against a device: every candidate replays at --capacity then
        mapped = any(ri.program_columns is not None and ri.program_columns.has_external_mappings() for ri in si.ranks)
        # without --capacity, the card a recorded engine was sized against (its scenario's capacity_mib)
        cards = {ri.engine.get("capacity") for ri in si.ranks if ri.engine}
        card = capacity or (cards.pop() if len(cards) == 1 else None)
        external = card if card and mapped else None
        ev = Evaluator(si.ranks, procs, external)
        try:
            sections.append(advise_scenario(si, ev, max_flushes, budget, capacity, settings=tuple(settings)))
        except BaseException:  # Ctrl-C, a replay's error, a dead worker: stop the workers, wait for nothing
            ev.close(abort=True)
            raise
        ev.close()
    return {"schema": SCHEMA, "input": str(path), "scenarios": sections}
