"""Real memory incidents of RLHF stacks, reproduced at CI scale as gates: the "before" passes its budget
(baselines/cpu/incidents.yaml, written by ``--rlhfmem-update-baselines`` from the "before" runs alone), the "after"
fails it with a message naming the phase and the cause. docs/incidents.md says what each incident reported, what is
reproduced and at what scale; ``tox -e incidents`` (suites/test_incidents_scale.py) runs them at larger scales.
Every device figure is simulated.

1. PrimeIntellect-ai/prime-rl PR 1895: the chunked LM head's chunk 2048 -> 8192 (here 512 -> 2048 on a tiny
   Qwen3-shaped model, tests/data/commands/chunked_lm_head.py on the simulated CUDA device without values).
2. NVIDIA-NeMo/RL PR 3280: a vLLM upgrade sized the KV cache larger at the same gpu_memory_utilization; the wake-up
   could not map it beside the colocated policy. Here vLLM 0012cf6's sizing -> 35d5cda's (rollout/engine.py) in the
   DeepSpeed-Chat recipe with the colocated engine (tiny OPT, 128 MiB card).
3. vLLM PR 11743 / 14189, OpenRLHF issue 1011 (fix PR 1274): expandable_segments:True in the engine's process, sleep
   frees nothing, training OOMs (vLLM 9ac9658's sleep pool).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem.memory.allocator import MiB
from pytest_rlhfmem.memory.events import ALLOC, EXTERNAL_MAP, EXTERNAL_UNMAP, FREE, PHASE, Event, Trace
from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.rollout import (
    KV_CACHE, KV_CACHE_EXPANDABLE, NEXT_ROLLOUT, WEIGHTS, WEIGHTS_EXPANDABLE, ColocatedEngine, EngineSettingsError,
    colocated_trace, oom_causes, without_engine_expandable_segments,
)

SCRIPT = Path(__file__).parent / "data" / "commands" / "chunked_lm_head.py"
VALUE_FREE = {"RLHFMEM_SIM_CUDA_VALUES": "off", "RLHFMEM_SIM_CUDA_SDPA": "efficient"}
CAPACITY_MIB = 128
ENGINE = {"rollout_engine": True, "capacity_mib": CAPACITY_MIB, "gpu_memory_utilization": 0.71}


def _updating(request) -> bool:
    return bool(request.config.getoption("rlhfmem_update_baselines"))


def _script():
    spec = importlib.util.spec_from_file_location("chunked_lm_head", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- incident 1: the LM head's chunk --------------------------------------------------------------------------------

def test_the_chunked_lm_head_is_the_full_log_softmax():
    """The trainer's chunked function (float64 inputs, on the CPU) against ``log_softmax`` of the whole
    ``[tokens, vocab]`` logits: log-probabilities, entropy and both gradients, for a chunk that does not divide the
    vocabulary."""
    import torch

    mod = _script()
    torch.manual_seed(0)
    n, h, v = 48, 16, 1000
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    labels, inv_t = torch.randint(0, v, (n,)), torch.rand(n, dtype=torch.float64) + 0.5
    adv = torch.randn(n, dtype=torch.float64)
    logp, ent = mod.ChunkedLogprobEntropy.apply(hidden, weight, labels, inv_t, 300)
    (adv * logp).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = torch.log_softmax((hidden @ weight.t()) * inv_t[:, None], dim=-1)
    ref_logp = ref.gather(1, labels[:, None]).squeeze(1)
    (adv * ref_logp).sum().backward()
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    assert torch.allclose(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5) and torch.allclose(grads[1], weight.grad, atol=1e-5)


def test_incident_1_a_larger_lm_head_chunk_fails_the_gate(rlhfmem_command, memory_budget, request):
    """prime-rl PR 1895 at CI scale: the same trainer, its LM-head chunk 512 (the budget's) then 2048 (four times,
    as 2048 -> 8192). The larger chunk's ``[tokens, chunk]`` fp32 temporaries raise the ``lm_head`` phase's live
    bytes, and peak reserved with them: over budget, the failure naming ``lm_head``. Nothing before the LM head
    moves (the forward's figures are equal)."""
    def run(chunk: int):
        return rlhfmem_command([sys.executable, str(SCRIPT), "--chunk-size", str(chunk)],
                               id="prime-rl-1895/lm-head-chunk", device="cuda-sim", env=VALUE_FREE)

    before = run(512)
    assert before.capture == "sim-cuda-simulated" and {"forward", "lm_head", "backward"} <= set(before.phases)
    memory_budget.check(before)
    if _updating(request):
        return
    after = run(2048)
    same = ("peak_reserved", "peak_allocated", "cuda_malloc_count")
    assert {k: after.phases["forward"][k] for k in same} == {k: before.phases["forward"][k] for k in same}
    grown = after.phases["lm_head"]["peak_allocated"] - before.phases["lm_head"]["peak_allocated"]
    assert grown > 40 * MiB  # ~24 B per token per extra vocabulary row (2048 tokens x 1536 rows)
    with pytest.raises(pytest.fail.Exception) as exc:
        memory_budget.check(after)
    message = str(exc.value)
    assert "prime-rl-1895/lm-head-chunk is over its memory budget (simulated" in message
    assert "peak allocated in phase: lm_head" in message
    assert any(ln.startswith("peak_reserved ") and ln.endswith("OVER BUDGET") for ln in message.splitlines()), message


# -- the engine's vLLM rules (incidents 2 and 3), on a toy trace ------------------------------------------------------

def _toy(kept: int = 0) -> Trace:
    """A trainer's iteration: 20 MiB of states at init, a rollout tensor, training's 40 MiB of temporaries and
    ``kept`` bytes it keeps (an optimizer's states made at its first step)."""
    return Trace(events=[
        Event(PHASE, name="init"), Event(ALLOC, 1, 20 * MiB),
        Event(PHASE, name="generate"), Event(ALLOC, 3, MiB),
        Event(PHASE, name="train_actor"), Event(ALLOC, 4, 40 * MiB), *([Event(ALLOC, 5, kept)] if kept else []),
        Event(FREE, 4, 40 * MiB), Event(FREE, 3, MiB)])


def test_vllm_versions_size_the_kv_cache_by_their_own_rule():
    """0012cf6 subtracts the process's torch peak (the trainer's 20 MiB included); 35d5cda only what the engine
    adds after its init snapshot, so the same utilization gives a KV cache larger by the trainer's live bytes;
    35d5cda refuses to start where the free memory at init is below the utilization's share, and takes
    ``kv_cache_memory_bytes`` (which 0012cf6 does not have) as the KV cache."""
    old = ColocatedEngine(weights_bytes=8 * MiB, gpu_memory_utilization=0.5)
    new = ColocatedEngine(weights_bytes=8 * MiB, gpu_memory_utilization=0.5, vllm="35d5cda")
    assert old.sizes(200 * MiB, 20 * MiB)[KV_CACHE] == 100 * MiB - 28 * MiB
    assert new.sizes(200 * MiB, 20 * MiB)[KV_CACHE] == 100 * MiB - 8 * MiB
    with pytest.raises(EngineSettingsError, match=r"^Free memory on device \(0\.05/0\.20 GiB\) on startup is less "
                                                  r"than desired GPU memory utilization \(0\.5, 0\.10 GiB\)"):
        new.sizes(200 * MiB, 150 * MiB)
    pinned = ColocatedEngine(weights_bytes=8 * MiB, gpu_memory_utilization=0.5, vllm="35d5cda",
                             kv_cache_memory_bytes=33 * MiB)
    assert pinned.sizes(200 * MiB, 20 * MiB)[KV_CACHE] == 32 * MiB  # rounded down to the 2 MiB mapping
    with pytest.raises(EngineSettingsError) as exc:
        ColocatedEngine(weights_bytes=MiB, kv_cache_memory_bytes=32 * MiB)
    assert str(exc.value) == ("kv_cache_memory_bytes: vLLM 0012cf6 has no such setting (vLLM PR 21489); allowed with "
                              "vllm 35d5cda")
    with pytest.raises(EngineSettingsError) as exc:
        ColocatedEngine(weights_bytes=MiB, vllm="0.25.1")
    assert str(exc.value) == ("vllm '0.25.1': allowed values are 0012cf6, 35d5cda, 9ac9658 (the commits whose rules "
                              "are modelled)")


def test_expandable_segments_in_the_engine_keep_its_memory_through_sleep():
    """vLLM 9ac9658's sleep pool with expandable_segments in the engine's process: the pool records nothing (its
    mappings are 0 B, so sleep frees 0 B), the same bytes are held as expandable segments through training, whose
    allocations then fail at the card; stripping the setting gives back the working engine's trace and figures.
    0012cf6's pool turns expandable segments off: the setting changes nothing there."""
    capacity = 96 * MiB
    working = ColocatedEngine(weights_bytes=8 * MiB, gpu_memory_utilization=0.7)
    broken = ColocatedEngine(weights_bytes=8 * MiB, gpu_memory_utilization=0.7, vllm="9ac9658",
                             expandable_segments=True)
    assert not ColocatedEngine(weights_bytes=8 * MiB, expandable_segments=True).holds_through_sleep
    ok_trace, ok = colocated_trace(_toy(), working, capacity)
    bad_trace, bad = colocated_trace(_toy(), broken, capacity)
    assert (bad[WEIGHTS], bad[KV_CACHE]) == (0, 0)
    assert (bad[WEIGHTS_EXPANDABLE], bad[KV_CACHE_EXPANDABLE]) == (ok[WEIGHTS], ok[KV_CACHE])
    assert [e.size for e in bad_trace.events if e.action == EXTERNAL_UNMAP] == [0, 0, 0, 0]  # "freed 0.00 GiB"
    good, held = replay(ok_trace, capacity=capacity), replay(bad_trace, capacity=capacity)
    assert good.total.ooms == 0
    assert [p.phase for p in held.phases if p.ooms] == ["train_actor"] and not held.external_map_failures
    stripped = Trace(events=without_engine_expandable_segments(
        bad_trace.events, {**broken_record(broken, bad), "capacity": capacity}, capacity))
    again = replay(stripped, capacity=capacity)
    assert (again.total.ooms, again.peak_device_used) == (0, good.peak_device_used)
    maps = [e.size for e in stripped.events if e.action == EXTERNAL_MAP]
    assert [m for m in maps if m] == [e.size for e in ok_trace.events if e.action == EXTERNAL_MAP]
    assert maps.count(0) == 2  # the emptied expandable segments


def broken_record(engine: ColocatedEngine, info: dict) -> dict:
    """The recipe's record of ``engine`` (rollout/engine.py: EngineStandIn.describe's fields that advise reads)."""
    return {"weights_bytes": engine.weights_bytes, "gpu_memory_utilization": engine.gpu_memory_utilization,
            "sleep_level": engine.sleep_level, "flush_before_wake_up": engine.flush_before_wake_up,
            "vllm": engine.vllm, "expandable_segments": engine.expandable_segments,
            "trainer_allocated_at_start": info["trainer_allocated_at_start"]}


def _advise_toy(engine: ColocatedEngine, capacity: int, tmp_path, kept: int = 0) -> dict:
    """``rlhfmem advise`` on the toy iteration (``kept``: :func:`_toy`) beside ``engine`` on a ``capacity``-byte
    card, written as a recipe's result JSON with its trace (the engine's record as EngineStandIn.describe writes
    it)."""
    from pytest_rlhfmem.advise import advise
    from pytest_rlhfmem.memory.trace_io import save_trace

    trace, info = colocated_trace(_toy(kept), engine, capacity)
    save_trace(tmp_path / "rank0.rlhftrace", trace)
    record = {**broken_record(engine, info), "capacity": capacity, "kv_cache_memory_bytes": None,
              "held_through_sleep_bytes": info.get(WEIGHTS_EXPANDABLE, 0) + info.get(KV_CACHE_EXPANDABLE, 0),
              "mappings": {k: v for k, v in info.items() if k in (WEIGHTS, KV_CACHE, WEIGHTS_EXPANDABLE,
                                                                     KV_CACHE_EXPANDABLE)}}
    result = {"scenario_id": "toy", "status": "ok", "capture": "synthetic", "scenario": {"flush": "none"},
              "ranks": [{"rank": 0, "trace_file": "rank0.rlhftrace", "recipe": {"rollout_engine": record}}]}
    (tmp_path / "toy.json").write_text(json.dumps(result))
    return advise(tmp_path / "toy.json", processes=1)["scenarios"][0]


def test_advise_names_the_pin_or_the_utilization_that_fits(tmp_path):
    """vLLM 35d5cda's engine beside the toy trainer that keeps 30 MiB after training, the trainer's flush before
    the wake-up included: the next rollout's wake-up still fails. advise finds the largest kv_cache_memory_bytes that
    fits by replays (2 MiB more does not) and the utilization that fits, and recommends them, since no flush or
    allocator setting removes that OOM."""
    capacity, kept = 96 * MiB, 30 * MiB
    engine = ColocatedEngine(weights_bytes=8 * MiB, gpu_memory_utilization=0.7, vllm="35d5cda")
    s = _advise_toy(engine, capacity, tmp_path, kept)
    assert s["baseline"]["ooms"] == 1 and s["baseline"]["external_map_failures"] == 1
    e = s["colocated_engine"]
    pin = e["pin"]["largest_fitting"]["no_flush"]
    assert pin and pin % (2 * MiB) == 0
    for kv, ooms in ((pin, 0), (pin + 2 * MiB, 1)):
        pinned = ColocatedEngine(8 * MiB, 0.7, vllm="35d5cda", kv_cache_memory_bytes=kv)
        assert replay(colocated_trace(_toy(kept), pinned, capacity)[0], capacity=capacity).total.ooms == ooms, kv
    u = e["largest_fitting"]["no_flush"]
    assert u < 0.7 and s["recommendation"]["candidate"] == "engine"
    assert f"kv_cache_memory_bytes={pin} " in s["recommendation"]["text"]
    assert f"lower the engine's gpu_memory_utilization to {u:.2f}" in s["recommendation"]["text"]
    assert "vLLM refuses to start: Free memory on device" in e["text"]  # 35d5cda's start check, high utilizations


def test_advise_says_to_strip_expandable_segments_from_the_engine(tmp_path):
    """vLLM 9ac9658 with expandable_segments in the engine's process beside the toy trainer: training OOMs with the
    engine's memory held through sleep; advise replays the run with the setting stripped (no OOM) and says so."""
    engine = ColocatedEngine(weights_bytes=8 * MiB, gpu_memory_utilization=0.7, vllm="9ac9658",
                             expandable_segments=True)
    s = _advise_toy(engine, 96 * MiB, tmp_path)
    es = s["colocated_engine"]["expandable_segments"]
    assert s["baseline"]["ooms"] > 0 and es["stripped"]["ooms"] == 0 and es["held_through_sleep"] == 46 * MiB
    assert s["recommendation"]["text"].startswith(
        "strip expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF (and PYTORCH_ALLOC_CONF) in the engine's "
        "process (OpenRLHF PR 1274 does it in each rollout actor)")
    assert "Sleep freed 0 B" in s["colocated_engine"]["text"]
    assert s["colocated_engine"]["pin"] is None  # 9ac9658 has no kv_cache_memory_bytes


# -- incidents 2 and 3 in the recipe ---------------------------------------------------------------------------------

def _before(iteration_result):
    """The DeepSpeed-Chat PPO iteration beside the engine (tiny OPT, ZeRO-2, one rank, 128 MiB card, utilization
    0.71), vLLM 0012cf6's rules: the session's run of it where suites/test_colocated_cpu.py already made it (the same
    scenario, its cell ``sleep-1-flush``), else a fresh one (10-30 s here)."""
    from pytest_rlhfmem.rlhf.scenario import Scenario

    return iteration_result(Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1, ENGINE))


def _after(ppo_iteration, **environment):
    """The same iteration under ``environment`` (vllm, engine_expandable_segments): the same scenario id (the
    engine's environment is not its identity), so always a fresh run, never the session's cached one."""
    return ppo_iteration(models="tiny-opt", strategy="zero2", flush="none", world_size=1, device="cpu", **ENGINE,
                         **environment)


def test_incident_2_a_vllm_upgrade_that_sizes_the_kv_cache_larger_fails_at_the_wake_up(iteration_result, ppo_iteration,
                                                                                        memory_budget, request):
    """NeMo-RL PR 3280 at CI scale: the same iteration and utilization, the engine's vLLM 0012cf6 -> 35d5cda. The
    new rule no longer subtracts the trainer's live bytes at the engine's start, so the KV cache grows by them, and
    after training the next rollout's wake-up cannot map it beside what the trainer still reserves: over budget
    (one OOM, the engine's bytes), the failure naming phase next_rollout and the sizing. ``rlhfmem advise`` names
    the pin and the utilization that fit (:func:`test_advise_names_the_pin_or_the_utilization_that_fits`;
    on this run in ``tox -e incidents``)."""
    before = _before(iteration_result)
    memory_budget.check(before)
    if _updating(request):
        return
    after = _after(ppo_iteration, vllm="35d5cda")
    assert after.scenario_id == before.scenario_id  # the engine's version is its environment, not its identity
    old, new = (r["ranks"][0]["recipe"]["rollout_engine"] for r in (before, after))
    grown = new["mappings"][KV_CACHE] - old["mappings"][KV_CACHE]
    assert abs(grown - old["trainer_allocated_at_start"]) < 2 * MiB  # the trainer's live bytes, to the 2 MiB mapping
    with pytest.raises(pytest.fail.Exception) as exc:
        memory_budget.check(after)
    message = str(exc.value)
    assert (f"OOM in phase {NEXT_ROLLOUT}: the colocated engine's wake_up could not map kv_cache "
            f"({new['mappings'][KV_CACHE] / MiB:.2f} MiB)") in message
    assert "vLLM 35d5cda's init-snapshot rule sized its KV cache" in message


def test_incident_3_expandable_segments_in_the_engine_fail_training_after_sleep(iteration_result, ppo_iteration,
                                                                                memory_budget, request):
    """vLLM PR 11743/14189 and OpenRLHF issue 1011 at CI scale: the same iteration with
    ``expandable_segments:True`` in the engine's process under vLLM 9ac9658's sleep pool. Sleep frees 0 B, the
    engine's 70 MiB stay through training, and train_actor's allocations fail at the card: over budget, the
    failure naming the phase and the setting. ``rlhfmem advise`` says to strip the setting
    (:func:`test_advise_says_to_strip_expandable_segments_from_the_engine`; on this run in ``tox -e incidents``)."""
    before = _before(iteration_result)
    memory_budget.check(before)
    if _updating(request):
        return
    after = _after(ppo_iteration, vllm="9ac9658", engine_expandable_segments=True)
    rec = after["ranks"][0]["recipe"]["rollout_engine"]
    assert rec["sleep_frees_bytes"] == 0
    assert rec["held_through_sleep_bytes"] == before["ranks"][0]["recipe"]["rollout_engine"]["sleep_frees_bytes"]
    assert [p for p, m in after.phases.items() if m["ooms"]] == ["train_actor"]
    with pytest.raises(pytest.fail.Exception) as exc:
        memory_budget.check(after)
    message = str(exc.value)
    assert "OOM(s) in phase train_actor: the trainer's cudaMalloc failed beside the colocated engine" in message
    assert "sleep freed 0.00 MiB (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the engine's process" in message
    assert oom_causes(after.data) == [ln for ln in message.splitlines() if "OOM" in ln and "phase" in ln]
