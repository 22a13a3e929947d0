"""The compiled snapshot reader (memory/csrc/snapshot_reader.cpp): the same columns, Trace and one-line errors as
Python's unpickler path (load_snapshot + columns_from_snapshot), and no pickle runs code through it."""

import json
import os
import pickle
import random
import subprocess
import sys

import pytest

from helpers import shared_snapshot
from pytest_rlhfmem.memory import snapshot_reader
from pytest_rlhfmem.memory.allocator import AllocatorConfig
from pytest_rlhfmem.memory.snapshot_reader import SnapshotEntries
from pytest_rlhfmem.memory.trace import (
    SnapshotError, columns_from_snapshot, load_snapshot, load_snapshot_columnar, trace_from_snapshot,
)

ALL_SNAPSHOTS = ("eor_nn", "select_n_a", "cs336_ctx256_fwd", "codeloc_expandable_dev0_dev2", "slime_init_b",
                 "llminf_1p3b_a", "wedson_medium_128_inference", "wedson_medium_256_training")

pytestmark = pytest.mark.skipif(not snapshot_reader.reader_available()[0], reason="no C++ compiler here")


def _config(snap):
    return AllocatorConfig.from_snapshot_settings(snap.get("allocator_settings"))


def old_path(path, device=None):
    """What `rlhfmem replay` read before: ("ok", columns) or ("error", message)."""
    try:
        snap = load_snapshot(path)
        return "ok", columns_from_snapshot(snap, device, _config(snap), str(path))
    except SnapshotError as exc:
        return "error", str(exc)


def new_path(path, device=None):
    try:
        snap, reader = load_snapshot_columnar(path)
        return "ok", columns_from_snapshot(snap, device, _config(snap), str(path))
    except SnapshotError as exc:
        return "error", str(exc)


@pytest.mark.parametrize("name", ALL_SNAPSHOTS)
def test_every_real_snapshot_reads_the_same_columns_and_trace(name):
    path = shared_snapshot(name)
    snap, reader = load_snapshot_columnar(path)
    assert reader == "compiled"
    assert all(isinstance(t, SnapshotEntries) for t in snap["device_traces"])
    ref = load_snapshot(path)
    assert {k: v for k, v in snap.items() if k != "device_traces"} == {k: v for k, v in ref.items()
                                                                      if k != "device_traces"}
    assert [len(t) for t in snap["device_traces"]] == [len(t) for t in ref["device_traces"]]
    devices = [None] + [i for i, t in enumerate(ref["device_traces"]) if t]
    for device in devices:
        assert columns_from_snapshot(snap, device, _config(snap), str(path)) == columns_from_snapshot(
            ref, device, _config(ref), str(path))
        assert trace_from_snapshot(snap, device, source=str(path)) == trace_from_snapshot(ref, device,
                                                                                          source=str(path))


def _write(tmp_path, snap, name="s.pickle", protocol=4):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(snap, protocol=protocol))
    return p


def _seg(addr, size, blocks, **kw):
    return {"device": 0, "address": addr, "total_size": size, "allocated_size": 0, "stream": 0,
            "segment_type": "large", "blocks": blocks, **kw}


MIB = 1 << 20
ODD_SNAPSHOTS = {
    # PyTorch's oom layout (device_free, no addr), the lean layout (both: the lean path reads addr), None / missing
    # numbers (read as 0 by trace_from_snapshot), skipped actions, the 1.13-era "free"
    "oom_layouts": {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096, "size": 1000, "stream": 0, "time_us": 1},
        {"action": "oom", "device_free": 30 * MIB, "size": 40 * MIB, "stream": 0, "time_us": 2},
        {"action": "free_requested", "addr": 4096, "size": 1000, "stream": 0, "time_us": 3},
        {"action": "free_completed", "addr": 4096, "size": 1000, "stream": 0, "time_us": 3}]]},
    # record_stream: a request whose completion comes after other entries is kept; the immediate one is not
    "record_stream_gap": {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096, "size": 1000, "stream": 0, "time_us": 1},
        {"action": "free_requested", "addr": 4096, "size": 1000, "stream": 0, "time_us": 2},
        {"action": "alloc", "addr": 8192, "size": 1000, "stream": 0, "time_us": 3},
        {"action": "free_requested", "addr": 8192, "size": 1000, "stream": 0, "time_us": 4},
        {"action": "free_completed", "addr": 8192, "size": 1000, "stream": 0, "time_us": 4},
        {"action": "free_completed", "addr": 4096, "size": 1000, "stream": 0, "time_us": 5}]]},
    "oom_both_keys": {"segments": [], "device_traces": [[
        {"action": "oom", "addr": 5, "device_free": 30 * MIB, "size": 40 * MIB, "stream": 0, "time_us": 2}]]},
    "none_and_missing": {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096, "size": 512, "stream": None},
        {"action": "snapshot", "addr": "whatever"},
        {"action": "free", "addr": 4096, "size": 512, "frames": [{"name": "f", "filename": "x.py", "line": 3}]}]]},
    "devices_none_and_empty": {"segments": [], "device_traces": [None, [], [
        {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 0}]]},
    "shared_frames": {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 8192, "size": 512, "stream": 0, "time_us": 0, "frames": (fr := [])},
        {"action": "free_completed", "addr": 8192, "size": 512, "stream": 0, "time_us": 1, "frames": fr}]],
        "extra": fr},
    "big_and_float_values": {"segments": [_seg(1 << 60, 2 * MIB, [{"size": 2 * MIB, "state": "inactive"}])],
                             "device_traces": [[]], "allocator_settings": {"x": 1.5, "y": 2**100, "z": b"\x00"}},
    # declined by the compiled reader, so Python's path (and message) applies
    "negative": {"segments": [], "device_traces": [[{"action": "alloc", "addr": -1, "size": 1, "stream": 0,
                                                     "time_us": 0}]]},
    "string_size": {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": "lots"}]]},
    "no_action": {"segments": [], "device_traces": [[{"addr": 1, "size": 1}]]},
    "int_action": {"segments": [], "device_traces": [[{"action": 7, "addr": 1, "size": 1}]]},
    "device_traces_str": {"segments": [], "device_traces": "nope"},
    "segment_without_total": {"segments": [{"address": 5}], "device_traces": [[]]},
    "not_a_snapshot": {"not": "a snapshot"},
    "a_list": [1, 2, 3],
}


@pytest.mark.parametrize("name", sorted(ODD_SNAPSHOTS))
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_odd_snapshots_read_as_python_reads_them(tmp_path, name, protocol):
    p = _write(tmp_path, ODD_SNAPSHOTS[name], protocol=protocol)
    old = old_path(p)
    assert new_path(p) == old
    if old[0] == "ok":  # (protocol 2 pickles bytes as a call of _codecs.encode: refused by both)
        reader = load_snapshot_columnar(p)[1]
        assert reader.startswith("python (the compiled reader declined") == (name in READ_BY_PYTHON), reader


READ_BY_PYTHON = {"negative", "string_size", "no_action", "int_action"}


def test_a_trace_cut_anywhere_rebuilds_the_same_initial_segments(tmp_path):
    """select_n_a has segments from before the trace; cutting its trace's head makes many blocks pre-trace ones
    (the reader hands _rebuild_initial_segments fewer rows: the same segments or the same error)."""
    ref = load_snapshot(shared_snapshot("select_n_a"))
    entries = ref["device_traces"][0]
    rng = random.Random(22)
    cuts = [0, 1, len(entries) // 2, len(entries) - 1] + rng.sample(range(len(entries)), 6)
    for head in cuts:
        for tail in (len(entries), head + (len(entries) - head) // 3):
            snap = dict(ref, device_traces=[entries[head:tail]])
            p = _write(tmp_path, snap)
            old, new = old_path(p), new_path(p)
            assert new == old, (head, tail)


def test_damaged_and_truncated_files_give_the_same_result_or_message(tmp_path):
    """Bytes changed, deleted (frames then end inside an opcode: Python's unpickler reads such a stream
    differently, so the compiled reader declines) or inserted; truncations. The one difference allowed: an
    opcode that builds or calls (REDUCE, BUILD, NEWOBJ, ...) that a damaged stream happens to contain is
    refused by the compiled reader, where Python fails on it with its own message."""
    data = shared_snapshot("eor_nn").read_bytes()
    rng = random.Random(7)
    cases = [data[:n] for n in (0, 1, 2, 11, len(data) // 3, len(data) - 1)]
    for _ in range(40):
        b = bytearray(data)
        i, r = rng.randrange(2, len(b)), rng.random()
        if r < 0.6:
            b[i] = rng.randrange(256)
        elif r < 0.8:
            del b[i:i + rng.randrange(1, 20)]
        else:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5)))
        cases.append(bytes(b))
    for k, content in enumerate(cases):
        p = tmp_path / f"c{k}.pickle"
        p.write_bytes(content)
        old, new = old_path(p), new_path(p)
        if old[0] == new[0] == "error" and "refused: the pickle uses" in new[1]:
            continue
        assert new == old, k


class RunsCode:
    """Pickles to a call of os.system: loading it must be refused before anything runs."""

    def __reduce__(self):
        return (os.system, ("echo PWNED > pwned.txt",))


@pytest.mark.parametrize("protocol", range(0, 6))
def test_a_pickle_naming_a_global_is_refused_with_todays_message(tmp_path, protocol, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = _write(tmp_path, {"segments": [], "device_traces": [[RunsCode()]]}, protocol=protocol)
    status, message = new_path(p)
    assert (status, message) == old_path(p)
    assert "refused: the pickle names the global" in message and ".system;" in message
    if protocol >= 2:  # protocols 0-1 start with an opcode the compiled reader leaves to Python (refusing too)
        assert snapshot_reader.parse_snapshot(p.read_bytes(), {}).status == "refused"
    assert not (tmp_path / "pwned.txt").exists()


@pytest.mark.parametrize("stream, opcode", [
    (b"\x80\x04}\x94)R.", "REDUCE"),
    (b"\x80\x04}\x94}b.", "BUILD"),
    (b"\x80\x04(}o.", "OBJ"),
    (b"\x80\x04\x82\x01.", "EXT"),
    (b"\x80\x04K\x01Q.", "persistent id"),
])
def test_every_opcode_that_builds_or_calls_is_refused(tmp_path, stream, opcode):
    parsed = snapshot_reader.parse_snapshot(stream, {})
    assert parsed.status == "refused" and opcode in parsed.message
    p = tmp_path / "evil.pickle"
    p.write_bytes(stream)
    with pytest.raises(SnapshotError, match="refused: the pickle uses"):
        load_snapshot_columnar(p)


def test_without_a_compiler_python_reads_the_pickle_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_reader, "_lib", None)
    monkeypatch.setattr(snapshot_reader, "_unavailable", None)
    monkeypatch.setenv("CXX", "no-such-compiler-rlhfmem")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    snap, reader = load_snapshot_columnar(shared_snapshot("eor_nn"))
    assert reader.startswith("python (compiled reader unavailable: no C++ compiler")
    assert old_path(shared_snapshot("eor_nn")) == ("ok", columns_from_snapshot(snap, None, _config(snap),
                                                                               str(shared_snapshot("eor_nn"))))


def _rlhfmem(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_replay_names_the_reader(tmp_path):
    p = _rlhfmem("replay", str(shared_snapshot("select_n_a")))
    assert p.returncode == 0, p.stderr
    assert "pickle read by the compiled reader" in p.stdout.splitlines()[0]
    env = dict(os.environ, CXX="no-such-compiler-rlhfmem", XDG_CACHE_HOME=str(tmp_path))
    q = _rlhfmem("replay", str(shared_snapshot("eor_nn")), "--json", env=env)
    assert q.returncode == 0, q.stderr
    out = json.loads(q.stdout)
    assert out["snapshot_reader"].startswith("python (compiled reader unavailable")
    assert "the pickle was read in Python" in q.stderr


def test_a_length_past_any_size_is_one_line(tmp_path):
    """BYTEARRAY8 with a length of 2**64-1: Python's unpickler raises OverflowError, once a traceback."""
    p = tmp_path / "huge.pickle"
    p.write_bytes(b"\x80\x05\x96" + b"\xff" * 8 + b".")
    assert old_path(p) == new_path(p) == ("error", f"{p}: truncated or corrupt pickle (OverflowError: BYTEARRAY8 "
                                                   "exceeds system's maximum size of 9223372036854775807 bytes)")


def test_load_columns_for_replay_reads_pickles_compiled(monkeypatch):
    """replay.load_columns_for_replay (the CLI's, the benchmark's and the API's entry) reads a pickle with the
    compiled reader now: the same columns and settings as Python's Unpickler path, on every real snapshot; the
    recorded settings are the file's, as read (replay.allocator_config builds the same AllocatorConfig)."""
    from pytest_rlhfmem.memory import trace as trace_mod
    from pytest_rlhfmem.memory.replay import allocator_config, load_columns_for_replay

    readers = []
    real = trace_mod.load_snapshot_columnar

    def spy(path):
        snap, reader = real(path)
        readers.append(reader)
        return snap, reader

    monkeypatch.setattr(trace_mod, "load_snapshot_columnar", spy)
    for name in ALL_SNAPSHOTS:
        path = shared_snapshot(name)
        cols, recorded = load_columns_for_replay(str(path))
        assert old_path(str(path)) == ("ok", cols)
        snap = load_snapshot(path)
        assert (recorded.allocator_settings, recorded.source, recorded.reader) == (
            snap.get("allocator_settings"), str(path), "compiled")
        assert allocator_config(recorded.allocator_settings) == _config(snap)
    assert readers == ["compiled"] * len(ALL_SNAPSHOTS)
