"""Phase marks for Hugging Face ``Trainer``-based code in one line (``pytest_rlhfmem.integrations.trl``), and the
begin/end form of ``rlhfmem.phase`` (``begin_phase`` / ``end_phase``) the optimizer-step callback uses, on a real
``transformers.Trainer`` run captured on CPU. TRL's own trainers: suites/test_trl_sim.py (``tox -e trl``)."""

from pathlib import Path

import pytest

from helpers import DATA

import pytest_rlhfmem as rlhfmem
from pytest_rlhfmem.command.run import run_command
from pytest_rlhfmem.integrations.trl import mark_phases


def test_a_trainer_marked_in_one_line_reports_its_training_and_optimizer_steps(tmp_path):
    result = run_command([str(DATA / "commands" / "hf_trainer_marked.py"), str(tmp_path / "out")], "hf-trainer",
                         device="cpu", work_dir=tmp_path / "work")
    assert result["status"] == "ok", result.get("failure")
    log = Path(result["log"]).read_text()
    # a plain Trainer has training_step; TRL's experience/generate/score_reward methods are absent, so skipped
    assert "MARKED train_step,optimizer_step" in log
    assert "REFUSED rlhfmem.end_phase('train'): the innermost phase begin_phase opened is 'setup'" in log
    phases = result["phases"]  # name -> figures
    assert {"setup", "train_step", "optimizer_step"} <= set(phases)
    # Adam's states appear at the first optimizer step: it allocates there
    assert phases["optimizer_step"]["peak_allocated"] > 0 and "trained 4 steps" in log


def test_marks_are_no_ops_without_a_capture_and_refuse_a_non_trainer():
    assert rlhfmem.active() is None
    rlhfmem.begin_phase("x")  # nothing captured: nothing to open, nothing to check
    rlhfmem.end_phase("y")
    with pytest.raises(TypeError, match="mark_phases\\(trainer\\): a transformers.Trainer .* got object"):
        mark_phases(object())
