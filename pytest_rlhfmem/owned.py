"""What the tool made, and nothing else: the work directories it created and the processes it started.

A run never removes a directory it did not create, and never signals a process because a file names its pid.

- Work directories (:func:`claim_work_dir`, :func:`remove_work`): a directory the run creates (a new temporary
  one, or a ``--work-dir`` path that did not exist) is the run's, removed whole after a run that passed. A
  ``--work-dir`` that already exists is the user's: it must be empty (one line otherwise, before anything runs;
  a multi-node run's shared directory is checked for other runs' rank files instead), and afterwards only the
  entries a run writes (:data:`RUN_ENTRIES`) are removed from it; the directory and anything else in it stay.
  A multi-node run's shared directory is made by whichever node's agent comes first: that agent leaves
  :data:`MADE_MARK` in it, so node rank 0, which removes the run's files, removes the directory too.
- Processes (:func:`run_env`, :func:`is_run_process`): every process a run starts carries the run's own random
  token in its environment (:data:`TOKEN_PREFIX` + token, inherited by torchrun's workers and their children,
  unforgeable by a file). A pid read from a rank's progress file is signalled only when ``/proc/<pid>/environ``
  carries the token and the process started no earlier than the run's launcher (a reused pid fails both).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

MADE_MARK = ".rlhfmem-made-by-run"  # in a shared (multi-node) directory that one of the run's agents created

# The names a run writes into its work directory (rlhf/launch.py, record/rank.py, command/run.py, command/rank.py):
# removed from a directory the user gave once the run passed. A name missing here stays behind (the safe side);
# tests/test_owned.py holds a passing run in an existing directory to "nothing of the run left".
RUN_ENTRIES = (
    "launcher.log",  # torchrun's output (the recipes)
    "command.log",  # the user's command's output (rlhfmem capture)
    "torchelastic",  # torchrun's --log-dir
    "alive-at-timeout.json",  # the ranks still running at a timeout
    "progress-rank*",  # each rank's phase, pid and peaks so far (and their .tmp while written)
    "result-rank*",  # each rank's result
    "trace-rank*",  # each rank's trace
    "claim-rank*",  # a command's rank claim (command/rank.py)
    "node[0-9]*",  # a multi-node agent's log and report
    "leftover-processes.json",  # processes of the run still alive after it ended (LEFTOVERS)
    MADE_MARK,
)
LEFTOVERS = "leftover-processes.json"

TOKEN_PREFIX = "RLHFMEM_RUN_"  # + token: the environment variable every process of a run carries (value "1")


class WorkDirError(ValueError):
    """A ``--work-dir`` the run cannot use without touching what is not its own (one line)."""


def claim_work_dir(work_dir: str | Path | None, prefix: str, shared: bool = False) -> tuple[Path, bool]:
    """The run's work directory and whether this call created it.

    ``work_dir`` ``None``: a new temporary directory (``prefix`` + random). A path that does not exist: created
    (its missing parents too; only the leaf is the run's). An existing empty directory: used as it is. Raises
    :class:`WorkDirError` for a path that is not a directory, or a non-empty directory (unless ``shared``: a
    multi-node run's directory, which every node's agent names and fills; its caller checks it for other
    runs' rank files)."""
    if work_dir is None:
        return Path(tempfile.mkdtemp(prefix=prefix)), True
    work = Path(work_dir)
    try:
        work.mkdir(parents=True)
        if shared:  # another node's agent may find it first: it is the run's all the same
            (work / MADE_MARK).touch()
        return work, True
    except FileExistsError:
        pass
    except OSError as exc:
        raise WorkDirError(f"--work-dir {work}: cannot create it ({exc.strerror or exc})") from None
    if not work.is_dir():
        raise WorkDirError(f"--work-dir {work}: exists and is not a directory")
    if not shared:
        entries = sorted(p.name for p in work.iterdir())
        if entries:
            raise WorkDirError(f"--work-dir {work}: not empty (holds {entries[0]!r}"
                               + (f" and {len(entries) - 1} more" if len(entries) > 1 else "")
                               + "); the run removes its own files afterwards, so it needs a new or empty directory")
    return work, False


def remove_work(work: str | Path, created: bool) -> None:
    """After a run that passed: remove ``work`` whole if the run ``created`` it, else only the entries a run
    writes (:data:`RUN_ENTRIES`), leaving the directory and everything else in it; a shared directory another
    agent of the run created (:data:`MADE_MARK`) is removed too once nothing else is in it."""
    work = Path(work)
    if created:
        shutil.rmtree(work, ignore_errors=True)
        return
    made_by_run = (work / MADE_MARK).exists()
    for pattern in RUN_ENTRIES:
        for p in work.glob(pattern):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
    if made_by_run:
        try:
            work.rmdir()
        except OSError:  # something else is in it: not the run's
            pass


def new_token() -> str:
    """A run's token: 16 random hex digits."""
    return secrets.token_hex(8)


def run_env(env: dict[str, str], token: str) -> dict[str, str]:
    """``env`` with the run's token added: every process the run starts, and every process those start, carries
    it (an outer run's token stays: a run inside a run's rank belongs to both)."""
    return {**env, TOKEN_PREFIX + token: "1"}


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22), or ``None`` when it is
    gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields from 3 (state) on: the name may hold spaces
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_run_process(pid: object, token: str, not_before: int | None) -> bool:
    """Whether ``pid`` is a live process of the run whose token is ``token``: its environment carries the token
    and it started at or after ``not_before`` (the launcher's :func:`start_ticks`; ``None`` skips that check).
    Anything else (a pid from a stale or planted file, a reused pid, a process this user cannot read, a value
    that is not a pid) is ``False``."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        return False
    started = start_ticks(pid)
    if started is None or (not_before is not None and started < not_before):
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{TOKEN_PREFIX}{token}=1".encode() in environ


def run_processes(token: str, not_before: int | None) -> list[tuple[int, str]]:
    """The live processes of the run whose token is ``token`` (:func:`is_run_process`), each ``(pid, command
    line)``: after the run's command ended and its ranks' groups were killed, the ones its program left behind (a
    daemon that double-forked into a session of its own)."""
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        pid = int(d.name)
        if is_run_process(pid, token, not_before):
            try:
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            found.append((pid, cmdline))
    return sorted(found)


def stop_processes(pids: list[int], token: str, not_before: int | None, grace: float = 3.0) -> None:
    """SIGTERM to each of ``pids`` that is still a process of the run, then after ``grace`` seconds SIGKILL to those
    alive (each verified again before it is signalled: a pid freed meanwhile is not touched)."""
    import signal
    import time

    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in pids if is_run_process(p, token, not_before)]
        for p in alive:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        t_end = time.monotonic() + grace
        while alive and time.monotonic() < t_end:
            time.sleep(0.05)
            alive = [p for p in alive if is_run_process(p, token, not_before)]
        if not alive:
            return
