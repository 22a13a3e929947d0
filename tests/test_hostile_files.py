"""Issue 47 item 8: compressed traces and pickles bounded before they are inflated or read.

Before: a 2 MB ``.rlhftrace`` whose payload inflates to 2.1 GB was inflated whole before its header's event count
was checked against it; ``rlhfmem replay /dev/zero`` read without bound (as did advise, diff and plot of any
device or FIFO). Now the header is checked first (at most 2**28 events, no more than deflate's 1032:1 can give),
inflating stops one byte past the header's events x 37 bytes, and every input is read only from a regular file of
a stated size (a snapshot pickle 8 GiB, a trace file 4 GiB, a result JSON 1 GiB, a budget YAML 64 MiB), refused
in one line otherwise. Each probe of an unbounded read runs in a subprocess under an address-space limit and a
timeout, so that the old code fails the test without taking the machine's memory."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import tracemalloc
import zlib

import pytest

from pytest_rlhfmem.memory.trace import MAX_SNAPSHOT_BYTES
from pytest_rlhfmem.memory.trace_io import MAGIC, MAX_TRACE_FILE_BYTES, TraceFileError, load_trace
from pytest_rlhfmem.report import MAX_RESULT_JSON_BYTES

MiB = 2**20


def _trace_file(path, payload: bytes, events: int) -> None:
    head = json.dumps({"capture": "x", "source": "", "allocator_settings": None, "initial_segments": [],
                       "events": events, "actions": ["alloc"], "names": [], "payload_bytes": len(payload)}).encode()
    path.write_bytes(MAGIC + struct.pack("<HI", 1, len(head)) + head + payload)


def _zeros(n: int) -> bytes:
    c = zlib.compressobj(9)
    return b"".join([c.compress(bytes(n)), c.flush()])


def test_a_payload_that_inflates_past_its_header_is_refused_without_inflating_it(tmp_path):
    """64 MiB of zeros in 64 KiB, under a header of one event (37 bytes): refused after at most 38 bytes."""
    p = tmp_path / "bomb.rlhftrace"
    _trace_file(p, _zeros(64 * MiB), 1)
    tracemalloc.start()
    try:
        with pytest.raises(TraceFileError) as exc:
            load_trace(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(exc.value) == f"{p}: corrupt trace payload (it inflates past the 37 bytes of its 1 events)"
    assert peak < 8 * MiB, f"{peak / MiB:.1f} MiB held while refusing it"


@pytest.mark.parametrize("events, fragment", [
    (2**28 + 1, "corrupt trace header (268435457 events; a trace file holds 0 to 2**28)"),
    (10**6, "corrupt trace header (1000000 events cannot come out of"),
])
def test_a_header_past_the_bounds_is_refused_before_inflating(tmp_path, events, fragment):
    p = tmp_path / "t.rlhftrace"
    _trace_file(p, _zeros(1000), events)
    with pytest.raises(TraceFileError) as exc:
        load_trace(p)
    assert str(exc.value).startswith(f"{p}: {fragment}")


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))  # the old unbounded reads fail, not the machine


def _rlhfmem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                          timeout=60, preexec_fn=_limited)


@pytest.mark.parametrize("argv", [["replay", "{f}"], ["advise", "{f}"], ["diff", "{f}", "{f}"],
                                  ["plot", "{f}", "-o", "{tmp}/x.png"]], ids=lambda a: a[0])
def test_a_device_or_fifo_is_refused_in_one_line_not_read(tmp_path, argv):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for f in ("/dev/zero", str(fifo)) if argv[0] == "replay" else ("/dev/zero",):  # opening a FIFO would wait
        r = _rlhfmem(*(a.format(f=f, tmp=tmp_path) for a in argv))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (f, r.returncode, r.stderr[-1000:])
        assert lines[0].startswith(f"rlhfmem: error: {f}: cannot read: not a regular file"), lines


@pytest.mark.parametrize("name, limit, argv", [
    ("big.pickle", MAX_SNAPSHOT_BYTES, ["replay", "{f}"]),
    ("big.rlhftrace", MAX_TRACE_FILE_BYTES, ["replay", "{f}"]),
    ("big.json", MAX_RESULT_JSON_BYTES, ["diff", "{f}", "{f}"]),
    ("big.yaml", 64 * MiB, ["diff", "{f}", "{f}"]),
])
def test_a_file_past_its_size_bound_is_refused_before_it_is_read(tmp_path, name, limit, argv):
    """A sparse file one byte past the bound (no disk used), beginning as its format does."""
    p = tmp_path / name
    with open(p, "wb") as f:
        f.write(MAGIC if name.endswith(".rlhftrace") else b"{" if name.endswith(".json") else b"\x80\x04")
        f.truncate(limit + 1)
    r = _rlhfmem(*(a.format(f=p) for a in argv))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "refused: " in lines[0] and "is larger than a" in lines[0], \
        r.stderr[-1000:]
