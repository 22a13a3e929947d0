"""The README's CI recipes work as written: each YAML block parses, every tox environment it runs exists in tox.ini,
every suite it names exists, and the GPU jobs collect only GPU cells of the DeepSpeed-Chat suites (the old recipe,
``pytest suites --gpu-marker=require``, collected the opt-in suites and the ColossalChat cells, which fail without
their own environments)."""

import configparser
import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = README[README.index("## CI\n"):README.index("\n## ", README.index("## CI\n") + 1)]


def _blocks() -> list:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", CI, re.S)]


def _tox_envs() -> set[str]:
    cp = configparser.ConfigParser(interpolation=None)
    cp.read(ROOT / "tox.ini")
    return {s.split(":", 1)[1] for s in cp.sections() if s.startswith("testenv:")} | {"py"}


def _run_lines() -> list[str]:
    out = []
    for block in _blocks():
        steps = block if isinstance(block, list) else [s for job in block["jobs"].values() for s in job["steps"]]
        out += [s["run"] for s in steps if "run" in s]
    return out


def test_every_ci_block_parses_and_has_a_job_per_gpu_count():
    blocks = _blocks()
    assert len(blocks) == 2
    jobs = blocks[1]["jobs"]
    assert set(jobs) == {"gpu-1", "gpu-4"}
    assert "workflow_dispatch" in blocks[1][True]  # YAML reads the key `on` as True


def test_every_command_names_an_existing_tox_env_and_suite():
    envs = _tox_envs()
    lines = _run_lines()
    assert any("gpu-suite" in line for line in lines)
    for line in lines:
        words = shlex.split(re.sub(r"\$\{\{.*?\}\}", "", line))
        if "tox" in words and "-e" in words:
            for env in words[words.index("-e") + 1].split(","):
                assert env in envs, f"README's CI runs tox -e {env}, which tox.ini lacks"
        for w in words:
            if w.startswith("suites/"):
                assert (ROOT / w).is_file(), f"README's CI names {w}, which does not exist"
                assert "colossal" not in w and w.endswith(("_gpu1.py", "_study.py"))
