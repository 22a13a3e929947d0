"""The study's DeepSpeed-Chat scale without a GPU (opt-in: ``tox -e study-sim``; about 2 minutes on 2 cores).

OPT-1.3b actor/reference + OPT-350m critic/reward, LoRA 128, prompt 256 + answer 256, fp16, 4 ranks (rank 0
on a fake process group), run as DeepSpeed-Chat's ``run_1.3b.sh`` ran on the study's DeepSpeed (the pair's defaults:
batch 4, the Hybrid Engine, EMA, actor dropout 0, ``rlhf/deepspeed_chat/configs.py``; and the Hybrid Engine's
inference kernels injected into OPT, ``hybrid_engine_kernels``, ``fakecuda/inference_kernels.py``), on the fake-CUDA
route (``pytest_rlhfmem/fakecuda``) with the simulated CUDA device's tensors (``tensors="sim"``): every figure is
simulated (the device's allocation log replayed through the allocator model). Each strategy runs once with
the after-inference flush marks; its flush-none cell replays the same trace without them. Measured (the run of
``docs/study-runs/2026-11-25/scripts``): 19-24 s of CPU per strategy (process), 2-3 s of it generation.

``RLHFMEM_STUDY_SIM_RESULTS=DIR`` reuses the result JSONs that ``studies/study_scale.py --out DIR``
wrote instead of running again.
"""

import json
import os
from pathlib import Path

import pytest

from pytest_rlhfmem.fakecuda.run import run_fake_cuda
from pytest_rlhfmem.rlhf.scenario import Scenario

from studies import study_scale

STRATEGIES = ("none", "zero2", "zero3", "zero3-offload", "all")
# The route is deterministic: the figures the README's "The study's scale without a GPU" table gives (GiB to one
# decimal: each figure must round to it), from the recorded run named there. strategy -> flush -> (peak reserved,
# fragmentation at peak, peak allocated, peak phase); the flush runs' allocated figure is not tabulated (None).
GiB = 2**30
PINNED = {
    "none": {"none": (23.0, 6.5, 21.9, "train_actor"), "after-inference": (25.6, 7.3, None, "train_critic")},
    "zero2": {"none": (20.6, 8.1, 17.7, "train_critic"), "after-inference": (20.6, 8.1, None, "train_critic")},
    "zero3": {"none": (18.5, 12.3, 14.3, "train_critic"), "after-inference": (18.0, 11.7, None, "train_critic")},
    "zero3-offload": {"none": (14.4, 11.7, 11.2, "train_critic"), "after-inference": (13.9, 11.4, None, "ema")},
    "all": {"none": (8.2, 5.7, 5.2, "ema"), "after-inference": (5.6, 1.2, None, "generate")},
}
_cache: dict[str, dict] = {}


# run_1.3b.sh on the study's DeepSpeed: the Hybrid Engine injected its inference kernels into OPT, which DeepSpeed
# 0.19.8 does not do with the pinned transformers 5.23.0; the fake-CUDA route runs them as stand-ins
# (fakecuda/inference_kernels.py).
# The overrides studies/study_scale.py runs by default, which recorded the pinned figures.
SCRIPTS = study_scale.SCRIPTS_OVERRIDES


def _scenario(strategy: str, flush: str) -> Scenario:
    return Scenario("deepspeed-chat", "opt-1.3b", strategy, flush, 4, SCRIPTS)


def _result(strategy: str, flush: str, tmp_dir: Path) -> dict:
    sc = _scenario(strategy, flush)
    if sc.id not in _cache:
        reuse = os.environ.get("RLHFMEM_STUDY_SIM_RESULTS")
        if reuse:
            for f in ("none", "after-inference"):
                p = Path(reuse) / (_scenario(strategy, f).id.replace("/", "__") + ".json")
                if not p.exists():
                    pytest.fail(f"RLHFMEM_STUDY_SIM_RESULTS: {p} does not exist")
                _cache[_scenario(strategy, f).id] = json.loads(p.read_text())
        else:
            _cache.update(run_fake_cuda(_scenario(strategy, "after-inference"), work_dir=tmp_dir,
                                        without_flush=True, timeout=3600, tensors="sim"))
    return _cache[sc.id]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("study-sim")


@pytest.mark.parametrize("flush", ("none", "after-inference"))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_study_scale_iteration_runs(strategy, flush, work_dir, record_property):
    r = _result(strategy, flush, work_dir)
    assert r["status"] == "ok", r.get("error")
    assert r["capture"] == "sim-cuda-simulated" and r["simulated"] is True
    assert r["recipe"]["sequence_shape"] == [4, 512] and r["recipe"]["dtype"] == "float16"
    recipe = r["recipe"]  # what run_1.3b.sh passes
    assert (recipe["hybrid_engine"], recipe["ema"], recipe["actor_dropout"]) == ("DeepSpeedHybridEngine", True, 0.0)
    assert r["adjustments"]["cublas_workspace"]["count"] >= 2
    # every one of the actor's 24 layers ran the injected kernels in each of the generation's 256 forwards
    assert r["inference_kernel_calls"]["softmax_context"] == 24 * 256
    assert r["outside_caching_allocator"][0]["bytes"] == 4 * 132 * 2**20  # GenWorkSpace: 132 MiB per sequence
    # the recipe's offload annotations name host tensors: none of them may be a device tensor
    assert r["placement"]["annotated_host_bytes_on_cuda"] == 0
    reserved, frag, allocated, phase = PINNED[strategy][flush]
    t = r["total"]
    got = (round(t["peak_reserved"] / GiB, 1), round(t["fragmentation_at_peak"] / GiB, 1),
           round(t["peak_allocated"] / GiB, 1) if allocated is not None else None, r["peak_phase"])
    assert got == (reserved, frag, allocated, phase), f"{strategy}/{flush}: the README's table says otherwise"
    record_property("peak_reserved", r["total"]["peak_reserved"])
    record_property("peak_allocated", r["total"]["peak_allocated"])
    record_property("peak_phase", r["peak_phase"])


def test_offload_lowers_the_peak(work_dir):
    """ARCHITECTURE.md's second trap: host-resident state must leave the device trace."""
    z3 = _result("zero3", "none", work_dir)
    off = _result("zero3-offload", "none", work_dir)
    assert off["total"]["peak_allocated"] < z3["total"]["peak_allocated"]
