"""TRL's online RLHF trainers, unchanged, on the simulated CUDA device (values on), gated by a budget.

    tox -e trl                                   # TRL 1.16.0 and its datasets stack (constraints/trl.txt)

``examples/trl/train_trl.py`` is a ``GRPOTrainer`` / ``RLOOTrainer`` script as a GPU runner runs it (a random-weight
Llama from a config, TRL's default device, bf16, two steps) plus the one line that marks TRL's phases
(``pytest_rlhfmem.integrations.trl.mark_phases``). Each trainer runs to its end twice with the same device
figures, its phases marked, and from the project's wheel installed in a fresh virtual environment with the same
figures; then a user's test gates it, and the plain generate + PPO loop of tests/data/commands/hf_generate_ppo.py,
with the ``rlhfmem_command`` fixture in real pytest sessions: the budget is recorded
(``--rlhfmem-update-baselines``), the same run passes it, and the run with the completion length doubled fails it.
Figures simulated (``sim-cuda-simulated``).
"""

import json
import os
import subprocess
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


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_from_the_wheel_in_a_fresh_venv_the_same_figures(trainer, wheel_venv, rlhfmem_command, tmp_path):
    """``pip install`` of the wheel, no checkout on the path (the root conftest's ``wheel_venv``): the script runs
    to its end under that environment's ``rlhfmem capture``, with the checkout's figures."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "result.json"
    r = subprocess.run([str(wheel_venv / "bin" / "rlhfmem"), "capture", "--device", "cuda-sim", "--id", "wheel",
                        "--json", str(out), "--", str(wheel_venv / "bin" / "python"), str(SCRIPT), "--trainer", trainer,
                        str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    from_wheel = json.loads(out.read_text())
    here = rlhfmem_command([sys.executable, str(SCRIPT), "--trainer", trainer, str(tmp_path / "here")],
                           id=f"trl-{trainer}", device="cuda-sim")
    assert {k: from_wheel["metrics"][k] for k in METRIC_NAMES} == {k: here.metrics[k] for k in METRIC_NAMES}


PPO_LOOP = Path(__file__).resolve().parent.parent / "tests" / "data" / "commands" / "hf_generate_ppo.py"
GATED = {  # id -> (the command, the flag of its completion length, the length recorded; twice that is over budget)
    "trl-grpo": ([str(SCRIPT), "--trainer", "grpo", "OUT"], "--completion-length", 16),
    "trl-rloo": ([str(SCRIPT), "--trainer", "rloo", "OUT"], "--completion-length", 16),
    # the plain generate + PPO loop (no TRL): its 4 x 64-token rollout is small beside the four models' states
    # (doubled from 16, peak allocated grows 4%, inside the budget's 2 MiB tolerance; from 64, 23.3 -> 28.1 MiB)
    "hf-generate-ppo": ([str(PPO_LOOP)], "--max-new-tokens", 64),
}
USER_TEST = """
import json, os, sys

def test_rlhf_memory(rlhfmem_command, memory_budget, tmp_path):
    command = [a.replace("OUT", str(tmp_path / "out")) for a in json.loads(os.environ["COMMAND"])]
    result = rlhfmem_command([sys.executable, *command, os.environ["LENGTH_FLAG"], os.environ["LENGTH"]],
                             id=os.environ["ID"], device="cuda-sim")
    memory_budget.check(result)
"""


@pytest.mark.parametrize("ident", list(GATED))
def test_a_user_gates_it_with_the_fixture_and_a_doubled_completion_length_fails(ident, pytester, monkeypatch):
    command, flag, length = GATED[ident]
    pytester.makepyfile(test_rlhf_memory=USER_TEST)
    for k, v in {"COMMAND": json.dumps(command), "LENGTH_FLAG": flag, "ID": ident, "LENGTH": str(length)}.items():
        monkeypatch.setenv(k, v)
    r = pytester.runpytest_subprocess("--rlhfmem-update-baselines")
    r.assert_outcomes(passed=1)
    assert ident in (pytester.path / "baselines" / "cpu" / "rlhf_memory.yaml").read_text()
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(passed=1)
    monkeypatch.setenv("LENGTH", str(2 * length))
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([f"*{ident} is over its memory budget (simulated*", "*OVER BUDGET*"])
