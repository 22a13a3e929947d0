"""What the ``ppo_iteration`` and ``rlhfmem_command`` fixtures return: a call that runs, records and returns.

Both run in fresh processes in a work directory of their own (noted in the session, removed at its end
unless the run failed), ``--rlhfmem-time-rounds`` times (``timing.run_rounds``), record the result in the
session and fail the test in one line when the run cannot start or did not finish. A run stopped by
SIGINT, SIGTERM or SIGHUP ends the session (:func:`stop_session`). The heavy imports (the recipes' launcher,
the command runner) happen on the first call, so loading the plugin stays fast.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from .errors import RlhfmemWarning
from .options import option_value
from .results import IterationResult
from .session import RlhfmemSession
from .timing import run_rounds


def stop_session(exc: KeyboardInterrupt) -> NoReturn:
    """A run that SIGINT, SIGTERM or SIGHUP stopped (``rlhf/launch.py``'s ``RunInterrupted``: every process of
    the run already stopped): end the session with its one line (each rank's phase, the work directory) and exit
    status 128 + the signal (130, 143, 129), as a shell reports a process the signal ended. Raises
    ``pytest.exit``'s exception, or ``exc`` itself for a plain ``KeyboardInterrupt``."""
    if hasattr(exc, "exit_status"):
        pytest.exit(f"rlhfmem: {exc}", returncode=exc.exit_status)
    raise exc


@dataclass
class _Runner:
    """What both fixtures share: the test's request, the session and pytest's temporary directories."""

    request: pytest.FixtureRequest
    session: RlhfmemSession
    tmp_path_factory: pytest.TempPathFactory

    def option(self, dest: str) -> Any:
        return option_value(self.request.config, dest)

    def _run(self, work_name: str, start: Callable[[Path, str | None], dict], refused: type[Exception],
             prefix: str = "") -> IterationResult:
        """``start(work_dir, snapshot_dir)`` for each round, each in a new ``<work_name>N`` directory; the
        result recorded. Fails the test with ``prefix`` and the message of a ``refused`` error, or with the
        result's failure (rank, phase, memory so far)."""

        def once(snapshots: str | None) -> dict:
            work = self.tmp_path_factory.mktemp(work_name)
            self.session.note_work(work, None)
            data = start(work, snapshots)
            self.session.note_work(work, data)
            return data

        try:
            data, _ = run_rounds(once, self.option("rlhfmem_time_rounds") or 1, self.option("rlhfmem_snapshots"))
        except refused as exc:
            bad = prefix + str(exc)
        except KeyboardInterrupt as exc:
            stop_session(exc)
        else:
            bad = None
        if bad:  # outside the except block: one message, no chained traceback
            pytest.fail(bad, pytrace=False)
        from .rlhf.launch import leftover_warning

        result = IterationResult(data)
        left = leftover_warning(data)
        if left:  # the program's own processes outlived the run: named where pytest lists warnings
            warnings.warn(RlhfmemWarning(left), stacklevel=3)
        self.session.record(self.request.node.nodeid, result)
        if not result.ok:
            pytest.fail(result.describe_failure(), pytrace=False)
        return result


class IterationRunner(_Runner):
    """``ppo_iteration(framework="deepspeed-chat", models="tiny-opt", strategy="none", flush="none",
    world_size=2, device=None, algorithm="ppo", **overrides)``: ONE RLHF iteration (PPO, or ``remax`` /
    ``grpo``) in fresh worker processes (torchrun); ``iterations=N`` (an override) runs N of them on the same
    engines, with per-iteration figures and, for N >= 3, their growth. Fails the test (``pytest.fail``) for an
    unknown name (with
    the list of valid ones), a device that cannot run it, a JIT op build that fails, and a crashed, hung or
    OOM run (with the rank, phase and memory so far)."""

    def __call__(self, framework: str = "deepspeed-chat", models: str = "tiny-opt", strategy: str = "none",
                 flush: str = "none", world_size: int = 2, device: str | None = None, algorithm: str = "ppo",
                 **overrides: Any) -> IterationResult:
        from .rlhf.launch import run_scenario
        from .rlhf.scenario import Scenario, ScenarioError

        try:
            scenario = Scenario(framework, models, strategy, flush, world_size, overrides, algorithm)
        except ScenarioError as exc:
            pytest.fail(str(exc), pytrace=False)
        where = device or self.option("rlhfmem_device")
        if where == "cuda-sim":
            pytest.fail("ppo_iteration: device cuda-sim runs a command's CUDA code on the simulated CUDA device "
                        "(rlhfmem_command); the recipes run on cpu or cuda, and on the simulated device through the "
                        "fake-CUDA route (suites/test_deepspeed_chat_gpu1_sim.py)", pytrace=False)

        def start(work: Path, snapshots: str | None) -> dict:
            return run_scenario(scenario, device=where,
                                timeout=self.option("rlhfmem_timeout"), snapshot_dir=snapshots, work_dir=work,
                                cuda_emulation=self.option("rlhfmem_cuda_emulation"),
                                kill_leftovers=bool(self.option("rlhfmem_kill_leftovers")))

        return self._run("rlhfmem-run", start, ScenarioError)


class CommandRunner(_Runner):
    """``rlhfmem_command(cmd, *, id, world_size=None, timeout=None, env=None, device=None, cwd=None,
    iterations=None)``: YOUR training command with every rank recorded from its first allocation, as ``rlhfmem
    capture`` does. ``timeout`` is seconds (default ``--rlhfmem-timeout``). ``iterations=N``: the program runs N
    iterations (``$RLHFMEM_ITERATIONS`` says N) and marks each with ``rlhfmem.iteration()``: the result has
    per-iteration figures and, for N >= 3, their growth, which the budget gates. Fails the test (``pytest.fail``,
    one line starting ``rlhfmem_command('<id>'):``) for a command that cannot run or that marked another number of
    iterations, and with the rank, phase and memory so far for a crashed, hung or OOM rank."""

    def __call__(self, cmd: Sequence[str] | str, *, id: str, world_size: int | None = None,  # noqa: A002
                 timeout: float | None = None, env: dict | None = None, device: str | None = None,
                 cwd: str | Path | None = None, iterations: int | None = None) -> IterationResult:
        from .command.run import CommandError, run_command

        def start(work: Path, snapshots: str | None) -> dict:
            return run_command(cmd, id, world_size=world_size, device=device or self.option("rlhfmem_device"),
                               timeout=timeout or self.option("rlhfmem_timeout"), snapshot_dir=snapshots,
                               work_dir=work, env=env, cwd=cwd,
                               cuda_emulation=self.option("rlhfmem_cuda_emulation") or "on",
                               kill_leftovers=bool(self.option("rlhfmem_kill_leftovers")), iterations=iterations)

        return self._run("rlhfmem-command", start, CommandError, f"rlhfmem_command({id!r}): ")
