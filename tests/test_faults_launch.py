"""Issue 38 items 6, 7 and 9: `--timeout` bounds the wait on DeepSpeed's op-build lock; a passing run leaves
no `rlhfmem-*` or `torchelastic_*` directory in the temporary directory; argument ranges are refused at parse
time, in one line, before anything runs."""

import time
from pathlib import Path

import pytest
from filelock import FileLock
from helpers import rlhfmem_cli

COMMANDS = Path(__file__).parent / "data" / "commands"


cli = rlhfmem_cli


@pytest.mark.parametrize("args, fragment", [
    (["run", "--timeout", "-5"], "argument --timeout: '-5': allowed values are a number of seconds > 0"),
    (["run", "--timeout", "0"], "argument --timeout: '0': allowed values are a number of seconds > 0"),
    (["run", "--timeout", "nan"], "argument --timeout: 'nan': allowed values are a number of seconds > 0"),
    (["run", "--batch-size", "0"], "argument --batch-size: '0': allowed values are an integer >= 1"),
    (["run", "--batch-size", "-3"], "argument --batch-size: '-3': allowed values are an integer >= 1"),
    (["run", "--master-port", "70000"], "argument --master-port: '70000': allowed values are an integer 1..65535"),
    (["run", "--node-rank", "-1"], "argument --node-rank: '-1': allowed values are an integer >= 0"),
    (["capture", "--timeout", "-5", "--", "train.py"], "argument --timeout: '-5': allowed values are a number of "
                                                      "seconds > 0"),
    (["run", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
])
def test_argument_ranges_are_one_line_at_parse_time(args, fragment, tmp_path):
    t0 = time.monotonic()
    p = cli(*args, cwd=tmp_path, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("rlhfmem: error: ") and fragment in lines[0], p.stderr
    assert time.monotonic() - t0 < 60  # refused before any rank or build started


def test_timeout_bounds_the_wait_on_the_op_build_lock(tmp_path):
    cache = tmp_path / "cache"
    lock = cache / "pytest-rlhfmem" / "ds-ops.lock"
    lock.parent.mkdir(parents=True)
    with FileLock(str(lock)):  # another run building DeepSpeed's ops, for longer than this run's timeout
        t0 = time.monotonic()
        p = cli("run", "--device", "cpu", "--world-size", "1", "--timeout", "3", cwd=tmp_path, timeout=120,
                env={"RLHFMEM_CACHE_DIR": str(lock.parent), "TMPDIR": str(tmp_path)})
        elapsed = time.monotonic() - t0
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0] == (f"rlhfmem: error: waited the whole 3 s timeout for the JIT-build lock {lock}, held by another "
                        f"run building DeepSpeed's ops: run again when it is done, or give a longer --timeout")
    assert elapsed < 30, elapsed
    assert not list(tmp_path.glob("rlhfmem-*")), "the refused run left its work directory"


def test_a_passing_run_leaves_no_directory_in_the_temporary_directory(tmp_path):
    p = cli("run", "--device", "cpu", "--world-size", "1", "--timeout", "300", cwd=tmp_path,
            env={"TMPDIR": str(tmp_path)})
    assert p.returncode == 0, p.stdout + p.stderr
    left = sorted(x.name for x in tmp_path.iterdir())
    assert not [n for n in left if n.startswith(("rlhfmem-", "torchelastic_"))], left


def test_a_passing_torchrun_capture_leaves_no_directory_in_the_temporary_directory(tmp_path):
    p = cli("capture", "--device", "cpu", "--world-size", "2", "--timeout", "300", "--",
            str(COMMANDS / "plain_train.py"), cwd=tmp_path, env={"TMPDIR": str(tmp_path)})
    assert p.returncode == 0, p.stdout + p.stderr
    left = sorted(x.name for x in tmp_path.iterdir())
    assert not [n for n in left if n.startswith(("rlhfmem-", "torchelastic_"))], left
