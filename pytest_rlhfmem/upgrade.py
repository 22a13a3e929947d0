"""``rlhfmem deps-diff``: a dependency upgrade as a pull request: one cell recorded under the old and the new
dependency set, and the per-phase diff naming the phase that moved and the packages that changed.

    rlhfmem deps-diff --base constraints/previous.txt --head constraints/deepspeed.txt -- \\
        run --framework deepspeed-chat --models tiny-opt --strategy zero2 --world-size 1 --device cpu

A dependency set (``--base``, ``--head``) is one of:

- a Python interpreter (``.venv-old/bin/python``) or a virtual environment's directory (its ``bin/python``), in
  which this checkout's ``pytest_rlhfmem`` imports (``pip install -e .`` there);
- a constraints file (``*.txt``, ``pip freeze``'s format, as ``constraints/deepspeed.txt``): a virtual environment
  is built for it once (:func:`build_env`: ``python -m venv``, then ``pip install -c FILE -e CHECKOUT[EXTRAS]``),
  kept under ``--envs-dir`` (default ``$RLHFMEM_CACHE_DIR/deps-envs``), keyed by the file's bytes and the extras.

The cell is ``rlhfmem run ...`` or ``rlhfmem capture ... -- COMMAND`` as written after ``--``, run by each
interpreter as ``python -m pytest_rlhfmem.cli`` with its own environment first on ``PATH`` and its own
``TORCH_EXTENSIONS_DIR`` (``<env>/torch_extensions``: DeepSpeed's JIT ops of one version never serve another).
Both results go to the work directory (``--work-dir``; default a new temporary one, printed), with each side's
installed distributions; the report is ``report.py``'s diff of the two results (whole iteration, then per phase,
the phase that moved most first) under the list of distributions that differ. Every figure is labelled as its
capture is (simulated on the CPU route and the simulated CUDA device).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .cbuild import cache_dir
from .errors import CliError
from .report import ReportInputError, diff, load_side, moved_phase, parse_threshold, to_json, to_markdown

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) holding pytest_rlhfmem/
SUBCOMMANDS = ("run", "capture")
LIST_DISTRIBUTIONS = ("import importlib.metadata as m, json; print(json.dumps(sorted({(d.metadata['Name'] or '')"
                      ".lower().replace('_', '-'): d.version for d in m.distributions()}.items())))")


@dataclass
class DependencySet:
    """One side: ``python`` (an interpreter path), ``prefix`` (its ``sys.prefix``), what it was given as
    (``spec``) and its distributions (name -> version, names lower-case with ``-``)."""

    spec: str
    python: str
    prefix: str
    distributions: dict[str, str]


def env_key(constraints: Path, extras: str) -> str:
    """The directory name of a constraints file's environment: 16 hex digits of the SHA-256 of its bytes, the
    extras and this interpreter's version (a new file, or other extras, build another)."""
    h = hashlib.sha256(constraints.read_bytes() + f"\0{extras}\0{sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def build_env(constraints: Path, envs_dir: Path, extras: str, log: Path) -> Path:
    """The interpreter of the virtual environment for ``constraints`` (bytes of the file, ``extras``), built once
    under ``envs_dir``: ``python -m venv``, then ``pip install -c CONSTRAINTS -e PACKAGE_ROOT[EXTRAS]`` (``pip`` as
    configured here: its index, its find-links; ``$PIP_CONSTRAINT`` dropped so the file alone decides). A finished
    environment carries a ``.complete`` mark; a half-built one is built again. The pip output goes to ``log``.
    Raises :class:`~.errors.CliError` (one line: the file, the step that failed, the log's last line)."""
    env = envs_dir / env_key(constraints, extras)
    python = env / "bin" / "python"
    if (env / ".complete").is_file() and python.exists():
        return python
    envs_dir.mkdir(parents=True, exist_ok=True)
    run_env = {k: v for k, v in os.environ.items() if k not in ("PIP_CONSTRAINT", "VIRTUAL_ENV", "PYTHONPATH")}
    target = f"{PACKAGE_ROOT}[{extras}]" if extras else str(PACKAGE_ROOT)
    steps = [([sys.executable, "-m", "venv", "--clear", str(env)], "python -m venv"),
             ([str(python), "-m", "pip", "install", "-q", "-c", str(constraints.resolve()), "-e", target],
              f"pip install -c {constraints} -e {target}")]
    with open(log, "ab") as out:
        for cmd, what in steps:
            out.write(f"$ {shlex.join(cmd)}\n".encode())
            out.flush()
            code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env)
            if code != 0:
                raise CliError(f"{constraints}: {what} exited with code {code} ({_last_line(log)}); log: {log}")
    (env / ".complete").write_text(str(constraints.resolve()) + "\n")
    return python


def resolve(spec: str, envs_dir: Path, extras: str, log: Path) -> DependencySet:
    """``spec`` (an interpreter, a virtual environment's directory, or a constraints ``.txt``) as a
    :class:`DependencySet`; a constraints file's environment is built first (:func:`build_env`). Raises
    :class:`~.errors.CliError` naming ``spec`` when it is none of these or its interpreter cannot import
    ``pytest_rlhfmem``."""
    p = Path(spec)
    if p.is_dir():
        python = p / "bin" / "python"
        if not python.exists():
            raise CliError(f"{spec}: a directory without bin/python: give a virtual environment, an interpreter or a "
                           "constraints file (.txt)")
    elif p.is_file() and p.suffix == ".txt":
        python = build_env(p, envs_dir, extras, log)
    elif p.is_file() and os.access(p, os.X_OK):
        python = p
    else:
        raise CliError(f"{spec}: not an interpreter, a virtual environment's directory or a constraints file (.txt)")
    probe = subprocess.run([str(python), "-c", "import sys, pytest_rlhfmem; print(sys.prefix); " + LIST_DISTRIBUTIONS],
                           capture_output=True, text=True, env=_clean_env())
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise CliError(f"{spec}: {python} cannot import pytest_rlhfmem ({tail}): install this checkout there "
                       "(pip install -e .)")
    prefix, listing = probe.stdout.strip().splitlines()[-2:]
    return DependencySet(spec, str(python), prefix, dict(json.loads(listing)))


def _clean_env() -> dict[str, str]:
    """This process's environment without what would make another interpreter import this one's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def cell_command(side: DependencySet, cell: list[str], out: Path) -> list[str]:
    """The command that records ``cell`` (``run ...`` or ``capture ... -- COMMAND``) with ``side``'s interpreter,
    its result written to ``out``. Raises :class:`~.errors.CliError` for a cell that is not one of
    :data:`SUBCOMMANDS` or names its own ``--json``."""
    if not cell or cell[0] not in SUBCOMMANDS:
        raise CliError(f"after --: {' or '.join(SUBCOMMANDS)} and its arguments (the cell to record), got "
                       f"{shlex.join(cell) or 'nothing'}")
    own = cell[1:cell.index("--")] if "--" in cell else cell[1:]
    if any(a == "--json" or a.startswith("--json=") for a in own):
        raise CliError("the cell's --json is deps-diff's own (each side's result goes to --work-dir)")
    return [side.python, "-m", "pytest_rlhfmem.cli", cell[0], "--json", str(out), *cell[1:]]


def side_env(side: DependencySet) -> dict[str, str]:
    """The environment a side's run gets: its ``bin`` first on ``PATH`` (torchrun, accelerate of that set),
    ``VIRTUAL_ENV`` its prefix, ``TORCH_EXTENSIONS_DIR`` under its prefix (JIT-built ops of one DeepSpeed never
    serve another), no ``PYTHONPATH`` of this process."""
    env = _clean_env()
    env["PATH"] = os.pathsep.join([str(Path(side.prefix) / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = side.prefix
    env["TORCH_EXTENSIONS_DIR"] = str(Path(side.prefix) / "torch_extensions")
    return env


def changed_distributions(base: DependencySet, head: DependencySet) -> list[tuple[str, str | None, str | None]]:
    """``(name, base version, head version)`` of every distribution whose version differs (``None``: absent on
    that side), sorted by name; this checkout's own ``pytest-rlhfmem`` left out."""
    names = sorted(set(base.distributions) | set(head.distributions))
    return [(n, base.distributions.get(n), head.distributions.get(n)) for n in names
            if n != "pytest-rlhfmem" and base.distributions.get(n) != head.distributions.get(n)]


def render(md: str, changes: list[tuple[str, str | None, str | None]], moved: str | None) -> str:
    """The report: a title naming what changed and the phase that moved, the list of changed distributions, then
    the diff (``report.to_markdown``)."""
    what = ", ".join(f"{n} {b or '(none)'} -> {h or '(none)'}" for n, b, h in changes) or "nothing"
    lines = ["# Dependency upgrade: memory diff", "",
             f"**Dependencies changed:** {what}  ",
             f"**Phase that moved:** {'`' + moved + '`' if moved else 'none beyond the threshold'}", ""]
    body = md.split("\n", 1)[1] if md.startswith("# ") else md  # to_markdown's own title dropped
    return "\n".join(lines) + body


def deps_diff(base_spec: str, head_spec: str, cell: list[str], work: Path | None = None,
              envs_dir: Path | None = None, extras: str = "deepspeed", threshold: str = "5%",
              timeout: float | None = None) -> tuple[str, dict, bool]:
    """Record ``cell`` under both dependency sets and diff them: returns ``(markdown, json report, regressed)``.
    ``work``: where both results, their traces, each side's distributions and the logs go (default a new
    temporary directory, named in the report's JSON as ``work_dir``, and removed again when the command is refused
    before either side's cell ran: a bad dependency set or cell leaves nothing behind). ``timeout``: seconds each
    side's run may take.
    Raises :class:`~.errors.CliError` (one line) for a dependency set that cannot be used or built, a cell that is
    not ``run``/``capture``, a side whose run ended without a result, or results that cannot be compared."""
    try:
        limit = parse_threshold(threshold)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    made = work is None
    work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="rlhfmem-deps-diff-"))
    work.mkdir(parents=True, exist_ok=True)
    envs = Path(envs_dir) if envs_dir is not None else cache_dir() / "deps-envs"
    log = work / "deps-diff.log"
    sides, cmds = {}, {}
    try:  # refused before either side's cell ran: the directory made for it goes again
        for name, spec in (("base", base_spec), ("head", head_spec)):
            sides[name] = resolve(spec, envs, extras, log)
            (work / f"{name}-distributions.json").write_text(json.dumps(sides[name].distributions, indent=1))
        for name, side in sides.items():
            cmds[name] = cell_command(side, cell, work / f"{name}.json")
    except CliError:
        if made:
            shutil.rmtree(work, ignore_errors=True)
        raise
    for name, side in sides.items():
        out = work / f"{name}.json"
        cmd = cmds[name]
        with open(log, "ab") as f:
            f.write(f"$ {shlex.join(cmd)}\n".encode())
            f.flush()
            try:
                subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=side_env(side), timeout=timeout,
                               check=False)
            except subprocess.TimeoutExpired:
                raise CliError(f"{name} ({side.spec}): the cell ran past {timeout:g} s; log: {log}") from None
        if not out.is_file():
            raise CliError(f"{name} ({side.spec}): the cell wrote no result ({_last_line(log)}); log: {log}")
    try:
        d = diff(load_side(work / "base.json"), load_side(work / "head.json"), limit)
    except ReportInputError as exc:
        raise CliError(str(exc)) from None
    changes = changed_distributions(sides["base"], sides["head"])
    top = moved_phase(d)
    moved = top.metric.partition(":")[0] if top is not None else None
    md = render(to_markdown(d), changes, moved)
    report = to_json(d) | {"title": "Dependency upgrade: memory diff", "work_dir": str(work),
                           "dependencies_changed": [{"name": n, "base": b, "head": h} for n, b, h in changes],
                           "base_env": sides["base"].prefix, "head_env": sides["head"].prefix}
    return md, report, d.regressed
