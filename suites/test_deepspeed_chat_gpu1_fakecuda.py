"""The one-GPU DeepSpeed-Chat cells on the fake-CUDA route (``pytest_rlhfmem/fakecuda``), simulated.

The cells of ``deepspeed_chat_gpu1`` (tiny OPT, OPT-125m) and ``deepspeed_chat_gpu1_study`` (OPT-1.3b actor/reference
+ OPT-350m critic/reward at the pair's defaults: batch 4, Hybrid Engine, EMA), world size 1, run as the GPU suite
(``test_deepspeed_chat_gpu1.py``) runs them: on CUDA, fp16, the pair's defaults and nothing else (no
``hybrid_engine_kernels``: the GPU route refuses it). Rank 0 of 1 runs the unchanged recipe on the simulated CUDA
device (``tensors="sim"``: meta kernels, the device's allocation log) and its trace is replayed through the
allocator model: every device figure is simulated (capture ``sim-cuda-simulated``), losses are meaningless
(``.item()`` is answered with fixed values) and no host figure is measured (host columns 0). Each strategy runs
once with the after-inference flush marks; its flush-none cell replays the same trace without them (one test per
strategy checks both cells, so that two xdist workers never run one strategy twice).

Budgets (``baselines/cpu/``): ``deepspeed_chat_gpu1_fakecuda.yaml`` (tiny OPT, the default test run: seconds per
strategy), ``deepspeed_chat_gpu1_fakecuda_mid.yaml`` (OPT-125m) and ``deepspeed_chat_gpu1_fakecuda_study.yaml``
(OPT-1.3b), both opt-in (``tox -e gpu1-sim``). One file per test, so a run of one test alone calls no other
test's entries stale. At world size 1 the worker holds the whole pair's optimizer state where it is offloaded: the
OPT-1.3b zero3-offload and all cells skip below the host memory they need (:data:`HOST_NEED`), naming it; all's
entries are not recorded yet (killed on the 24 GiB machine that recorded the others).
"""

import json
from pathlib import Path

import psutil
import pytest

from pytest_rlhfmem.fakecuda.run import FakeCudaRunError, run_fake_cuda
from pytest_rlhfmem.matrix import load_matrix
from pytest_rlhfmem.results import IterationResult
from pytest_rlhfmem.rlhf.launch import aggregate
from pytest_rlhfmem.rlhf.scenario import Scenario

MATRICES = Path(__file__).resolve().parent / "matrices.yaml"
TIMEOUT_S = 3600.0
GiB = 2**30
# Host memory the worker needs (bytes) where world size 1 offloads the whole pair's optimizer state: OPT-1.3b
# zero3-offload's worker peaked at 15.9 GiB of RSS; all's was killed by the kernel twice beside other jobs on a 24 GiB
# machine (about 17 GiB free), so its need is unmeasured: its budget entries are to be recorded on a larger host.
HOST_NEED = {("opt-1.3b", "zero3-offload"): 16 * GiB, ("opt-1.3b", "all"): 24 * GiB}


def _strategies(matrix: str, models: str) -> list:
    """The after-inference cells of GPU matrix ``matrix`` for ``models``, without its gpu mark (the twin runs
    here); each stands for its strategy's two flush cells, which the matrix must both have."""
    cells = [p.values[0] for p in load_matrix(matrix, MATRICES) if p.values[0].models == models]
    flushes = {c.flush for c in cells}
    assert flushes == {"none", "after-inference"}, f"{matrix}: flush {sorted(flushes)}; the twin derives none"
    return [pytest.param(c, id=c.id) for c in cells if c.flush == "after-inference"]


def _iteration_results(scenario: Scenario, work: Path) -> list[IterationResult]:
    """Run ``scenario`` (flush after-inference) as rank 0 of 1 on the simulated CUDA device; its two cells'
    results (flush none, then after-inference) as the GPU route's launcher aggregates them
    (``rlhf/launch.py: aggregate`` over the one rank's result)."""
    try:
        results = run_fake_cuda(scenario, work_dir=work, without_flush=True, timeout=TIMEOUT_S, tensors="sim")
    except FakeCudaRunError as exc:  # the worker died or hung: its log's tail, no traceback of this test
        pytest.fail(str(exc), pytrace=False)
    out = []
    for cell in (Scenario.from_dict({**scenario.to_dict(), "flush": "none"}), scenario):
        rank = results[cell.id]
        rank_dir = work / cell.id.replace("/", "__")
        rank_dir.mkdir()
        (rank_dir / "result-rank0.json").write_text(json.dumps(rank))
        out.append(IterationResult(aggregate(cell, "cuda", rank_dir, 0 if rank["status"] == "ok" else 1, False,
                                             TIMEOUT_S, rank["process_wall_s"], rank_dir / "no-launcher.log")))
    return out


def _check(scenario: Scenario, tmp_path: Path, memory_budget, record_property, suite: str) -> None:
    need = HOST_NEED.get((scenario.models, scenario.strategy), 0)
    free = psutil.virtual_memory().available
    if free < need:
        pytest.skip(f"needs {need / GiB:.0f} GiB of available host memory (the whole pair's optimizer state offloaded "
                    f"at world size 1); this machine has {free / GiB:.1f} GiB available")
    for result in _iteration_results(scenario, tmp_path):
        if not result.ok:
            pytest.fail(result.describe_failure(), pytrace=False)
        rank = result["ranks"][0]
        assert result.simulated and result.capture == "sim-cuda-simulated" and rank["tensors"] == "sim"
        assert (result["world_size"], rank["rank"]) == (1, 0)
        assert rank["recipe"]["dtype"] == "float16" and not rank["inference_kernel_calls"]  # what the GPU runs
        # the recipe's offload annotations name host tensors: none of them may be a device tensor
        assert rank["placement"]["annotated_host_bytes_on_cuda"] == 0
        record_property(f"{result.scenario_id} process_cpu_s", rank["process_cpu_s"])
        memory_budget.check(result, suite=suite)


@pytest.mark.parametrize("scenario", _strategies("deepspeed_chat_gpu1", "tiny-opt"))
def test_tiny_opt_within_budget(scenario, tmp_path, memory_budget, record_property):
    _check(scenario, tmp_path, memory_budget, record_property, "deepspeed_chat_gpu1_fakecuda")


@pytest.mark.parametrize("scenario", _strategies("deepspeed_chat_gpu1", "opt-125m"))
def test_opt_125m_within_budget(scenario, tmp_path, memory_budget, record_property):
    _check(scenario, tmp_path, memory_budget, record_property, "deepspeed_chat_gpu1_fakecuda_mid")


@pytest.mark.parametrize("scenario", _strategies("deepspeed_chat_gpu1_study", "opt-1.3b"))
def test_study_pair_within_budget(scenario, tmp_path, memory_budget, record_property):
    _check(scenario, tmp_path, memory_budget, record_property, "deepspeed_chat_gpu1_fakecuda_study")
