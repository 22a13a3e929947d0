"""A colocated rollout engine in DeepSpeed-Chat's PPO iteration on CPU (issue 40): vLLM's sleep mode as a stand-in
(pytest_rlhfmem/rollout/engine.py), tiny OPT, one rank, the engine's KV cache sized for a 128 MiB simulated card at
gpu_memory_utilization 0.71; checked against baselines/cpu/colocated_cpu.yaml (engine_mapped_peak and
peak_device_used beside the usual figures). Every device figure is simulated (the CPU trace, the engine's mappings
as EXTERNAL_MAP events, replayed through the allocator model); docs/colocated-rollout.md says what is modelled."""

import pytest

from pytest_rlhfmem.memory.allocator import MiB
from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.memory.trace_io import load_trace
from pytest_rlhfmem.rollout import NEXT_ROLLOUT

CAPACITY_MIB = 128  # the simulated card the engine sizes its KV cache against, and the replays below run at
ENGINE = {"rollout_engine": True, "capacity_mib": CAPACITY_MIB, "gpu_memory_utilization": 0.71}


def scenario(algorithm="ppo", **overrides):
    from pytest_rlhfmem.rlhf.scenario import Scenario

    return Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1, overrides, algorithm)


# GRPO (TRL's GRPOTrainer is the common colocated setup) without a critic holds less when the engine starts, so its
# KV cache is larger at the same utilization: 0.67 is where its flush decides (advise's search finds 0.66-0.68)
GRPO = {**ENGINE, "gpu_memory_utilization": 0.67, "group_size": 2}
SCENARIOS = {
    "engine-off": scenario(),
    "sleep-1-flush": scenario(**ENGINE),  # TRL's order: empty_cache() before wake_up
    "sleep-1-no-flush": scenario(**ENGINE, flush_before_wake_up=False),
    "sleep-2-flush": scenario(**ENGINE, sleep_level=2),
    "never-sleeps": scenario(**ENGINE, sleep_level=0),
    "grpo-flush": scenario("grpo", **GRPO),
    "grpo-no-flush": scenario("grpo", **GRPO, flush_before_wake_up=False),
    "remax-flush": scenario("remax", **{**ENGINE, "gpu_memory_utilization": 0.68}),  # it serves both generations
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_iteration_within_budget(name, iteration_result, memory_budget):
    result = iteration_result(SCENARIOS[name])
    assert result.simulated and result.capture == "cpu-trace-simulated"
    engine = name != "engine-off"
    assert ("engine_mapped_peak" in result.metrics) == engine
    if engine:  # the engine's mappings are outside the trainer's reserved bytes, and count on the device
        assert result.metrics["peak_device_used"] > result.metrics["peak_reserved"]
        assert NEXT_ROLLOUT in result.phases
    memory_budget.check(result)


def _at_capacity(result):
    return replay(load_trace(result["ranks"][0]["trace_file"]), capacity=CAPACITY_MIB * MiB)


def test_the_flush_before_wake_up_decides_whether_the_engine_wakes_up(iteration_result):
    """The seed study's finding, colocated, on the recipe's own trace at the card's capacity (simulated): after
    training the trainer's allocator holds cached blocks; without its flush the next rollout's wake-up cannot map
    the KV cache (an OOM the engine raises; nothing of the trainer's cache is released for it), with it it fits."""
    held = _at_capacity(iteration_result(SCENARIOS["sleep-1-no-flush"]))
    flushed = _at_capacity(iteration_result(SCENARIOS["sleep-1-flush"]))
    assert [(f["name"], f["phase"]) for f in held.external_map_failures] == [("kv_cache", NEXT_ROLLOUT)]
    assert held.total.ooms == 1
    assert flushed.external_map_failures == [] and flushed.total.ooms == 0
    assert flushed.peak_device_used <= CAPACITY_MIB * MiB < held.peak_device_used + held.external_map_failures[0][
        "bytes"]


def test_grpo_and_remax_run_beside_the_engine(iteration_result):
    """The critic-free iterations with the engine (rlhf/deepspeed_chat/critic_free_iteration.py): GRPO's group
    sampling and ReMax's sampled and greedy answers are the engine's work, it wakes up again after training, and for
    GRPO at 0.67 the flush before wake-up decides whether it can (simulated, at the card)."""
    held = iteration_result(SCENARIOS["grpo-no-flush"])
    flushed = iteration_result(SCENARIOS["grpo-flush"])
    remax = iteration_result(SCENARIOS["remax-flush"])
    assert held.metrics["ooms"] == 1 and flushed.metrics["ooms"] == 0 and remax.metrics["ooms"] == 0
    for r in (flushed, remax):
        assert NEXT_ROLLOUT in r.phases and r["ranks"][0]["recipe"]["rollout_engine"]["mappings"]["kv_cache"] > 0
    events = load_trace(remax["ranks"][0]["trace_file"]).events
    phase, sleeps = None, []
    for e in events:
        phase = e.name if e.action == "phase" else phase
        if e.action == "external_unmap" and e.name == "kv_cache":
            sleeps.append(phase)
    assert sleeps == ["init", "generate_greedy"]  # asleep at start, then after both generations


def test_sleep_levels_release_the_same_device_bytes(iteration_result):
    """vLLM's sleep(1) and sleep(2) both unmap every CuMemAllocator mapping; level 1 keeps the weights on the host."""
    one = iteration_result(SCENARIOS["sleep-1-flush"]).metrics
    two = iteration_result(SCENARIOS["sleep-2-flush"]).metrics
    for m in ("engine_mapped_peak", "peak_device_used", "peak_reserved"):
        assert one[m] == two[m], m


def test_an_engine_that_never_sleeps_crowds_training(iteration_result):
    """Without sleep mode the engine stays mapped through training: at the card's capacity the trainer's training
    retries or fails, where the sleeping engine's run fits."""
    awake = _at_capacity(iteration_result(SCENARIOS["never-sleeps"]))
    sleeping = _at_capacity(iteration_result(SCENARIOS["sleep-1-flush"]))
    assert sleeping.total.alloc_retries == 0 and sleeping.total.ooms == 0
    training = [p for p in awake.phases if p.phase in ("train_actor", "train_critic")]
    assert sum(p.alloc_retries + p.ooms for p in training) > 0


def test_advise_names_the_flush_that_lets_the_engine_wake_up(iteration_result, tmp_path):
    """``rlhfmem advise --capacity 128MiB`` on the run without the flush (simulated): every candidate replays at the
    card's capacity because the trace maps memory outside the caching allocator; the unchanged program's OOM is the
    engine's wake-up, and the recommendation is a flush after training that removes it."""
    import copy
    import json

    from pytest_rlhfmem.advise import advise
    from pytest_rlhfmem.memory.trace_io import store_beside

    data = copy.deepcopy(iteration_result(SCENARIOS["sleep-1-no-flush"]).data)
    path = tmp_path / "no-flush.json"
    store_beside([data], path)
    path.write_text(json.dumps(data))
    s = advise(path, capacity=CAPACITY_MIB * MiB, processes=1)["scenarios"][0]
    assert s["baseline"]["ooms"] == 1 and s["baseline"]["external_map_failures"] == 1
    assert "--capacity 128.00 MiB for every candidate" in s["assumptions"]["replay"]
    best = next(c for c in s["candidates"] if c["id"] == s["recommendation"]["candidate"])
    assert best["ooms"] == 0 and best["flushes_at"] == ["train_critic"] and best["before_wake_up"]
    assert (best["extra_cuda_malloc"], best["extra_cuda_free"]) == (0, 1)  # the cheapest fix: one cudaFree
    assert "removes the 1 OOM(s)" in s["recommendation"]["text"] and "colocated engine's wake-up" in \
        s["recommendation"]["text"]
    assert "(before the engine's wake_up)" in s["recommendation"]["text"]
    # without --capacity: the card the engine was sized for (the run's capacity_mib), the same answer
    card = advise(path, processes=1)["scenarios"][0]
    assert "the card the engine was sized for 128.00 MiB" in card["assumptions"]["replay"]
    assert card["recommendation"] == s["recommendation"]
    # the utilization search: the run's 0.71 fits only with the flush; without it a smaller KV cache fits
    engine = card["colocated_engine"]
    fits = engine["largest_fitting"]
    assert fits["flush_before_wake_up"] >= 0.71 > fits["no_flush"] > 0
    at = next(p for p in engine["points"] if p["utilization"] == 0.71)
    assert at["no_flush"]["ooms"] == 1 and at["flush_before_wake_up"]["ooms"] == 0
    assert engine["wake_up_boundaries"] == [best["flushes_at"][0]]


def test_the_simulated_device_route_records_the_engine(tmp_path):
    """The same scenario on the fake-CUDA route's simulated CUDA device (the route of the study's scale,
    suites/test_colocated_study.py): the engine's mappings are in its trace, the replay runs at the card, and the twin
    without the flush before wake-up (the same trace without that FLUSH) is the run whose wake-up fails."""
    from pytest_rlhfmem.fakecuda.run import run_fake_cuda

    flushed = SCENARIOS["sleep-1-flush"]
    results = run_fake_cuda(flushed, work_dir=tmp_path, without_flush=True, tensors="sim")
    held = results[SCENARIOS["sleep-1-no-flush"].id]
    ok = results[flushed.id]
    assert ok["status"] == held["status"] == "ok" and ok["capacity"] == CAPACITY_MIB * MiB
    assert ok["total"]["ooms"] == 0 and held["total"]["ooms"] == 1
    assert ok["total"]["engine_mapped_peak"] == held["total"]["engine_mapped_peak"] > 0
    assert held["recipe"]["rollout_engine"]["flush_before_wake_up"] is False
    assert ok["recipe"]["rollout_engine"]["mappings"]["kv_cache"] > 0
    # the study's scale runs rank 0 of 4 alone (suites/test_colocated_study.py): aggregated with ranks_run, the
    # result is that rank's and says so; without it the missing ranks fail it
    import json

    from pytest_rlhfmem.rlhf.launch import aggregate
    from pytest_rlhfmem.rlhf.scenario import Scenario

    (tmp_path / "result-rank0.json").write_text(json.dumps(held))
    four = Scenario.from_dict({**SCENARIOS["sleep-1-no-flush"].to_dict(), "world_size": 4})
    alone = aggregate(four, "cuda", tmp_path, 0, False, 60.0, 1.0, tmp_path / "none.log", ranks_run=(0,))
    assert alone["status"] == "ok" and alone["ranks_run"] == [0] and alone["metrics"]["ooms"] == 1
    assert aggregate(four, "cuda", tmp_path, 0, False, 60.0, 1.0, tmp_path / "none.log")["status"] == "failed"
