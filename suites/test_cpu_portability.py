"""The main job's CPU portability check (issue 19): every cell of the DeepSpeed-Chat CPU matrix, run as a
weaker or different CPU would (pytest_rlhfmem/hostcpu.py: FORCED_CPU_SETTINGS: ATen's dispatch ISA, oneDNN's
ISA cap, the fp16-kernel answer), gives the simulated figures of this machine's own run
(suites/test_deepspeed_chat_cpu.py, reused) to the byte. The default test run checks one
(tests/test_cpu_portability.py)."""

import pytest

from pytest_rlhfmem.hostcpu import FORCED_CPU_SETTINGS
from pytest_rlhfmem.matrix import run_as_other_cpu


@pytest.mark.parametrize("setting", FORCED_CPU_SETTINGS)
@pytest.mark.matrix("deepspeed_chat_cpu")
def test_figures_do_not_depend_on_the_cpu(scenario, setting, iteration_result, ppo_iteration, monkeypatch):
    moved, unapplied = run_as_other_cpu(scenario, setting, iteration_result, ppo_iteration, monkeypatch)
    assert not unapplied, f"the forced setting did not reach the workers: {unapplied}"
    assert not moved, f"{setting} moved a gated figure (native, forced): {moved}"
