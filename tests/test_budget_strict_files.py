"""Budget files that cannot lose an entry or pass one by accident (issue 38, items 2, 3 and 5): many concurrent
writers through ``update_budget_file``; duplicate keys, negative sizes, an empty file refused at collection; an
entry missing a gated metric fails its check; a read-only or full baselines directory refused before anything runs,
leaving nothing behind; an update keeps the file's mode and ownership."""

import contextlib
import multiprocessing
import os
import resource
import stat
import subprocess

import pytest
import yaml
from helpers import DATA

from pytest_rlhfmem.budgets import (
    BUDGET_METRICS, BudgetError, BudgetWriteError, check_writable, load_budget_file, lock_path, update_budget_file,
)

SCENARIO = "my-trainer/phased"
METRICS = {"peak_reserved": "64 MiB", "peak_allocated": "50 MiB", "fragmentation_at_peak": "14 MiB",
           "cuda_malloc_count": 12, "alloc_retries": 0, "host_anon_growth": "90 MiB", "host_pinned_peak": "0 B"}


def _entry(i: int) -> dict:
    return {"capture": "cpu-trace-simulated", "device": "cpu", "metrics": dict(METRICS, cuda_malloc_count=i)}


# -- item 2: any number of writers ------------------------------------------------------------------------

def _writer(path: str, worker: int, n: int) -> None:
    for i in range(n):
        update_budget_file(path, {f"w{worker}/e{i}": _entry(i)}, "cpu")


# trials 1 and 2 (a minute more on 2 cores) run in tox -e long
@pytest.mark.parametrize("trial", [0, *(pytest.param(t, marks=pytest.mark.long) for t in (1, 2))])
def test_six_concurrent_writers_keep_all_240_entries(tmp_path, trial):
    """6 processes x 40 updates of one entry each: before, the lock file was unlinked after each release, so a
    third writer locked a new inode while a second held the old one (240, 232, 200 of 240 kept)."""
    path = tmp_path / "suite.yaml"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 40)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 6
    entries = load_budget_file(path).entries
    assert len(entries) == 240, f"{240 - len(entries)} of 240 entries lost"
    assert sorted(os.listdir(tmp_path)) == ["suite.yaml"]  # no *.tmp, no lock file beside it
    assert lock_path(path).exists()  # kept (in the user cache): the stable inode every writer locks


# -- item 3: strict loading ----------------------------------------------------------------------------------

def _file(metrics_text: str) -> str:
    return f"schema: 1\nentries:\n  {SCENARIO}:\n    metrics:\n{metrics_text}"


FULL = "".join(f"      {k}: {v}\n" for k, v in METRICS.items())
REFUSED = {
    "duplicate_metric": (_file(FULL + "      peak_reserved: 1 TiB\n"),
                         f"entry '{SCENARIO}'.metrics: key 'peak_reserved' given twice (lines 5 and 12)"),
    "duplicate_entry": (_file(FULL) + f"  {SCENARIO}:\n    metrics:\n{FULL}",
                        f"entries: key '{SCENARIO}' given twice (lines 3 and 12)"),
    "negative_size": (_file(FULL.replace("64 MiB", "-54 MiB")),
                      f"entry '{SCENARIO}'.metrics.peak_reserved: a size is >= 0, got '-54 MiB'"),
    "empty": ("", "top level: the file is empty (damaged?)"),
    "comments_only": ("# nothing but a comment\n\n", "top level: the file is empty (damaged?)"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_load_refuses_in_one_line_naming_file_entry_and_key(tmp_path, name):
    text, fragment = REFUSED[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    with pytest.raises(BudgetError) as exc:
        load_budget_file(path)
    assert str(exc.value).startswith(f"{path}: ") and fragment in str(exc.value)
    assert "\n" not in str(exc.value)


GUARDED_TEST = """
def test_guarded(memory_budget):
    open({marker!r}, "w").write("ran")
"""


def _session(pytester, *args):
    marker = pytester.path / "ran.txt"
    pytester.makepyfile(test_guarded=GUARDED_TEST.format(marker=str(marker)))
    r = pytester.runpytest_subprocess(*args)
    return r, marker


@pytest.mark.parametrize("name", ["duplicate_metric", "negative_size", "empty"])
def test_a_refused_file_ends_the_session_at_collection(pytester, name):
    text, fragment = REFUSED[name]
    budget = pytester.path / "baselines" / "cpu" / "guarded.yaml"
    budget.parent.mkdir(parents=True)
    budget.write_text(text)
    r, marker = _session(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    lines = [ln for ln in r.stderr.lines if "guarded.yaml" in ln]
    assert len(lines) == 1 and "malformed baseline file" in lines[0] and fragment in lines[0], r.stderr.str()
    assert "Traceback" not in r.stderr.str() + r.stdout.str()
    assert not marker.exists()  # before any test (iteration) ran


CHECKED_TEST = """
import sys

def test_my_trainer(rlhfmem_command, memory_budget):
    result = rlhfmem_command([sys.executable, {script!r}], id={id!r}, device="cpu")
    memory_budget.check(result)
"""


def test_an_entry_cut_short_fails_its_check_naming_the_missing_metrics(pytester):
    """Before: an entry with only peak_reserved (cut after it) passed as 'ok' with the rest unchecked."""
    pytester.makepyfile(test_own=CHECKED_TEST.format(script=str(DATA / "commands" / "phased_train.py"), id=SCENARIO))
    r = pytester.runpytest_subprocess("--rlhfmem-update-baselines")
    r.assert_outcomes(passed=1)
    budget = pytester.path / "baselines" / "cpu" / "own.yaml"
    data = yaml.safe_load(budget.read_text())
    data["entries"][SCENARIO]["metrics"] = {"peak_reserved": data["entries"][SCENARIO]["metrics"]["peak_reserved"]}
    budget.write_text(yaml.safe_dump(data))
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1)
    missing = ", ".join(m for m in BUDGET_METRICS if m != "peak_reserved")
    r.stdout.fnmatch_lines([f"*{budget}: entry '{SCENARIO}'.metrics: missing {missing}; every entry gates*"])


# -- item 5: unwritable directories, mode and ownership -------------------------------------------------------

def _mount_tmpfs(where, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def _umount(where) -> None:
    subprocess.run(["umount", str(where)], capture_output=True)


@contextlib.contextmanager
def read_only_dir(tmp_path, content: str):
    """A baselines directory holding ``cpu/guarded.yaml`` that no one can write: a tmpfs remounted read-only
    where this process may mount (root ignores directory modes), else a directory of mode 0555."""
    base = tmp_path / "ro"
    mounted = _mount_tmpfs(base, "1m")
    if not mounted and os.geteuid() == 0:
        pytest.skip("a read-only directory as root needs CAP_SYS_ADMIN (mount): root ignores directory modes")
    (base / "cpu").mkdir()
    (base / "cpu" / "guarded.yaml").write_text(content)
    try:
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(base)], check=True, capture_output=True)
        else:
            for d in (base / "cpu", base):
                d.chmod(0o555)
        yield base
    finally:
        if mounted:
            _umount(base)
        else:
            for d in (base, base / "cpu"):
                d.chmod(0o755)


@contextlib.contextmanager
def full_dir(tmp_path, content: str, fsize: int = 16 * 1024):
    """A baselines directory holding ``cpu/guarded.yaml`` on a full filesystem: a tiny tmpfs filled up where this
    process may mount, else an RLIMIT_FSIZE of ``fsize`` bytes (writes past it fail with EFBIG, as a full disk's
    do; a pytester session writes its output to files, so it needs some)."""
    base = tmp_path / "full"
    mounted = _mount_tmpfs(base, "256k")
    (base / "cpu").mkdir()
    (base / "cpu" / "guarded.yaml").write_text(content)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        if mounted:
            with contextlib.suppress(OSError), open(base / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, old[1]))
        yield base
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        if mounted:
            _umount(base)


def _listing(base):
    return sorted(str(p.relative_to(base)) for p in base.rglob("*"))


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_an_unwritable_baselines_dir_is_refused_before_anything_runs(pytester, tmp_path, kind):
    """Before: a 70-80-line traceback after the whole session ran, and on a full disk a 0-byte *.tmp and a .lock
    left in baselines/."""
    content = _file(FULL)
    with (read_only_dir if kind == "read-only" else full_dir)(tmp_path, content) as base:
        before = _listing(base)
        r, marker = _session(pytester, "--rlhfmem-update-baselines", f"--rlhfmem-baselines-dir={base}")
        after = _listing(base)
        text = (base / "cpu" / "guarded.yaml").read_text()
    assert r.ret == pytest.ExitCode.USAGE_ERROR, r.stdout.str() + r.stderr.str()
    lines = [ln for ln in r.stderr.lines if "guarded.yaml" in ln]
    assert len(lines) == 1 and "baselines cannot be written" in lines[0], r.stderr.str()
    assert "Traceback" not in r.stderr.str() + r.stdout.str()
    assert not marker.exists()  # refused before any test (iteration) ran
    assert after == before and text == content  # nothing left behind, nothing changed


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_an_update_into_an_unwritable_dir_is_one_line_and_leaves_nothing(tmp_path, kind):
    """The directory can turn unwritable after the session started: the session's end gets one line."""
    content = _file(FULL)
    with (read_only_dir(tmp_path, content) if kind == "read-only" else full_dir(tmp_path, content, 256)) as base:
        path = base / "cpu" / "guarded.yaml"
        before = _listing(base)
        assert "baselines cannot be written" in check_writable(path)
        with pytest.raises(BudgetWriteError) as exc:
            update_budget_file(path, {"another/entry": _entry(1)}, "cpu")
        after = _listing(base)
        text = path.read_text()
    assert str(exc.value).startswith(f"{path}: not written: ") and "\n" not in str(exc.value)
    assert after == before and text == content


def test_an_update_keeps_the_files_mode_and_ownership(tmp_path):
    """Before: every update rewrote the file with the temporary file's mode, 0600, owned by the writer."""
    path = tmp_path / "suite.yaml"
    update_budget_file(path, {"a/b": _entry(1)}, "cpu")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # a new file: as open() would create it
    path.chmod(0o664)
    owner = (4242, 4243) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    os.chown(path, *owner)
    update_budget_file(path, {"a/c": _entry(2)}, "cpu")
    st = path.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o664, *owner)
    assert set(load_budget_file(path).entries) == {"a/b", "a/c"}


def test_a_writable_dir_passes_the_probe_and_keeps_nothing(tmp_path):
    path = tmp_path / "not" / "yet" / "suite.yaml"
    assert check_writable(path) is None
    assert list(tmp_path.iterdir()) == []  # the probe went into the nearest existing parent, and is gone
