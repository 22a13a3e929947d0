"""Issue 47 items 1 and 2: the tool removes only the directories it created and signals only the processes of
its own run (pytest_rlhfmem/owned.py).

1. ``rlhfmem run --work-dir DIR`` on a directory holding the user's files removed the whole directory after a
   passing run. Now an existing non-empty directory is refused in one line before anything runs, an existing
   empty one is kept (only the run's own files leave it), and only a directory the run made is removed.
2. A stale or planted ``progress-rank<R>.json`` made the next run SIGKILL the process group of whatever pid the
   file named. Now a pid is signalled only when its process carries the run's token in its environment."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import rlhfmem_cli
from pytest_rlhfmem.command.run import CommandError, run_command
from pytest_rlhfmem.owned import (WorkDirError, claim_work_dir, is_run_process, new_token,
                                  remove_work, run_env, start_ticks)
from pytest_rlhfmem.rlhf.launch import finish_work, run_process_group

COMMANDS = Path(__file__).parent / "data" / "commands"


# -- work directories ---------------------------------------------------------------------------------------

def test_a_new_path_is_created_and_is_the_runs(tmp_path):
    work, created = claim_work_dir(tmp_path / "a" / "b", "x-")
    assert created and work.is_dir()
    remove_work(work, created)
    assert not work.exists() and (tmp_path / "a").is_dir()  # only the leaf was the run's


def test_an_existing_empty_directory_is_kept_with_the_users_later_files(tmp_path):
    work, created = claim_work_dir(tmp_path, "x-")
    assert not created
    for name in ("launcher.log", "progress-rank0.json", "result-rank1.json", "trace-rank0.rlhftrace",
                 "claim-rank0", "command.log", "alive-at-timeout.json"):
        (work / name).write_text("{}")
    (work / "torchelastic" / "none_abc").mkdir(parents=True)
    (work / "node1").mkdir()
    (work / "notes.txt").write_text("the user's")  # written during the run: not the run's
    remove_work(work, created)
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("content", ["file", "dir"])
def test_a_non_empty_directory_is_refused_in_one_line(tmp_path, content):
    (tmp_path / "mine").mkdir() if content == "dir" else (tmp_path / "mine").write_text("x")
    (tmp_path / "other").write_text("y")
    with pytest.raises(WorkDirError) as e:
        claim_work_dir(tmp_path, "x-")
    assert str(e.value) == (f"--work-dir {tmp_path}: not empty (holds 'mine' and 1 more); the run removes its own "
                            f"files afterwards, so it needs a new or empty directory")
    assert (tmp_path / "mine").exists() and (tmp_path / "other").exists()


def test_a_shared_multi_node_directory_may_hold_files(tmp_path):
    (tmp_path / "node1").mkdir()
    assert claim_work_dir(tmp_path, "x-", shared=True) == (tmp_path, False)


def test_a_file_is_not_a_work_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(WorkDirError, match=r"--work-dir .*/f: exists and is not a directory$"):
        claim_work_dir(tmp_path / "f", "x-")


def test_finish_work_removes_only_what_the_run_made(tmp_path):
    (tmp_path / "result-rank0.json").write_text("{}")
    (tmp_path / "keep.txt").write_text("x")
    assert finish_work({"work_dir": str(tmp_path), "status": "ok"}) is None  # no word of ownership: not the run's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert finish_work({"work_dir": str(tmp_path), "status": "ok", "work_dir_created": True}) is None
    assert not tmp_path.exists()


def test_rlhfmem_run_refuses_a_directory_with_the_users_files_before_running(tmp_path):
    (tmp_path / "train.py").write_text("print('mine')\n")
    r = rlhfmem_cli("run", "--device", "cpu", "--work-dir", ".", "--timeout", "60", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "rlhfmem: error: --work-dir .: not empty (holds 'train.py'); the run removes its own files afterwards, so it "
        "needs a new or empty directory"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_a_passing_capture_in_an_existing_empty_directory_leaves_it_empty(tmp_path):
    """Every name the run writes is in RUN_ENTRIES: a missing one would stay behind here."""
    work = tmp_path / "work"
    work.mkdir()
    result = run_command([sys.executable, str(COMMANDS / "phased_train.py")], id="owned", device="cpu",
                         world_size=2, work_dir=work, timeout=300)
    assert result["status"] == "ok", result.get("failure")
    assert result["work_dir_created"] is False and sorted(p.name for p in work.iterdir())
    assert finish_work(result) is None
    assert work.is_dir() and list(work.iterdir()) == []


def test_a_capture_refuses_a_non_empty_work_directory(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"1")
    with pytest.raises(CommandError, match="not empty"):
        run_command([sys.executable, "-c", "pass"], id="x", device="cpu", work_dir=tmp_path)
    assert (tmp_path / "data.bin").read_bytes() == b"1"


# -- processes ----------------------------------------------------------------------------------------------

@pytest.fixture
def bystander():
    """An unrelated process in a session of its own (as ``setsid sleep``), killed afterwards."""
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_a_planted_progress_file_gets_no_process_signalled(tmp_path, bystander):
    (tmp_path / "progress-rank0.json").write_text(json.dumps({"rank": 0, "pid": bystander.pid, "phase": "x"}))
    rc, timed_out = run_process_group([sys.executable, "-c", "pass"], tmp_path / "log", dict(os.environ), 30,
                                      tmp_path)
    assert (rc, timed_out) == (0, False)
    time.sleep(0.2)
    assert bystander.poll() is None, f"the planted pid {bystander.pid} was signalled ({bystander.returncode})"


def test_a_planted_progress_file_is_not_named_alive_at_a_timeout_nor_killed(tmp_path, bystander):
    (tmp_path / "progress-rank3.json").write_text(json.dumps({"rank": 3, "pid": bystander.pid, "phase": "x"}))
    rc, timed_out = run_process_group([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log",
                                      dict(os.environ), 1.0, tmp_path)
    assert timed_out
    assert json.loads((tmp_path / "alive-at-timeout.json").read_text()) == []
    assert bystander.poll() is None


def test_a_rank_of_the_run_is_still_killed_when_left_behind(tmp_path):
    """The positive side: a rank of this run (its pid in its progress file) whose group outlives the command."""
    script = (f"import json, os, subprocess, sys\n"
              f"p = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
              f"open({str(tmp_path / 'progress-rank0.json')!r}, 'w').write(json.dumps({{'rank': 0, 'pid': p.pid}}))\n")
    rc, _ = run_process_group([sys.executable, "-c", script], tmp_path / "log", dict(os.environ), 30, tmp_path)
    assert rc == 0
    pid = json.loads((tmp_path / "progress-rank0.json").read_text())["pid"]
    for _ in range(50):
        if start_ticks(pid) is None:
            break
        time.sleep(0.1)
    assert start_ticks(pid) is None, "the run's own leftover rank survived"


def test_is_run_process_needs_the_token_and_a_start_after_the_launcher(bystander):
    token = new_token()
    child = subprocess.Popen(["sleep", "60"], env=run_env(dict(os.environ), token))
    try:
        since = start_ticks(child.pid)
        assert is_run_process(child.pid, token, since)
        assert not is_run_process(child.pid, new_token(), since)  # another run's token
        assert not is_run_process(child.pid, token, since + 10 ** 9)  # started before the launcher: a reused pid
        assert not is_run_process(bystander.pid, token, None)
        for garbage in (None, "1", 1.5, True, -1, 0, 1, os.getpid(), 2 ** 40):
            assert not is_run_process(garbage, token, None)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not is_run_process(child.pid, token, None)  # gone



def test_a_shared_directory_one_agent_made_is_removed_by_node_rank_0(tmp_path):
    shared = tmp_path / "shared"
    assert claim_work_dir(shared, "x-", shared=True) == (shared, True)  # node rank 1's agent came first
    work, created = claim_work_dir(shared, "x-", shared=True)  # node rank 0's
    assert not created
    (work / "node0").mkdir()
    (work / "result-rank0.json").write_text("{}")
    remove_work(work, created)
    assert not shared.exists()
    shared.mkdir()
    (shared / "users.txt").write_text("x")  # a user's shared directory: kept, with the user's file
    work, created = claim_work_dir(shared, "x-", shared=True)
    (work / "result-rank0.json").write_text("{}")
    remove_work(work, created)
    assert sorted(p.name for p in shared.iterdir()) == ["users.txt"]


DAEMON = """
import os, torch
x = torch.zeros(1 << 16)
if os.fork() == 0:  # a daemon: double-forked into a session of its own, out of the rank's process group
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "120"])
    os._exit(0)
"""


@pytest.mark.parametrize("kill", [False, True])
def test_a_daemon_the_program_leaves_is_named_and_stopped_only_when_asked(tmp_path, kill):
    script = tmp_path / "daemon.py"
    script.write_text(DAEMON)
    args = ["capture", "--device", "cpu", *(["--kill-leftovers"] if kill else []), "--", sys.executable, str(script)]
    r = rlhfmem_cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("rlhfmem: warning: the command left"))
    pid = int(line.split("pid ")[1].split()[0])
    assert "(sleep 120)" in line
    try:
        if kill:
            assert line.endswith("stopped (--kill-leftovers)") and start_ticks(pid) is None
        else:
            assert line.endswith("left running: rerun with --kill-leftovers (the fixtures: --rlhfmem-kill-leftovers) "
                                 "to stop them")
            assert start_ticks(pid) is not None  # the program's own: not the tool's to stop unasked
    finally:
        if start_ticks(pid) is not None:
            os.kill(pid, signal.SIGKILL)


def test_a_killed_runs_jit_build_batons_are_cleared_and_older_ones_kept(tmp_path):
    """A rank killed while loading a JIT op holds torch's FileBaton ``lock``; every later load would wait on it for
    ever. After a cut run, the locks made since it began go; an older one (another run's, still held) stays."""
    import time as _time

    from pytest_rlhfmem.rlhf.launch import clear_stale_batons

    started = _time.time()
    fresh = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    older = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (fresh, older):
        lock.parent.mkdir(parents=True)
        lock.touch()
    os.utime(older, (started - 3600, started - 3600))
    (tmp_path / "py311_cpu" / "cpu_adam" / "cpu_adam.so").write_bytes(b"\x7fELF")
    assert clear_stale_batons({"TORCH_EXTENSIONS_DIR": str(tmp_path)}, started, settle_s=0.0) == [fresh]
    assert not fresh.exists() and older.exists()


def test_a_baton_another_run_holds_in_that_moment_is_kept(tmp_path):
    """A lock made since the killed run began, but held by a live build (a process working in its directory, as
    ninja does) or released and taken again within the settling time, is another load's: removing it would make
    that load's ``FileBaton.release()`` fail."""
    import threading
    import time as _time

    from pytest_rlhfmem.rlhf.launch import clear_stale_batons

    started = _time.time()
    building = tmp_path / "py311_cpu" / "deepspeed_shm_comm"
    retaken = tmp_path / "py311_cpu" / "cpu_adam"
    for d in (building, retaken):
        d.mkdir(parents=True)
        (d / "lock").touch()
    ninja = subprocess.Popen(["sleep", "30"], cwd=building)

    def release_and_take_again():
        _time.sleep(0.2)
        (retaken / "lock").unlink()
        (retaken / "lock").touch()

    t = threading.Thread(target=release_and_take_again)
    t.start()
    try:
        assert clear_stale_batons({"TORCH_EXTENSIONS_DIR": str(tmp_path)}, started, settle_s=0.5) == []
    finally:
        ninja.kill()
        ninja.wait()
        t.join()
    assert (building / "lock").exists() and (retaken / "lock").exists()
    # once no build works there and the lock outlasts the settling time, both are stale
    assert set(clear_stale_batons({"TORCH_EXTENSIONS_DIR": str(tmp_path)}, started, settle_s=0.0)) == {
        building / "lock", retaken / "lock"}
