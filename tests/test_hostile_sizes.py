"""Issue 47 item 6: sizes a snapshot can hold, and a worker that dies, make no command crash, hang or lie.

Before: one allocation of 92 GiB or more under ``expandable_segments:True`` was signal 11 in the compiled core (an
AssertionError in the Python model); sizes near 2**63 overflowed the core's int64 sums ("peak reserved 2.00 MiB",
"final reserved -8388608 TiB", exit 0) while the Python model computed them; ``rlhfmem advise`` on such a snapshot
segfaulted with one process and hung for ever with its pool (the dead worker's job lost, SIGINT ignored). Now a
request larger than an expandable segment's whole address space fails as an OOM, as on the device, in both engines;
both engines refuse, in the same one line and at the same event, what is beyond the replay's stated bounds
(``memory/replay_types.py``: 2**48 bytes for a request, a segment, a capacity or the bytes reserved at once; 2**60
for a recorded segment address; +-2**62 for a time; 2**62 for the model's own addresses); advise's pool fails in one
line when a worker dies and stops at once on Ctrl-C. The crash-prone probes run in a subprocess, so that the old
code fails the test rather than the run."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_rlhfmem.memory.allocator import AllocatorConfig
from pytest_rlhfmem.memory.columns import columns_from_trace
from pytest_rlhfmem.memory.replay import FREE_RUNNING, replay
from pytest_rlhfmem.memory.replay_engine import BOUNDS, COMPILED, PYTHON, core_bounds
from pytest_rlhfmem.memory.replay_types import ReplayError
from pytest_rlhfmem.memory.trace import (
    ALLOC, FLUSH, FREE, OOM, Event, SegmentState, Trace, snapshot_columns_for_replay,
)
from pytest_rlhfmem.memory.trace_io import load_columns, save_trace

GiB = 2**30
MiB = 2**20
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) for the compiled core")


def _snapshot(tmp_path: Path, name: str, size: int, settings: dict | None = None) -> Path:
    """A snapshot of one allocation of ``size`` bytes, freed."""
    entries = [{"action": "alloc", "addr": 4096, "size": size, "stream": 0, "time_us": 1},
               {"action": "free_requested", "addr": 4096, "size": size, "stream": 0, "time_us": 2},
               {"action": "free_completed", "addr": 4096, "size": size, "stream": 0, "time_us": 2}]
    snap = {"segments": [], "device_traces": [entries], **({"allocator_settings": settings} if settings else {})}
    p = tmp_path / f"{name}.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    return p


def _rlhfmem(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _one_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhfmem: error: "), p.stderr[-2000:]
    return lines[0]


def _both(trace: Trace | object, config: AllocatorConfig | None = None, capacity: int | None = None) -> str:
    """The one ReplayError both engines raise for ``trace`` (equal messages), or a failure."""
    messages = []
    for engine in (PYTHON, COMPILED):
        with pytest.raises(ReplayError) as exc:
            replay(trace, config, FREE_RUNNING, capacity=capacity, record_series=False, engine=engine)
        messages.append(str(exc.value))
    assert messages[0] == messages[1], messages
    assert "\n" not in messages[0]
    return messages[0]


@needs_gxx
def test_an_allocation_past_an_expandable_segments_address_space_is_an_oom_in_both_engines(tmp_path):
    """92 GiB under expandable segments: more than the 90 GiB of address space a segment of the assumed 80 GiB
    device reserves, so the device could not map it: an OOM (was signal 11); with the H200's 141 GiB it fits."""
    snap = _snapshot(tmp_path, "expandable_92gib", 92 * GiB, {"expandable_segments": True})
    p = _rlhfmem("replay", str(snap), "--free-running", "--json", "--engine", COMPILED)  # a subprocess: it crashed
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    sim = json.loads(p.stdout)["simulated"]
    assert (sim["ooms"], sim["peak_reserved"], sim["final_reserved"]) == (1, 0, 0), sim
    cols, recorded = snapshot_columns_for_replay(str(snap))
    config = AllocatorConfig.from_snapshot_settings(recorded.allocator_settings)
    pages = -(-92 * GiB // (20 * MiB)) * 20 * MiB  # the large pool's 20 MiB pages that back 92 GiB
    for capacity, ooms, peak in ((None, 1, 0), (141 * GiB, 0, pages)):
        py, cc = (replay(cols, config, FREE_RUNNING, capacity=capacity, record_series=False, engine=e)
                  for e in (PYTHON, COMPILED))
        assert (py.total.ooms, py.total.peak_reserved) == (cc.total.ooms, cc.total.peak_reserved) == (ooms, peak)
        assert py.segment_maps == cc.segment_maps


@needs_gxx
@pytest.mark.parametrize("size", [2**63 - 2**20, 2**62, 2**48 + 1])
def test_a_size_past_the_bound_is_the_same_one_line_from_both_engines(tmp_path, size):
    """Sizes a snapshot holds (0..2**63-1) past 2**48 bytes: refused before anything replays (the core summed
    2**63 - 1 MiB into "final reserved -8388608 TiB" with exit 0)."""
    snap = _snapshot(tmp_path, "huge", size)
    cols, _ = snapshot_columns_for_replay(str(snap))
    msg = _both(cols)
    assert msg == (f"{snap}: event 0 (alloc): size {size} is out of range (0 to 2**48 bytes (256 TiB), the replay's "
                   "bound)")
    if size == 2**63 - 2**20:  # the command says it too, in one line
        assert _one_line(_rlhfmem("replay", str(snap), "--anchored")) == f"rlhfmem: error: {msg}"


@needs_gxx
def test_the_bound_itself_replays_to_the_same_figures():
    """2**48 bytes, the largest request: both engines, exact figures (a cudaMalloc of exactly that)."""
    trace = Trace(events=[Event(ALLOC, 4096, 2**48, 0, 1), Event(FREE, 4096, 0, 0, 2)])
    py, cc = (replay(trace, None, FREE_RUNNING, record_series=False, engine=e) for e in (PYTHON, COMPILED))
    assert py.total.peak_reserved == cc.total.peak_reserved == 2**48
    assert py.segment_allocs == cc.segment_allocs and py.final_reserved == cc.final_reserved == 2**48


@needs_gxx
def test_the_models_own_bounds_stop_both_engines_at_the_same_event():
    """Reserved bytes past 2**48 (three live 2**47 requests), and new segments' addresses past 2**62 (16,128 flushed
    2**48 segments, each placed above the last): the same line at the same event from both engines."""
    three = Trace(events=[Event(ALLOC, a, 2**47, 0, a) for a in (1, 2, 3, 4)], source="three.pickle")
    assert _both(three) == ("three.pickle: event 2 (alloc): the model reserves 422212465065984 bytes, out of range "
                            "(0 to 2**48 bytes (256 TiB), the replay's bound)")
    events = []
    for k in range(16_200):
        events += [Event(ALLOC, 4096, 2**48, 0, k), Event(FREE, 4096, 0, 0, k), Event(FLUSH, 0, 0, 0, k)]
    msg = _both(columns_from_trace(Trace(events=events, source="cycles")))
    # (2**62 - 2**56) / (2**48 + 2 MiB) = 16127.9...: the 16,128th segment (event 3 x 16,127) passes it
    assert msg.startswith("cycles: event 48381 (alloc): the model's new segments' addresses pass 2**62"), msg


@needs_gxx
def test_times_capacities_and_earlier_segments_past_the_bounds_are_one_line_from_both_engines(tmp_path):
    # a time past 2**62 us, whose .rlhftrace delta sum overflows int64 in the core (saturated, then refused)
    f = save_trace(tmp_path / "t.rlhftrace", Trace(events=[Event(ALLOC, 1, 512, 0, 2**62),
                                                          Event(FREE, 1, 0, 0, 2**63)], source="t"))
    cols, _ = load_columns(f)
    assert _both(cols) == ("t: event 1 (free): time_us is out of range (-2**62 to 2**62 microseconds, the replay's "
                           "bound)")
    # -2**62 - 2**63 would wrap to 2**62, back in range: the core's sum saturates instead
    f = save_trace(tmp_path / "n.rlhftrace", Trace(events=[Event(ALLOC, 1, 512, 0, -2**62),
                                                          Event(FREE, 1, 0, 0, -2**62 - 2**63)], source="n"))
    cols, _ = load_columns(f)
    assert _both(cols).startswith("n: event 1 (free): time_us is out of range")
    # a capacity inferred from an oom entry's free bytes (2**62 + 0 reserved)
    oom = Trace(events=[Event(OOM, 2**62, MiB, 0, 1)], source="oom")
    assert _both(oom) == ("oom: device capacity 4611686018427387904 bytes is out of range (-2**48 to 2**48 bytes, the "
                          "replay's bound)")
    # a segment that existed before the trace, at 2**61
    seg = Trace(events=[Event(ALLOC, 1, 512, 0, 1)], initial_segments=[SegmentState(2**61, 2 * MiB, 0, False, [])],
                source="seg")
    assert _both(seg) == ("seg: segment 0 that existed before the trace: address 2305843009213693952 is out of range "
                          "(0 to 2**60, the replay's bound)")


@needs_gxx
def test_the_core_reports_the_bounds_python_states():
    assert core_bounds() == BOUNDS


# -- advise: the snapshot, a worker that dies, Ctrl-C ---------------------------------------------------------------

@needs_gxx
def test_advise_on_a_snapshot_past_the_bound_is_one_line_with_its_pool(tmp_path):
    """Was: a segfault with one process, a hang with the default pool of two."""
    snap = _snapshot(tmp_path, "huge", 2**63 - 2**20)
    line = _one_line(_rlhfmem("advise", str(snap), "--processes", "2", timeout=120))
    assert f"{snap}: event 0 (alloc): size 9223372036853727232 is out of range" in line


_DRIVER = """
import os, signal, sys, time
from pytest_rlhfmem.advise import evaluation
from pytest_rlhfmem.cli import main

def replay_one(job):  # stands in for a replay: a worker that dies, or one that takes long
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGSEGV)
    with open(sys.argv[3], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(600)

evaluation._replay_one = replay_one
sys.exit(main(["advise", sys.argv[1], "--processes", "2"]))
"""


def _advise_input(tmp_path: Path) -> Path:
    snap = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096 * (i + 1), "size": MiB, "stream": 0, "time_us": i} for i in range(20)]]}
    p = tmp_path / "small.pickle"
    p.write_bytes(pickle.dumps(snap))
    return p


def test_a_replay_worker_that_dies_fails_advise_in_one_line(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.Popen([sys.executable, str(driver), str(_advise_input(tmp_path)), "die", str(tmp_path / "pids")],
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        err = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:  # the old pool: the dead worker's job lost, the parent waiting for it
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 2, err
    assert err.strip().splitlines() == ["rlhfmem: error: a replay worker process died (killed by a signal, or by the "
                                        "out-of-memory killer) while replaying the candidates; nothing was advised "
                                        "(--processes 1 replays in this process)"]


def test_ctrl_c_stops_advise_and_its_workers_at_once(tmp_path):
    driver, pids = tmp_path / "driver.py", tmp_path / "pids"
    driver.write_text(_DRIVER)
    p = subprocess.Popen([sys.executable, str(driver), str(_advise_input(tmp_path)), "sleep", str(pids)],
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        t0 = time.monotonic()
        while len(pids.read_text().split() if pids.exists() else []) < 2 and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        workers = [int(w) for w in pids.read_text().split()]
        os.kill(p.pid, signal.SIGINT)  # the parent only, as `kill -INT`
        err = p.communicate(timeout=20)[1]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130 and "Traceback" not in err, err
    time.sleep(0.2)
    assert not [w for w in workers if Path(f"/proc/{w}").exists()
                and Path(f"/proc/{w}/stat").read_text().split()[2] != "Z"], "a replay worker outlived the command"
