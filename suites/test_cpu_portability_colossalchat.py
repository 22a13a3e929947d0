"""The main job's CPU portability check for ColossalChat (issue 19): every CPU cell of its matrix, run as a
weaker or different CPU would (pytest_rlhfmem/hostcpu.py: FORCED_CPU_SETTINGS), gives the simulated figures of
this machine's own run (suites/test_colossalchat_cpu.py, reused) to the byte. Runs in the colossalai
environments; the matrix's CUDA-only cells carry its gpu mark."""

import pytest

from pytest_rlhfmem.hostcpu import FORCED_CPU_SETTINGS
from pytest_rlhfmem.matrix import run_as_other_cpu



@pytest.mark.parametrize("setting", FORCED_CPU_SETTINGS)
@pytest.mark.matrix("colossalchat_cpu")
def test_figures_do_not_depend_on_the_cpu(scenario, setting, iteration_result, ppo_iteration, monkeypatch):
    moved, unapplied = run_as_other_cpu(scenario, setting, iteration_result, ppo_iteration, monkeypatch)
    assert not unapplied, f"the forced setting did not reach the workers: {unapplied}"
    assert not moved, f"{setting} moved a gated figure (native, forced): {moved}"
