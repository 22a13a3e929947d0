"""Issue 47 item 4: a CPU capture is measured by the allocation recorder or not at all. A build cache that cannot
hold its build (a file in its place, a full disk), or a recorder that cannot load, is one line before anything runs
or a failed rank, never a quiet fallback to another backend with other figures (it gave 65.5 KiB for 16.31 MiB)."""

import os
import stat
import sys
from pathlib import Path

import pytest

from helpers import rlhfmem_cli
from pytest_rlhfmem import cbuild
from pytest_rlhfmem.record import recorder as rec_mod


@pytest.mark.parametrize("cache", ["file", "under-a-file"])
def test_an_unusable_build_cache_is_one_line_and_leaves_nothing(tmp_path, cache):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    where = blocker if cache == "file" else blocker / "cache"
    fresh = tmp_path / "tmp"
    fresh.mkdir()
    r = rlhfmem_cli("capture", "--device", "cpu", "--", sys.executable, "-c", "import torch; torch.ones(1 << 20)",
                    env={"RLHFMEM_CACHE_DIR": str(where), "TMPDIR": str(fresh), "CXX": _fresh_compiler(tmp_path)},
                    cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith(f"rlhfmem: error: device cpu: cannot build the CPU allocation recorder: the build "
                                f"cache {where} cannot hold cpu_alloc_recorder.cpp's build ("), lines
    assert lines[-1].endswith("): give $RLHFMEM_CACHE_DIR a writable directory with room")
    assert "Traceback" not in r.stderr and list(fresh.iterdir()) == []  # no work directory left


def _fresh_compiler(tmp_path: Path) -> str:
    """A g++ of this machine under another path: the build's cache key changes, so no cached build is found."""
    import shutil

    link = tmp_path / "g++"
    link.symlink_to(shutil.which("g++"))
    return str(link)


def test_a_compiler_that_runs_out_of_disk_is_one_line(tmp_path, monkeypatch):
    cxx = tmp_path / "cxx"
    cxx.write_text("#!/bin/sh\necho 'ld: final link failed: No space left on device' >&2\n"
                   "echo 'collect2: error: ld returned 1 exit status' >&2\nexit 1\n")
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("RLHFMEM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "x.cpp"
    src.write_text("int x;\n")
    with pytest.raises(RuntimeError) as e:
        cbuild.build_library(src, RuntimeError, ("-shared",))
    assert str(e.value) == (f"the build cache {tmp_path / 'cache'} cannot hold x.cpp's build (No space left on "
                            f"device): give $RLHFMEM_CACHE_DIR a writable directory with room")
    cxx.write_text("#!/bin/sh\necho 'x.cpp:1: error: one' >&2\necho 'x.cpp:2: error: two' >&2\nexit 1\n")
    with pytest.raises(RuntimeError) as e:
        cbuild.build_library(src, RuntimeError, ("-shared",))
    assert "\n" not in str(e.value) and str(e.value).endswith("x.cpp:1: error: one / x.cpp:2: error: two")
    assert os.listdir(tmp_path / "cache") == ["x.lock"]  # the lock file alone: no partial build left


def test_a_recorder_that_cannot_load_fails_the_rank_instead_of_measuring_another_way(monkeypatch):
    def unavailable():
        raise RuntimeError("cannot build the CPU allocation recorder: no C++ compiler (g++ not on PATH)")

    import pytest_rlhfmem.record.cpu_recorder as cpu_recorder

    monkeypatch.setattr(cpu_recorder, "load_recorder", unavailable)
    r = rec_mod.Recorder("cpu")
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler"):
        r.start()
    assert r.backend == ""  # nothing was started in its place
