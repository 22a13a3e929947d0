"""TRL's GRPO trainer under ``accelerate launch --num_processes 2``, unchanged, on the simulated CUDA device (values
on), gated by a budget (``tox -e trl``).

``examples/trl/train_trl.py`` as a GPU runner launches it on two GPUs: Accelerate's launcher sees two devices
(``torch.cuda.device_count()``), runs torchrun's agent in its own process and two ranks, each on its own simulated
device with the device's NCCL process group (``simcuda/distributed.py``). A user's test gates it with the
``rlhfmem_command`` fixture in real pytest sessions: the budget is recorded, the same run passes with identical
per-rank figures (the program ran to its end twice), and the run with the completion length doubled fails.
"""

import json
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem.memory.metrics import METRIC_NAMES

pytest.importorskip("trl", reason="TRL is not installed in this environment: this suite runs in `tox -e trl`")
pytest_plugins = ["pytester"]

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "trl" / "train_trl.py"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
LENGTH = 32  # tokens: doubled, the rollout's logits and the policy's activations pass the budget's tolerance

USER_TEST = """
import json, os, sys

def test_grpo_two_processes(rlhfmem_command, memory_budget, tmp_path):
    command = [a.replace("OUT", str(tmp_path / "out")) for a in json.loads(os.environ["COMMAND"])]
    result = rlhfmem_command(command, id="trl-grpo/accelerate-x2", device="cuda-sim")
    assert result["world_size"] == 2 and sorted(r["rank"] for r in result["ranks"]) == [0, 1]
    memory_budget.check(result)
"""


def per_rank(result: dict) -> list[dict]:
    return [{k: r["total"][k] for k in METRIC_NAMES if k in r["total"]}
            for r in sorted(result["ranks"], key=lambda r: r["rank"])]


def command(length: int) -> list[str]:
    return [ACCELERATE, "launch", "--num_processes", "2", str(SCRIPT), "--trainer", "grpo", "OUT",
            "--completion-length", str(length)]


def test_grpo_under_accelerate_launch_twice_with_the_same_figures_gated(pytester, monkeypatch):
    pytester.makepyfile(test_trl_dist=USER_TEST)
    monkeypatch.setenv("COMMAND", json.dumps(command(LENGTH)))
    r = pytester.runpytest_subprocess("--rlhfmem-update-baselines", "--rlhfmem-json=first.json")
    r.assert_outcomes(passed=1)
    r = pytester.runpytest_subprocess("--rlhfmem-json=second.json")
    r.assert_outcomes(passed=1)
    first, second = ((json.loads((pytester.path / f).read_text())["results"][0]) for f in ("first.json", "second.json"))
    assert first["capture"] == "sim-cuda-simulated"
    assert {"train_step", "generate", "optimizer_step"} <= set(first["phases"]), first["phases"]
    assert per_rank(first) == per_rank(second)
    assert all(rank["collectives"].get("all_reduce", 0) > 0 for rank in first["ranks"])  # DDP's gradient buckets
    monkeypatch.setenv("COMMAND", json.dumps(command(2 * LENGTH)))
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*trl-grpo/accelerate-x2 is over its memory budget (simulated*", "*OVER BUDGET*"])
