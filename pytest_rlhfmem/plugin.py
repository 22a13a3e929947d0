"""pytest face of pytest-rlhfmem: options (+ ini twins), the ``gpu`` marker, fixtures, the session.

Registered through the ``pytest11`` entry point. The work lives one concern per module: the option table and
how a value is read (``options.py``), the ``gpu`` marker's arguments (``marks.py``), the session's state and
hooks, xdist merge included (``session.py``), the terminal summary (``summary.py``), the budget check
(``budget_check.py``) and what the two run fixtures return (``runners.py``). Heavy imports (torch,
deepspeed) happen only when a test actually runs an iteration, so ``pytest --help`` and unrelated test runs
stay fast.
"""

from __future__ import annotations

from typing import Any

import pytest

from .budget_check import MemoryBudget
from .marks import GPU_MARKER_HELP
from .options import OPTIONS
from .runners import CommandRunner, IterationRunner
from .session import RlhfmemSession


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rlhfmem", "RLHF memory budgets (pytest-rlhfmem)")
    for o in OPTIONS:
        if o.kind == "bool":
            group.addoption(o.flag, dest=o.dest, action="store_true", default=None, help=o.help)
            parser.addini(o.dest, o.help, type="bool", default=o.default)
        else:
            kw: dict[str, Any] = {"dest": o.dest, "default": None, "help": o.help}
            if o.choices:
                kw["choices"] = o.choices
            if o.kind in ("float", "int"):
                kw["type"] = float if o.kind == "float" else int
            group.addoption(o.flag, **kw)
            parser.addini(o.dest, o.help + " (ini twin of " + o.flag + ")", default=o.default)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", GPU_MARKER_HELP)
    config.pluginmanager.register(RlhfmemSession.start(config), "rlhfmem_session")


@pytest.fixture
def rlhfmem_session(request: pytest.FixtureRequest) -> RlhfmemSession:
    """``rlhfmem_session.results[-1]["metrics"]["peak_reserved"]``: the session's :class:`RlhfmemSession`
    (options, results with sizes in bytes, budget verdicts)."""
    return request.config.pluginmanager.get_plugin("rlhfmem_session")


@pytest.fixture
def ppo_iteration(request: pytest.FixtureRequest, rlhfmem_session: RlhfmemSession,
                  tmp_path_factory: pytest.TempPathFactory) -> IterationRunner:
    """``result = ppo_iteration(framework="deepspeed-chat", models="tiny-opt", strategy="zero2")``

    Factory: ``ppo_iteration(framework="deepspeed-chat", models="tiny-opt", strategy="none",
    flush="none", world_size=2, device=None, algorithm="ppo", **overrides)`` runs ONE RLHF iteration (PPO,
    or ``remax`` / ``grpo``) in fresh worker processes (torchrun) and returns an :class:`IterationResult`.
    A crashed, hung or OOM run fails the test with the rank, phase and memory so far. Unknown names fail
    with the list of valid ones; a device that cannot run it (``cuda`` without a GPU; fewer CUDA devices
    than ranks, under ``auto`` too) or a JIT op build that fails fails in one line before any rank starts."""
    return IterationRunner(request, rlhfmem_session, tmp_path_factory)


@pytest.fixture
def rlhfmem_command(request: pytest.FixtureRequest, rlhfmem_session: RlhfmemSession,
                    tmp_path_factory: pytest.TempPathFactory) -> CommandRunner:
    """``result = rlhfmem_command("python train.py --steps 1", id="my-trainer", world_size=2)``

    Factory: ``rlhfmem_command(cmd, *, id, world_size=None, timeout=None, env=None, device=None,
    cwd=None)`` runs YOUR training command (a script, ``python -m module`` or a torchrun line; a list or a
    shell-like string) with every rank recorded from its first allocation, as ``rlhfmem capture`` does, and
    returns the same :class:`IterationResult` as ``ppo_iteration``: ``memory_budget.check(result)`` keys the
    budget entry by ``id``. ``world_size`` > 1 wraps a plain command in torchrun; ``timeout`` (seconds)
    defaults to ``--rlhfmem-timeout``; ``env`` adds environment variables. A crashed, hung or OOM rank
    fails the test with its rank, phase and memory so far; a command that cannot run (not found, exits
    before its first allocation, never imports torch; a device without a CUDA device per rank) fails the test
    in one line."""
    return CommandRunner(request, rlhfmem_session, tmp_path_factory)


@pytest.fixture
def memory_budget(request: pytest.FixtureRequest, rlhfmem_session: RlhfmemSession) -> MemoryBudget:
    """``memory_budget.check(ppo_iteration(strategy="zero2"))``

    Compares an :class:`IterationResult` with its YAML budget; see :class:`MemoryBudget`."""
    return MemoryBudget(request, rlhfmem_session)
