"""The GPU route's code and which of its lines the default tests execute (issue 45): a plain module the conftest
and tests/test_gpu_route_coverage.py import.

:data:`ROUTE` names the code a run on a GPU executes and a CPU or ``cuda-sim`` run does not: the CUDA branches of the
launcher, the rank's capture and its recorder, the memory history, the CUDA host meter, the profile. The tests that
exercise it (the rehearsal, :data:`MEASURED_MODULES`) run under coverage.py (branch mode): in their own process and,
through ``$COVERAGE_PROCESS_START`` and coverage's ``.pth`` hook, in every process they start (the ranks, torchrun,
pytester's sessions). At the session's end the conftest prints the lines of :data:`ROUTE` no measured test executed:
each must be one a real GPU is needed for, marked ``# hardware-only: <why>`` where it stands (the named list,
:func:`hardware_only`), or a gap to close. A branch of a measured unit that leads only to hardware-only lines is
hardware-only as well.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_rlhfmem"
ENV_DIR = "RLHFMEM_GPU_ROUTE_COVERAGE_DIR"  # where the measured processes write their data (set by the conftest)
HARDWARE_ONLY = "# hardware-only:"  # marks a line only a real GPU executes, with the reason after it

# (file under pytest_rlhfmem/, qualified name of a function or class): the GPU route's units
ROUTE: tuple[tuple[str, str], ...] = (
    ("hardware.py", "detect_cuda_devices"),
    ("hardware.py", "cuda_device_count"),
    ("hardware.py", "profile_name"),
    ("hardware.py", "code_device"),
    ("rlhf/launch.py", "resolve_device"),
    ("rlhf/launch.py", "no_cuda_device"),
    ("rlhf/launch.py", "jit_ops"),
    ("rlhf/launch.py", "command_env"),
    ("rlhf/launch.py", "_sim_cuda_library"),
    ("command/rank.py", "_start_cuda"),
    ("record/rank.py", "_cuda_peaks"),
    ("record/rank.py", "_current_cuda_device"),
    ("record/rank.py", "_write_snapshot"),
    ("record/recorder.py", "Recorder._start_cuda"),
    ("record/recorder.py", "Recorder._mark_cuda"),
    ("record/recorder.py", "Recorder._flush_cuda"),
    ("record/recorder.py", "Recorder._stop_cuda"),
    ("record/recorder.py", "Recorder.intercept_history"),
    ("record/recorder.py", "_cuda_memory_stats"),
    ("record/recorder.py", "cuda_trace_with_marks"),
    ("record/recorder.py", "cuda_phase_counters"),
    ("record/recorder.py", "HistoryWrapped"),
    ("record/recorder.py", "history_settings"),
    ("record/recorder.py", "history_lost"),
    ("record/recorder.py", "mark_times"),
    ("record/recorder.py", "CudaHistory"),
    ("record/host.py", "_has_host_allocator_stats"),
    ("record/host.py", "cuda_pinned_peak"),
    ("record/host.py", "reset_cuda_pinned_peak"),
    ("fakecuda/rehearsal.py", "main"),
)
ROUTE_FILES = tuple(sorted({f for f, _ in ROUTE}))
# the test modules that exercise the route, measured under coverage in the default run
MEASURED_MODULES = ("test_rehearsal.py", "test_cuda_path.py", "test_cuda_capture_history.py",
                    "test_gpu_runner_devices.py", "test_gpu_runner_ops.py")


@dataclass(frozen=True)
class Unit:
    file: str
    qualname: str
    lines: frozenset[int]  # the unit's source lines, its definition line and docstring excluded


def units() -> list[Unit]:
    """Each unit of :data:`ROUTE` with its lines (``ast``); raises ``LookupError`` naming a unit that is gone."""
    out = []
    for file, qualname in ROUTE:
        tree = ast.parse((PACKAGE / file).read_text())
        node = _find(tree, qualname.split("."))
        if node is None:
            raise LookupError(f"tests/gpu_route.py: {file}: no {qualname} (renamed or removed: update ROUTE)")
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring
        lines = {n for stmt in body for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)}
        out.append(Unit(file, qualname, frozenset(lines)))
    return out


def _find(tree: ast.AST, path: list[str]) -> ast.AST | None:
    node = tree
    for name in path:
        node = next((n for n in ast.iter_child_nodes(node)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name), None)
        if node is None:
            return None
    return node


def hardware_only(file: str) -> dict[int, str]:
    """``{line: why}`` of the lines of ``file`` marked :data:`HARDWARE_ONLY`."""
    out = {}
    for i, text in enumerate((PACKAGE / file).read_text().splitlines(), 1):
        if HARDWARE_ONLY in text:
            out[i] = text.split(HARDWARE_ONLY, 1)[1].strip()
    return out


def config_text(data_dir: Path) -> str:
    """coverage.py's settings for the measured processes (branch mode, one data file per process)."""
    sources = "\n    ".join(str(PACKAGE / f) for f in ROUTE_FILES)
    return (f"[run]\nbranch = True\nparallel = True\ndata_file = {data_dir / '.coverage'}\n"
            f"disable_warnings = no-data-collected, module-not-measured\ninclude =\n    {sources}\n")


def missing(data_dir: Path) -> tuple[dict[Unit, list[int]], dict[Unit, dict[int, str]], int]:
    """Combine the measured processes' data in ``data_dir``; returns ``(lines of each unit no measured test
    executed and not marked hardware-only, the hardware-only lines of each unit, the units' executable lines)``."""
    import coverage

    cov = coverage.Coverage(data_file=str(data_dir / ".coverage"), config_file=str(data_dir / "coveragerc"))
    cov.combine([str(data_dir)], keep=False, strict=False)
    cov.load()
    gaps: dict[Unit, list[int]] = {}
    marked: dict[Unit, dict[int, str]] = {}
    total = 0
    analysed: dict[str, tuple[set[int], set[int]]] = {}
    for unit in units():
        if unit.file not in analysed:
            _, statements, _, missed, _ = cov.analysis2(str(PACKAGE / unit.file))
            analysed[unit.file] = (set(statements), set(missed))
        statements, missed = analysed[unit.file]
        hw = hardware_only(unit.file)
        mine = statements & unit.lines
        total += len(mine)
        gaps[unit] = sorted(n for n in missed & mine if n not in hw)
        marked[unit] = {n: why for n, why in hw.items() if n in unit.lines}
    return gaps, marked, total


def report(data_dir: Path) -> list[str]:
    """The terminal report's lines (see the module docstring)."""
    gaps, marked, total = missing(data_dir)
    not_run = sum(len(v) for v in gaps.values())
    hw = sum(len(v) for v in marked.values())
    lines = [f"GPU route (tests/gpu_route.py: {len(gaps)} units, {total} executable lines): the rehearsal and the "
             f"CUDA tests executed {total - not_run - hw}; {hw} are hardware-only; {not_run} no test executed"]
    for unit, missed in gaps.items():
        if missed:
            lines.append(f"  not executed: pytest_rlhfmem/{unit.file}: {unit.qualname}: lines "
                         f"{', '.join(map(str, missed))}")
    for unit, why in marked.items():
        for n, reason in why.items():
            lines.append(f"  hardware-only: pytest_rlhfmem/{unit.file}:{n} ({unit.qualname}): {reason}")
    return lines


def data_dir() -> Path | None:
    d = os.environ.get(ENV_DIR)
    return Path(d) if d else None
