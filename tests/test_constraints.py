"""The pinned dependency sets (constraints/): every direct dependency of an environment is pinned, every tox
environment installs under its file, and `latest` under none. CI on a clean clone must install what the
budgets were recorded with (constraints/README.md: transformers 5.24.0 changed what DeepSpeed's Hybrid
Engine does to OPT)."""

from __future__ import annotations

import configparser
import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# constraints file -> the pyproject extras its environments install (lint: tox.ini's own deps)
SETS = {"deepspeed.txt": ("deepspeed", "test"), "colossalai.txt": ("colossalai", "test")}


def _name(requirement: str) -> str:
    """PEP 503 normalised project name of a requirement line ("Jinja2==3.1.6" -> "jinja2")."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0]).lower()


def pins(file: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints" / file).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line), f"constraints/{file}: {line!r}"
            out[_name(line)] = line.split("==", 1)[1]
    return out


def tox() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "tox.ini")
    return cfg


@pytest.mark.parametrize("file, extras", SETS.items())
def test_every_direct_dependency_is_pinned(file, extras):
    # the installed package's requirements (pyproject.toml's, as pip read them): 'name>=x; extra == "deepspeed"'
    requirements = importlib.metadata.requires("pytest-rlhfmem") or []
    wanted = {_name(r) for r in requirements
              if ";" not in r or any(f'extra == "{e}"' in r for e in extras)}
    pinned = pins(file)
    assert wanted - set(pinned) == set(), f"constraints/{file} lacks pins for these dependencies"
    assert "torch" in pinned and "+" not in pinned["torch"]  # a CUDA build of the same version satisfies it


def test_lint_tools_are_pinned():
    deps = tox()["testenv:lint"]["deps"].split()
    assert {_name(d) for d in deps} <= set(pins("lint.txt"))


# tox environment -> the constraints file it installs under (None: the newest releases)
EXPECTED = {"py": "deepspeed.txt", "suite": "deepspeed.txt", "methods-mid": "deepspeed.txt",
            "nvme": "deepspeed.txt", "study-sim": "deepspeed.txt", "study-sensitivity": "deepspeed.txt",
            "gpu1-sim": "deepspeed.txt", "gpu-suite": "deepspeed.txt", "sim-fidelity": "deepspeed.txt",
            "colocated-study": "deepspeed.txt", "sim-dist": "deepspeed.txt", "long": "deepspeed.txt",
            "incidents": "deepspeed.txt",
            "growth": "deepspeed.txt", "deps-upgrade": "deepspeed.txt",
            "colossalai": "colossalai.txt", "colossalai-suite": "colossalai.txt", "lint": "lint.txt",
            "trl": "trl.txt", "latest": None}


def test_readme_table_names_every_environment_with_its_file():
    """constraints/README.md's table (| `file` | `env`, `env` (note) |) lists each constrained environment
    under the file tox installs it with."""
    listed = {}
    for line in (ROOT / "constraints" / "README.md").read_text().splitlines():
        m = re.fullmatch(r"\|\s*`([^`]+\.txt)`\s*\|(.*)\|\s*", line)
        if m:
            for env in re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", m.group(2))):
                listed[env] = m.group(1)
    assert listed == {env: f for env, f in EXPECTED.items() if f}, "constraints/README.md's table"


def test_every_tox_environment_installs_under_its_constraints_file():
    cfg = tox()

    def constraint(section: str) -> str | None:
        setenv = cfg[section].get("setenv", "")
        if "{[testenv:colossalai]setenv}" in setenv:
            return constraint("testenv:colossalai")
        found = re.findall(r"^\s*PIP_CONSTRAINT\s*=\s*(.*)$", setenv, flags=re.M)
        if found:
            return found[-1].strip()  # the last assignment wins over an inherited {[testenv]setenv}
        return constraint("testenv") if section != "testenv" else None

    expected = EXPECTED
    envs = {s.split(":", 1)[1] for s in cfg.sections() if s.startswith("testenv:")} | {"py"}
    assert envs == set(expected), "a tox environment without a line here: say which constraints it installs under"
    for env, file in expected.items():
        value = constraint("testenv" if env == "py" else f"testenv:{env}")
        if file is None:
            assert value == "", f"{env}: installs the newest releases (PIP_CONSTRAINT empty)"
        else:
            assert value == "{toxinidir}/constraints/" + file, env
            assert (ROOT / "constraints" / file).is_file()
