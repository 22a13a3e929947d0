"""Issue 48, incident 5 (prime-rl #1731: vLLM 0.16 + transformers 5, peak reserved +3.18 GiB, baseline edited by hand;
NeMo RL #656: torch 2.6 -> 2.7): a dependency upgrade as a pull request, at CI scale.

``rlhfmem deps-diff`` records one cell (``rlhfmem capture`` of tests/data/commands/upgrade_train.py) under two
dependency sets: two real virtual environments that see this environment's packages (a ``.pth`` adding its
site-packages) plus a stand-in dependency, ``rlhfmem-probe``, installed in each as its own distribution (1.0 or 2.0;
2.0's forward holds a 16 MiB cache for the call). Before: the same set on both sides, nothing moves, exit 0. After:
1.0 -> 2.0, exit 1 with --fail-on-regression, the report naming the phase that moved (``forward``) and the package
that changed. The real upgrade of this project's pinned stack runs in ``tox -e deps-upgrade``
(suites/test_deps_upgrade.py; docs/incidents.md quotes it). Also: the CI recipe's command line parses with the real
parser, and bad sides are one line.
"""

import json
import sys
import sysconfig
import venv
from pathlib import Path

import yaml
from helpers import DATA, rlhfmem_cli

from pytest_rlhfmem.cli import build_parser
from pytest_rlhfmem.report import Side, diff, moved_phase, to_markdown

ROOT = Path(__file__).resolve().parent.parent
CELL = ["capture", "--id", "upgrade-probe", "--device", "cpu", "--", str(DATA / "commands" / "upgrade_train.py")]


def make_env(path: Path, probe_version: str) -> Path:
    """A virtual environment seeing this environment's packages (a ``.pth`` adding its site-packages) with the
    stand-in dependency ``rlhfmem-probe`` at ``probe_version`` as a distribution of its own; returns its python."""
    venv.create(path, with_pip=False, symlinks=True)
    site = path / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    here = sysconfig.get_paths()["purelib"]
    (site / "_rlhfmem_this_env.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    source = (DATA / "upgrade_probe" / "rlhfmem_probe.py").read_text().replace('"VERSION"', repr(probe_version))
    (site / "rlhfmem_probe.py").write_text(source)
    info = site / f"rlhfmem_probe-{probe_version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rlhfmem-probe\nVersion: {probe_version}\n")
    (info / "RECORD").write_text("")
    return path / "bin" / "python"


def test_incident_5_an_upgrade_moves_a_phase_and_the_report_names_it_and_the_package(tmp_path):
    old, new = make_env(tmp_path / "old", "1.0"), make_env(tmp_path / "new", "2.0")
    r = rlhfmem_cli("deps-diff", "--base", str(old), "--head", str(tmp_path / "old"), "--work-dir",
                    str(tmp_path / "same"), "--fail-on-regression", "--", *CELL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "**Dependencies changed:** nothing" in r.stdout and "No phase moved beyond the threshold." in r.stdout
    r = rlhfmem_cli("deps-diff", "--base", str(old), "--head", str(new), "--work-dir", str(tmp_path / "upgrade"),
                    "--json", str(tmp_path / "upgrade.json"), "--fail-on-regression", "--", *CELL)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "**Dependencies changed:** rlhfmem-probe 1.0 -> 2.0" in r.stdout
    assert "**Phase that moved:** `forward`" in r.stdout
    assert "**The phase that moved most: `forward`** (peak allocated " in r.stdout
    report = json.loads((tmp_path / "upgrade.json").read_text())
    assert report["moved_phase"] == "forward" and report["regressed"]
    assert report["dependencies_changed"] == [{"name": "rlhfmem-probe", "base": "1.0", "head": "2.0"}]
    moved = {r["metric"]: r for r in report["phase_rows"] if r["status"] == "regressed"}
    # the 16 MiB cache on top of what the phase held at its old peak (15.88 MiB: simulated, CPU route)
    assert 15 * 2**20 <= moved["forward:peak_allocated"]["delta"] <= 16 * 2**20
    assert "generate:peak_allocated" not in moved  # the phases before it did not move
    assert (tmp_path / "upgrade" / "base.json").is_file()
    assert (tmp_path / "upgrade" / "head-distributions.json").is_file()


def _side(label: str, phases: dict[str, tuple[int, int]]) -> Side:
    """A side holding one finished run result with ``phases`` {name: (peak reserved, peak allocated)} (bytes)."""
    result = {"scenario_id": "cell", "status": "ok", "metrics": {"peak_reserved": max(r for r, _ in phases.values()),
                                                                 "peak_allocated": max(a for _, a in phases.values())},
              "phases": {n: {"peak_reserved": r, "peak_allocated": a} for n, (r, a) in phases.items()}}
    return Side(label, {"cell": {"metrics": result["metrics"], "status": "ok", "env": {}, "result": result}})


def test_the_phase_that_moved_is_the_one_whose_allocation_moved_not_the_later_cached_ones():
    """An upgrade that allocates 16 MiB more in ``forward`` leaves it cached: ``forward``, ``train`` and ``run`` all
    reserve 20 MiB more, only ``forward`` allocates more. The report names ``forward``; with nothing moved, none."""
    MiB = 2**20
    base = _side("old", {"run": (40 * MiB, 30 * MiB), "forward": (40 * MiB, 30 * MiB), "train": (40 * MiB, 35 * MiB)})
    head = _side("new", {"run": (60 * MiB, 30 * MiB), "forward": (60 * MiB, 46 * MiB), "train": (60 * MiB, 35 * MiB)})
    d = diff(base, head)
    assert moved_phase(d).metric == "forward:peak_allocated"
    changed = {r.metric for r in d.phase_rows if r.status == "regressed"}
    assert changed == {"run:peak_reserved", "forward:peak_reserved", "train:peak_reserved", "forward:peak_allocated"}
    assert "**The phase that moved most: `forward`** (peak allocated 30.00 MiB -> 46.00 MiB, +16.00 MiB, +53.3%" \
        in to_markdown(d)
    assert moved_phase(diff(base, base)) is None and "No phase moved" in to_markdown(diff(base, base))


def test_bad_sides_and_cells_are_one_line(tmp_path):
    """Each refusal is one line, and leaves no temporary work directory behind (it made one before refusing)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    r = rlhfmem_cli("deps-diff", "--base", str(tmp_path / "nothing"), "--head", sys.executable, "--", *CELL, env=env)
    assert r.returncode == 2
    assert "not an interpreter, a virtual environment's directory or a constraints file" in r.stderr
    r = rlhfmem_cli("deps-diff", "--base", sys.executable, "--head", sys.executable, "--", "replay", "x", env=env)
    assert r.returncode == 2 and "after --: run or capture and its arguments" in r.stderr
    r = rlhfmem_cli("deps-diff", "--base", sys.executable, "--head", sys.executable, "--", "capture", "--json", "x",
                    "--", "a.py", env=env)
    assert r.returncode == 2 and "the cell's --json is deps-diff's own" in r.stderr
    assert list(tmp.glob("rlhfmem-deps-diff-*")) == []


def test_the_ci_recipe_runs_a_command_the_cli_accepts():
    """examples/github-actions/dependency-upgrade.yml: its deps-diff line parses with rlhfmem's own parser, its cell
    with the run subcommand's, and the file it diffs against is the pinned one."""
    wf = yaml.safe_load((ROOT / "examples" / "github-actions" / "dependency-upgrade.yml").read_text())
    (line,) = [s["run"] for s in wf["jobs"]["deps-diff"]["steps"] if s.get("run", "").startswith("rlhfmem deps-diff")]
    words = line.split()
    args = build_parser().parse_args(words[1:])
    assert args.command == "deps-diff" and args.fail_on_regression
    assert (ROOT / args.head).is_file() and args.head == "constraints/deepspeed.txt"
    cell = args.cell[1:]
    assert build_parser().parse_args(cell).command == "run"
