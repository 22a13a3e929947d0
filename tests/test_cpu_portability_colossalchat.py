"""The ColossalChat cell of the CPU portability test (tests/test_cpu_portability.py): runs in the
`colossalai` tox environment, after the ColossalChat CPU suite, whose run of the cell it reuses."""

import pytest

from pytest_rlhfmem.hostcpu import FORCED_CPU_SETTINGS
from pytest_rlhfmem.matrix import run_as_other_cpu

from pytest_rlhfmem.rlhf.scenario import Scenario


@pytest.mark.parametrize("setting", FORCED_CPU_SETTINGS)
def test_figures_do_not_depend_on_the_cpu(setting, iteration_result, ppo_iteration, monkeypatch):
    scenario = Scenario("colossalchat", "tiny-opt", "none", "after-inference", 2)
    moved, unapplied = run_as_other_cpu(scenario, setting, iteration_result, ppo_iteration, monkeypatch)
    assert not unapplied, f"the forced setting did not reach the workers: {unapplied}"
    assert not moved, f"{setting} moved a gated figure (native, forced): {moved}"
