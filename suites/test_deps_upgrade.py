"""Issue 48, incident 5 on this project's own pinned stack (opt-in: ``tox -e deps-upgrade``; needs the package
index): DeepSpeed's previous minor release, 0.18.9, against the pinned 0.19.8 (constraints/deepspeed.txt), every
other pin the same. ``rlhfmem deps-diff`` builds the old set's virtual environment from a constraints file (this
environment's pins with deepspeed==0.18.9) and the new set's from constraints/deepspeed.txt itself, both with the
same extras (cached under $RLHFMEM_CACHE_DIR/deps-envs, minutes each the first time), so that DeepSpeed is the one
distribution that differs; records the DeepSpeed-Chat cell (tiny OPT, ZeRO-2 and ZeRO-3, world size 1, CPU route:
simulated device figures, measured host figures) under each and prints the per-phase diff, whatever it turns out to
be.
tests/test_deps_diff.py holds the command at CI scale (a stand-in dependency whose upgrade moves one phase).
Each test prints ``FIGURES {...}`` and the report: what docs/incidents.md quotes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PINNED, PREVIOUS = "0.19.8", "0.18.9"  # deepspeed: the pin and the last release of the minor before it


def previous_constraints(tmp_path: Path) -> Path:
    """constraints/deepspeed.txt with DeepSpeed's previous minor release, every other pin kept."""
    text = (ROOT / "constraints" / "deepspeed.txt").read_text()
    assert f"deepspeed=={PINNED}\n" in text, "the pin moved: update PINNED and PREVIOUS"
    out = tmp_path / "deepspeed-previous.txt"
    out.write_text(text.replace(f"deepspeed=={PINNED}\n", f"deepspeed=={PREVIOUS}\n"))
    return out


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_deepspeed_previous_minor_against_the_pin(tmp_path, strategy):
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "pytest_rlhfmem.cli", "deps-diff", "--base", str(previous_constraints(tmp_path)),
           "--head", str(ROOT / "constraints" / "deepspeed.txt"), "--work-dir", str(work),
           "--json", str(tmp_path / "report.json"), "--",
           "run", "--framework", "deepspeed-chat", "--models", "tiny-opt", "--strategy", strategy, "--world-size", "1",
           "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:] + (work / "deps-diff.log").read_text()[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    changed = {d["name"]: (d["base"], d["head"]) for d in report["dependencies_changed"]}
    assert changed == {"deepspeed": (PREVIOUS, PINNED)}, changed  # like for like: nothing else differs
    moved = [row for row in report["phase_rows"] if row["status"] != "unchanged"]
    print("FIGURES " + json.dumps({"strategy": strategy, "dependencies_changed": changed,
                                   "moved_phase": report["moved_phase"], "verdict": report["verdict"],
                                   "phase_rows_moved": moved, "rows": [row for row in report["rows"]
                                                                       if row["metric"] in ("peak_reserved",
                                                                                            "peak_allocated")]}))
    assert "**Dependencies changed:** " in r.stdout and "**Phase that moved:** " in r.stdout
