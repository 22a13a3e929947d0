"""Bad input to `rlhfmem run | diff | plot` is one line on stderr and exit status 2, never a traceback."""

import importlib.util
import subprocess
import sys

import pytest

COLOSSALAI = importlib.util.find_spec("colossalai") is not None


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["run", "--models", "tiny-llama"], "unknown model pair 'tiny-llama'; valid: opt-1.3b"),
        (["run", "--strategy", "zero4"], "unknown strategy for deepspeed-chat 'zero4'; valid: none, zero1"),
        (["run", "--flush", "sometimes"], "unknown flush policy 'sometimes'; valid: none, after-inference"),
        (["run", "--framework", "nemo"], "unknown framework 'nemo'; valid: deepspeed-chat, colossalchat"),
        (["run", "--world-size", "0"], "world_size must be a positive integer, got 0"),
        (["run", "--device", "tpu"], "unknown device 'tpu'; valid: auto, cpu, cuda"),
        (["run", "--framework", "colossalchat", "--device", "cpu"] if not COLOSSALAI else
         ["run", "--framework", "colossalchat", "--strategy", "zero3", "--device", "cpu"],
         "needs the colossalai package" if not COLOSSALAI else "needs CUDA"),
        (["plot", "/nonexistent.json", "-o", "x.png"], "/nonexistent.json: cannot read a result"),
        (["diff", "/nonexistent.json", "/nonexistent2.json"], "/nonexistent.json: no such file"),
        (["replay", "/"], "/: cannot read"),
    ],
)
def test_one_line_and_exit_2(args, fragment, tmp_path):
    p = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhfmem: error:") and fragment in lines[0], p.stderr
