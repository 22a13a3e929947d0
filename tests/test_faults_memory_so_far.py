"""Issue 38 item 4's remainder: a CPU (or cuda-sim) rank killed by a signal leaves its simulated device figures so
far. Its progress file carries, at each phase change, the peaks of the trace recorded so far replayed through the
allocator model, advanced by the rows since the last phase change (record/recorder.py: SoFar), and the failure
line shows them, labelled simulated."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import textwrap

import pytest
from helpers import rlhfmem_cli
import yaml

from pytest_rlhfmem.record import emulation
from pytest_rlhfmem.record.recorder import Recorder
from pytest_rlhfmem.memory.replay import FREE_RUNNING, replay
from pytest_rlhfmem.units import parse_size

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "deepspeed-chat/tiny-opt/zero2/flush-after-inference/x2"

KILLED = '''
    """Rank 1 is killed by SIGKILL as phase `train_actor` begins, 4 MiB of device tensors live."""
    import os, signal, time
    import torch
    import torch.distributed as dist
    import pytest_rlhfmem as rlhfmem

    dist.init_process_group("gloo")
    sync = torch.zeros(1)
    weights = torch.zeros(1024, 1024, device="cuda" if torch.cuda.is_available() else "cpu")
    with rlhfmem.phase("generate"):
        dist.all_reduce(sync)
    with rlhfmem.phase("train_actor"):
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1)
        dist.all_reduce(sync)
'''


def test_figures_so_far_equal_the_end_replay_of_the_rows_they_cover():
    """At every phase change, the incremental figures are the end derivation's (CUDA emulation, placement
    annotations, allocator model) over the recorder rows they cover: computed here afresh from the raw rows."""
    import torch

    rec = Recorder("cpu", keep_raw_rows=True)
    seen = []
    rec.on_phase = lambda name: seen.append(rec.figures_so_far())
    rec.start()
    if not rec.backend.startswith("rlhfmem CPU"):
        pytest.skip(f"the CPU allocation recorder could not be built here ({rec.backend}); no compiler")
    keep = [torch.randn(256, 256)]
    with rec.phase("generate"):
        w = torch.randn(512, 512)
        for _ in range(3):
            keep.append(w @ w * 2.0 + 1.0)
        rec.host_resident([keep[1]])  # same phase as its allocation: removed from the device trace
    rec.flush("after-generate")
    with rec.phase("train_actor"):
        del keep[2:]
        x = torch.randn(300, 700, requires_grad=True)
        (x.relu() * 3.0).sum().backward()
        keep.append(torch.empty(3 << 20, dtype=torch.uint8))
    with rec.phase("train_critic"):
        pass
    rec.stop()
    assert len(seen) == 3 and all(f is not None for f in seen), seen  # at generate, train_actor, train_critic
    assert seen[-1]["peak_reserved"] >= 3 << 20 and seen[-1]["peak_allocated"] >= 3 << 20, seen
    for figs in seen:
        trace = rec.trace_from_rows(rec.raw_rows[:figs["rows"]], emulation.EmulationSettings())
        total = replay(trace, mode=FREE_RUNNING, record_series=False).total
        assert (figs["peak_reserved"], figs["peak_allocated"]) == (total.peak_reserved, total.peak_allocated), figs


def test_the_emulation_fed_in_pieces_is_the_emulation_of_the_whole():
    """emulation.Emulator: rows taken piece by piece at its settled points are apply()'s rows, to the row."""
    marks = [(emulation.OP_BEGIN, ("mm", "caller", 1, True, ())), (emulation.OP_END, None),
             (emulation.OP_BEGIN, ("add", "caller", 0, True, (64,))), (emulation.OP_END, None), ("phase", "x")]
    rows = [(1, 10, 4, 0, 1), (2, 0, 0, 2, 1), (3, 11, 8, 0, 1), (4, 12, 16, 0, 1), (5, 12, 16, 1, 1),
            (6, 1, 0, 2, 1), (7, 4, 0, 2, 1), (8, 13, 32, 0, 1), (9, 2, 0, 2, 1), (10, 3, 0, 2, 1),
            (11, 10, 4, 1, 1), (12, 13, 32, 1, 1), (13, 14, 8, 0, 0), (14, 11, 8, 1, 1)]
    whole, report = emulation.apply(rows, marks, emulation.EmulationSettings())
    for cut in range(len(rows) + 1):
        em = emulation.Emulator(marks, emulation.EmulationSettings())
        em.feed(rows[:cut])
        first = em.take(em.settled())
        em.feed(rows[cut:])
        assert first + em.take() == whole, cut
        assert em.report.to_dict() == report.to_dict()


@pytest.mark.parametrize("device", ["cpu", "cuda-sim"])
def test_a_captured_rank_killed_by_sigkill_shows_its_simulated_device_figures_so_far(tmp_path, device):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED))
    p = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "capture", "--device", device, "--world-size", "2",
                        "--timeout", "120", "--", str(script)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)})
    assert p.returncode == 1, p.stdout + p.stderr
    failed = next(ln for ln in p.stdout.splitlines() if ln.startswith("FAILED: "))
    assert "rank 1 failed in phase 'train_actor': Crash: killed by SIGKILL" in failed, p.stdout
    mem = next(ln for ln in p.stdout.splitlines() if "memory so far" in ln)
    # was: "memory so far: host rss 312.45 MiB" (no device figure)
    assert mem.strip().startswith("memory so far (simulated): peak reserved "), p.stdout
    assert ", peak allocated 4.00 MiB (its last report, in phase 'train_actor'); host RSS " in mem, p.stdout
    assert mem.rstrip().endswith(" (measured)"), p.stdout


def _budget(metric: str) -> int:
    entry = yaml.safe_load((ROOT / "baselines/cpu/deepspeed_chat_cpu.yaml").read_text())["entries"][SCENARIO]
    return parse_size(str(entry["metrics"][metric]))


def test_a_rank_killed_in_train_actor_leaves_its_simulated_device_figures(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--device", "cpu", "--world-size",
                             "2", "--strategy", "zero2", "--flush", "after-inference", "--timeout", "400",
                             "--work-dir", str(work), "--json", str(tmp_path / "out.json")],
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)})
    t_end = time.monotonic() + 380
    prog, killed = work / "progress-rank1.json", None
    while killed is None and proc.poll() is None and time.monotonic() < t_end:
        try:
            state = json.loads(prog.read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("phase") == "train_actor":
            os.kill(state["pid"], signal.SIGKILL)
            killed = state
        time.sleep(0.02)
    out, err = proc.communicate(timeout=200)
    assert killed is not None, out + err
    assert proc.returncode == 1, out + err
    failed = next(ln for ln in out.splitlines() if ln.startswith("FAILED: "))
    assert f"{SCENARIO}: rank 1 failed in phase 'train_actor': Crash: killed by SIGKILL" in failed, out
    assert "memory so far (simulated): peak reserved " in out, out  # was: "memory so far: host rss ..."
    assert "(its last report, in phase 'train_actor'); host RSS " in out, out
    so_far = json.loads((tmp_path / "out.json").read_text())["failure"]["memory_so_far"]
    assert 0 < so_far["peak_allocated"] <= so_far["peak_reserved"], so_far
    assert so_far["peak_reserved"] <= _budget("peak_reserved"), (so_far, _budget("peak_reserved"))
    assert so_far["peak_allocated"] <= _budget("peak_allocated"), (so_far, _budget("peak_allocated"))
    assert killed["simulated"] is True and killed["device_rows"] > 0, killed


def test_a_phaseless_command_that_hangs_is_named_in_its_root_window_with_what_it_held(tmp_path):
    """Issue 47 item 9: a rank without phases is in the capture's root window ('run'), not 'startup', and its
    progress file is rewritten every few seconds (record/rank.py: the heartbeat), so a hang long after its last
    phase change reports what it holds when it hangs."""
    script = tmp_path / "holds.py"
    script.write_text("import time, torch\nweights = torch.zeros(1 << 22)\ntime.sleep(300)\n")
    r = rlhfmem_cli("capture", "--device", "cpu", "--timeout", "15", "--", sys.executable, str(script), cwd=tmp_path,
                    env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 1, r.stderr
    assert "rank 0 failed in phase 'run': Hang: hung: no result after the 15 s timeout" in r.stdout, r.stdout
    assert "peak allocated 16.00 MiB (its last report, in phase 'run'); host RSS " in r.stdout, r.stdout
