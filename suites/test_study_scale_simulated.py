"""The study's DeepSpeed-Chat scale without a GPU (opt-in: ``tox -e study-sim``; about an hour on 2 cores).

OPT-1.3b actor/reference + OPT-350m critic/reward, LoRA 128, batch 2, prompt 256 + answer 256, fp16,
4 ranks (rank 0 on a fake process group), on the fake-CUDA route (``pytest_rlhfmem/fakecuda``): every
figure is simulated (a fake-CUDA allocation trace replayed through the allocator model). Each strategy
runs once with the after-inference flush marks; its flush-none cell replays the same trace without them.

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
                                        without_flush=True, timeout=7200))
    return _cache[sc.id]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("study-sim")


@pytest.mark.parametrize("flush", ("none", "after-inference"))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_study_scale_iteration_runs(strategy, flush, work_dir, record_property):
    r = _result(strategy, flush, work_dir)
    assert r["status"] == "ok", r.get("error")
    assert r["capture"] == "fake-cuda-simulated" and r["simulated"] is True
    assert r["recipe"]["sequence_shape"] == [2, 512] and r["recipe"]["dtype"] == "float16"
    assert r["adjustments"]["cublas_workspace"]["count"] >= 2
    # the recipe's offload annotations name host tensors: none of them may be a device tensor
    assert r["placement"]["annotated_host_bytes_on_cuda"] == 0
    record_property("peak_reserved", r["total"]["peak_reserved"])
    record_property("peak_allocated", r["total"]["peak_allocated"])
    record_property("peak_phase", r["peak_phase"])


def test_offload_lowers_the_peak(work_dir):
    """ARCHITECTURE.md's second trap: host-resident state must leave the device trace."""
    z3 = _result("zero3", "none", work_dir)
    off = _result("zero3-offload", "none", work_dir)
    assert off["total"]["peak_allocated"] < z3["total"]["peak_allocated"]
