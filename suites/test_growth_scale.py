"""Issue 48, incident 4 at larger scales than the default run's (opt-in: ``tox -e growth``), simulated device
figures, measured host figures. tests/test_iterations_growth.py holds it at CI scale (3 iterations).

1. The shipped DeepSpeed-Chat recipe over 8 iterations (tiny OPT: PPO with ZeRO-3 at world size 2, the default
   cell; ZeRO-2 at world size 1; GRPO with ZeRO-2): each passes a growth budget of 0 B per iteration with the
   default tolerances. What the host meter sees grow besides the program (the CPU allocation recorder's own
   entries, ``recorder_bytes``) is printed and taken out (``host_anon_program``).
2. tests/data/commands/leaky_train.py over 10 iterations: the device leak (4 MiB a step) and a host leak (32 MiB of
   host bytes a step, verl #630's climb) each fail a zero growth budget, naming the rate and where it runs out.

Each test prints ``FIGURES {...}``: what docs/incidents.md quotes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from pytest_rlhfmem.budgets import GROWTH_BUDGETS, compare, entry_from_result, load_budget_file
from pytest_rlhfmem.iterations import growth_message

COMMANDS = Path(__file__).resolve().parent.parent / "tests" / "data" / "commands"
MiB = 2**20


def zero_growth_check(tmp_path: Path, result) -> dict[str, str]:
    """``result`` against a budget file whose entry is the result's own figures with growth 0 B per iteration and
    the default tolerances (budgets.py): each growth metric's status (ok, over)."""
    entry = entry_from_result(result.data)
    entry["metrics"].update({m: "0 B" for m in GROWTH_BUDGETS})
    path = tmp_path / "growth.yaml"
    path.write_text(yaml.safe_dump({"schema": 1, "entries": {result.scenario_id: entry}}))
    bf = load_budget_file(path)
    return {r.metric: r.status for r in compare(bf, bf.entries[result.scenario_id], result.metrics)
            if r.metric in GROWTH_BUDGETS}


def figures(result) -> dict:
    rows = result["iterations"]
    return {"id": result.scenario_id, **{m: result.metrics[m] for m in GROWTH_BUDGETS},
            **{k: [r[k] for r in rows] for k in ("peak_reserved", "peak_allocated", "host_anon_peak",
                                                 "recorder_bytes", "host_anon_program")}}


@pytest.mark.parametrize("cell", [
    {"strategy": "zero3", "world_size": 2},
    {"strategy": "zero2", "world_size": 1},
    {"strategy": "zero2", "world_size": 1, "algorithm": "grpo"},
], ids=["ppo-zero3-x2", "ppo-zero2-x1", "grpo-zero2-x1"])
def test_the_recipe_does_not_grow_over_8_iterations(ppo_iteration, tmp_path, cell):
    result = ppo_iteration(framework="deepspeed-chat", models="tiny-opt", flush="none", device="cpu", iterations=8,
                           **cell)
    print("FIGURES " + json.dumps(figures(result)))
    statuses = zero_growth_check(tmp_path, result)
    assert statuses == dict.fromkeys(GROWTH_BUDGETS, "ok"), (statuses, figures(result))
    assert result.metrics["growth_peak_allocated"] == 0  # the device: not a byte more per iteration (simulated)


@pytest.mark.parametrize("leak, metric", [(["--leak"], "growth_peak_allocated"),
                                          (["--host-leak", "32"], "growth_host_anon")], ids=["device", "host"])
def test_a_leak_over_10_iterations_fails_its_growth_budget(rlhfmem_command, tmp_path, leak, metric):
    result = rlhfmem_command([sys.executable, str(COMMANDS / "leaky_train.py"), *leak], id=f"leaky/{metric}",
                             device="cpu", iterations=10)
    message = growth_message(metric, result["iterations"], None, result.simulated)
    print("FIGURES " + json.dumps(figures(result) | {"message": message}))
    assert zero_growth_check(tmp_path, result)[metric] == "over"
    expected = 4 * MiB if metric == "growth_peak_allocated" else 32 * MiB
    assert abs(result.metrics[metric] - expected) < expected // 4, result.metrics[metric]
