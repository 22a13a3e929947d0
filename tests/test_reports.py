"""Reports from real CPU suite sessions: the per-PR diff (flush none vs after-inference), Figure 1 as a
PNG, memory_viz snapshots, the GitHub step summary and benchmark JSON."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "suites" / "test_deepspeed_chat_cpu.py"


def pytest_session(out: Path, k: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", str(SUITE), "-k", k, "-p", "no:cacheprovider", "-q",
                           "--benchmark-disable", *extra], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "GITHUB_STEP_SUMMARY": str(out / "step_summary.md")})


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """Two real CPU suite runs of ZeRO-2: flush none (base) and after-inference (head)."""
    out = tmp_path_factory.mktemp("reports")
    base = pytest_session(out, "zero2/flush-none", "--rlhfmem-json", str(out / "base.json"))
    head = pytest_session(out, "zero2/flush-after-inference", "--rlhfmem-json", str(out / "head.json"),
                          "--rlhfmem-snapshots", str(out / "snapshots"), "--rlhfmem-report", str(out / "report.md"),
                          "--rlhfmem-benchmark-json", str(out / "bench.json"))
    assert base.returncode == 0, base.stdout[-3000:]
    assert head.returncode == 0, head.stdout[-3000:]
    return out


def rlhfmem(*args):
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_diff_of_two_real_suite_runs_shows_what_the_flush_changed(sessions, tmp_path):
    """ZeRO-2, flush none (base) vs after inference (head): DeepSpeed's own ``empty_cache()`` calls in ``init``
    (ZeRO-2's flattening, ``stage_1_and_2.py``; recorded on CPU as on CUDA) already release what the inference
    flushes would, so at tiny scale nothing moves beyond the threshold, and the report says so. A regression is
    flagged: the same head against a base whose fragmentation figure is 8 MiB lower (the noise floor is 4 MiB)."""
    p = rlhfmem("diff", str(sessions / "base.json"), str(sessions / "head.json"), "--ignore-flush")
    assert p.returncode == 0, p.stderr
    md = p.stdout
    assert md.startswith("# RLHF memory diff")
    assert "0 regressed" in md.splitlines()[2] and "1 unchanged" in md.splitlines()[2] and "threshold 5%" in md
    assert "| device | cpu | cpu |" in md and "simulated" in md
    assert "No metric moved beyond the threshold" in md.split("## Changes")[1].split("<details>")[0]
    assert "<details><summary>All metrics</summary>" in md
    j = json.loads(rlhfmem("diff", str(sessions / "base.json"), str(sessions / "head.json"), "--ignore-flush",
                           "--format", "json").stdout)
    row = next(r for r in j["rows"] if r["metric"] == "fragmentation_at_peak")
    assert row["head"] == row["base"] > 0 and j["verdict"]["regressed"] == 0
    lowered = json.loads((sessions / "base.json").read_text())
    lowered["results"][0]["metrics"]["fragmentation_at_peak"] -= 8 * 2**20
    (tmp_path / "lowered.json").write_text(json.dumps(lowered))
    worse = rlhfmem("diff", str(tmp_path / "lowered.json"), str(sessions / "head.json"), "--ignore-flush")
    changes = worse.stdout.split("## Changes")[1].split("<details>")[0]
    assert "fragmentation_at_peak" in changes and "🔴 regressed" in changes
    assert rlhfmem("diff", str(tmp_path / "lowered.json"), str(sessions / "head.json"), "--ignore-flush",
                   "--fail-on-regression").returncode == 1
    same = rlhfmem("diff", str(sessions / "base.json"), str(sessions / "base.json"), "--fail-on-regression")
    assert same.returncode == 0 and "0 regressed" in same.stdout


def test_diff_against_a_budget_file_and_bad_inputs(sessions, tmp_path):
    p = rlhfmem("diff", str(REPO / "baselines/cpu/deepspeed_chat_cpu.yaml"), str(sessions / "head.json"))
    assert p.returncode == 0 and "1 unchanged" in p.stdout and "13 missing" in p.stdout
    assert "| host aten_cpu_capability |" in p.stdout  # what of the host could move a figure, both sides
    # a budget recorded on another CPU: the diff names the property that differs
    import yaml

    data = yaml.safe_load((REPO / "baselines/cpu/deepspeed_chat_cpu.yaml").read_text())
    for e in data["entries"].values():
        e["host_cpu"]["aten_cpu_capability"] = "OTHER-ISA"
    (tmp_path / "other_cpu.yaml").write_text(yaml.safe_dump(data))
    p = rlhfmem("diff", str(tmp_path / "other_cpu.yaml"), str(sessions / "head.json"))
    assert "**Environments differ**" in p.stdout and "host aten_cpu_capability: base OTHER-ISA vs head " in p.stdout
    (tmp_path / "x.json").write_text("[1, 2]")
    bad = rlhfmem("diff", str(tmp_path / "x.json"), str(sessions / "head.json"))
    assert bad.returncode == 2 and bad.stderr.startswith("rlhfmem: error:") and "x.json" in bad.stderr
    bad = rlhfmem("diff", str(sessions / "base.json"), str(sessions / "head.json"), "--threshold", "lots")
    assert bad.returncode == 2 and "expected a percentage" in bad.stderr


def test_plugin_report_and_github_step_summary(sessions):
    md = (sessions / "report.md").read_text()
    assert "# RLHF memory diff" in md and "`deepspeed-chat/tiny-opt/zero2/flush-after-inference/x2`" in md
    assert json.loads((sessions / "report.json").read_text())["verdict"]["unchanged"] == 1
    assert "# RLHF memory diff" in (sessions / "step_summary.md").read_text()
    bench = json.loads((sessions / "bench.json").read_text())
    assert {b["unit"] for b in bench} == {"bytes", "count"}
    assert any(b["name"].endswith("peak_reserved") and b["value"] > 0 for b in bench)


def test_plot_of_a_real_run_is_a_readable_png(sessions, tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    out = tmp_path / "fig1.png"
    p = rlhfmem("plot", str(sessions / "base.json"), str(sessions / "head.json"), "-o", str(out))
    assert p.returncode == 0, p.stderr
    img = mpimg.imread(out)
    assert img.shape[0] >= 500 and img.shape[1] >= 1000  # 11 x 5.5 in at 110 dpi
    rgb = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours = {tuple(c) for c in rgb[:: max(1, len(rgb) // 200000)]}
    assert len(colours) > 50  # lines, bands, text: not blank
    red = np.sum((rgb[:, 0] > 150) & (rgb[:, 1] < 90) & (rgb[:, 2] < 90))  # the reserved curve
    assert red > 200
    single = rlhfmem("plot", str(sessions / "head.json"), "-o", str(tmp_path / "one.png"))
    assert single.returncode == 0


def test_exported_simulated_snapshot_loads_in_memory_viz(sessions):
    from torch.cuda import _memory_viz

    files = sorted((sessions / "snapshots").glob("*.pickle"))
    assert len(files) == 2  # one per rank
    snap = pickle.loads(files[0].read_bytes())
    assert snap["allocator_settings"]["rlhfmem_capture"] == "cpu-trace-simulated"
    assert "simulated" in snap["allocator_settings"]["rlhfmem_note"]
    html = _memory_viz.trace_plot(snap)
    assert len(html) > 10000 and "Active Memory Timeline" in html
    assert "cudaMalloc(" in _memory_viz.trace(snap) and "Allocator State History" in _memory_viz.segment_plot(snap)
    # blocks lie inside their segments: the export is the replayed trace, not raw CPU pointers
    seg = [(s["address"], s["address"] + s["total_size"]) for s in snap["segments"]]
    for b in (b for s in snap["segments"] for b in s["blocks"]):
        assert any(lo <= b["address"] < hi for lo, hi in seg)
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_completed", "segment_alloc"} <= actions
    assert "total_reserved" in subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats",
                                               str(files[0])], capture_output=True, text=True).stdout
    # our own reader takes it back and the model replays it to the same end state
    from pytest_rlhfmem.memory.replay import replay
    from pytest_rlhfmem.memory.trace import load_snapshot, trace_from_snapshot

    result = replay(trace_from_snapshot(load_snapshot(files[0])), mode="anchored")
    assert result.final_reserved == sum(s["total_size"] for s in snap["segments"])
