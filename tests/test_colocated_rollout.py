"""A colocated rollout engine (pytest_rlhfmem/rollout/engine.py, vLLM's sleep mode as a stand-in) beside a real
DeepSpeed-Chat iteration's trace: settings refused in one line, vLLM's KV-cache sizing, the events' order, and the
seed study's finding in its colocated form (the trainer's flush before the engine wakes up), simulated."""

from __future__ import annotations

import pytest

from pytest_rlhfmem.memory.allocator import MiB
from pytest_rlhfmem.memory.events import ALLOC, EXTERNAL_MAP, EXTERNAL_UNMAP, FLUSH, FREE, PHASE, Event, Trace
from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.rollout import (
    KV_CACHE, NEXT_ROLLOUT, WEIGHTS, ColocatedEngine, EngineSettingsError, colocated_trace, kv_cache_bytes,
)


@pytest.mark.parametrize("kwargs, message", [
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization 0.0: allowed values are in (0, 1]"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization 1.5: allowed values are in (0, 1]"),
    ({"sleep_level": 3}, "sleep level 3: allowed values are 1, 2 or None (no sleep)"),
    ({"cuda_graph_bytes": -1}, "cuda_graph_bytes -1: allowed values are 0 or more bytes"),
])
def test_settings_out_of_range_are_one_line(kwargs, message):
    with pytest.raises(EngineSettingsError) as exc:
        ColocatedEngine(weights_bytes=MiB, **kwargs)
    assert str(exc.value) == message


def test_kv_cache_is_vllms_utilization_minus_the_process_peak():
    # gpu_worker.py determine_available_memory: total * utilization - peak, here rounded down to 2 MiB
    assert kv_cache_bytes(100 * MiB, 0.5, 20 * MiB) == 30 * MiB
    assert kv_cache_bytes(100 * MiB, 0.5, 20 * MiB, non_torch_bytes=3 * MiB) == 26 * MiB
    with pytest.raises(EngineSettingsError, match="leaves no KV cache"):
        kv_cache_bytes(100 * MiB, 0.2, 20 * MiB)
    # the trainer's live tensors at the engine's start shrink the KV cache: same process, same torch peak
    e = ColocatedEngine(weights_bytes=3 * MiB, gpu_memory_utilization=0.5)
    assert e.sizes(100 * MiB, 0) == {WEIGHTS: 4 * MiB, KV_CACHE: 46 * MiB, "cuda_graph": 0}
    assert e.sizes(100 * MiB, 10 * MiB)[KV_CACHE] == 36 * MiB
    assert e.host_bytes_asleep(e.sizes(100 * MiB, 0)) == 4 * MiB  # level 1 keeps the weights on the host
    assert ColocatedEngine(weights_bytes=3 * MiB, sleep_level=2).host_bytes_asleep(e.sizes(100 * MiB, 0)) == 0


def _toy() -> Trace:
    return Trace(events=[
        Event(PHASE, name="init"), Event(ALLOC, 1, 4 * MiB),
        Event(PHASE, name="generate"), Event(ALLOC, 2, MiB), Event(FREE, 2, MiB), Event(ALLOC, 3, MiB),
        Event(PHASE, name="train_actor"), Event(ALLOC, 4, 8 * MiB), Event(FREE, 4, 8 * MiB), Event(FREE, 3, MiB)])


def test_events_order_start_sleep_wake_and_the_rollout_generated_by_the_engine():
    e = ColocatedEngine(weights_bytes=2 * MiB, gpu_memory_utilization=0.5, sleep_level=1, flush_before_wake_up=True)
    t, info = colocated_trace(_toy(), e, 64 * MiB)
    got = [(ev.action, ev.name or ev.addr) for ev in t.events]
    assert got == [
        (PHASE, "init"), (ALLOC, 1),
        (EXTERNAL_MAP, WEIGHTS), (EXTERNAL_MAP, KV_CACHE),  # LLM(...) as init ends
        (EXTERNAL_UNMAP, WEIGHTS), (EXTERNAL_UNMAP, KV_CACHE), (FLUSH, "engine-sleep"),  # asleep at once (TRL)
        (PHASE, "generate"), (FLUSH, "before-wake-up"), (EXTERNAL_MAP, WEIGHTS), (EXTERNAL_MAP, KV_CACHE),
        (ALLOC, 3),  # the trainer's own generate temporaries (2) are gone: the engine generated; 3 outlives it
        (EXTERNAL_UNMAP, WEIGHTS), (EXTERNAL_UNMAP, KV_CACHE), (FLUSH, "engine-sleep"),
        (PHASE, "train_actor"), (ALLOC, 4), (FREE, 4), (FREE, 3),
        (PHASE, NEXT_ROLLOUT), (FLUSH, "before-wake-up"), (EXTERNAL_MAP, WEIGHTS), (EXTERNAL_MAP, KV_CACHE)]
    assert info["generate_allocations_dropped"] == 2
    assert info["trainer_allocated_at_start"] == 4 * MiB
    assert info[KV_CACHE] == 32 * MiB - 4 * MiB - 2 * MiB
    awake = [ev.action for ev in colocated_trace(_toy(), ColocatedEngine(2 * MiB, 0.5, sleep_level=None), 64 * MiB)[0]
             .events]
    assert EXTERNAL_UNMAP not in awake and FLUSH not in awake and awake.count(EXTERNAL_MAP) == 2
    with pytest.raises(EngineSettingsError, match="phase 'generate' is not in the trace: its phases are init"):
        colocated_trace(Trace(events=[Event(PHASE, name="init")]), e, 64 * MiB)


@pytest.fixture(scope="module")
def deepspeed_chat_trace(tmp_path_factory):
    """One real DeepSpeed-Chat PPO iteration (tiny OPT, no ZeRO partitioning, world size 1, CPU), its trace."""
    from pytest_rlhfmem.memory.trace_io import load_trace
    from pytest_rlhfmem.rlhf.launch import run_scenario
    from pytest_rlhfmem.rlhf.scenario import Scenario

    r = run_scenario(Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1), device="cpu", timeout=600,
                     work_dir=tmp_path_factory.mktemp("colocated"))
    assert r["status"] == "ok", r["failure"]
    return load_trace(r["ranks"][0]["trace_file"])


CAPACITY = 128 * MiB  # a device the tiny iteration's trace is sized against (simulated)
UTILIZATIONS = [round(0.30 + 0.01 * k, 2) for k in range(66)]  # 0.30 .. 0.95


def _wake(trace, util, level, flush):
    e = ColocatedEngine(weights_bytes=2 * MiB, gpu_memory_utilization=util, sleep_level=level,
                        flush_before_wake_up=flush, activation_peak_bytes=MiB)
    ct, info = colocated_trace(trace, e, CAPACITY)
    return replay(ct, capacity=CAPACITY), info


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_the_flush_before_wake_up_on_a_deepspeed_chat_trace(deepspeed_chat_trace):
    """The seed finding, colocated: after training, the trainer's allocator holds cached blocks when the next
    rollout wakes the engine. For every utilization where the wake-up fails without the trainer's flush, and
    fits with it, the flush is what makes it fit; the flush never makes a setting fail that fits without it.
    Found on this trace (simulated, CPU): the window exists for both sleep levels and is narrow (the trainer's
    free cached bytes at the wake-up are mostly inside segments that still hold live blocks)."""
    base = replay(deepspeed_chat_trace)
    assert base.final_reserved > base.final_allocated  # the trainer ends its training with cached blocks
    for level in (1, 2):
        window = []
        for util in UTILIZATIONS:
            held, _ = _wake(deepspeed_chat_trace, util, level, flush=False)
            flushed, info = _wake(deepspeed_chat_trace, util, level, flush=True)
            assert not (held.total.ooms == 0 and flushed.total.ooms > 0), util
            if held.total.ooms and not flushed.total.ooms:
                assert [f["phase"] for f in held.external_map_failures] == [NEXT_ROLLOUT], util
                window.append(util)
        assert window, f"sleep level {level}: no utilization where the flush before wake-up decides"
    # sleep levels 1 and 2 release the same device bytes: the same device figures
    one, _ = _wake(deepspeed_chat_trace, 0.5, 1, flush=False)
    two, _ = _wake(deepspeed_chat_trace, 0.5, 2, flush=False)
    assert (one.peak_device_used, one.total.ooms) == (two.peak_device_used, two.total.ooms)


def test_an_engine_that_never_sleeps_crowds_the_trainers_training(deepspeed_chat_trace):
    """Without sleep mode the engine stays mapped through training: vLLM sized its KV cache against the trainer's
    live bytes at the engine's start, not against what training adds, so a high utilization leaves training short
    (retries, then OOMs) where sleep mode fits."""
    sleeping, _ = _wake(deepspeed_chat_trace, 0.8, 1, flush=True)
    awake, info = _wake(deepspeed_chat_trace, 0.8, None, flush=True)
    assert awake.external_peak == info["engine_mapped_bytes"]
    assert awake.total.alloc_retries + awake.total.ooms > 0
    assert sleeping.total.alloc_retries + sleeping.total.ooms < awake.total.alloc_retries + awake.total.ooms


@pytest.mark.parametrize("overrides, message", [
    ({"sleep_level": 1}, "override sleep_level sets the colocated rollout engine: it needs rollout_engine=True"),
    ({"rollout_engine": True, "sleep_level": 3}, "override sleep_level=3: allowed values are 0 (never sleeps), 1, 2"),
    ({"rollout_engine": True, "gpu_memory_utilization": 1.2},
     "override gpu_memory_utilization=1.2: allowed values are in (0, 1]"),
    ({"rollout_engine": True, "capacity_mib": 0}, "override capacity_mib=0: allowed values are 1 MiB or more"),
    ({"rollout_engine": True, "flush_before_wake_up": "yes"},
     "override flush_before_wake_up='yes' must be of type bool"),
])
def test_scenario_overrides_of_the_engine_are_one_line(overrides, message):
    from pytest_rlhfmem.rlhf.scenario import Scenario, ScenarioError

    with pytest.raises(ScenarioError) as exc:
        Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1, overrides)
    assert str(exc.value) == message
    with pytest.raises(ScenarioError, match="wired into DeepSpeed-Chat's iterations of ppo, grpo, remax: got "
                                            "'colossalchat' / 'ppo'"):
        Scenario("colossalchat", "tiny-opt", "none", "none", 1, {"rollout_engine": True})
    with pytest.raises(ScenarioError, match="not Hydra-PPO's"):
        Scenario("deepspeed-chat", "tiny-opt", "hydra", "none", 1, {"rollout_engine": True})
    Scenario("deepspeed-chat", "tiny-opt", "none", "none", 1, {"rollout_engine": True, "group_size": 2}, "grpo")
    s = Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1, {"rollout_engine": True, "sleep_level": 2})
    assert s.id.endswith("/x1/rollout_engine=True,sleep_level=2")


def test_the_recorders_stream_keeps_mappings_and_drops_the_engines_temporaries():
    """record/recorder.py EventStream: EXTERNAL_MAP/UNMAP marks become events; inside ``engine_region`` a block
    allocated and freed there leaves the trace, one that outlives it (the rollout) stays."""
    from pytest_rlhfmem.record.recorder import EventStream

    marks = [(EXTERNAL_MAP, (2, 4 * MiB, KV_CACHE)), ("engine_enter", None), ("engine_exit", None),
             (EXTERNAL_UNMAP, (2, 4 * MiB, KV_CACHE))]
    stream = EventStream(marks)
    stream.feed([(1000, 0, 1, 0, 0), (2000, 1, 1, 1, 0), (3000, 2, 0, 0xA, 100), (4000, 3, 0, 0xB, 200),
                 (5000, 4, 0, 0xA, -100), (6000, 5, 1, 2, 0), (7000, 6, 0, 0xB, -200), (8000, 7, 1, 3, 0)])
    got = [(e.action, e.addr, e.size, e.name) for e in stream.take()]
    assert got == [(EXTERNAL_MAP, 2, 4 * MiB, KV_CACHE), (ALLOC, 0xB, 200, ""), (FREE, 0xB, 200, ""),
                   (EXTERNAL_UNMAP, 2, 4 * MiB, KV_CACHE)]


def test_fake_tensors_refuse_the_engine_in_one_line(tmp_path):
    """FakeTensorMode's recorder writes no mappings: the engine runs on the simulated CUDA device (tensors='sim')."""
    from pytest_rlhfmem.fakecuda.run import run_fake_cuda
    from pytest_rlhfmem.rlhf.scenario import Scenario

    sc = Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 1, {"rollout_engine": True})
    with pytest.raises(ValueError, match=r"recorded on the simulated CUDA device \(tensors='sim'\)"):
        run_fake_cuda(sc, work_dir=tmp_path)
    with pytest.raises(ValueError, match="under record_stream='until-sync' that flush's host wait returns blocks"):
        run_fake_cuda(sc, work_dir=tmp_path, tensors="sim", without_flush=True, record_stream="until-sync")


def test_sizes_at_another_utilization_are_the_engines_and_resize_only_its_mappings():
    """advise's utilization search: the engine of a run's record, sized again on a card at another utilization
    (vLLM's determine_available_memory with the same trainer), and the run's events with those sizes."""
    from pytest_rlhfmem.rollout import sizes_at, with_mapping_sizes

    record = {"weights_bytes": 3 * MiB, "gpu_memory_utilization": 0.5, "sleep_level": 1, "flush_before_wake_up": True,
              "activation_peak_bytes": MiB, "cuda_graph_bytes": 0, "trainer_allocated_at_start": 20 * MiB}
    got = sizes_at(record, 128 * MiB, 0.75)
    assert got == ColocatedEngine(3 * MiB, 0.75, 1, True, MiB).sizes(128 * MiB, 20 * MiB)
    assert got[KV_CACHE] == 70 * MiB  # 96 MiB - (20 + 4 + 1) MiB (weights rounded up to 2 MiB), rounded down to 2 MiB
    with pytest.raises(EngineSettingsError, match="leaves no KV cache"):
        sizes_at(record, 128 * MiB, 0.2)
    events = [Event(EXTERNAL_MAP, 2, 10 * MiB, name=KV_CACHE), Event(ALLOC, 7, 512), Event(EXTERNAL_MAP, 1, 4 * MiB,
              name=WEIGHTS), Event(EXTERNAL_UNMAP, 2, 10 * MiB, name=KV_CACHE)]
    out = with_mapping_sizes(events, {KV_CACHE: got[KV_CACHE]})
    assert [(e.action, e.size) for e in out] == [(EXTERNAL_MAP, got[KV_CACHE]), (ALLOC, 512), (EXTERNAL_MAP, 4 * MiB),
                                                 (EXTERNAL_UNMAP, got[KV_CACHE])]


def test_advise_finds_the_boundaries_right_before_a_wake_up():
    """A flush boundary is a wake-up's when the next event after it, phase marks and flushes aside, is a mapping."""
    from pytest_rlhfmem.advise.inputs import find_boundaries, wake_up_boundaries
    from pytest_rlhfmem.memory.events import PHASE_END

    events = [Event(PHASE, name="init"), Event(ALLOC, 1, 512), Event(PHASE_END, name="init"), Event(ALLOC, 2, 512),
              Event(PHASE, name="generate"), Event(EXTERNAL_MAP, 1, 2 * MiB, name=WEIGHTS), Event(FREE, 2, 512),
              Event(PHASE_END, name="generate"), Event(PHASE, name="train"), Event(ALLOC, 3, 512),
              Event(PHASE_END, name="train"), Event(PHASE, name=NEXT_ROLLOUT), Event(FLUSH, name="engine-sleep"),
              Event(EXTERNAL_MAP, 2, 2 * MiB, name=KV_CACHE), Event(FREE, 1, 512), Event(FREE, 3, 512)]
    b = find_boundaries(events)
    assert wake_up_boundaries(events, b) == frozenset({"train"})  # init is followed by the trainer's allocation
