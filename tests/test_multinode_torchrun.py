"""Scenarios beyond one node (issue 35): torchrun's multi-node options passed through ``rlhfmem run`` and
``run_scenario``, one agent per node, the ranks' files in a shared work directory, the node-rank-0 agent
aggregating. Shown on this machine with two real torchrun agents (``--nnodes 2``, one rank each) running one
world-size-2 CPU scenario of real DeepSpeed; docs/multi-node.md has the commands and figures."""

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from pytest_rlhfmem.matrix import known_race
from pytest_rlhfmem.rlhf.launch import Nodes, run_scenario
from pytest_rlhfmem.rlhf.scenario import Scenario

FIGURES = ("peak_reserved", "peak_allocated", "fragmentation_at_peak", "cuda_malloc_count")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rlhfmem(*args: str, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pytest_rlhfmem.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=cwd)


def test_torchrun_gets_the_node_options_under_its_own_names():
    assert Nodes().torchrun_args(2) == ["--standalone", "--nproc-per-node=2"]
    c10d = Nodes.parse(nnodes="2", nproc_per_node="4", node_rank=1, rdzv_backend="c10d",
                       rdzv_endpoint="node0:29400", rdzv_id="job7")
    assert c10d.torchrun_args(8) == ["--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
                                     "--rdzv-endpoint=node0:29400", "--rdzv-id=job7"]
    static = Nodes.parse(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert static.torchrun_args(4) == ["--nnodes=2", "--nproc-per-node=2", "--master-addr=10.0.0.1",
                                       "--master-port=29500", "--node-rank=1"]


@pytest.mark.parametrize("args, fragment", [
    (["--nnodes", "2", "--nproc-per-node", "1", "--world-size", "4", "--work-dir", "w"],
     "--nnodes 2 x --nproc-per-node 1 ranks do not make the scenario's world size 4"),
    (["--nnodes", "1:2"], "--nnodes '1:2': a fixed count, an integer >= 1, is needed"),
    (["--nproc-per-node", "gpu"], "--nproc-per-node 'gpu': a fixed count"),
    (["--nnodes", "2"], "--nnodes 2 needs --work-dir: a directory every node shares"),
    (["--nnodes", "2", "--node-rank", "2", "--work-dir", "w"], "--node-rank 2: one of 0..1 (--nnodes 2)"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--work-dir", "w"], "--rdzv-backend c10d needs --rdzv-endpoint"),
    (["--rdzv-backend", "zmq"], "--rdzv-backend 'zmq': one of static, c10d, etcd, etcd-v2"),
    (["--nnodes", "2", "--work-dir", "w", "--time-rounds", "3"], "--time-rounds 3 with --nnodes 2: one round"),
])
def test_bad_node_options_are_one_line_before_launching(args, fragment, tmp_path):
    p = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--device", "cpu", *args],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and fragment in lines[0], p.stderr
    assert not (tmp_path / "w").exists()  # refused before any work directory or agent


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_two_agents_measure_what_one_agent_measures(iteration_result, tmp_path):
    """Two torchrun agents (c10d rendezvous on localhost, one rank each) and one agent with two ranks run the
    same world-size-2 scenario: the same figures per phase, within the scenario's known race."""
    scenario = Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 2)
    work, port = tmp_path / "shared", _free_port()
    agents = {n: _rlhfmem("run", "--strategy", "zero2", "--device", "cpu", "--nnodes", "2", "--nproc-per-node", "1",
                          "--node-rank", str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-id", "test-multinode", "--work-dir", str(work), "--timeout", "300",
                          "--json", str(tmp_path / f"node{n}.json"), cwd=tmp_path)
              for n in (1, 0)}
    out = {n: p.communicate(timeout=420)[0] for n, p in agents.items()}
    assert agents[0].returncode == 0 and agents[1].returncode == 0, out
    assert "node rank 1 of 2, agent ok; the node-rank-0 agent prints and writes the result" in out[1]
    assert "on cpu x2 (2 nodes x 1) (simulated" in out[0] and "peak reserved reached in phase" in out[0]
    assert not (tmp_path / "node1.json").exists()  # only node rank 0 writes the result
    assert not work.exists()  # the run succeeded: node rank 0 removed the shared directory after every agent ended
    two = json.loads((tmp_path / "node0.json").read_text())
    two = two["results"][0] if "results" in two else two
    assert two["status"] == "ok" and two["simulated"] and [r["rank"] for r in two["ranks"]] == [0, 1]
    assert two["nodes"]["nnodes"] == 2 and two["nodes"]["agents"]["1"]["returncode"] == 0
    one = iteration_result(scenario).data
    race = known_race(scenario)
    assert list(two["phases"]) == list(one["phases"])
    for name in [*one["phases"], "iteration"]:
        a = two["metrics"] if name == "iteration" else two["phases"][name]
        b = one["metrics"] if name == "iteration" else one["phases"][name]
        for m in FIGURES:
            assert abs(a[m] - b[m]) <= race.get(m, 0), (name, m, a[m], b[m])


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_a_rank_failing_on_the_other_node_fails_the_aggregated_result(tmp_path):
    """Static rendezvous (node rank 1 runs rank 1): rank 1 raises in ``generate`` on node 1; node 0's agent,
    which aggregates, reports the run failed, naming rank 1 first; node 1's agent reports its own failure."""
    scenario = Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 2, {"inject_crash": "generate:1"})
    port, results = _free_port(), {}

    def agent(n: int) -> None:
        results[n] = run_scenario(scenario, device="cpu", timeout=300, work_dir=tmp_path, nodes=Nodes.parse(
            nnodes=2, nproc_per_node=1, node_rank=n, master_addr="127.0.0.1", master_port=port))

    threads = [threading.Thread(target=agent, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=420)
    assert set(results) == {0, 1}
    assert results[1]["role"] == "agent" and results[1]["status"] == "failed" and results[1]["work_dir"] is None
    r = results[0]
    assert r["status"] == "failed", r["log_tail"]
    assert r["failure"]["rank"] == 1 and r["failure"]["phase"] == "generate", r["failures"]
    assert "injected crash" in r["failure"]["message"]
    assert r["nodes"]["agents"][1]["returncode"] != 0
    assert (tmp_path / "node1" / "launcher.log").exists() and os.path.isdir(r["work_dir"])
