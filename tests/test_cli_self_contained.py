"""Issue 20, items 1 and 2, as a new user meets them: a capture's JSON carries its traces (it can be moved
and still advises), no work directory is left behind unless asked for or the run failed, captures of one
program get one default id, and a diff where nothing matched cannot pass."""

import json
import os
import shutil
import subprocess
import sys

from helpers import DATA

COMMANDS = DATA / "commands"


def rlhfmem(*args: str, tmpdir=None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=cwd)


def test_a_moved_capture_json_still_advises_and_no_work_directory_is_left(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "a" / "plain.json"
    r = rlhfmem("capture", "--id", "plain", "--device", "cpu", "--json", str(out), "--",
                str(COMMANDS / "plain_train.py"), tmpdir=scratch)
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(scratch.glob("rlhfmem-*")) == []  # the capture's work directory is gone
    res = json.loads(out.read_text())
    assert res["ranks"][0]["trace_file"] == "plain-traces/plain__rank0.rlhftrace"
    moved = tmp_path / "artifact"
    moved.mkdir()
    shutil.move(out, moved / "plain.json")
    shutil.move(tmp_path / "a" / "plain-traces", moved / "plain-traces")
    a = rlhfmem("advise", str(moved / "plain.json"))
    assert a.returncode == 0 and "plain" in a.stdout, a.stdout + a.stderr


def test_keep_work_keeps_it_and_a_failed_run_keeps_it_and_prints_where(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = rlhfmem("capture", "--id", "plain", "--device", "cpu", "--keep-work", "--",
                str(COMMANDS / "plain_train.py"), tmpdir=scratch)
    assert r.returncode == 0, r.stdout + r.stderr
    kept = [p for p in scratch.iterdir() if p.name.startswith("rlhfmem-capture-")]
    assert len(kept) == 1 and f"work directory kept: {kept[0]}" in r.stdout
    shutil.rmtree(kept[0])
    r = rlhfmem("capture", "--id", "crash", "--device", "cpu", "--", str(COMMANDS / "crash.py"), tmpdir=scratch)
    assert r.returncode == 1, r.stdout + r.stderr
    kept = [p for p in scratch.iterdir() if p.name.startswith("rlhfmem-capture-")]
    assert len(kept) == 1 and f"work directory kept: {kept[0]}" in r.stdout
