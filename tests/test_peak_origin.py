"""memory/peak_origin.py: what the peak's fragmentation is made of, by the phase that made each segment."""

import json
import subprocess
import sys

import pytest

from pytest_rlhfmem.memory.events import ALLOC, FREE, PHASE, Event, Trace
from pytest_rlhfmem.memory.peak_origin import peak_origin
from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.memory.trace_io import save_trace

MiB = 2**20


def _trace() -> Trace:
    return Trace(events=[Event(PHASE, name="infer"), Event(ALLOC, 1, 6 * MiB), Event(FREE, 1, 6 * MiB),
                         Event(PHASE, name="train"), Event(ALLOC, 2, 15 * MiB), Event(ALLOC, 3, 12 * MiB),
                         Event(FREE, 3, 12 * MiB), Event(FREE, 2, 15 * MiB)])


def test_inference_leaves_a_segment_that_training_fragments():
    """``infer`` makes a 20 MiB segment (CUDACachingAllocator.cpp: requests of 1-10 MiB get kLargeBuffer) and
    frees its 6 MiB; ``train`` puts 15 MiB there (5 MiB left free) and its 12 MiB request needs a new segment
    (12 MiB: above 10 MiB, rounded to 2 MiB): that cudaMalloc sets the peak (32 MiB), with the 5 MiB of the
    inference segment as its fragmentation."""
    trace = _trace()
    r = replay(trace)
    assert r.total.peak_reserved == 32 * MiB and r.total.fragmentation_at_peak == 5 * MiB
    po = peak_origin(trace, r.total.peak_reserved)
    assert (po.phase, po.segment_size, po.allocated, po.fragmentation) == ("train", 12 * MiB, 15 * MiB, 5 * MiB)
    assert po.free_by_segment_phase == {"infer": 5 * MiB}
    assert po.allocated_by_phase == {"train": 15 * MiB} and po.reserved_by_phase == {"infer": 20 * MiB}
    with pytest.raises(ValueError, match="never reserves"):
        peak_origin(trace, 33 * MiB)


def test_rlhfmem_replay_prints_it(tmp_path):
    path = save_trace(tmp_path / "t.rlhftrace", _trace())
    cmd = [sys.executable, "-m", "pytest_rlhfmem.cli", "replay", str(path), "--free-running", "--peak-origin"]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["peak_origin"]["free_by_segment_phase"] == {"infer": 5 * MiB}
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "fragmentation 5.00 MiB" in text and "infer" in text
    bad = subprocess.run(cmd[:-2] + ["--peak-origin"], capture_output=True, text=True)
    assert bad.returncode == 2 and "add --free-running" in bad.stderr and len(bad.stderr.splitlines()) == 1
