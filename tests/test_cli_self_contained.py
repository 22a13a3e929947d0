"""Issue 20, items 1 and 2, as a new user meets them: a capture's JSON carries its traces (it can be moved
and still advises), no work directory is left behind unless asked for or the run failed, captures of one
program get one default id, and a diff where nothing matched cannot pass."""

import pytest
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


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
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


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_captures_with_other_scratch_arguments_get_one_default_id_and_diff_pairs_them(tmp_path):
    outs = []
    for batch in (256, 2048):
        out = tmp_path / f"b{batch}.json"
        r = rlhfmem("capture", "--device", "cpu", "--json", str(out), "--", "batch_train.py",
                    str(tmp_path / f"ckpt-{batch}"), "--batch", str(batch), cwd=COMMANDS)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.startswith("batch_train.py on cpu x1"), r.stdout
        assert json.loads(out.read_text())["scenario_id"] == "batch_train.py"
        outs.append(out)
    d = rlhfmem("diff", *map(str, outs), "--fail-on-regression")
    assert d.returncode == 1 and "**1 regressed**" in d.stdout and "0 new, 0 missing" in d.stdout, d.stdout


def _result(path, sid, peak):
    path.write_text(json.dumps({"scenario_id": sid, "status": "ok", "device": "cpu",
                                "metrics": {"peak_reserved": peak, "peak_allocated": peak, "cuda_malloc_count": 3}}))
    return str(path)


def test_a_diff_where_nothing_matched_fails_with_one_line(tmp_path):
    a = _result(tmp_path / "a.json", "train.py out/1", 40 << 20)
    b = _result(tmp_path / "b.json", "train.py out/2", 55 << 20)
    d = rlhfmem("diff", a, b)
    assert d.returncode == 2 and d.stdout == "", d.stdout
    assert d.stderr.count("\n") == 1 and d.stderr.startswith("rlhfmem: error: nothing compared: no scenario id is in "
                                                             "both"), d.stderr
    assert "train.py out/1" in d.stderr and "train.py out/2" in d.stderr and "--allow-disjoint" in d.stderr
    ok = rlhfmem("diff", a, b, "--allow-disjoint", "--fail-on-regression")  # accepted: one new, one missing
    assert ok.returncode == 0 and "1 new, 1 missing" in ok.stdout, ok.stdout + ok.stderr


def test_new_and_missing_are_named_above_the_table(tmp_path):
    from pytest_rlhfmem.report import diff, load_side, to_markdown

    a = tmp_path / "a.json"
    a.write_text(json.dumps({"results": [json.loads(open(_result(tmp_path / "x.json", sid, 40 << 20)).read())
                                         for sid in ("kept", "gone")]}))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"results": [json.loads(open(_result(tmp_path / "y.json", sid, 40 << 20)).read())
                                         for sid in ("kept", "added")]}))
    md = to_markdown(diff(load_side(a), load_side(b)))
    assert "Not compared** (an id on one side only): only in head (new): `added`; only in base (missing): `gone`" in md


def test_the_default_id_is_the_program_without_its_arguments():
    from pytest_rlhfmem.command.run import default_id

    assert default_id(["train.py", "out/run1", "--batch", "4"]) == default_id(["python", "./train.py", "out/2"]) \
        == "train.py"
    torchrun = ["torchrun", "--standalone", "--nproc-per-node", "2", "ex/ppo.py", "--out", "o"]
    assert default_id(torchrun, 2) == "ex/ppo.py/x2"
    module = ["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "pkg.train", "o"]
    assert default_id(module, 2) == "pkg.train/x2"
