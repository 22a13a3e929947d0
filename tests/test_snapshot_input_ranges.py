"""Snapshot input out of the allocator's range (issue 38, item 8): a number past int64 (size >= 2**63) and a live
address allocated again (a duplicate ``alloc`` or ``segment_alloc``) are one line each naming the file and the
entry, with both readers (Python's unpickler, ``memory/trace.py``; the compiled one, ``memory/csrc/
snapshot_reader.cpp``, which declines them so Python's path gives the line) and through ``rlhfmem replay``.
Before: a 39-46-line traceback (OverflowError, then StopIteration) for the numbers; the duplicates replayed
silently (exit 0)."""

import os
import pickle
import subprocess
import sys

import pytest

from pytest_rlhfmem.memory import snapshot_reader
from pytest_rlhfmem.memory.allocator import AllocatorConfig
from pytest_rlhfmem.memory.trace import (
    SnapshotError, columns_from_snapshot, load_snapshot, load_snapshot_columnar, trace_from_snapshot,
)

MIB = 1 << 20


def _alloc(addr, size, t, action="alloc"):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t}


def _snap(*entries):
    return {"segments": [], "device_traces": [list(entries)]}


OUT_OF_RANGE = {
    "size_2_63": (_snap(_alloc(4096, 1000, 1), _alloc(8192, 2**63, 2)),
                  "device 0 trace entry 1 (alloc): size 9223372036854775808 is out of range (0 to 2**63-1)"),
    "size_2_64": (_snap(_alloc(4096, 2**64, 1)),
                  "device 0 trace entry 0 (alloc): size 18446744073709551616 is out of range (0 to 2**63-1)"),
    "addr_2_63": (_snap({"action": "snapshot"}, _alloc(2**63, 512, 1)),
                  "device 0 trace entry 1 (alloc): addr 9223372036854775808 is out of range (0 to 2**63-1)"),
    "time_2_70": (_snap(_alloc(4096, 512, 2**70)), "trace entry 0 (alloc): time_us 1180591620717411303424 is out"),
    "oom_free_2_63": (_snap({"action": "oom", "device_free": 2**63, "size": MIB, "stream": 0, "time_us": 1}),
                      "trace entry 0 (oom): device_free 9223372036854775808 is out of range"),
}
DUPLICATE = {
    "alloc": (_snap(_alloc(4096, 512, 1), _alloc(8192, 512, 2), _alloc(4096, 512, 3)),
              "device 0 alloc #2 of the kept entries (address 0x1000, 512 bytes): the block at that address is "
              "live, allocated by kept entry #0 with no free_completed between"),
    "alloc_after_free_requested": (  # a request is not the free: the block stays live until free_completed
        _snap(_alloc(4096, 512, 1), _alloc(4096, 512, 2, "free_requested"), _alloc(8192, 512, 3),
              _alloc(4096, 512, 4)),
        "alloc #3 of the kept entries (address 0x1000, 512 bytes): the block at that address is live"),
    "segment_alloc": (_snap(_alloc(2 * MIB, 2 * MIB, 1, "segment_alloc"), _alloc(2 * MIB, 512, 2),
                            _alloc(2 * MIB, 2 * MIB, 3, "segment_alloc")),
                      "device 0 segment_alloc #2 of the kept entries (address 0x200000, 2097152 bytes): the segment "
                      "at that address is live, allocated by kept entry #0 with no segment_free between"),
}
FINE = {  # the same addresses reused after their frees: read as before
    "reuse": _snap(_alloc(4096, 512, 1), _alloc(4096, 512, 2, "free_requested"), _alloc(4096, 512, 2, "free_completed"),
                   _alloc(4096, 512, 3), _alloc(4096, 512, 4, "free")),
    "segment_reuse": _snap(_alloc(2 * MIB, 2 * MIB, 1, "segment_alloc"), _alloc(2 * MIB, 2 * MIB, 2, "segment_free"),
                           _alloc(2 * MIB, 2 * MIB, 3, "segment_alloc")),
    "largest_size": _snap(_alloc(4096, 2**63 - 1, 1)),
}


def _write(tmp_path, name, snap):
    p = tmp_path / f"{name}.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    return p


def _read(path, reader):
    """``("ok", columns)`` or ``("error", message)`` through one reader, as ``rlhfmem replay`` reads."""
    try:
        if reader == "python":
            snap = load_snapshot(path)
        else:
            snap, used = load_snapshot_columnar(path)
        cfg = AllocatorConfig.from_snapshot_settings(snap.get("allocator_settings"))
        cols = columns_from_snapshot(snap, None, cfg, str(path))
        trace_from_snapshot(snap, None, source=str(path))
        return "ok", cols
    except SnapshotError as exc:
        return "error", str(exc)


READERS = ["python"] + (["compiled"] if snapshot_reader.reader_available()[0] else [])


# (table, name, the message's start after the file): a number past int64 names the entry; a live address or segment
# allocated again names the snapshot
BAD_INPUT = ([(OUT_OF_RANGE, n, "malformed snapshot entry: ") for n in sorted(OUT_OF_RANGE)]
             + [(DUPLICATE, n, "malformed snapshot: ") for n in sorted(DUPLICATE)])


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("table, name, prefix", BAD_INPUT, ids=[n for _, n, _ in BAD_INPUT])
def test_a_number_past_int64_or_a_live_address_allocated_again_is_one_line_naming_file_and_entry(
        tmp_path, table, name, prefix, reader):
    snap, fragment = table[name]
    p = _write(tmp_path, name, snap)
    status, msg = _read(p, reader)
    assert status == "error" and msg.startswith(f"{p}: {prefix}") and fragment in msg, msg
    assert "\n" not in msg


@pytest.mark.skipif(not snapshot_reader.reader_available()[0], reason="no C++ compiler here (the compiled reader)")
@pytest.mark.parametrize("name", sorted(DUPLICATE))
def test_the_compiled_reader_declines_a_live_address_allocated_again(tmp_path, name):
    p = _write(tmp_path, name, DUPLICATE[name][0])
    parsed = snapshot_reader.parse_snapshot(p.read_bytes(), {"alloc": "alloc", "free_completed": "free",
                                                             "free": "free", "free_requested": "free_requested",
                                                             "segment_alloc": "segment_alloc",
                                                             "segment_free": "segment_free"})
    assert parsed.status == "declined" and "address allocated again" in parsed.message


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", sorted(FINE))
def test_addresses_reused_after_their_frees_read_as_before(tmp_path, name, reader):
    p = _write(tmp_path, name, FINE[name])
    status, cols = _read(p, reader)
    assert status == "ok", cols
    if reader == "compiled":
        assert load_snapshot_columnar(p)[1] == "compiled"
        assert cols == _read(p, "python")[1]


@pytest.mark.parametrize("name", ["size_2_63", "size_2_64", "dup_alloc", "dup_segment_alloc"])
def test_rlhfmem_replay_says_it_in_one_line(tmp_path, name):
    snap, fragment = (OUT_OF_RANGE[name] if name in OUT_OF_RANGE else DUPLICATE[name[4:]])
    p = _write(tmp_path, name, snap)
    for reader in READERS:
        r = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "replay", str(p)], capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, RLHFMEM_SNAPSHOT_READER=reader))
        lines = (r.stdout + r.stderr).strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (reader, r.stdout, r.stderr)
        assert str(p) in lines[0] and fragment in lines[0], lines[0]
