"""Distributed CUDA programs, unchanged, on the simulated CUDA device (``rlhfmem capture --device cuda-sim`` under
torchrun): its process groups (``simcuda/distributed.py``, ``simcuda/csrc/sim_dist.cpp``).

Default run (tiny sizes, world size 2): the four-line program of issue 46 with backend ``nccl`` and ``gloo`` (a correct
all-reduce on each rank's own device), a DDP loop and the same loop under FSDP2 (``fully_shard``): both run to their
end, agree with each other on every loss and on the final parameters, and record the collectives each one runs.
The heavier programs (every collective checked, DeepSpeed, accelerate, world size 4, the wheel in a fresh venv, the
CPU route's figures beside these) run in ``tox -e sim-dist`` (``suites/test_sim_dist_programs.py``).
"""

import json
import sys
from pathlib import Path

from helpers import DATA

from pytest_rlhfmem.command.run import run_command

COMMANDS = DATA / "commands"


def torchrun(tmp_path: Path, script: str, *args: str, nproc: int = 2, **kw) -> dict:
    """One capture of ``script`` under torchrun with ``nproc`` ranks on the simulated device (values on)."""
    return run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                        str(COMMANDS / script), *args], script, device="cuda-sim", work_dir=tmp_path, timeout=600,
                       **kw)


def printed(result: dict, prefix: str) -> list[dict]:
    """The json each rank printed after ``prefix``, by rank."""
    rows = [json.loads(ln.removeprefix(prefix)) for ln in Path(result["log"]).read_text().splitlines()
            if ln.startswith(prefix)]
    return sorted(rows, key=lambda row: row["rank"])


def ok(result: dict) -> dict:
    assert result["status"] == "ok", result.get("failure") or Path(result["log"]).read_text()[-3000:]
    return result


def test_the_four_line_program_all_reduces_on_each_rank_s_own_device_with_nccl_and_gloo(tmp_path):
    """``init_process_group(BACKEND)``, ``set_device(LOCAL_RANK)``, ``torch.ones(1 << 20, device="cuda")``,
    ``all_reduce``: each rank holds 2.0 everywhere, on cuda:LOCAL_RANK; with nccl the device's NCCL backend ran it,
    with gloo the gloo group's CUDA backend (on host views). Neither adds device memory: the same figures."""
    figures = {}
    for backend in ("nccl", "gloo"):
        r = ok(torchrun(tmp_path / backend, "dist_all_reduce.py", backend))
        assert printed(r, "RESULT ") == [{"rank": k, "device": f"cuda:{k}", "first": 2.0, "sum": 2.0 * (1 << 20)}
                                         for k in range(2)]
        ranks = sorted(r["ranks"], key=lambda x: x["rank"])
        assert [rank["collectives"] for rank in ranks] == [{"all_reduce": 1}] * 2
        figures[backend] = [(rank["total"]["peak_reserved"], rank["total"]["peak_allocated"]) for rank in ranks]
        assert "torch.cuda.nccl.version: (2, 27, 5)" in r["capture_description"]["torch_distributed_answered"]
    assert figures["nccl"] == figures["gloo"]
    assert figures["nccl"][0][0] == 22 * 2**20 and 4 * 2**20 < figures["nccl"][0][1] < 5 * 2**20  # 4 MiB + sum


def test_ddp_and_fsdp2_train_to_their_end_and_agree_on_every_loss(tmp_path):
    """The same loop under DDP and under FSDP2 at world size 2: both average the ranks' gradients, so every loss
    and the final parameters agree (real values through the device's NCCL); DDP all-reduces its buckets, FSDP2
    all-gathers its parameters and reduce-scatters its gradients, each rank on its own device."""
    ddp = ok(torchrun(tmp_path / "ddp", "dist_train.py", "--mode", "ddp"))
    fsdp = ok(torchrun(tmp_path / "fsdp2", "dist_train.py", "--mode", "fsdp2"))
    figures = [printed(r, "FIGURES ") for r in (ddp, fsdp)]
    assert figures[0] == figures[1] and len(figures[0]) == 2
    assert figures[0][0]["param_sum"] == figures[0][1]["param_sum"]  # data parallelism: equal parameters
    assert figures[0][0]["losses"] != figures[0][1]["losses"]  # each rank its own batches
    for rank in ddp["ranks"]:
        assert rank["collectives"]["all_reduce"] >= 3 and rank["collectives"]["broadcast"] >= 1, rank["collectives"]
    for rank in fsdp["ranks"]:
        c = rank["collectives"]
        assert c["all_gather_into_tensor"] >= 3 and c["reduce_scatter_tensor"] >= 3, c
    # FSDP2 keeps each rank's half of the parameters and optimizer states, DDP all of them and its gradient buckets
    assert max(r["total"]["peak_allocated"] for r in fsdp["ranks"]) < min(r["total"]["peak_allocated"]
                                                                         for r in ddp["ranks"])


def test_a_nccl_group_holds_device_memory_as_process_group_nccl_does(tmp_path):
    """The program's own torch.cuda.memory_allocated() around each case (tests/data/commands/dist_memory.py), as
    ProcessGroupNCCL.cpp of torch 2.13 allocates and keeps: a blocking all-reduce keeps nothing; an asynchronous one
    keeps its tensor in the work's stash until wait() and in the work's outputs until the work is dropped; dropped
    unwaited, the watchdog's copy keeps the stash until the group's next collective; an all-gather into a list
    flattens its output in a buffer of its own (2 x 1 MiB at world size 2); a barrier's 1-byte tensor and 1-element
    fp32 tensor (512 B blocks) are freed when it returns."""
    r = ok(torchrun(tmp_path, "dist_memory.py"))
    cases = {row.pop("case"): row for row in (json.loads(ln.removeprefix("MEM ")) for ln in
                                              Path(r["log"]).read_text().splitlines() if ln.startswith("MEM "))}
    mib = 1 << 20
    assert cases == {
        "blocking": {"after_del": 0},
        "async_waited": {"before_wait": mib, "after_wait": mib, "after_del_work": 0},
        "async_dropped": {"before_next": mib, "after_next": 512},
        "all_gather_list": {"peak_extra": 2 * mib, "after": 0},
        "barrier": {"peak_extra": 1024, "after": 0},
    }
