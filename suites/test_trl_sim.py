"""TRL's online RLHF trainers, unchanged, on the simulated CUDA device (values on), gated by a budget.

    tox -e trl                                   # TRL 1.16.0 and its datasets stack (constraints/trl.txt)

``examples/trl/train_trl.py`` is a ``GRPOTrainer`` / ``RLOOTrainer`` script as a GPU runner runs it (a random-weight
Llama from a config, TRL's default device, bf16, two steps) plus the one line that marks TRL's phases
(``pytest_rlhfmem.integrations.trl.mark_phases``). Each trainer runs to its end twice with the same device
figures, its phases marked; then a user's test gates it with the ``rlhfmem_command`` fixture in real pytest sessions:
the budget is recorded (``--rlhfmem-update-baselines``), the same run passes it, and the run with the completion
length doubled fails it. Figures simulated (``sim-cuda-simulated``).
"""

import json
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem.memory.metrics import METRIC_NAMES

pytest.importorskip("trl", reason="TRL is not installed in this environment: this suite runs in `tox -e trl`")
pytest_plugins = ["pytester"]

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "trl" / "train_trl.py"
PHASES = {"train_step", "experience", "generate", "score_reward", "optimizer_step"}


def done(result) -> dict:
    line = next(ln for ln in Path(result["log"]).read_text().splitlines() if ln.startswith("DONE "))
    return json.loads(line.removeprefix("DONE "))


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_a_trl_trainer_runs_unchanged_to_its_end_with_the_same_figures_twice(trainer, rlhfmem_command, tmp_path):
    runs = [rlhfmem_command([sys.executable, str(SCRIPT), "--trainer", trainer, str(tmp_path / str(k))],
                            id=f"trl-{trainer}", device="cuda-sim") for k in range(2)]
    for r in runs:
        assert r["capture"] == "sim-cuda-simulated"
        assert r["capture_description"]["simulated_cuda_device"]["values"] == "on"
        assert done(r)["steps"] == 2
        assert PHASES <= set(r.phases), r.phases
    assert {k: runs[0].metrics[k] for k in METRIC_NAMES} == {k: runs[1].metrics[k] for k in METRIC_NAMES}
    assert done(runs[0]) == done(runs[1])


USER_TEST = f'''
import os, sys

def test_grpo_memory(rlhfmem_command, memory_budget, tmp_path):
    length = os.environ.get("COMPLETION_LENGTH", "16")
    result = rlhfmem_command([sys.executable, {str(SCRIPT)!r}, "--trainer", "grpo", "--completion-length", length,
                              str(tmp_path / "out")], id="trl-grpo", device="cuda-sim")
    memory_budget.check(result)
'''


def test_a_user_gates_grpo_with_the_fixture_and_a_doubled_completion_length_fails(pytester, monkeypatch):
    pytester.makepyfile(test_trl_memory=USER_TEST)
    r = pytester.runpytest_subprocess("--rlhfmem-update-baselines")
    r.assert_outcomes(passed=1)
    budget = pytester.path / "baselines" / "cpu" / "trl_memory.yaml"
    assert "trl-grpo" in budget.read_text()
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(passed=1)
    monkeypatch.setenv("COMPLETION_LENGTH", "32")
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*trl-grpo is over its memory budget (simulated*", "*OVER BUDGET*"])
