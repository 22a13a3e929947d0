"""The simulated CUDA device with values (``rlhfmem capture --device cuda-sim``'s default; ``--sim-values``):
a program whose control flow reads device values runs unchanged to its end.

Each op's outputs are made by its meta kernel (the allocations a CUDA kernel makes) and its values by the CPU
kernel on host memory at the device address (``simcuda/csrc/sim_cuda.cpp``: "values mode"); copies move bytes and
``.item()`` reads them. The generation loop's stopping criteria, a boolean mask's index, sampling and
``torch.Event.synchronize`` then follow the program, and the allocation sequence stays the value-free one."""

import json
from pathlib import Path

import pytest

from helpers import DATA

from pytest_rlhfmem.command.run import CommandError, run_command
from pytest_rlhfmem.memory.metrics import METRIC_NAMES
from pytest_rlhfmem.memory.trace import load_snapshot, trace_from_snapshot

COMMANDS = DATA / "commands"


def capture(tmp_path: Path, script: str, *args: str, values: str | None = None, snapshots: bool = False) -> dict:
    return run_command([str(COMMANDS / script), *args], script, device="cuda-sim", work_dir=tmp_path / "work",
                       timeout=900, sim_values=values, snapshot_dir=tmp_path / "snap" if snapshots else None)


def memory(result: dict) -> dict:
    """The device figures of a result (its times and host figures are measured, so they vary)."""
    return {k: result["metrics"][k] for k in METRIC_NAMES}


def printed(result: dict, prefix: str) -> str:
    return next(ln for ln in Path(result["log"]).read_text().splitlines() if ln.startswith(prefix))


def test_a_generate_and_ppo_loop_written_for_a_gpu_runs_to_its_end_with_the_same_figures_twice(tmp_path):
    runs = [capture(tmp_path / str(k), "hf_generate_ppo.py") for k in range(2)]
    for r in runs:
        assert r["status"] == "ok", r.get("failure") or Path(r["log"]).read_text()[-3000:]
        assert r["capture_description"]["simulated_cuda_device"]["values"] == "on"
        # the script's own torch.cuda.max_memory_allocated() is the simulated allocator's
        assert printed(r, "peak allocated ") == f"peak allocated {r['metrics']['peak_allocated']} B"
        assert r["ranks"][0]["scalar_answers"] == {}  # no read took a fixed answer: every value was computed
    assert memory(runs[0]) == memory(runs[1])
    figures = [json.loads(printed(r, "FIGURES ").removeprefix("FIGURES ")) for r in runs]
    assert figures[0] == figures[1]
    # the rollout stopped where the sampled tokens say: lengths in [1, 24], EOS found by a boolean mask
    assert all(1 <= n <= 24 for step in figures[0]["lengths"] for n in step)
    assert all(loss == loss for loss in figures[0]["actor_loss"] + figures[0]["critic_loss"])  # computed: no NaN


def test_a_boolean_mask_runs_with_values_and_is_refused_in_one_line_naming_the_flag_without(tmp_path):
    import torch

    torch.manual_seed(0)
    expected = int((torch.randn(64) > 0).sum())  # the CPU generator's draw: the device's values come from it too
    on = capture(tmp_path / "on", "cuda_mask.py")
    assert on["status"] == "ok", on.get("failure")
    assert printed(on, "KEPT ") == f"KEPT {expected} of 64"
    off = capture(tmp_path / "off", "cuda_mask.py", values="off")
    assert off["status"] == "failed"
    log = Path(off["log"]).read_text()
    assert "aten::nonzero cannot run without values" in log and "--sim-values on" in log


def test_values_keep_the_value_free_allocation_sequence(tmp_path):
    """cuda_train.py reads no device value until its end: with and without values the device log holds the same
    allocations in the same order, the same frees between each two of them, and the figures are equal. (Frees
    made at one moment can come in either order: CUDA autocast's cast cache, a hash map keyed by the weights'
    addresses, drops its bf16 copies in an order that depends on where the host put those weights.)"""
    steps, metrics = {}, {}
    for values in ("on", "off"):
        r = capture(tmp_path / values, "cuda_train.py", values=values, snapshots=True)
        assert r["status"] == "ok", r.get("failure")
        (snap,) = (tmp_path / values / "snap").glob("*.pickle")
        trace = trace_from_snapshot(load_snapshot(snap), source=str(snap))
        steps[values] = between_allocations(trace.events)
        metrics[values] = memory(r)
    assert steps["on"] == steps["off"] and len(steps["on"]) > 50
    assert metrics["on"] == metrics["off"]


def between_allocations(events) -> list[tuple[int, list[int]]]:
    """Each allocation's size with the sizes of the frees before the next one, sorted."""
    out: list[tuple[int, list[int]]] = []
    for e in events:
        if e.action == "alloc":
            out.append((e.size, []))
        elif e.action == "free" and out:
            out[-1][1].append(e.size)
    return [(size, sorted(frees)) for size, frees in out]


def test_sim_values_needs_the_simulated_device(tmp_path):
    with pytest.raises(CommandError, match="sim_values 'on' chooses whether the simulated CUDA device computes "
                                           "values: it needs device cuda-sim or cuda-rehearsal, got cpu"):
        run_command([str(COMMANDS / "plain_train.py")], "x", device="cpu", sim_values="on", work_dir=tmp_path)
    with pytest.raises(CommandError, match=r"simulated CUDA device values 'maybe' \(\$RLHFMEM_SIM_CUDA_VALUES\): "
                                           "allowed values are on, off"):
        run_command([str(COMMANDS / "plain_train.py")], "x", device="cuda-sim", sim_values="maybe",
                    work_dir=tmp_path)
