"""Issue 38 item 4: the failure names the rank whose process died first (torchrun's own report of the
workers' exits: a signal, its root cause), its phase and the figures so far, then the bystanders; a rank
that wrote its result and then never exited is named, not "rank None ... LaunchError"; no "None" figure
line for a run whose ranks wrote no result."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import rlhfmem_cli

KILLED = '''
    """Rank 1 is killed by SIGKILL inside phase `train_actor`; rank 0 fails or is stopped in its next collective."""
    import os, signal, time
    import torch
    import torch.distributed as dist
    import pytest_rlhfmem as rlhfmem

    dist.init_process_group("gloo")
    weights = torch.zeros(1024, 1024)
    with rlhfmem.phase("generate"):
        dist.all_reduce(weights)
    with rlhfmem.phase("train_actor"):
        grads = torch.ones(512, 1024)
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1)
        dist.all_reduce(weights)
'''

NEVER_EXITS = '''
    """Writes its result (the capture's exit handler runs first), then never exits: an exit handler of its own,
    registered before torch was imported, sleeps."""
    import atexit, time
    atexit.register(time.sleep, 3600)
    import torch
    import pytest_rlhfmem as rlhfmem

    with rlhfmem.phase("train"):
        weights = torch.zeros(1024, 1024)
'''


def cli(*args: str, tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return rlhfmem_cli(*args, cwd=tmp_path, timeout=timeout, env={"TMPDIR": str(tmp_path)})


def test_the_rank_killed_first_is_the_culprit_not_its_bystander(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED))
    p = cli("capture", "--device", "cpu", "--world-size", "2", "--timeout", "120", "--", str(script), tmp_path=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    failed = next(ln for ln in p.stdout.splitlines() if ln.startswith("FAILED: "))
    assert failed.startswith("FAILED: killed.py/x2: rank 1 failed in phase 'train_actor': Crash: killed by SIGKILL "
                             "(signal 9) without a result; torchrun's first observed failure"), p.stdout
    assert "also rank 0 in phase 'train_actor'" in p.stdout, p.stdout


def test_rlhfmem_run_names_the_killed_rank_and_prints_no_none(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--device", "cpu", "--world-size",
                             "2", "--timeout", "300", "--work-dir", str(work)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)})
    t_end = time.monotonic() + 240
    prog = work / "progress-rank1.json"
    while not prog.exists() and proc.poll() is None and time.monotonic() < t_end:
        time.sleep(0.1)
    os.kill(json.loads(prog.read_text())["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out + err
    failed = next(ln for ln in out.splitlines() if ln.startswith("FAILED: "))
    assert " rank 1 failed in phase '" in failed and "killed by SIGKILL (signal 9) without a result" in failed, out
    assert "None" not in out, out  # was: "peak RSS by None; anonymous RSS: None"


def test_a_rank_that_wrote_its_result_and_never_exited_is_named(tmp_path):
    script = tmp_path / "never_exits.py"
    script.write_text(textwrap.dedent(NEVER_EXITS))
    p = cli("capture", "--device", "cpu", "--timeout", "20", "--", str(script), tmp_path=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    failed = next(ln for ln in p.stdout.splitlines() if ln.startswith("FAILED: "))
    assert failed.startswith("FAILED: never_exits.py: rank 0 failed in phase "), p.stdout
    assert "ExitHang: wrote its result, then had not exited by the 20 s timeout" in failed, p.stdout
    assert "None" not in p.stdout, p.stdout
