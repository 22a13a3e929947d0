"""The CPU gate gives the same figures on every CPU (issue 19): a budget recorded on one x86-64 machine must
hold on another whatever its vector extensions or fp16 kernels.

One cell of the DeepSpeed-Chat CPU matrix that holds ZeRO-3, CPU offload and the after-inference flush, run as
a weaker or different CPU would (pytest_rlhfmem/hostcpu.py: FORCED_CPU_SETTINGS), must give the simulated figures
of this machine's own run to the byte (three cells took 154 s of the default run; one keeps each code path).
The ColossalChat cell is tests/test_cpu_portability_colossalchat.py (its own environment); the main job checks
every cell (suites/test_cpu_portability*.py). Before the recipe answered
DeepSpeed's dtype checks itself, every fp16 cell failed in ``init`` on a CPU without fp16 kernels ("Type fp16
is not supported on your device.").
"""

import pytest

from pytest_rlhfmem.hostcpu import FORCED_CPU_SETTINGS
from pytest_rlhfmem.matrix import run_as_other_cpu
from pytest_rlhfmem.rlhf.scenario import Scenario

CELLS = [Scenario("deepspeed-chat", "tiny-opt", "zero3-offload", "after-inference", 2)]


# the weakest CPU in the default run; the others (45 s each on 2 cores) in tox -e long
WEAKEST = "aten-default_onednn-sse41_no-fp16"


@pytest.mark.parametrize("setting", [s if s == WEAKEST else pytest.param(s, marks=pytest.mark.long)
                                     for s in FORCED_CPU_SETTINGS])
@pytest.mark.parametrize("scenario", CELLS, ids=lambda s: s.id)
def test_figures_do_not_depend_on_the_cpu(scenario, setting, iteration_result, ppo_iteration, monkeypatch):
    moved, unapplied = run_as_other_cpu(scenario, setting, iteration_result, ppo_iteration, monkeypatch)
    assert not unapplied, f"the forced setting did not reach the workers: {unapplied}"
    assert not moved, f"{setting} moved a gated figure (native, forced): {moved}"
    # the recipe's answer to DeepSpeed's dtype checks is named in every result, never silent
    assert "deepspeed_dtype_checks" in iteration_result(scenario)["capture_description"]
