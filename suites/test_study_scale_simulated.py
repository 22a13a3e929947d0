"""The study's DeepSpeed-Chat scale without a GPU (opt-in: ``tox -e study-sim``; about 10 minutes on 2 cores).

OPT-1.3b actor/reference + OPT-350m critic/reward, LoRA 128, batch 2, prompt 256 + answer 256, fp16,
4 ranks (rank 0 on a fake process group), on the fake-CUDA route (``pytest_rlhfmem/fakecuda``) with the
simulated CUDA device's tensors (``tensors="sim"``): every figure is simulated (the device's allocation log
replayed through the allocator model). Each strategy runs once with the after-inference flush marks; its
flush-none cell replays the same trace without them. Measured: 543 s wall for the five strategies, two at
a time, at 190-201 s of CPU per ZeRO-3 worker and 81-82 s for none and ZeRO-2.

``RLHFMEM_STUDY_SIM_RESULTS=DIR`` reuses the result JSONs that ``benchmarks/study_scale.py --out DIR``
wrote instead of running again.
"""

import json
import os
from pathlib import Path

import pytest

from pytest_rlhfmem.fakecuda.run import run_fake_cuda
from pytest_rlhfmem.rlhf.scenario import Scenario

STRATEGIES = ("none", "zero2", "zero3", "zero3-offload", "all")
# The route is deterministic: the figures the README's "The study's scale without a GPU" table gives (GiB to one
# decimal: each figure must round to it), from the recorded run named there. strategy -> flush -> (peak reserved,
# fragmentation at peak, peak allocated, peak phase); the flush runs' allocated figure is not tabulated (None).
GiB = 2**30
PINNED = {
    "none": {"none": (17.9, 3.2, 16.0, "train_actor"), "after-inference": (19.5, 3.9, None, "train_critic")},
    "zero2": {"none": (14.8, 5.0, 12.2, "train_critic"), "after-inference": (14.9, 5.2, None, "train_critic")},
    "zero3": {"none": (14.9, 9.3, 10.5, "train_critic"), "after-inference": (14.7, 9.1, None, "train_critic")},
    "zero3-offload": {"none": (11.4, 8.7, 8.2, "train_critic"), "after-inference": (11.2, 8.6, None, "train_critic")},
    "all": {"none": (5.3, 2.7, 2.8, "train_critic"), "after-inference": (5.2, 2.6, None, "train_critic")},
}
_cache: dict[str, dict] = {}


def _scenario(strategy: str, flush: str) -> Scenario:
    return Scenario("deepspeed-chat", "opt-1.3b", strategy, flush, 4)


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
    assert r["recipe"]["sequence_shape"] == [2, 512] and r["recipe"]["dtype"] == "float16"
    assert r["adjustments"]["cublas_workspace"]["count"] >= 2
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
