"""One CUDA device per rank, refused in one line before any rank starts (issue 35, items 2 and 10).

The refusal logic takes the device count as data; the end-to-end tests run on this machine, which has no GPU
(``rlhfmem run``/``capture --device cuda``, the plugin's ``--rlhfmem-device cuda``), and with one stand-in GPU
(torch's answers replaced in the inner session's conftest) for ``auto`` with fewer GPUs than ranks."""

import subprocess
import sys

import pytest
from helpers import DATA, rlhfmem_cli

from pytest_rlhfmem.command.run import CommandError, run_command
from pytest_rlhfmem.rlhf import launch
from pytest_rlhfmem.rlhf.launch import resolve_device
from pytest_rlhfmem.rlhf.scenario import ScenarioError

pytest_plugins = ["pytester"]

PLAIN_TRAIN = DATA / "commands" / "plain_train.py"
TOO_FEW = "{device}: 2 ranks on this machine need 2 CUDA devices (one per rank), found 1: give a world size of at " \
          "most 1, or device cpu (figures simulated by the allocator model)"


@pytest.mark.parametrize("device, ranks, gpus, expected", [
    ("auto", 2, 0, "cpu"), ("auto", 2, 2, "cuda"), ("auto", 1, 8, "cuda"), ("cuda", 4, 4, "cuda"),
    ("cpu", 4, 1, "cpu"), ("cpu", 2, 0, "cpu"),
])
def test_a_device_with_a_gpu_per_rank_or_none_at_all_resolves(device, ranks, gpus, expected):
    assert resolve_device(device, ranks, device_count=gpus) == expected


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_fewer_gpus_than_ranks_is_refused_naming_ranks_gpus_and_the_way_out(device):
    """On a 1-GPU machine, ``cuda`` with 2 ranks called ``set_device(1)`` and crashed in startup; ``auto`` ran the
    CPU route, silently, against ``baselines/cpu``."""
    with pytest.raises(ScenarioError) as e:
        resolve_device(device, 2, device_count=1)
    assert str(e.value) == TOO_FEW.format(device=f"device {device}")


def test_cuda_without_a_gpu_is_refused_saying_there_is_none():
    with pytest.raises(ScenarioError, match=r"^device cuda: no CUDA device here \(torch .* is built without CUDA\); "
                                            r"run on device cpu \(figures simulated by the allocator model\)"):
        resolve_device("cuda", 1, device_count=0)


def test_capture_refuses_more_ranks_than_gpus_before_starting_one(monkeypatch, tmp_path):
    """``rank.py`` wrapped the ranks with ``% device_count``: two NCCL ranks on one GPU. A torchrun line's own
    ``--nproc-per-node`` is what this machine runs (not ``--nnodes`` times it)."""
    monkeypatch.setattr(launch, "cuda_device_count", lambda: 1)
    for cmd, kw in (([str(PLAIN_TRAIN)], {"nproc_per_node": 2}),
                    ([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                      str(PLAIN_TRAIN)], {})):
        with pytest.raises(CommandError) as e:
            run_command(cmd, "two-ranks", device="cuda", work_dir=tmp_path / "work", **kw)
        assert str(e.value) == TOO_FEW.format(device="device cuda")
    assert not (tmp_path / "work").exists()  # nothing started


def cli(*args: str) -> subprocess.CompletedProcess:
    return rlhfmem_cli(*args, timeout=300)


@pytest.mark.parametrize("args", [
    ["run", "--device", "cuda", "--world-size", "1"],
    ["capture", "--device", "cuda", "--id", "plain", "--", str(PLAIN_TRAIN)],
    ["capture", "--device", "cuda", "--nproc-per-node", "2", "--id", "plain", "--", str(PLAIN_TRAIN)],
], ids=["run", "capture", "capture-2-ranks"])
def test_device_cuda_on_this_machine_without_a_gpu_is_one_line_and_exit_2(args):
    """It failed in phase startup with a bootstrap traceback under a header saying 'measured'."""
    p = cli(*args)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhfmem: error: device cuda: no CUDA device here ("), p.stderr
    assert "measured" not in p.stdout and "Traceback" not in p.stderr


def test_plugin_device_cuda_without_a_gpu_is_a_usage_error_before_any_test(pytester):
    pytester.makepyfile("def test_one(ppo_iteration):\n    ppo_iteration(world_size=1)\n")
    result = pytester.runpytest_subprocess("--rlhfmem-device", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [ln for ln in result.stderr.lines if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("ERROR: --rlhfmem-device cuda: no CUDA device here ("), errors


ONE_GPU = """
import torch

torch.cuda.is_available = lambda: True  # a stand-in: this machine has one GPU
torch.cuda.device_count = lambda: 1
"""


def test_plugin_auto_with_fewer_gpus_than_ranks_fails_in_one_line_and_runs_nothing(pytester):
    """``auto`` on a machine WITH GPUs but too few must not fall to the CPU route (whose figures the GPU
    profile's budgets would never see); a test that passes ``device="cpu"`` still runs there (not run here:
    the refusal happens before any launch, which is what is checked)."""
    pytester.makeconftest(ONE_GPU)
    pytester.makepyfile("""
        def test_recipe(ppo_iteration):
            ppo_iteration(world_size=2)

        def test_command(rlhfmem_command):
            rlhfmem_command(["{script}"], id="plain", world_size=2)
    """.replace("{script}", str(PLAIN_TRAIN)))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert out.count(TOO_FEW.format(device="device auto")) >= 2, out
    assert f"rlhfmem_command('plain'): {TOO_FEW.format(device='device auto')}" in out
    assert not list(pytester.path.rglob("launcher.log")) and "rlhfmem: memory per scenario" not in out


@pytest.mark.parametrize("var, value", [("RLHFMEM_HISTORY_MAX_ENTRIES", "lots"), ("RLHFMEM_HISTORY_CONTEXT", "frames")])
def test_a_bad_history_setting_is_one_line_before_any_rank_starts(monkeypatch, tmp_path, var, value):
    """A CUDA rank read ``$RLHFMEM_HISTORY_*`` only in ``Recorder.start``: a bad value was a traceback in every
    rank's log. Checked with one stand-in GPU (the count as data), the same line for a recipe and a command."""
    from pytest_rlhfmem.rlhf.scenario import Scenario

    monkeypatch.setattr(launch, "cuda_device_count", lambda: 1)
    monkeypatch.setenv(var, value)
    with pytest.raises(CommandError, match=rf"^\${var}='{value}': allowed values: "):
        run_command([str(PLAIN_TRAIN)], "plain", device="cuda", work_dir=tmp_path / "work")
    with pytest.raises(ScenarioError, match=rf"^\${var}='{value}': allowed values: "):
        launch.run_scenario(Scenario("deepspeed-chat", "tiny-opt", "none", "none", 1), device="cuda",
                            work_dir=tmp_path / "work")
    assert not (tmp_path / "work").exists()  # nothing started


def test_cuda_without_a_gpu_names_the_simulated_device(capsys):
    from pytest_rlhfmem.cli import main

    assert main(["capture", "--device", "cuda", "--", sys.executable, "-c", "import torch"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and "--device cuda-sim" in err and len(err.strip().splitlines()) == 1
