"""Issue 38 item 1: SIGINT, SIGTERM or SIGHUP to `rlhfmem run`, `rlhfmem capture` or a pytest session using
the fixtures stops every process of the run within seconds (torchrun, its workers, which lead sessions of
their own), names each rank's phase and the work directory, and exits 128 + the signal.

Every process the entry point starts inherits a token in its environment; the check scans /proc for it
(workers are in sessions of their own, so a check by the entry point's session or group would miss them)."""

import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

COMMANDS = Path(__file__).parent / "data" / "commands"
TOKEN_VAR = "RLHFMEM_FAULT_TEST_TOKEN"


def alive_with(token: str) -> list[str]:
    """``pid cmdline`` of every process (not a zombie) whose environment carries ``token``."""
    marker = f"{TOKEN_VAR}={token}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if marker not in (d / "environ").read_bytes().split(b"\0"):
                continue
            stat = (d / "stat").read_text()
            if stat[stat.rindex(")") + 2] == "Z":
                continue
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{d.name} {cmdline}")
        except OSError:
            pass
    return found


def start(argv: list[str], tmp_path: Path) -> tuple[subprocess.Popen, str]:
    token = secrets.token_hex(8)
    env = dict(os.environ, **{TOKEN_VAR: token}, TMPDIR=str(tmp_path), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # as from a terminal: the signal goes to the entry point
    return proc, token


def wait_for(predicate, proc: subprocess.Popen, limit: float = 240.0) -> None:
    t_end = time.monotonic() + limit
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"ended before the signal (rc {proc.returncode}):\n{out}\n{err}")
        if time.monotonic() > t_end:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the run never reached the point to interrupt")
        time.sleep(0.2)


def progress(root: Path, ranks: int, phase: str | None = None) -> bool:
    files = list(root.rglob("progress-rank*.json"))
    return len(files) >= ranks and (phase is None or all(f'"{phase}"'.encode() in p.read_bytes() for p in files))


def interrupt(proc: subprocess.Popen, token: str, sig: int) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    try:
        out, err = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        stuck = True
    else:
        stuck = False
    elapsed = time.monotonic() - t0
    time.sleep(0.5)
    left = alive_with(token)
    for line in left:  # leave nothing behind for the next test, then fail
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"after {signal.Signals(sig).name} these processes of the run survive:\n" + "\n".join(left)
    assert not stuck, f"still running 40 s after {signal.Signals(sig).name}:\n{err[-2000:]}"
    return proc.returncode, out, err, elapsed


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_rlhfmem_run_stops_every_process_on_a_signal(sig, tmp_path):
    work = tmp_path / "work"
    proc, token = start([sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--device", "cpu", "--world-size", "2",
                         "--work-dir", str(work), "--timeout", "300"], tmp_path)
    wait_for(lambda: progress(work, 2), proc)
    rc, out, err, elapsed = interrupt(proc, token, sig)
    assert rc == 128 + sig, (rc, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"rlhfmem: interrupted by {signal.Signals(sig).name}: every process of the run was "
                           f"stopped (rank 0 in phase '"), err
    assert "rank 1 in phase" in line and f"work directory kept: {work}" in line, err
    assert elapsed < 20, elapsed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_rlhfmem_capture_stops_every_process_on_a_signal(sig, tmp_path):
    proc, token = start([sys.executable, "-m", "pytest_rlhfmem.cli", "capture", "--device", "cpu", "--world-size",
                         "2", "--timeout", "300", "--", str(COMMANDS / "hang.py")], tmp_path)
    wait_for(lambda: progress(tmp_path, 2, "wait"), proc)
    rc, out, err, elapsed = interrupt(proc, token, sig)
    assert rc == 128 + sig, (rc, err)
    line = err.strip().splitlines()[-1]
    assert f"interrupted by {signal.Signals(sig).name}" in line, err
    # each rank's phase and what it held by its last report: hang.py holds its 4 MiB of weights in phase wait
    assert re.search(r"\(rank 0 in phase 'wait': peak reserved [\d.]+ MiB, peak allocated 4\.00 MiB \(simulated\), "
                     r"host RSS [\d.]+ [MG]iB; rank 1 in phase 'wait': .*\); work directory kept: ", line), err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_pytest_session_with_the_fixture_stops_every_process_on_a_signal(sig, tmp_path):
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent(f"""
        import sys

        def test_hangs(rlhfmem_command):
            rlhfmem_command([sys.executable, {str(COMMANDS / 'hang.py')!r}], id="hangs", device="cpu",
                            world_size=2, timeout=300)
        """))
    proc, token = start([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_hangs.py"], tmp_path)
    wait_for(lambda: progress(tmp_path, 2, "wait"), proc)
    rc, out, err, elapsed = interrupt(proc, token, sig)
    assert rc == 128 + sig, (rc, out, err)
    assert f"interrupted by {signal.Signals(sig).name}" in out + err, out + err
    assert "rank 0 in phase 'wait'" in out + err, out + err


def test_a_signal_while_waiting_for_the_op_build_lock_leaves_nothing(tmp_path):
    from filelock import FileLock

    lock = tmp_path / "cache" / "pytest-rlhfmem" / "ds-ops.lock"
    lock.parent.mkdir(parents=True)
    with FileLock(str(lock)):  # another run is building DeepSpeed's ops
        token = secrets.token_hex(8)
        proc = subprocess.Popen([sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--device", "cpu", "--world-size",
                                 "1", "--timeout", "300"], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=dict(os.environ, **{TOKEN_VAR: token}, TMPDIR=str(tmp_path),
                                         XDG_CACHE_HOME=str(tmp_path / "cache")))
        wait_for(lambda: any(tmp_path.glob("rlhfmem-*")), proc)  # its work directory: it waits for the lock
        time.sleep(1)
        rc, out, err, elapsed = interrupt(proc, token, signal.SIGTERM)
    assert rc == 143, (rc, err)
    assert err.strip().splitlines()[-1] == ("rlhfmem: interrupted by SIGTERM: every process of the run was stopped "
                                            "(no rank had reported its phase); work directory removed"), err
    assert not list(tmp_path.glob("rlhfmem-*"))
