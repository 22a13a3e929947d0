"""The incidents of docs/incidents.md at larger scales than the default run's (opt-in: ``tox -e incidents``),
simulated. tests/test_incidents.py holds them at CI scale.

1. prime-rl PR 1895 at the incident's own scale: tests/data/commands/chunked_lm_head.py with a Qwen3-0.6B-shaped
   model (random weights from its config), 2 micro batches of 65,536 tokens, LM-head chunk 2048 (the budget's) then
   8192, on the simulated CUDA device without values (``--sim-values off``, memory-efficient attention).
2. NeMo-RL PR 3280 at the study's DeepSpeed-Chat scale (OPT-1.3b + OPT-350m, ZeRO-2, rank 0 of 4, the fake-CUDA
   route's simulated device) beside the colocated engine on an 80 GiB card at ``gpu_memory_utilization`` 0.87: vLLM
   0012cf6's sizing (the budget's) then 35d5cda's; the KV cache pinned at 0012cf6's size. (At 0.85 the larger KV
   cache still fitted beside the trainer, 79.79 of 80 GiB: over budget, no OOM; above 0.88 35d5cda refuses to start
   beside the trainer's 9.52 GiB: docs/incidents.md.)
3. vLLM PR 11743 / OpenRLHF issue 1011 at the same scale, utilization 0.9: ``expandable_segments:True`` in the
   engine's process under vLLM 9ac9658's sleep pool.
4. ``rlhfmem advise`` on the CI-scale recipe runs of incidents 2 and 3 (the pin, the utilization, the stripped
   setting), and the pinned run passing the CI budget.

Budgets: ``baselines/cpu/incidents_scale.yaml`` (``--rlhfmem-update-baselines`` writes them from the "before" runs).
Each test prints ``FIGURES {...}``: the figures docs/incidents.md quotes.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem.memory.allocator import MiB
from pytest_rlhfmem.results import IterationResult
from pytest_rlhfmem.rollout import KV_CACHE, NEXT_ROLLOUT

GiB = 1024 * MiB
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "data" / "commands" / "chunked_lm_head.py"
VALUE_FREE = {"RLHFMEM_SIM_CUDA_VALUES": "off", "RLHFMEM_SIM_CUDA_SDPA": "efficient"}
TIMEOUT_S = 3600.0
STUDY_ENGINE = {"rollout_engine": True, "capacity_mib": 80 * 1024, "gpu_memory_utilization": 0.87}
CI_ENGINE = {"rollout_engine": True, "capacity_mib": 128, "gpu_memory_utilization": 0.71}


def _updating(request) -> bool:
    return bool(request.config.getoption("rlhfmem_update_baselines"))


def _figures(**kw) -> None:
    print("FIGURES " + json.dumps(kw, sort_keys=True), flush=True)


def test_incident_1_at_the_incidents_scale(rlhfmem_command, memory_budget, request):
    """Qwen3-0.6B-shaped, 2 x 65,536 tokens, LM-head chunk 2048 then 8192 (prime-rl's defaults before and after its
    PR 1892): the larger chunk's temporaries raise the ``lm_head`` phase by GiBs and fail the budget there."""
    def run(chunk: int) -> IterationResult:
        return rlhfmem_command([sys.executable, str(SCRIPT), "--model", "qwen3-0.6b", "--seq-len", "65536",
                                "--micro-batches", "2", "--chunk-size", str(chunk)],
                               id="prime-rl-1895/qwen3-0.6b/seq65536", device="cuda-sim", env=VALUE_FREE,
                               timeout=TIMEOUT_S)

    before = run(2048)
    memory_budget.check(before)
    if _updating(request):
        return
    after = run(8192)
    grown = after.phases["lm_head"]["peak_allocated"] - before.phases["lm_head"]["peak_allocated"]
    _figures(incident=1, peak_reserved=[before.metrics["peak_reserved"], after.metrics["peak_reserved"]],
             peak_phase=[before.peak_phase, after.peak_phase],
             lm_head_peak_allocated=[before.phases["lm_head"]["peak_allocated"],
                                     after.phases["lm_head"]["peak_allocated"]])
    assert grown > 5 * GiB and after.peak_phase == "lm_head"
    with pytest.raises(pytest.fail.Exception) as exc:
        memory_budget.check(after)
    assert "peak reserved reached in phase: lm_head" in str(exc.value)


# -- the study's scale, rank 0 of 4 on the fake-CUDA route -----------------------------------------------------------

_study: dict[tuple, IterationResult] = {}


def _study_run(tmp_path, monkeypatch, **overrides) -> IterationResult:
    """The study's DeepSpeed-Chat iteration beside the engine (:data:`STUDY_ENGINE` with ``overrides``) as rank 0 of
    4 on the simulated CUDA device, aggregated as the launcher does (``ranks_run=(0,)``), its trace named for
    advise; kept for the module."""
    from pytest_rlhfmem.fakecuda.run import FakeCudaRunError, run_fake_cuda
    from pytest_rlhfmem.rlhf.launch import aggregate
    from pytest_rlhfmem.rlhf.scenario import Scenario

    key = tuple(sorted(overrides.items()))
    if key in _study:
        return _study[key]
    sc = Scenario("deepspeed-chat", "opt-1.3b", "zero2", "none", 4, {**STUDY_ENGINE, **overrides})
    monkeypatch.setenv("RLHFMEM_FAKECUDA_SAVE_TRACE", "1")
    work = tmp_path / f"study-{len(_study)}"  # one directory per run: a test may make several
    try:
        results = run_fake_cuda(sc, work_dir=work, timeout=TIMEOUT_S, tensors="sim")
    except FakeCudaRunError as exc:
        pytest.fail(str(exc), pytrace=False)
    rank = results[sc.id]
    trace = work / (sc.id.replace("/", "__") + ".rlhftrace")
    if trace.exists():
        rank["trace_file"] = str(trace)
    rank_dir = work / "rank"
    rank_dir.mkdir()
    (rank_dir / "result-rank0.json").write_text(json.dumps(rank))
    r = IterationResult(aggregate(sc, "cuda", rank_dir, 0 if rank["status"] == "ok" else 1, False, TIMEOUT_S,
                                  rank["process_wall_s"], rank_dir / "no-launcher.log", ranks_run=(0,)))
    if not r.ok:
        pytest.fail(r.describe_failure(), pytrace=False)
    _study[key] = r
    return r


def _engine(r: IterationResult) -> dict:
    return r["ranks"][0]["recipe"]["rollout_engine"]


def test_incident_2_at_the_studys_scale(tmp_path, monkeypatch, memory_budget, request):
    """80 GiB card, utilization 0.87: 35d5cda's KV cache is larger by the trainer's GiBs at the engine's start, and
    the next rollout's wake-up fails beside what training leaves; pinning the KV cache to 0012cf6's size fits."""
    before = _study_run(tmp_path, monkeypatch)
    memory_budget.check(before)
    if _updating(request):
        return
    after = _study_run(tmp_path, monkeypatch, vllm="35d5cda")
    old, new = _engine(before), _engine(after)
    pinned = _study_run(tmp_path, monkeypatch, vllm="35d5cda", kv_cache_memory_bytes=old["mappings"][KV_CACHE])
    _figures(incident=2, kv_cache=[old["mappings"][KV_CACHE], new["mappings"][KV_CACHE],
                                   _engine(pinned)["mappings"][KV_CACHE]],
             trainer_allocated_at_start=old["trainer_allocated_at_start"],
             ooms=[before.metrics["ooms"], after.metrics["ooms"], pinned.metrics["ooms"]],
             peak_device_used=[before.metrics["peak_device_used"], after.metrics["peak_device_used"],
                               pinned.metrics["peak_device_used"]])
    assert new["mappings"][KV_CACHE] - old["mappings"][KV_CACHE] > GiB
    assert before.metrics["ooms"] == 0 == pinned.metrics["ooms"]
    with pytest.raises(pytest.fail.Exception) as exc:
        memory_budget.check(after)
    assert f"OOM in phase {NEXT_ROLLOUT}: the colocated engine's wake_up could not map kv_cache" in str(exc.value)


ES_UTILIZATION = 0.9


def test_incident_3_at_the_studys_scale(tmp_path, monkeypatch, memory_budget, request):
    """The same card with expandable_segments in the engine's process (vLLM 9ac9658): the engine's GiBs stay through
    training, which fails at the card. At utilization :data:`ES_UTILIZATION`: at 0.85 the engine held 58.47 GiB
    through training and the trainer's 21.03 GiB still fitted beside it (no OOM: docs/incidents.md).
    (Under 0012cf6's pool, which turns them off, the run is the "before" one: tests/test_incidents.py checks that
    the setting changes nothing there.)"""
    before = _study_run(tmp_path, monkeypatch, gpu_memory_utilization=ES_UTILIZATION)
    memory_budget.check(before)
    if _updating(request):
        return
    after = _study_run(tmp_path, monkeypatch, gpu_memory_utilization=ES_UTILIZATION, vllm="9ac9658",
                       engine_expandable_segments=True)
    _figures(incident=3, held_through_sleep=_engine(after)["held_through_sleep_bytes"],
             ooms=[before.metrics["ooms"], after.metrics["ooms"]],
             ooms_by_phase={p: m["ooms"] for p, m in after.phases.items() if m["ooms"]},
             retries_by_phase={p: m["alloc_retries"] for p, m in after.phases.items() if m["alloc_retries"]})
    assert _engine(after)["sleep_frees_bytes"] == 0 and after.metrics["ooms"] > 0
    with pytest.raises(pytest.fail.Exception) as exc:
        memory_budget.check(after)
    assert "sleep freed 0.00 MiB (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in str(exc.value)


# -- advise on the CI-scale recipe runs -------------------------------------------------------------------------------

def _ci(ppo_iteration, **overrides) -> IterationResult:
    return ppo_iteration(models="tiny-opt", strategy="zero2", flush="none", world_size=1, device="cpu", **CI_ENGINE,
                         **overrides)


def _advise(result: IterationResult, tmp_path) -> dict:
    from pytest_rlhfmem.advise import advise
    from pytest_rlhfmem.memory.trace_io import store_beside

    data = copy.deepcopy(result.data)
    path = tmp_path / "after.json"
    store_beside([data], path)
    path.write_text(json.dumps(data))
    return advise(path, processes=2)["scenarios"][0]


def test_advise_on_the_ci_scale_upgrade_names_the_pin_and_the_pin_fits(ppo_iteration, tmp_path):
    """advise on tests/test_incidents.py's incident-2 run (vLLM 35d5cda): it recommends the engine's settings, the
    largest kv_cache_memory_bytes that fits among them; the recipe run with that pin has no OOM."""
    before, after = _ci(ppo_iteration), _ci(ppo_iteration, vllm="35d5cda")
    s = _advise(after, tmp_path)
    e = s["colocated_engine"]
    pin = e["pin"]["largest_fitting"]["no_flush"]
    old, new = (r["ranks"][0]["recipe"]["rollout_engine"]["mappings"][KV_CACHE] for r in (before, after))
    assert old <= pin < new and s["recommendation"]["candidate"] == "engine"
    assert f"kv_cache_memory_bytes={pin} " in s["recommendation"]["text"]
    pinned = _ci(ppo_iteration, vllm="35d5cda", kv_cache_memory_bytes=pin)
    _figures(advise=2, recommendation=s["recommendation"]["text"], pin=pin, pinned_ooms=pinned.metrics["ooms"],
             largest_utilization=e["largest_fitting"])
    assert pinned.metrics["ooms"] == 0


def test_advise_on_the_ci_scale_expandable_segments_says_to_strip_them(ppo_iteration, tmp_path):
    """advise on tests/test_incidents.py's incident-3 run: strip expandable_segments from the engine's process (its
    replay without them has no OOM)."""
    after = _ci(ppo_iteration, vllm="9ac9658", engine_expandable_segments=True)
    s = _advise(after, tmp_path)
    es = s["colocated_engine"]["expandable_segments"]
    _figures(advise=3, recommendation=s["recommendation"]["text"], stripped=es["stripped"])
    assert es["stripped"]["ooms"] == 0
    assert s["recommendation"]["text"].startswith("strip expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF")
