"""The prepared device check (``benchmarks/gpu_check.py``, ``.ci/gpu-check``; issue 35), its CPU half.

On this machine (no CUDA device) ``run --mode cpu`` runs the real subset: one tiny-OPT cell on the CPU route and on
the fake-CUDA route, the GPU suite's pytest session for that cell (skipped by the gpu marker), and the CS336 script
at a small size on the simulated CUDA device. The tables of the directory it writes are held against the result
JSONs the product wrote; the device call that ``prepare`` prints is held against the device tool's limits."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parent.parent

CELL = gpu_check.CPU_SUBSET[0]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One real ``run --mode cpu``: (run directory, pack directory, stdout)."""
    base = tmp_path_factory.mktemp("gpu-check")
    out, pack = base / "2026-01-01-cpu-only", base / "out"
    env = {**__import__("os").environ, "RLHFMEM_GPU_CHECK_WORK": str(base / "work")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "run", "--mode", "cpu",
                           "--out", str(out), "--pack", str(pack), "--deadline-s", "300"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, pack, proc.stdout


def phase_table(readme: str, cell: str) -> dict[str, dict[str, str]]:
    """The per-phase table under ``### cell``: {phase: {column header: text}}."""
    lines = readme.splitlines()
    start = lines.index(f"### {cell}")
    head = next(i for i in range(start, len(lines)) if lines[i].startswith("| phase |"))
    header = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = {}
    for ln in lines[head + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_cpu_mode_tables_show_the_figures_of_the_result_jsons(cpu_run):
    out, _, _ = cpu_run
    readme = (out / "README.md").read_text()
    results = json.loads((out / "results.json").read_text())
    table = phase_table(readme, CELL)
    name = gpu_check.slug(CELL)
    checked = 0
    for source, raw_dir in (("cpu", "cpu"), ("fake", "fake")):
        label = dict(gpu_check.SOURCES)[source]
        raw = json.loads((out / "raw" / raw_dir / f"{name}.json").read_text())  # as the product wrote it
        figures = gpu_check.phase_figures(raw)
        assert results["cells"][CELL][source]["status"] == "ok"
        assert results["cells"][CELL][source]["figures"] == figures
        assert set(table) == set(figures) and "iteration" in table and "train_actor" in table
        for phase, row in figures.items():
            for key, title, is_size in gpu_check.METRICS:
                assert table[phase][f"{title}: {label}"] == gpu_check.figure_text(row[key], is_size), (phase, key)
                checked += 1
    # the bytes behind one figure, spelled out: the CPU route's iteration peak reserved
    raw = json.loads((out / "raw" / "cpu" / f"{name}.json").read_text())
    assert table["iteration"]["peak reserved: CPU route (simulated)"] == gpu_check.format_size(
        raw["metrics"]["peak_reserved"])
    assert checked == 2 * 5 * len(table)
    # no GPU here: every GPU column says so, and the GPU suite's session for the cell was skipped by its marker
    assert all(row[f"{title}: GPU"] == "not run: no CUDA device" for row in table.values() for _, title, _ in
               gpu_check.METRICS)
    gpu = results["cells"][CELL]["gpu"]
    assert gpu["status"] == "not run: no CUDA device" and "found no CUDA device" in gpu["detail"]
    assert "| deepspeed-chat/tiny-opt/zero2/flush-after-inference/x1 | not run: no CUDA device |" in readme


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_cpu_mode_runs_the_workload_on_the_simulated_device_and_records_each_step(cpu_run):
    out, _, stdout = cpu_run
    results = json.loads((out / "results.json").read_text())
    readme = (out / "README.md").read_text()
    (name, _, _), = gpu_check.CPU_WORKLOADS
    sim = results["workloads"][name]["sim"]
    assert sim["status"] == "ok", sim
    row = next(ln for ln in readme.splitlines() if ln.startswith(f"| {name} | cuda-sim (simulated) |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    f = sim["figures"]
    assert cells[3:8] == [gpu_check.format_size(f["peak_reserved"]), gpu_check.format_size(f["peak_allocated"]),
                          gpu_check.figure_text(f["fragmentation_at_peak"], True), str(f["cuda_malloc_count"]),
                          str(f["allocations"])]
    assert f["allocations"] > 0 and sim["snapshot_bytes"] > 0
    assert json.loads((out / sim["raw"]).read_text())["capture"] == "sim-cuda-simulated"
    steps = {s["name"]: s for s in results["steps"]}
    assert steps["build FusedAdamBuilder (DeepSpeed JIT, CUDA)"]["status"] == "not run: no CUDA device"
    assert steps["gpu-cells (suites/test_deepspeed_chat_gpu1.py)"]["status"] == "not run: no CUDA device"
    for key in ("cpu-route cells (rlhfmem run --device cpu --world-size 1)", "fake-CUDA cells (run_fake_cuda, "
                "tensors='sim')", "build + load the simulated CUDA device (fake-CUDA, cuda-sim)", "env"):
        assert steps[key]["status"] == "ok", steps[key]
        assert f"| {key} | ok | {steps[key]['wall_s']:.1f} |" in readme
    assert results["meta"]["transformers"] and results["meta"]["deepspeed"] != "not installed"
    # the traces stayed behind: their sizes are listed, the files are not in the directory
    assert any(k.endswith(".rlhftrace") for k in results["files"]) and not list(out.rglob("*.rlhftrace"))


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_the_packed_tarball_unpacks_into_docs_gpu_runs_only(cpu_run, tmp_path):
    out, pack, _ = cpu_run
    tarball = pack / gpu_check.TARBALL
    assert tarball.stat().st_size < gpu_check.PACK_LIMIT
    written = gpu_check.unpack(tarball, root=tmp_path)
    assert f"docs/gpu-runs/{out.name}/README.md" in written
    assert (tmp_path / "docs" / "gpu-runs" / out.name / "results.json").read_bytes() == \
        (out / "results.json").read_bytes()
    with tarfile.open(pack / gpu_check.LOGS_TARBALL) as tar:
        assert any(n.startswith("logs/cpu-") for n in tar.getnames())
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(__file__, arcname="pytest_rlhfmem/plugin.py")
    with pytest.raises(SystemExit, match="refusing member 'pytest_rlhfmem/plugin.py'"):
        gpu_check.unpack(bad, root=tmp_path)


def test_the_device_call_fits_the_device_tools_limits():
    call = gpu_check.device_command()
    assert len(call["command"]) <= gpu_check.COMMAND_LIMIT == 2000
    assert len(call["carry"]) <= gpu_check.CARRY_LIMIT == 8 and call["timeout_s"] <= 600
    assert "bash .ci/gpu-check" in call["command"] and "$OUT/" in call["command"]
    # every carried path is ignored by git (else it would travel twice and land in commits)
    ignored = subprocess.run(["git", "check-ignore", *[c + "/" for c in call["carry"]]], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
    assert sorted(p.rstrip("/") for p in ignored) == sorted(call["carry"])
    travel = gpu_check.travel_report()
    assert travel["total_bytes"] == travel["tree_bytes"] + sum(v["bytes"] for v in travel["carried"].values())
    assert 0 < travel["tree_bytes"] and travel["total_bytes"] < 64 * 2**20
    # the run itself ends inside the command's limit, with room for the wheel install and the packing
    assert gpu_check.DEFAULT_DEADLINE_S + 45 <= call["timeout_s"]
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "gpu-check")]).returncode == 0


def test_phase_figures_read_both_result_shapes():
    """A scenario result (phases a dict, ``metrics``) and a fake-CUDA rank result (phases a list, ``total``)."""
    row = {"peak_reserved": 4, "peak_allocated": 3, "fragmentation_at_peak": None, "cuda_malloc_count": 2,
           "alloc_retries": 0}
    scenario = {"phases": {"init": row}, "metrics": row}
    rank = {"phases": [{"phase": "init", **row}], "total": {"phase": "iteration", **row}}
    assert gpu_check.phase_figures(scenario) == gpu_check.phase_figures(rank) == {"init": row, "iteration": row}
