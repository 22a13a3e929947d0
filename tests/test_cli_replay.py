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
