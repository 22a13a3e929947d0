"""``rlhfmem replay|diff ... | head``: a reader that leaves early ends the command quietly (no BrokenPipeError
traceback), as any Unix filter would."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUDGETS = REPO / "baselines" / "cpu" / "deepspeed_chat_cpu.yaml"


@pytest.mark.parametrize("args", [["diff", str(BUDGETS), str(BUDGETS)],
                                  ["diff", str(BUDGETS), str(BUDGETS), "--format", "json"]])
def test_a_closed_pipe_ends_the_command_without_a_traceback(args):
    p = subprocess.Popen([sys.executable, "-m", "pytest_rlhfmem.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first write: every write meets EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
