"""The one-GPU suites (issue 35): their matrices (``suites/matrices.yaml``), the simulated twins' cells and budget
files, and a real pytest session in which every one-GPU cell skips naming the card it needs."""

import shutil
from pathlib import Path

import pytest

from pytest_rlhfmem.budgets import load_budget_file
from pytest_rlhfmem.matrix import load_matrix
from pytest_rlhfmem.rlhf.scenario import COLOSSAL_STRATEGIES

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
MATRICES = ROOT / "suites" / "matrices.yaml"
STRATEGIES = ("none", "zero2", "zero3", "zero3-offload", "grad-ckpt", "all")
FLUSH = ("none", "after-inference")


def _params(name: str) -> list:
    return load_matrix(name, MATRICES)


def _ids(*names: str) -> set[str]:
    return {p.id for name in names for p in _params(name)}


def _cells(framework: str, models: tuple[str, ...], strategies: tuple[str, ...]) -> set[str]:
    return {f"{framework}/{m}/{s}/flush-{f}/x1" for m in models for s in strategies for f in FLUSH}


def _gpu_marks(name: str) -> list[dict]:
    return [{**m.kwargs} for p in _params(name) for m in p.marks if m.name == "gpu"]


@pytest.mark.parametrize("name, models, strategies, min_gb", [
    ("deepspeed_chat_gpu1", ("tiny-opt", "opt-125m"), STRATEGIES, 16),
    ("deepspeed_chat_gpu1_study", ("opt-1.3b",), STRATEGIES, 80),
    ("colossalchat_gpu1", ("tiny-opt", "opt-125m"), COLOSSAL_STRATEGIES, 16),
])
def test_one_gpu_matrix_holds_its_cells_each_a_one_card_gpu_test(name, models, strategies, min_gb):
    framework = "colossalchat" if name.startswith("colossalchat") else "deepspeed-chat"
    assert _ids(name) == _cells(framework, models, strategies)
    assert _gpu_marks(name) == [{"count": 1, "min_memory_gb": min_gb}] * len(_params(name))
    assert all(not p.values[0].overrides for p in _params(name))  # the pair's defaults, as a GPU user runs them


def test_cpu_twins_are_the_one_gpu_cells_on_cpu():
    """The CPU route runs deepspeed_chat_gpu1's cells, no more, no fewer, with nothing a GPU run lacks."""
    assert _ids("deepspeed_chat_gpu1_cpu", "deepspeed_chat_gpu1_cpu_mid") == _ids("deepspeed_chat_gpu1")
    assert {p.values[0].models for p in _params("deepspeed_chat_gpu1_cpu")} == {"tiny-opt"}  # the default run's
    for name in ("deepspeed_chat_gpu1_cpu", "deepspeed_chat_gpu1_cpu_mid"):
        assert _gpu_marks(name) == [] and all(not p.values[0].overrides for p in _params(name))


def test_every_matrix_names_gpu_memory_in_gb():
    """The study's cards were sold as 24 GB (RTX 3090) and 40 GB (A100): ``min_memory_gb``, not binary GiB."""
    import yaml

    for name, m in yaml.safe_load(MATRICES.read_text()).items():
        gpu = (m.get("marks") or {}).get("gpu") or {}
        assert "min_memory_gib" not in gpu, name
        if gpu.get("count") == 4:
            assert gpu.get("min_memory_gb") in (24, 40), name


# OPT-1.3b `all` on the fake-CUDA route: killed by the kernel on the 24 GiB machine that recorded the file (its worker
# holds the whole pair's optimizer state at world size 1); the suite skips it below 24 GiB available, naming that.
# OPT-125m zero3-offload and all on the CPU route: removed when the route began to copy offloaded parameters at their
# fetch (rlhf/deepspeed_chat: copy_offloaded_fetches), not yet recorded again (the file's notes say how)
UNRECORDED = {"deepspeed_chat_gpu1_fakecuda_study": {f"deepspeed-chat/opt-1.3b/all/flush-{f}/x1" for f in FLUSH},
              "deepspeed_chat_gpu1_cpu_mid": {f"deepspeed-chat/opt-125m/{s}/flush-{f}/x1"
                                              for s in ("zero3-offload", "all") for f in FLUSH}}


@pytest.mark.parametrize("budget, names", [
    ("deepspeed_chat_gpu1_cpu", ("deepspeed_chat_gpu1_cpu",)),
    ("deepspeed_chat_gpu1_cpu_mid", ("deepspeed_chat_gpu1_cpu_mid",)),
    ("deepspeed_chat_gpu1_fakecuda", ("deepspeed_chat_gpu1:tiny-opt",)),
    ("deepspeed_chat_gpu1_fakecuda_mid", ("deepspeed_chat_gpu1:opt-125m",)),
    ("deepspeed_chat_gpu1_fakecuda_study", ("deepspeed_chat_gpu1_study",)),
])
def test_twin_budget_file_holds_exactly_its_cells(budget, names):
    """Each twin's budget file (``baselines/cpu/``) has one entry per cell of its test, each of its capture."""
    ids = set()
    for spec in names:
        name, _, models = spec.partition(":")
        ids |= {p.id for p in _params(name) if not models or p.values[0].models == models}
    ids -= UNRECORDED.get(budget, set())
    bf = load_budget_file(ROOT / "baselines" / "cpu" / f"{budget}.yaml")
    assert set(bf.entries) == ids
    capture = "sim-cuda-simulated" if "fakecuda" in budget else "cpu-trace-simulated"
    assert {e.capture for e in bf.entries.values()} == {capture}
    assert {e.raw["world_size"] for e in bf.entries.values()} == {1}


def test_one_gpu_cells_skip_naming_the_card_they_need(pytester, monkeypatch):
    """A real session of the two GPU suites on a machine without a visible CUDA device: every cell skips, each
    saying it needs one CUDA device; none runs, none fails."""
    for rel in ("conftest.py", "suites/matrices.yaml", "suites/test_deepspeed_chat_gpu1.py",
                "suites/test_colossalchat_gpu1.py"):
        (pytester.path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, pytester.path / rel)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a GPU machine runs this test as one without a card
    r = pytester.runpytest_subprocess("suites", "-rs", "-p", "no:cacheprovider")
    r.assert_outcomes(skipped=24 + 12 + 28)
    skips = [line for line in r.outlines if line.startswith("SKIPPED")]
    assert skips and all("gpu: needs 1 CUDA device(s)" in line and "found no CUDA device" in line
                         for line in skips), skips
