"""``budgets.update_budget_file`` on its own: what an update counts, keeps and refuses. The entries are the
recorded ones of baselines/cpu/deepspeed_chat_cpu.yaml (the plugin's sessions that write them:
tests/test_plugin_budgets.py)."""

import copy
from pathlib import Path

import pytest
import yaml

from pytest_rlhfmem.budgets import BudgetError, load_budget_file, update_budget_file

RECORDED = yaml.safe_load((Path(__file__).resolve().parents[1] / "baselines" / "cpu" /
                           "deepspeed_chat_cpu.yaml").read_text())["entries"]
ZERO2, ZERO3 = "deepspeed-chat/tiny-opt/zero2/flush-none/x2", "deepspeed-chat/tiny-opt/zero3/flush-none/x2"


def _entry(eid: str) -> dict:
    """A recorded entry without its hand-set tolerances: what ``entry_from_result`` gives for a result."""
    e = copy.deepcopy(RECORDED[eid])
    e.pop("tolerances", None)
    return e


def test_update_counts_new_updated_unchanged_and_keeps_tolerances_and_untouched_entries(tmp_path):
    path = tmp_path / "suite.yaml"
    s = update_budget_file(path, {ZERO2: _entry(ZERO2), ZERO3: _entry(ZERO3)}, "cpu")
    assert (s.new, s.updated, s.unchanged) == ([ZERO2, ZERO3], [], [])
    data = yaml.safe_load(path.read_text())
    data["entries"][ZERO2]["tolerances"] = {"peak_reserved": {"rel": 0.05}}  # hand-set by a user
    data["entries"]["kept/by/nobody"] = {"metrics": {"peak_reserved": "1 GiB"}}
    path.write_text(yaml.safe_dump(data))
    moved = _entry(ZERO2)
    moved["metrics"]["peak_reserved"] = "70 MiB"
    s = update_budget_file(path, {ZERO2: moved, ZERO3: _entry(ZERO3)}, "cpu")
    assert (s.new, s.updated, s.unchanged) == ([], [ZERO2], [ZERO3])
    after = load_budget_file(path)
    assert set(after.entries) == {ZERO2, ZERO3, "kept/by/nobody"}
    assert after.entries[ZERO2].metrics["peak_reserved"] == 70 * 2**20
    assert after.raw["entries"][ZERO2]["tolerances"] == {"peak_reserved": {"rel": 0.05}}
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.lock"))  # nothing left behind


def test_a_malformed_file_is_never_overwritten(tmp_path):
    path = tmp_path / "suite.yaml"
    text = f"entries:\n  {ZERO2}:\n    metrics:\n      peak_reserved: 123456\n"
    path.write_text(text)
    with pytest.raises(BudgetError, match=r"suite.yaml: entry .*peak_reserved: 123456 is not a size with a unit"):
        update_budget_file(path, {ZERO2: _entry(ZERO2)}, "cpu")
    assert path.read_text() == text
