"""The CI recipes work as written. They are files under examples/github-actions/ (the README shows one of them as
a generated block, so the README cannot drift from the files: tests/test_generated_tables.py): each parses, has the
jobs it promises, runs only tox environments, plugin options and files that exist, records budgets only through a
pull request, and its GPU jobs collect only gpu-marked cells of the DeepSpeed-Chat suites (an old recipe,
``pytest suites --gpu-marker=require``, collected the opt-in suites and the ColossalChat cells, which fail without
their own environments)."""

import configparser
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from doctables.options import plugin_options

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "examples" / "github-actions"
JOBS = {"own-trainer.yml": {"cpu", "gpu"}, "rerecord-baselines.yml": {"record-cpu", "record-gpu"},
        "rlhfmem.yml": {"cpu", "cpu-suites", "gpu-1", "gpu-4"}, "dependency-upgrade.yml": {"deps-diff"},
        "release.yml": {"build", "publish"}}
GPU_JOBS = {("own-trainer.yml", "gpu"), ("rerecord-baselines.yml", "record-gpu"), ("rlhfmem.yml", "gpu-1"),
            ("rlhfmem.yml", "gpu-4")}


def _load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _steps():
    """(workflow, job, step) for every step of every workflow."""
    for name in JOBS:
        for job, spec in _load(name)["jobs"].items():
            for step in spec["steps"]:
                yield name, job, step


def _words(line: str) -> list[str]:
    """The command's words; an ``${{ a && '--x' || '--y' }}`` expression counts as the options it can expand to."""
    exprs = re.findall(r"\$\{\{(.*?)\}\}", line)
    return shlex.split(re.sub(r"\$\{\{.*?\}\}", "", line)) + [w for e in exprs for w in re.findall(r"'(--[^']+)'", e)]


def _tox_envs() -> set[str]:
    cp = configparser.ConfigParser(interpolation=None)
    cp.read(ROOT / "tox.ini")
    return {s.split(":", 1)[1] for s in cp.sections() if s.startswith("testenv:")} | {"py"}


def test_every_workflow_parses_and_has_its_jobs():
    assert {p.name for p in WORKFLOWS.glob("*.yml")} == set(JOBS)
    for name, jobs in JOBS.items():
        wf = _load(name)
        assert set(wf["jobs"]) == jobs, name
        for job, spec in wf["jobs"].items():
            labels = spec["runs-on"] if isinstance(spec["runs-on"], list) else [spec["runs-on"]]
            on_gpu = any(lab.startswith("gpu") for lab in labels)
            assert on_gpu == ((name, job) in GPU_JOBS), f"{name}: job {job} runs on {labels}"


def test_budgets_are_recorded_only_through_a_pull_request():
    """Every step that runs --rlhfmem-update-baselines is followed, in its job, by a create-pull-request step that adds
    baselines/; the workflow is started by hand (workflow_dispatch); pull requests only check."""
    for name in JOBS:
        wf = _load(name)
        triggers = wf[True]  # YAML reads the key `on` as True
        for job, spec in wf["jobs"].items():
            # (a step that records in a directory of its own, outside the checkout, writes no budget of the repository)
            runs = [i for i, s in enumerate(spec["steps"])
                    if "--rlhfmem-update-baselines" in s.get("run", "") and "cd ../" not in s.get("run", "")]
            if not runs:
                continue
            assert "workflow_dispatch" in triggers, f"{name}: records budgets but cannot be started by hand"
            prs = [s for s in spec["steps"][runs[-1]:]
                   if s.get("uses", "").startswith("peter-evans/create-pull-request")]
            assert prs and prs[0]["with"]["add-paths"].startswith("baselines/"), f"{name}: {job} records without a PR"
    assert "pull_request" not in _load("rerecord-baselines.yml")[True]


def test_every_option_tox_environment_and_file_named_exists():
    flags = {o["flag"] for o in plugin_options()}
    envs = _tox_envs()
    named = 0
    for name, job, step in _steps():
        words = _words(step.get("run", ""))
        copied = {Path(w).name for w in words if (ROOT / w).is_file()} if "cp" in words else set()
        for w in words:
            if w.startswith(("--rlhfmem", "--gpu-marker")):
                assert w.split("=", 1)[0] in flags, f"{name}: {job} passes {w}, which the plugin lacks"
                named += 1
            if w.endswith(".py") or w.startswith("suites/"):  # a file of the checkout, or one the line copied
                assert (ROOT / w).is_file() or w in copied, f"{name}: {job} names {w}, which does not exist"
        if "tox" in words and "-e" in words:
            for env in words[words.index("-e") + 1].split(","):
                assert env in envs, f"{name}: {job} runs tox -e {env}, which tox.ini lacks"
    assert named >= 10


@pytest.mark.parametrize("job", ["gpu-1", "gpu-4"])
def test_a_gpu_job_collects_only_gpu_marked_deepspeed_chat_cells(job):
    (line,) = [s["run"] for n, j, s in _steps() if n == "rlhfmem.yml" and j == job and "gpu-suite" in s.get("run", "")]
    words = _words(line)
    args = words[words.index("--") + 1:]
    suites = [w for w in args if w.startswith("suites/")]
    assert suites and all("colossal" not in s and s.endswith(("_gpu1.py", "_study.py")) for s in suites)
    k = ["-k", args[args.index("-k") + 1]] if "-k" in args else []

    def collect(marks: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               *suites, *k, "-m", marks], cwd=ROOT, capture_output=True, text=True)

    assert collect("not gpu").returncode == 5, "the GPU job collects a test that is not gpu-marked"
    gpu = collect("gpu")
    assert gpu.returncode == 0 and re.search(r"^(\d+/)?\d+ tests? collected", gpu.stdout, re.M), gpu.stdout[-500:]


def test_the_readme_shows_the_own_trainer_workflow_and_links_the_others():
    readme = (ROOT / "README.md").read_text()
    assert "<!-- generated: python -m doctables.include examples/github-actions/own-trainer.yml -->" in readme
    for name in ("rerecord-baselines.yml", "rlhfmem.yml", "dependency-upgrade.yml"):
        assert f"(examples/github-actions/{name})" in readme


def _readme_install_lines() -> set[str]:
    """The arguments of the README's ``pip install`` lines (its install and quick-start blocks)."""
    out = set()
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.search(r"pip install (.+?)\s*(?:#|$)", line)
        if m:
            out.add(m[1].strip())
    return out


def test_every_recipe_installs_torch_and_the_package_as_the_readme_does():
    """A workflow installs pytest-rlhfmem with one of the README's own lines (from the checkout, or the wheel built
    from it) and torch with the README's line for its runner: a copied recipe cannot drift from the documented
    install (the recipes installed ``pytest-rlhfmem[plot]`` from PyPI, where it has never been published)."""
    readme = _readme_install_lines()
    installs = 0
    for name, job, step in _steps():
        for m in re.finditer(r"python -m pip install (.+?)\s*(?:#.*)?$", step.get("run", ""), re.M):
            arg = m[1].strip()
            if arg == "build twine" or not ("[plot]" in arg or arg.startswith("torch")):
                continue  # the release's own tools; another workflow's own packages
            assert arg in readme, f"{name}: {job} installs with `pip install {arg}`, a line the README lacks"
            installs += "[plot]" in arg
    assert installs >= 5
    assert not any(a.startswith(('"pytest-rlhfmem[', "pytest-rlhfmem")) for a in readme), "not on PyPI yet"


def test_the_release_workflow_builds_checks_and_publishes_with_trusted_publishing():
    wf = _load("release.yml")
    assert wf[True]["push"]["tags"] == ["v*"] and "workflow_dispatch" in wf[True]
    build, publish = wf["jobs"]["build"], wf["jobs"]["publish"]
    runs = [s.get("run", "") for s in build["steps"]]
    assert "python -m build" in runs and any(r.startswith("python -m twine check") for r in runs)
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in build["steps"])
    assert publish["needs"] == "build" and publish["if"] == "startsWith(github.ref, 'refs/tags/v')"
    assert publish["permissions"] == {"id-token": "write"} and publish["environment"] == "pypi"
    (pub,) = [s for s in publish["steps"] if s.get("uses", "").startswith("pypa/gh-action-pypi-publish")]
    assert not set(pub.get("with") or {}) & {"password", "user"}, "trusted publishing needs no token"


def test_the_release_tag_check_reads_the_version_of_pyproject():
    (step,) = [s for n, j, s in _steps() if n == "release.yml" and "tomllib" in s.get("run", "")]
    code = re.search(r"python -c\s+'(.+?)'", step["run"], re.S)[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(r"\d+\.\d+\.\d+\n", out), out
