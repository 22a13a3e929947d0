"""Issue 47 item 3: an output that cannot be written is known before the run, in one line naming the option; and a
result that still cannot be written at the end (the place changed during the run) goes to a named file with the
table printed, never a traceback that loses the measured result."""

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import rlhfmem_cli
from pytest_rlhfmem.outputs import OutputError, check_dir, check_file, keep


def test_check_file_and_dir_name_the_option_and_what_is_wrong(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [(check_file, "", "--json '': a file name is needed"),
             (check_file, tmp_path, f"--json {tmp_path}: is a directory; give a file name"),
             (check_file, afile / "out.json", f"--json {afile / 'out.json'}: {afile} is not a directory"),
             (check_dir, afile, f"--json {afile}: is not a directory"),
             (check_dir, afile / "d" / "e", f"--json {afile / 'd' / 'e'}: {afile} is not a directory")]
    for check, path, message in cases:
        with pytest.raises(OutputError) as e:
            check(str(path), "--json")
        assert str(e.value) == message
    check_file(str(tmp_path / "new" / "deeper" / "out.json"), "--json")  # writable: passes, and leaves nothing
    check_dir(str(tmp_path / "snaps"), "--snapshot-dir")
    check_file(str(afile), "--json")  # an existing file is appended to for the check: unchanged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and afile.read_text() == "x"
    kept = keep('{"a": 1}', "out.json")
    assert kept.name.startswith("rlhfmem-out.json-") and kept.suffix == ".json" and json.loads(kept.read_text())
    kept.unlink()


@pytest.mark.parametrize("args, message", [
    (["capture", "--json", "{d}", "--device", "cpu", "--", sys.executable, "-c", "pass"],
     "--json {d}: is a directory; give a file name"),
    (["capture", "--snapshot-dir", "{f}", "--device", "cpu", "--", sys.executable, "-c", "pass"],
     "--snapshot-dir {f}: is not a directory"),
    (["run", "--json", "{f}/out.json", "--device", "cpu"], "--json {f}/out.json: {f} is not a directory"),
    (["advise", "missing.json", "--md", "{d}"], "--md {d}: is a directory; give a file name"),
    (["plot", "missing.json", "-o", "{f}/fig.png"], "-o/--output {f}/fig.png: {f} is not a directory"),
])
def test_a_bad_output_path_is_one_line_before_anything_runs(tmp_path, args, message):
    afile = tmp_path / "afile"
    afile.write_text("x")
    fill = {"d": str(tmp_path), "f": str(afile)}
    r = rlhfmem_cli(*[a.format(**fill) for a in args], cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [f"rlhfmem: error: {message.format(**fill)}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


CHANGES_ITS_OUTPUT = """
import os, shutil, sys
import torch

out = sys.argv[1]
weights = torch.zeros(1 << 18)
shutil.rmtree(out)
open(out, "w").write("a file where the output directory was")
"""


def test_a_json_that_cannot_be_written_at_the_end_is_kept_and_the_table_printed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "prog.py"
    script.write_text(CHANGES_ITS_OUTPUT)
    r = rlhfmem_cli("capture", "--device", "cpu", "--json", str(out / "result.json"), "--", sys.executable,
                    str(script), str(out), cwd=tmp_path, env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "peak reserved reached in phase: run" in r.stdout  # the table was printed
    line = r.stderr.strip().splitlines()[-1]
    m = re.fullmatch(rf"rlhfmem: --json {out}/result.json: cannot be written \(File exists\); the result is in "
                     rf"(\S+), its traces in the work directory (\S+)", line)
    assert m, line
    kept = json.loads(Path(m[1]).read_text())
    assert kept["status"] == "ok" and kept["metrics"]["peak_allocated"] >= 1 << 20
    assert Path(m[2]).is_dir() and Path(kept["ranks"][0]["trace_file"]).exists()  # the traces it names stayed


def test_pytest_refuses_an_unwritable_output_before_any_test(pytester):
    pytester.makepyfile("def test_x():\n    assert True\n")
    (pytester.path / "afile").write_text("x")
    r = pytester.runpytest_subprocess("--rlhfmem-report", "afile/report.md")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --rlhfmem-report afile/report.md: afile is not a directory"])
    r = pytester.runpytest_subprocess("--rlhfmem-snapshots", "afile")
    r.stderr.fnmatch_lines(["ERROR: --rlhfmem-snapshots afile: is not a directory"])


def test_a_session_json_that_cannot_be_written_at_the_end_is_kept_and_the_session_fails(pytester):
    pytester.makepyfile(textwrap.dedent("""
        import shutil, sys

        def test_takes_the_place_of_the_output(rlhfmem_command):
            rlhfmem_command([sys.executable, "-c", "import torch; torch.zeros(1 << 18)"], id="tiny", device="cpu")
            shutil.rmtree("out")
            open("out", "w").write("a file where the output directory was")
        """))
    (pytester.path / "out").mkdir()
    r = pytester.runpytest_subprocess("--rlhfmem-json", "out/session.json", "-p", "no:cacheprovider")
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    line = next(ln for ln in r.outlines if "--rlhfmem-json out/session.json: cannot be written" in ln)
    kept = Path(line.split("; it is in ")[1])
    assert json.loads(kept.read_text())["results"][0]["scenario_id"] == "tiny"
    kept.unlink()
