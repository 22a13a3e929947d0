"""A colocated rollout engine beside the study's DeepSpeed-Chat iteration (issue 40; opt-in: ``tox -e colocated-study``,
4 min 26 s on 2 cores here), simulated.

OPT-1.3b actor/reference + OPT-350m critic/reward at the pair's defaults (batch 4, Hybrid Engine, EMA), ZeRO-2, 4
ranks (rank 0 on a fake process group), on the fake-CUDA route with the simulated CUDA device (``tensors="sim"``),
with vLLM's sleep mode as a stand-in (``pytest_rlhfmem/rollout/engine.py``) started as ``init`` ends, woken up for
``generate`` and again after training (phase ``next_rollout``), its KV cache sized for a 24 GiB and an 80 GiB card at
``gpu_memory_utilization`` 0.9; each run replays at its card. Every figure is simulated (the device's allocation log
and the engine's mappings replayed through the allocator model). Each engine cell runs with the trainer's flush
before wake-up (TRL's and verl's order); its twin without that flush replays the same trace without it
(``fakecuda/worker.py: without_wake_up_flushes``: a flush moves no allocation of the program).

Budgets: ``baselines/cpu/colocated_study.yaml``; the README's table is generated from it
(``python -m doctables.budget_tables colocated-study``). ``rlhfmem advise``'s answer on the 24 GiB run without the
flush is held to ``docs/colocated-advise-24GiB.txt`` (the README includes it); ``--rlhfmem-update-baselines``
rewrites both.
"""

import json
from pathlib import Path

import pytest

from pytest_rlhfmem.fakecuda.run import FakeCudaRunError, run_fake_cuda
from pytest_rlhfmem.results import IterationResult
from pytest_rlhfmem.rlhf.launch import aggregate
from pytest_rlhfmem.rlhf.scenario import Scenario

SUITE = "colocated_study"
TIMEOUT_S = 3600.0
CARDS_GIB = (24, 80)
UTILIZATION = 0.9  # vLLM's gpu_memory_utilization (TRL's default is 0.3, verl's 0.5, OpenRLHF's 0.95)
ADVISE_TEXT = Path(__file__).resolve().parent.parent / "docs" / "colocated-advise-24GiB.txt"
_cache: dict[str, IterationResult] = {}


def scenario(**overrides) -> Scenario:
    return Scenario("deepspeed-chat", "opt-1.3b", "zero2", "none", 4, overrides)


def engine(card_gib: int, level: int, flush: bool = True) -> Scenario:
    return scenario(rollout_engine=True, gpu_memory_utilization=UTILIZATION, capacity_mib=card_gib * 1024,
                    sleep_level=level, **({} if flush else {"flush_before_wake_up": False}))


def _run(sc: Scenario, work: Path, monkeypatch) -> None:
    """Run ``sc`` as rank 0 of 4 on the simulated device (with an engine: also its twin without the flush before
    wake-up) and cache each result as the launcher aggregates it, naming the trace the worker wrote beside it
    (advise)."""
    monkeypatch.setenv("RLHFMEM_FAKECUDA_SAVE_TRACE", "1")
    try:
        results = run_fake_cuda(sc, work_dir=work, without_flush=bool(sc.get("rollout_engine")), timeout=TIMEOUT_S,
                                tensors="sim")
    except FakeCudaRunError as exc:  # the worker died or hung: its log's tail, no traceback of this test
        pytest.fail(str(exc), pytrace=False)
    for sid, rank in results.items():
        trace = work / (sid.replace("/", "__") + ".rlhftrace")
        if trace.exists():
            rank["trace_file"] = str(trace)
        rank_dir = work / sid.replace("/", "__").replace("=", "-").replace(",", "_")
        rank_dir.mkdir()
        (rank_dir / "result-rank0.json").write_text(json.dumps(rank))
        cell = Scenario.from_dict(rank["scenario"])
        _cache[sid] = IterationResult(aggregate(cell, "cuda", rank_dir, 0 if rank["status"] == "ok" else 1, False,
                                                TIMEOUT_S, rank["process_wall_s"], rank_dir / "no-launcher.log",
                                                ranks_run=(0,)))  # rank 0 of 4, on a fake process group


def _result(sc: Scenario, work: Path, monkeypatch) -> IterationResult:
    if sc.id not in _cache:
        _run(sc, work, monkeypatch)
    r = _cache[sc.id]
    if not r.ok:
        pytest.fail(r.describe_failure(), pytrace=False)
    assert r.simulated and r.capture == "sim-cuda-simulated"
    return r


def test_engine_off_within_budget(tmp_path, monkeypatch, memory_budget):
    r = _result(scenario(), tmp_path, monkeypatch)
    assert "engine_mapped_peak" not in r.metrics
    memory_budget.check(r, suite=SUITE)


@pytest.mark.parametrize("level", (1, 2))
@pytest.mark.parametrize("card", CARDS_GIB)
def test_the_flush_before_wake_up_lets_the_engine_wake_up(card, level, tmp_path, monkeypatch, memory_budget):
    """The seed study's finding, colocated, at the study's scale (simulated): at each card, after training the
    trainer's allocator still holds its cached blocks; without its flush the next rollout's wake-up cannot map the KV
    cache (an OOM), with it the iteration fits. Both runs are held to their budgets."""
    flushed = _result(engine(card, level), tmp_path, monkeypatch)
    held = _result(engine(card, level, flush=False), tmp_path, monkeypatch)
    rank = flushed["ranks"][0]
    assert rank["capacity"] == card * 2**30 and rank["recipe"]["rollout_engine"]["gpu_memory_utilization"] == 0.9
    assert flushed.metrics["ooms"] == 0 and flushed.metrics["peak_device_used"] <= card * 2**30
    assert held.metrics["ooms"] >= 1
    assert flushed.metrics["engine_mapped_peak"] == held.metrics["engine_mapped_peak"] > 0
    memory_budget.check(flushed, suite=SUITE)
    memory_budget.check(held, suite=SUITE)


@pytest.mark.parametrize("card", CARDS_GIB)
def test_sleep_levels_release_the_same_device_bytes(card, tmp_path, monkeypatch):
    """vLLM's sleep(1) and sleep(2) both unmap every mapping (level 1 keeps the weights in host memory)."""
    one = _result(engine(card, 1), tmp_path, monkeypatch).metrics
    two = _result(engine(card, 2), tmp_path, monkeypatch).metrics
    for m in ("peak_reserved", "engine_mapped_peak", "peak_device_used", "alloc_retries", "ooms"):
        assert one[m] == two[m], m


def test_advise_names_the_flush_before_wake_up_and_the_utilization(tmp_path, monkeypatch, request):
    """``rlhfmem advise`` on the 24 GiB run without the flush: the recommendation is the flush right before the
    engine's wake-up, and its utilization search says what fits with and without it; the text is the committed
    docs/colocated-advise-24GiB.txt (rewritten under ``--rlhfmem-update-baselines``)."""
    from pytest_rlhfmem.advise import advise

    held = _result(engine(24, 1, flush=False), tmp_path, monkeypatch)
    path = tmp_path / "held.json"
    path.write_text(json.dumps(held.data))
    s = advise(path, processes=2)["scenarios"][0]
    assert s["baseline"]["ooms"] >= 1 and s["baseline"]["external_map_failures"] == 1
    assert "(before the engine's wake_up)" in s["recommendation"]["text"]
    engine_text = s["colocated_engine"]
    assert engine_text["largest_fitting"]["flush_before_wake_up"] >= UTILIZATION
    text = (f"$ rlhfmem advise RESULT.json   # {held.scenario_id}, simulated\n"
            f"recommendation: {s['recommendation']['text']}\ncolocated engine: {engine_text['text']}\n")
    if request.config.getoption("rlhfmem_update_baselines"):
        ADVISE_TEXT.write_text(text)
    assert ADVISE_TEXT.read_text() == text, (f"{ADVISE_TEXT} differs from advise's answer now; rerun with "
                                             "--rlhfmem-update-baselines and commit it")
