"""The files a command or a session writes, checked before anything runs, and kept when they still cannot be written.

Every output path a user names (``rlhfmem run/capture --json`` and ``--snapshot-dir``, ``rlhfmem advise --json/--md``,
``rlhfmem plot -o``, ``pytest --rlhfmem-json/--rlhfmem-report/--rlhfmem-benchmark-json/--rlhfmem-snapshots``) is
checked where it is parsed (:func:`check_file`, :func:`check_dir`): a directory named as a file, a path under a
file, or a place this process cannot write in is one line naming the option, before a run's minutes are spent.
The check probes by writing (a file created and removed), so a read-only mount or a full directory is found as the
run would find it, root or not; a directory it had to create is removed again (nothing of the check stays).
If writing still fails at the end (the disk filled during the run), :func:`keep` puts the text in a named file
of the temporary directory instead, and the caller says where, so a measured result is never lost.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


class OutputError(ValueError):
    """An output path that cannot be written (one line naming the option and the path)."""


def check_file(path: str | Path | None, option: str) -> None:
    """Raise :class:`OutputError` unless a file could be written at ``path`` (``None``: nothing to write)."""
    if path is None:
        return
    if not str(path):
        raise OutputError(f"{option} '': a file name is needed")
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{option} {path}: is a directory; give a file name")
    if p.exists():
        try:
            with open(p, "a"):  # opened for appending: nothing of its content changes
                pass
        except OSError as exc:
            raise OutputError(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None
        return
    _probe(p.parent, option, path)


def check_dir(path: str | Path | None, option: str) -> None:
    """Raise :class:`OutputError` unless files could be written in directory ``path`` (made if missing)."""
    if path is None:
        return
    if not str(path):
        raise OutputError(f"{option} '': a directory is needed")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{option} {path}: is not a directory")
    _probe(p, option, path)


def _probe(directory: Path, option: str, shown: str | Path) -> None:
    """Write (and remove) a file in ``directory``, creating it and its missing parents for the probe and removing
    those again."""
    made: list[Path] = []
    d = directory
    try:
        while not d.exists():
            made.append(d)
            d = d.parent
        if not d.is_dir():
            raise OutputError(f"{option} {shown}: {d} is not a directory")
        for m in reversed(made):
            m.mkdir()
        fd, probe = tempfile.mkstemp(prefix=".rlhfmem-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{option} {shown}: cannot write in {directory} ({exc.strerror or exc})") from None
    finally:
        for m in made:  # innermost first
            try:
                m.rmdir()
            except OSError:
                pass


def keep(text: str, name: str) -> Path:
    """Write ``text`` to a new file of the temporary directory named after ``name`` (``rlhfmem-<name>-<time>-*``)
    and return its path: where a result goes when its own path could not be written. Raises ``OSError`` when
    even that fails."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
    fd, path = tempfile.mkstemp(prefix=f"rlhfmem-{stem}-{time.strftime('%Y%m%dT%H%M%S')}-", suffix=Path(name).suffix)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(path)
