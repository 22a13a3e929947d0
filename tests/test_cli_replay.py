"""`rlhfmem replay` as a user runs it: a real subprocess, real snapshots, bad input."""

import json
import pickle
import subprocess
import sys

import pytest

from helpers import shared_snapshot


class RunsCode:
    """Pickles to a call of os.system: loading it must be refused before anything runs."""

    def __reduce__(self):
        import os
        return (os.system, ("echo PWNED",))


def rlhfmem(*args):
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_replay_json_reports_full_agreement():
    p = rlhfmem("replay", str(shared_snapshot("cs336_ctx256_fwd")), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"recorded", "simulated", "agreement"}
    a = out["agreement"]
    assert a["segment_allocs_recorded"] == a["segment_allocs_simulated"] == a["segment_allocs_matching"] == 471
    assert a["final_reserved_equal"] and a["final_allocated_equal"] and a["peak_reserved_equal"]
    assert out["simulated"]["peak_reserved"] == 26_545_750_016


def test_replay_table_and_what_if_alloc_conf():
    p = rlhfmem("replay", str(shared_snapshot("select_n_a")))
    assert p.returncode == 0 and "segment_alloc sizes matching in order: 13/13" in p.stdout
    q = rlhfmem("replay", str(shared_snapshot("select_n_a")), "--free-running", "--json",
                "--alloc-conf", "roundup_power2_divisions:4")
    assert q.returncode == 0
    # Power-of-2 rounding changes block sizes, so the model must answer differently from the recording.
    assert json.loads(q.stdout)["simulated"]["segment_allocs"] != json.loads(
        rlhfmem("replay", str(shared_snapshot("select_n_a")), "--json").stdout)["recorded"]["segment_allocs"]


def test_trace_without_segment_events_says_agreement_unavailable(tmp_path):
    snap = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096, "size": 1000, "stream": 0},
        {"action": "free_completed", "addr": 4096, "size": 1000, "stream": 0}]]}
    f = tmp_path / "plain.pickle"
    f.write_bytes(pickle.dumps(snap))
    out = json.loads(rlhfmem("replay", str(f), "--json").stdout)
    assert out["agreement"]["available"] is False and "no segment_alloc" in out["agreement"]["reason"]
    assert out["simulated"]["peak_reserved"] == 2 * 2**20


@pytest.mark.parametrize(
    "content, args, fragment",
    [
        (pickle.dumps({"segments": []})[:-4], [], "truncated or corrupt"),
        (pickle.dumps({"not": "a snapshot"}), [], "not a torch.cuda.memory._snapshot() pickle"),
        (pickle.dumps(RunsCode()), [], "system; memory snapshots hold only builtins"),
        (None, ["--alloc-conf", "nonsense_key:3"], "unknown alloc-conf key 'nonsense_key'"),
        (None, ["--torch-version", "banana"], "torch version 'banana': expected 'major.minor[.patch]'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, content, args, fragment):
    if content is None:
        path = shared_snapshot("eor_nn")
    else:
        path = tmp_path / "bad.pickle"
        path.write_bytes(content)
    p = rlhfmem("replay", str(path), *args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhfmem: error:") and fragment in lines[0]
    assert "Traceback" not in p.stderr and "PWNED" not in p.stdout


ALL_SNAPSHOTS = ("eor_nn", "select_n_a", "cs336_ctx256_fwd", "codeloc_expandable_dev0_dev2", "slime_init_b",
                 "llminf_1p3b_a", "wedson_medium_128_inference", "wedson_medium_256_training")


@pytest.mark.parametrize("name", ALL_SNAPSHOTS)
def test_every_real_snapshot_replays_anchored_and_agrees(name):
    p = rlhfmem("replay", str(shared_snapshot(name)), "--anchored", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    a = out["agreement"]
    assert isinstance(out["device"], int)
    if a["available"]:
        assert a["segment_allocs_matching"] == a["segment_allocs_recorded"] == a["segment_allocs_simulated"]
        assert a["segment_maps_matching"] == a["segment_maps_recorded"] == a["segment_maps_simulated"]
        assert a["segment_unmaps_matching"] == a["segment_unmaps_recorded"]
        assert a["segment_free_batches_equal"] and a["final_reserved_equal"] and a["final_allocated_equal"]


@pytest.mark.parametrize("name", ALL_SNAPSHOTS)
def test_expandable_what_if_on_every_real_snapshot(name):
    p = rlhfmem("replay", str(shared_snapshot(name)), "--free-running", "--json",
                "--alloc-conf", "expandable_segments:True")
    assert p.returncode == 0, p.stderr
    sim = json.loads(p.stdout)["simulated"]
    assert sim["segment_allocs"] == []  # every new byte comes from mapped pages, never a cudaMalloc
    assert sim["peak_reserved"] >= sim["peak_allocated"]


def test_device_option_and_json_names_the_device():
    path = str(shared_snapshot("codeloc_expandable_dev0_dev2"))
    assert json.loads(rlhfmem("replay", path, "--json").stdout)["device"] == 0
    out = json.loads(rlhfmem("replay", path, "--device", "2", "--json").stdout)
    assert out["device"] == 2 and out["agreement"]["segment_maps_matching"] == 78


def _seg(addr, size, blocks):
    return {"device": 0, "address": addr, "total_size": size, "allocated_size": 0, "stream": 0,
            "segment_type": "large", "blocks": blocks}


@pytest.mark.parametrize(
    "snap, args, fragment",
    [
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 1}], []]}, ["--device", "5"],
         "device 5 not in snapshot"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 1}], []]}, ["--device", "1"],
         "device 1 has no trace events and no segments"),
        ({"segments": [_seg(1 << 30, 20 << 20, [{"size": 1 << 20, "state": "inactive"}])], "device_traces": [[]]},
         [], "blocks add up to 1048576 bytes, not its total_size 20971520"),
        ({"segments": [dict(_seg(1 << 30, 20 << 20, [{"address": 1 << 30, "size": 20 << 20, "state": "inactive"}]),
                            is_expandable=True)],  # the trace allocates but maps nothing (an empty trace replays)
          "device_traces": [[{"action": "alloc", "addr": 1 << 30, "size": 1 << 20}]]},
         [], "pages mapped before the trace began cannot be rebuilt"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": "lots"}]]}, [],
         "malformed snapshot entry"),
        ({"segments": [{"address": 5}], "device_traces": [[]]}, [], "malformed snapshot entry"),
        ({"segments": [], "device_traces": "nope"}, [], "'device_traces' is a str"),
        ({"segments": [], "device_traces": [[]], "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "bad:1"}}, [],
         "unknown alloc-conf key 'bad'"),
    ],
)
def test_malformed_snapshots_are_one_line_and_exit_2(tmp_path, snap, args, fragment):
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps(snap))
    p = rlhfmem("replay", str(path), *args)
    assert p.returncode == 2, p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhfmem: error:") and fragment in lines[0], p.stderr
    assert str(path) in lines[0]


def test_expandable_what_if_on_a_cpu_captured_trace(tmp_path):
    from pytest_rlhfmem.memory.replay import replay
    from pytest_rlhfmem.memory.trace import ALLOC, CAPTURE_CPU_SIMULATED, FREE, Event, Trace, write_snapshot

    # what `rlhfmem run --snapshot-dir` writes: the simulated replay of a captured CPU trace
    mib = 1 << 20
    events = [Event(ALLOC, 0x1000 * (i + 1), (i % 7 + 1) * 3 * mib) for i in range(12)]
    events += [Event(FREE, 0x1000 * (i + 1), (i % 7 + 1) * 3 * mib) for i in range(0, 12, 2)]
    trace = Trace(events=events, capture=CAPTURE_CPU_SIMULATED)
    sim = replay(trace, record_events=True)
    path = write_snapshot(tmp_path / "rank0.pickle", Trace(events=sim.events, capture=trace.capture), sim.segments)
    default = json.loads(rlhfmem("replay", str(path), "--free-running", "--json").stdout)["simulated"]
    p = rlhfmem("replay", str(path), "--free-running", "--json", "--alloc-conf", "expandable_segments:True")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["expandable_segments"] is True and out["simulated"]["label"].startswith("simulated")
    es = out["simulated"]
    assert es["segment_allocs"] == [] and sum(es["segment_maps"]) == es["peak_reserved"]
    assert default["segment_allocs"] and es["peak_allocated"] <= default["peak_allocated"]


def test_a_recorded_oom_in_pytorchs_layout_gives_the_capacity(tmp_path):
    """PyTorch writes an oom entry's free device bytes under "device_free", with no "addr"
    (memory_snapshot.cpp). Capacity = 120 MiB reserved + 30 MiB free: the fourth 40 MiB request fails
    in the replay too, after one retry; without the capacity it would succeed and reserve 160 MiB."""
    mib = 1 << 20
    ev, segs = [], []
    for k in range(3):
        ev += [{"action": "segment_alloc", "addr": (k + 1) << 30, "size": 40 * mib, "stream": 0},
               {"action": "alloc", "addr": (k + 1) << 30, "size": 40 * mib, "stream": 0}]
        segs.append({"address": (k + 1) << 30, "total_size": 40 * mib, "allocated_size": 40 * mib, "stream": 0,
                     "device": 0, "segment_type": "large",
                     "blocks": [{"address": (k + 1) << 30, "size": 40 * mib, "requested_size": 40 * mib,
                                 "state": "active_allocated"}]})
    ev.append({"action": "oom", "device_free": 30 * mib, "size": 40 * mib, "stream": 0})
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps({"segments": segs, "device_traces": [ev], "allocator_settings": {}}))
    for mode in ("--anchored", "--free-running"):
        r = rlhfmem("replay", str(path), mode, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["capacity"] == 150 * mib and out["capacity_source"] == "inferred from the trace's oom entries"
        sim = out["simulated"]
        assert (sim["ooms"], sim["alloc_retries"], sim["peak_reserved"]) == (1, 1, 120 * mib)


@pytest.mark.parametrize("version", ["2.8", "2.10.0+cu128"])
def test_torch_version_option_selects_the_behaviours_and_says_so(version):
    p = rlhfmem("replay", str(shared_snapshot("slime_init_b")), "--torch-version", version, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["torch_version"], out["torch_version_source"]) == (".".join(version.split(".")[:2]), "given")
    assert out["agreement"]["segment_allocs_matching"] == out["agreement"]["segment_allocs_recorded"] == 422
