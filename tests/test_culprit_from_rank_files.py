"""``aggregate`` and ``culprit_order`` read from rank files written as a run leaves them (issue 45's blind spots):
which rank a failed run names first, and the scenario figures of ranks that finished. Each case writes the files a
real run writes (``result-rank<R>.json``, ``progress-rank<R>.json``, torchrun's ``ChildFailedError`` report in the
launcher's log), so the order is checked on the shapes production gives it."""

import json
from pathlib import Path

from pytest_rlhfmem.rlhf.launch import aggregate
from pytest_rlhfmem.rlhf.scenario import Scenario

MiB = 2**20
SCENARIO = Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 3)


def _rank_result(rank: int, reserved: int, error: dict | None = None) -> dict:
    phases = [{"phase": "generate", "peak_reserved": reserved // 2, "peak_allocated": reserved // 4, "wall_s": 1.0},
              {"phase": "train_actor", "peak_reserved": reserved, "peak_allocated": reserved // 2, "wall_s": 2.0}]
    return {"rank": rank, "error": error, "simulated": True, "capture": "cpu-trace-simulated", "phases": phases,
            "total": {"peak_reserved": reserved, "peak_allocated": reserved // 2, "cuda_malloc_count": rank + 3},
            "peak_phase": "train_actor", "wall_s": 3.0}


def _torchrun_report(failed: dict[int, int], root: int) -> str:
    """torchrun's ChildFailedError report (torch/distributed/elastic/multiprocessing/errors/__init__.py)."""
    def block(rank: int) -> str:
        return f"  time      : 2026-11-28_12:00:00\n  host      : h\n  rank      : {rank} (local_rank: {rank})\n" \
               f"  exitcode  : {failed[rank]} (pid: {100 + rank})\n"
    others = "".join(f"[{i}]:\n{block(r)}" for i, r in enumerate(sorted(r for r in failed if r != root), 1))
    return (f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n======\nFailures:\n{others}"
            f"------\nRoot Cause (first observed failure):\n[0]:\n{block(root)}======\n")


def _write(work: Path, results: dict[int, dict], progress: dict[int, dict], log: str) -> Path:
    for r, res in results.items():
        (work / f"result-rank{r}.json").write_text(json.dumps(res))
    for r, prog in progress.items():
        (work / f"progress-rank{r}.json").write_text(json.dumps(prog))
    (work / "launcher.log").write_text(log)
    return work / "launcher.log"


def test_a_rank_killed_by_a_signal_goes_before_a_peers_earlier_exception(tmp_path):
    """Rank 1 was killed (SIGKILL: the OOM killer) in train_actor and left no result; rank 0 then raised in its
    collective, and torchrun observed rank 0's exit first. The killed rank is the culprit."""
    error = {"phase": "train_actor", "type": "RuntimeError", "message": "Connection reset by peer", "time": 100.0}
    log = _write(tmp_path, {0: _rank_result(0, 64 * MiB, error)},
                 {1: {"rank": 1, "pid": 1, "phase": "train_actor", "peak_reserved": 80 * MiB,
                      "peak_allocated": 40 * MiB, "host_rss": 5 * 2**30, "simulated": True},
                  2: {"rank": 2, "pid": 2, "phase": "train_actor"}},
                 _torchrun_report({0: 1, 1: -9, 2: -15}, root=0))
    result = aggregate(SCENARIO, "cpu", tmp_path, 1, False, 900, 10.0, log)
    order = [(f["rank"], f["phase"], f.get("signal"), f["error"]) for f in result["failures"]]
    assert order == [(1, "train_actor", "SIGKILL", "Crash"), (0, "train_actor", None, "RuntimeError"),
                     (2, "train_actor", "SIGTERM", "Crash")]
    assert result["failure"]["memory_so_far"] == {"peak_reserved": 80 * MiB, "peak_allocated": 40 * MiB,
                                                  "host_rss": 5 * 2**30}
    assert result["status"] == "failed"


def test_without_a_signal_the_earliest_exception_goes_first_and_sigterm_bystanders_last(tmp_path):
    early = {"phase": "generate", "type": "OOM", "message": "CUDA out of memory", "time": 50.0}
    late = {"phase": "train_actor", "type": "RuntimeError", "message": "Connection closed by peer", "time": 70.0}
    log = _write(tmp_path, {0: _rank_result(0, 64 * MiB, late), 1: _rank_result(1, 32 * MiB, early)},
                 {2: {"rank": 2, "pid": 2, "phase": "infer_actor"}}, _torchrun_report({0: 1, 1: 1, 2: -15}, root=0))
    result = aggregate(SCENARIO, "cpu", tmp_path, 1, False, 900, 10.0, log)
    assert [f["rank"] for f in result["failures"]] == [1, 0, 2]
    assert result["failure"]["error"] == "OOM" and result["failure"]["phase"] == "generate"


def test_among_ranks_without_a_result_torchruns_root_cause_goes_first(tmp_path):
    log = _write(tmp_path, {}, {r: {"rank": r, "pid": r + 1, "phase": "init"} for r in range(3)},
                 _torchrun_report({0: 1, 1: 1, 2: 1}, root=2))
    result = aggregate(SCENARIO, "cpu", tmp_path, 1, False, 900, 10.0, log)
    assert [f["rank"] for f in result["failures"]] == [2, 0, 1]
    assert result["failures"][0]["root_cause"] is True


def test_finished_ranks_aggregate_to_the_maximum_per_metric_and_per_phase(tmp_path):
    log = _write(tmp_path, {r: _rank_result(r, (r + 1) * 16 * MiB) for r in range(3)}, {}, "")
    result = aggregate(SCENARIO, "cpu", tmp_path, 0, False, 900, 10.0, log)
    assert result["status"] == "ok" and result["failures"] == [] and result["failure"] is None
    assert result["metrics"]["peak_reserved"] == 48 * MiB and result["metrics"]["cuda_malloc_count"] == 5
    assert result["phases"]["generate"]["peak_reserved"] == 24 * MiB
    assert result["phases"]["train_actor"]["peak_allocated"] == 24 * MiB
    assert result["peak_phase"] == "train_actor" and [r["rank"] for r in result["ranks"]] == [0, 1, 2]
