"""The plugin's options: each ``--gpu-marker`` / ``--rlhfmem-*`` flag with its ini twin, and how a value is read.

One table (:data:`OPTIONS`) serves both sides: ``plugin.py: pytest_addoption`` registers every row (the flag
and an ini key named as its ``dest``), and :func:`option_value` reads one, the command line over the ini file.
An ini value is checked as the command line checks its flag (a number, one of the choices) when it is read.
The session, the budget check and the fixtures read their options here, so the table sits below them all.
Units: ``--rlhfmem-timeout`` is seconds; no option is a size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

GPU_MARKER_MODES = ("auto", "skip", "require")


@dataclass(frozen=True)
class Option:
    """One row of the table: ``flag`` on the command line, ``dest`` its attribute and ini key."""

    flag: str
    dest: str
    help: str
    kind: str = "string"  # "string" | "bool" | "float" | "int" | "choice"
    default: Any = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # "float" / "int" rows: the least allowed value (finite numbers only)
    exclusive: bool = False  # the minimum itself is not allowed

    def allowed(self) -> str:
        """The allowed values of a number row, in words."""
        what = "a whole number" if self.kind == "int" else "a finite number"
        return what + ("" if self.minimum is None else f" {'>' if self.exclusive else '>='} {self.minimum:g}")

    def check(self, value: float) -> bool:
        if value != value or value in (float("inf"), float("-inf")):
            return False
        return self.minimum is None or (value > self.minimum if self.exclusive else value >= self.minimum)


OPTIONS = (
    Option("--gpu-marker", "gpu_marker", "what to do with tests marked gpu: auto = run when enough CUDA devices "
           "(and memory) are present, else skip saying what is missing; skip = skip them all; require = a gpu "
           "test that cannot run FAILS. Memory: min_memory_gb=N is GB as cards are sold, met by a device whose "
           "total_memory is at least 0.96 x N x 10^9 bytes (every card sold as N GB: an A10G, L4, RTX 3090 or "
           "4090 for 24, a T4 or V100 for 16, an A100 or H100 for 40/80; no card sold smaller); "
           "min_memory_gib=N is exact binary GiB (N x 2^30 bytes)", "choice", "auto", GPU_MARKER_MODES),
    Option("--rlhfmem-update-baselines", "rlhfmem_update_baselines",
           "write the measured figures as the budgets (only the scenarios that ran) and pass", "bool", False),
    Option("--rlhfmem-baselines-dir", "rlhfmem_baselines_dir",
           "directory of budget files <profile>/<suite>.yaml (default: baselines/ beside the rootdir)"),
    Option("--rlhfmem-profile", "rlhfmem_profile", "hardware profile naming the budget directory (default: cpu "
           "for simulated figures, cuda-rehearsal for the rehearsal device's, else cuda-<gpu model>-x<count>)"),
    Option("--rlhfmem-device", "rlhfmem_device", "where iterations run: auto = CUDA with one device per rank, "
           "CPU with the allocator model (simulated) when there is no CUDA device, and a run with fewer CUDA "
           "devices than ranks is refused; cuda without a CUDA device is a usage error; cuda-sim = a command's "
           "CUDA code, unchanged, on the simulated CUDA device (rlhfmem_command only; simulated); cuda-rehearsal = "
           "the GPU route's own code (its memory history and snapshot) on the simulated CUDA device, for commands "
           "and the DeepSpeed-Chat recipe (simulated; budgets under baselines/cuda-rehearsal/)", "choice", "auto",
           ("auto", "cpu", "cuda", "cuda-sim", "cuda-rehearsal")),
    Option("--rlhfmem-cuda-emulation", "rlhfmem_cuda_emulation", "CPU runs: emulate CUDA's own allocations "
           "(cuBLAS workspaces, host scalars, CPU kernel scratch) in the capture; results record it and budgets "
           "of another capture are refused as not comparable", "choice", "on", ("on", "off")),
    Option("--rlhfmem-timeout", "rlhfmem_timeout", "seconds one iteration (all ranks) may take before its "
           "processes are killed and the test fails as hung", "float", 900.0, minimum=0, exclusive=True),
    Option("--rlhfmem-json", "rlhfmem_json", "write every result of the session (with budget verdicts) to this "
           "JSON file"),
    Option("--rlhfmem-snapshots", "rlhfmem_snapshots", "save each rank's trace as a memory_viz snapshot pickle in "
           "this directory (simulated ones are labelled so inside)"),
    Option("--rlhfmem-report", "rlhfmem_report", "write the per-PR memory diff report (markdown) against the "
           "baselines to this path; a JSON twin is written beside it"),
    Option("--rlhfmem-benchmark-json", "rlhfmem_benchmark_json", "write github-action-benchmark "
           "customSmallerIsBetter JSON (one entry per scenario and metric: unit bytes for sizes, count for counts)"),
    Option("--rlhfmem-time-rounds", "rlhfmem_time_rounds", "run each iteration N times: times become the "
           "median with their spread (memory figures from the first round)", "int", 1, minimum=1),
    Option("--rlhfmem-advise", "rlhfmem_advise", "for a scenario over its budget, add rlhfmem advise's "
           "recommendation (from the run's own trace) to the failure message and the report", "bool", False),
    Option("--rlhfmem-kill-leftovers", "rlhfmem_kill_leftovers", "stop the processes a run leaves behind once it "
           "ended (a daemon the program double-forked); by default they are named in a warning and left running",
           "bool", False),
    Option("--rlhfmem-keep-work", "rlhfmem_keep_work", "keep each run's work directory (ranks' files, launcher "
           "log, traces); by default it is removed at the session's end once its traces are stored beside "
           "--rlhfmem-json, and kept, its path printed, when the run failed", "bool", False),
)


def option_value(config: pytest.Config, dest: str) -> Any:
    """The value of option ``dest``: the command line's when given, else the ini twin's, else the row's default.
    An ini value is converted (``float`` / ``int`` rows) and checked (``choice`` rows) here. Raises
    ``pytest.UsageError`` (one line naming the ini key) for an ini value that is not a number or not one of
    the choices, and ``StopIteration`` for a ``dest`` that is not in :data:`OPTIONS` (a programming error)."""
    o = next(x for x in OPTIONS if x.dest == dest)
    v = config.getoption(dest)
    if v is not None:
        if o.kind in ("float", "int") and not o.check(v):
            raise pytest.UsageError(f"{o.flag}={v!r}: allowed values are {o.allowed()}")
        return v
    v = config.getini(dest)
    if v in (None, ""):
        return o.default
    if o.kind in ("float", "int"):
        try:
            number = float(v) if o.kind == "float" else int(v)
        except ValueError:
            raise pytest.UsageError(f"ini option {dest} = {v!r}: expected {o.allowed()}") from None
        if not o.check(number):
            raise pytest.UsageError(f"ini option {dest} = {v!r}: allowed values are {o.allowed()}")
        return number
    if o.choices and v not in o.choices:
        raise pytest.UsageError(f"ini option {dest} = {v!r}: allowed values are {', '.join(o.choices)}")
    return v
