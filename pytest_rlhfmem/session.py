"""The session's state, registered as a pytest plugin: results, budget verdicts, baseline updates.

One :class:`RlhfmemSession` per pytest session (``plugin.py: pytest_configure`` registers it as
``rlhfmem_session``); its hook methods do the session's work:

- the ``gpu`` marker: each marked test runs, is skipped or fails as ``--gpu-marker`` says;
- before the first test: every gpu mark is read and every budget file the collected tests check by default is
  loaded (and, under ``--rlhfmem-update-baselines``, its directory checked writable);
- each result the fixtures record (with its :class:`BudgetVerdict` from ``memory_budget``), each budget file
  entry produced, each run's work directory;
- under pytest-xdist, each worker sends its state at its end and the controller merges it
  (:meth:`RlhfmemSession.merge_state`), so budget files and reports are written once, by the controller;
- at the end: the budget files written, ``--rlhfmem-json``, the reports (``report.py``), the work
  directories removed, and the terminal summary (``summary.py``) with the stale entries.

Sizes in results and budget entries are bytes.
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import budgets as B
from . import hardware
from .cbuild import builds_since, cache_dir
from .hardware import REHEARSAL_DEVICE, REHEARSAL_PROFILE, CudaDevice, gpu_shortfall, profile_name
from .marks import gpu_mark_args
from .options import option_value
from .report import write_session_outputs
from .results import IterationResult, strip_for_summary
from .summary import write_terminal_summary


@dataclass
class BudgetVerdict:
    """How one result compared with its budget entry (``memory_budget.check``); stored in the session's JSON
    as the result's ``budget``."""

    file: str  # the budget file
    entry: str  # the entry id (the scenario id)
    status: str  # "ok" | "over" | "missing" | "updated" | "new" | "unchanged" | "error" | "not-comparable"
    worst_delta_pct: float | None = None  # the largest change of a device size metric, percent of its budget
    detail: str = ""  # the error, for "error"


_REQUIRE_FAIL = pytest.StashKey[str]()
OUTPUT_FILES = (("rlhfmem_json", "--rlhfmem-json"), ("rlhfmem_report", "--rlhfmem-report"),
                ("rlhfmem_benchmark_json", "--rlhfmem-benchmark-json"))


class RlhfmemSession:
    """Everything the session collects: results, budget verdicts, pending baseline updates."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: list[dict] = []  # stripped scenario results with "nodeid" and "budget"
        self.pending: dict[str, dict[str, dict]] = {}  # budget file -> {entry id -> entry}
        self.profiles: dict[str, str] = {}  # budget file -> profile
        self.produced: dict[str, set[str]] = {}  # budget file -> entry ids produced this session
        self.file_modules: dict[str, set[str]] = {}  # budget file -> test module node ids checking it
        self.update_summaries: list[B.UpdateSummary] = []
        self.update_errors: list[str] = []
        self.deselected = False
        self.unfinished_modules: set[str] = set()
        self._devices: list[CudaDevice] | None = None
        self.work_dirs: dict[str, bool] = {}  # each run's work directory -> whether the run succeeded
        self.lost_outputs: list[str] = []  # outputs that could not be written at the end, one line each
        self.kept_work: list[str] = []
        self.started = time.time()  # the C++ builds since then are named in the summary (cbuild.builds_since)

    @classmethod
    def start(cls, config: pytest.Config) -> RlhfmemSession:
        """The session of ``config``, once its options are known good. Raises ``pytest.UsageError`` (one line)
        for an ini value of ``gpu_marker``, ``rlhfmem_device``, ``rlhfmem_timeout`` or ``rlhfmem_time_rounds``
        that is not allowed, and for ``--rlhfmem-device cuda`` without a CUDA device (before any test: no rank
        could start)."""
        for dest in ("gpu_marker", "rlhfmem_device", "rlhfmem_timeout", "rlhfmem_time_rounds"):
            option_value(config, dest)  # validate ini values early: a bad one is a usage error
        if not hasattr(config, "workerinput"):  # the session's output files, checked before any test (outputs.py)
            from .outputs import OutputError, check_dir, check_file

            try:
                for dest, option in OUTPUT_FILES:
                    check_file(option_value(config, dest), option)
                check_dir(option_value(config, "rlhfmem_snapshots"), "--rlhfmem-snapshots")
            except OutputError as exc:
                raise pytest.UsageError(str(exc)) from None
        session = cls(config)
        if option_value(config, "rlhfmem_device") == "cuda" and not session.devices:
            from .rlhf.launch import no_cuda_device  # imported only here: the plugin loads fast

            raise pytest.UsageError(f"--rlhfmem-device cuda: {no_cuda_device()}")
        return session

    # -- hardware ---------------------------------------------------------------------------------
    @property
    def devices(self) -> list[CudaDevice]:
        if self._devices is None:
            self._devices = hardware.detect_cuda_devices()
        return self._devices

    @property
    def is_xdist_worker(self) -> bool:
        return hasattr(self.config, "workerinput")

    def baselines_dir(self) -> Path:
        d = option_value(self.config, "rlhfmem_baselines_dir")
        return Path(d) if d else Path(self.config.rootpath) / "baselines"

    def profile_for(self, result: IterationResult) -> str:
        p = option_value(self.config, "rlhfmem_profile")
        if p:
            return p
        if result.data.get("device") == REHEARSAL_DEVICE:  # never a GPU's or the CPU route's budgets
            return REHEARSAL_PROFILE
        return "cpu" if result.simulated else profile_name(self.devices)

    # -- gpu marker -------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        mark = item.get_closest_marker("gpu")
        if mark is None:
            return
        mode = option_value(self.config, "gpu_marker")
        try:
            count, min_gib, min_gb = gpu_mark_args(mark)
        except ValueError as exc:
            bad = f"{item.nodeid}: {exc}"
        else:
            bad = None
        if bad:  # outside the except block: one line, no chained traceback
            pytest.fail(bad, pytrace=False)
        if mode == "skip":
            pytest.skip(f"gpu test (needs {count} CUDA device(s)) skipped by --gpu-marker=skip")
        why = gpu_shortfall(self.devices, count, min_memory_gib=min_gib, min_memory_gb=min_gb)
        if why and mode == "auto":
            pytest.skip(f"gpu: {why}")
        if why and mode == "require":
            item.stash[_REQUIRE_FAIL] = why

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        why = item.stash.get(_REQUIRE_FAIL, None)
        if why:
            pytest.fail(f"--gpu-marker=require: this gpu test cannot run: {why}", pytrace=False)

    # -- budget files checked before anything runs ------------------------------------------------
    def start_profiles(self) -> list[str]:
        """The profiles this session's budgets can be under, before any result says: ``--rlhfmem-profile``,
        else ``cpu`` (simulated figures) and, with CUDA devices here and a device that may use them, theirs."""
        p = option_value(self.config, "rlhfmem_profile")
        if p:
            return [p]
        out = ["cpu"]
        device = option_value(self.config, "rlhfmem_device")
        if device == REHEARSAL_DEVICE:
            out.append(REHEARSAL_PROFILE)
        elif device != "cpu" and self.devices:
            out.append(profile_name(self.devices))
        return out

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Every collected ``gpu`` mark is read and every budget file the collected tests' ``memory_budget``
        reads by default is loaded now, before the first iteration: a bad mark or a malformed file ends the
        session at once with one line (a usage error). Under ``--rlhfmem-update-baselines`` each of those
        files' directories must be writable with room for the file (:func:`~.budgets.check_writable`)."""
        if self.is_xdist_worker:
            return
        for item in session.items:  # a gpu mark with a bad keyword or value: one line, before anything runs
            for mark in item.iter_markers("gpu"):
                try:
                    gpu_mark_args(mark)
                except ValueError as exc:
                    bad = f"{item.path}: {item.name}: {exc}"
                else:
                    continue
                raise pytest.UsageError(bad)
        files = set()
        for item in session.items:
            if "memory_budget" in getattr(item, "fixturenames", ()):
                mod = Path(str(item.path)).stem
                suite = mod[5:] if mod.startswith("test_") else mod
                files |= {self.baselines_dir() / prof / f"{suite}.yaml" for prof in self.start_profiles()}
        update = bool(option_value(self.config, "rlhfmem_update_baselines"))
        for f in sorted(files):
            if update:  # a read-only or full directory: refused now, not after the session ran
                unwritable = B.check_writable(f)
                if unwritable:
                    raise pytest.UsageError(unwritable)
            if not f.is_file():
                continue
            try:
                B.load_budget_file(f)
            except B.BudgetError as exc:
                bad = str(exc)
            except OSError as exc:
                bad = f"{f}: cannot read: {exc.strerror or exc}"
            else:
                continue
            raise pytest.UsageError(f"malformed baseline file: {bad}")  # outside except: nothing chained

    # -- stale-entry bookkeeping ------------------------------------------------------------------
    def pytest_deselected(self, items: list) -> None:
        if items:
            self.deselected = True

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):  # noqa: ANN001
        outcome = yield
        rep = outcome.get_result()
        if rep.failed or rep.skipped:  # in setup, call or teardown: the module did not run whole
            self.unfinished_modules.add(item.nodeid.split("::")[0])

    # -- results and budgets ----------------------------------------------------------------------
    def record(self, nodeid: str, result: IterationResult, verdict: BudgetVerdict | None = None) -> dict:
        entry = strip_for_summary(result.data)
        entry["nodeid"] = nodeid
        entry["budget"] = verdict.__dict__ if verdict else None
        for r in self.results:
            if r["nodeid"] == nodeid and r["scenario_id"] == result.scenario_id:
                r.update(entry)
                return r
        self.results.append(entry)
        return entry

    def queue_update(self, file: Path, entry_id: str, entry: dict, profile: str) -> None:
        self.pending.setdefault(str(file), {})[entry_id] = entry
        self.profiles[str(file)] = profile

    def note_work(self, work: Path, data: dict | None) -> None:
        """A run's work directory (``data`` its result, ``None`` when it measured nothing): removed at the
        session's end unless the run failed or ``--rlhfmem-keep-work``."""
        self.work_dirs[str(work)] = bool(data) and data.get("status") == "ok"

    def finish_work(self) -> list[str]:
        """Remove the session's work directories (after their traces are stored); return the kept ones."""
        keep = option_value(self.config, "rlhfmem_keep_work")
        kept = []
        for d, ok in sorted(self.work_dirs.items()):
            if not Path(d).is_dir():
                continue
            if (ok and not keep) or not any(Path(d).iterdir()):  # an empty one: the run never started
                shutil.rmtree(d, ignore_errors=True)
            else:
                kept.append(d)
        for parent in {Path(d).parent for d in self.work_dirs}:  # pytest's "<name>current" links to them
            for link in parent.glob("rlhfmem-*current"):
                if link.is_symlink() and not link.exists():
                    link.unlink()
        return kept

    def note_produced(self, file: Path, entry_id: str, nodeid: str) -> None:
        self.produced.setdefault(str(file), set()).add(entry_id)
        self.file_modules.setdefault(str(file), set()).add(nodeid.split("::")[0])

    # -- xdist: workers send, the controller merges and writes once ---------------------------------
    def _state(self) -> dict:
        return {"results": self.results, "pending": self.pending, "profiles": self.profiles,
                "produced": {k: sorted(v) for k, v in self.produced.items()},
                "file_modules": {k: sorted(v) for k, v in self.file_modules.items()},
                "deselected": self.deselected, "unfinished": sorted(self.unfinished_modules),
                "work_dirs": self.work_dirs}

    def merge_state(self, s: dict) -> None:
        self.results.extend(s["results"])
        for f, entries in s["pending"].items():
            self.pending.setdefault(f, {}).update(entries)
        self.profiles.update(s["profiles"])
        for f, ids in s["produced"].items():
            self.produced.setdefault(f, set()).update(ids)
        for f, mods in s["file_modules"].items():
            self.file_modules.setdefault(f, set()).update(mods)
        self.deselected |= s["deselected"]
        self.unfinished_modules.update(s["unfinished"])
        self.work_dirs.update(s["work_dirs"])

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:  # noqa: ANN001 - xdist controller hook
        data = getattr(node, "workeroutput", {}).get("rlhfmem")
        if data:
            self.merge_state(json.loads(data))

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.is_xdist_worker:
            self.config.workeroutput["rlhfmem"] = json.dumps(self._state())  # type: ignore[attr-defined]
            return
        for f, entries in sorted(self.pending.items()):
            try:
                self.update_summaries.append(B.update_budget_file(f, entries, self.profiles[f]))
            except B.BudgetError as exc:
                self.update_errors.append(str(exc))
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        out = option_value(self.config, "rlhfmem_json")
        if out:
            from .memory.trace_io import write_result_json

            try:  # each rank's trace beside the JSON, for rlhfmem advise
                write_result_json(out, self.session_json(), self.results)
            except OSError as exc:  # the disk filled during the session: the results are kept elsewhere
                self._lost_output("--rlhfmem-json", out, exc, json.dumps(self.session_json(), indent=1))
        try:
            write_session_outputs(self, option_value(self.config, "rlhfmem_report"),
                                  option_value(self.config, "rlhfmem_benchmark_json"))
        except OSError as exc:
            self._lost_output("--rlhfmem-report/--rlhfmem-benchmark-json", exc.filename or "", exc, None)
        if self.lost_outputs:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        self.kept_work = self.finish_work()

    def _lost_output(self, option: str, path: str, exc: OSError, text: str | None) -> None:
        """An output that could not be written at the session's end: one line for the summary, the text kept in a
        file of the temporary directory where there is one (``outputs.keep``), the work directories kept."""
        from .outputs import keep

        where = f"; it is in {keep(text, Path(path).name or 'results.json')}" if text is not None else ""
        self.lost_outputs.append(f"{option} {path}: cannot be written ({exc.strerror or exc}){where}")
        self.work_dirs = {d: False for d in self.work_dirs}  # the traces the lost file pointed at stay

    def session_json(self) -> dict:
        return {"schema": 1, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "results": self.results}

    def stale_entries(self) -> dict[str, list[str]]:
        """Per budget file, entries no test of this session produced, when every test of the modules that
        check that file ran and passed with nothing deselected (a whole suite ran)."""
        if self.deselected:
            return {}
        out = {}
        for f, ids in self.produced.items():
            if self.file_modules.get(f, set()) & self.unfinished_modules or not Path(f).exists():
                continue
            try:
                entries = set(B.load_budget_file(f).entries)
            except (B.BudgetError, OSError):
                continue
            stale = sorted(entries - ids)
            if stale:
                out[f] = stale
        return out

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.is_xdist_worker:
            write_terminal_summary(terminalreporter, self)
            built = builds_since(self.started)
            if built:  # a first run on this machine (or torch): say what it compiled and what it cost, once
                terminalreporter.write_line(
                    "rlhfmem: built the C++ parts this session needed, once per machine, compiler and torch: "
                    + ", ".join(f"{name} in {secs:.1f} s" for name, secs in built) + f" (cached in {cache_dir()})")
