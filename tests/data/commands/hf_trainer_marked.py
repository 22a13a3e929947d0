"""tests/data/commands/hf_trainer.py with its phases marked in one line (pytest_rlhfmem.integrations.trl), and the
begin/end form of rlhfmem.phase used as a framework's callbacks would use it."""

import runpy
from pathlib import Path

import torch  # noqa: F401 - the capture starts with torch; transformers imports it lazily
import transformers

import pytest_rlhfmem as rlhfmem
from pytest_rlhfmem.integrations.trl import mark_phases

rlhfmem.begin_phase("setup")
try:
    rlhfmem.end_phase("train")  # not the innermost open phase
except ValueError as exc:
    print(f"REFUSED {exc}")
rlhfmem.end_phase("setup")

_init = transformers.Trainer.__init__


def init_then_mark(self, *args, **kwargs):  # the script builds its own Trainer: mark it as it is made
    _init(self, *args, **kwargs)
    print("MARKED " + ",".join(mark_phases(self)))


transformers.Trainer.__init__ = init_then_mark
runpy.run_path(str(Path(__file__).with_name("hf_trainer.py")), run_name="__main__")
