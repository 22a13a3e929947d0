"""pytest face of pytest-rlhfmem: options (+ ini twins), the ``gpu`` marker, fixtures, session summary.

Registered through the ``pytest11`` entry point. Heavy imports (torch, deepspeed) happen only when a
test actually runs an iteration, so ``pytest --help`` and unrelated test runs stay fast.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from collections.abc import Callable, Sequence

import pytest

from . import budgets as B
from . import hardware
from .hardware import CudaDevice, gpu_shortfall, profile_name
from .record.host import format_rss
from .results import IterationResult, strip_for_summary
from .units import format_size

GPU_MARKER_MODES = ("auto", "skip", "require")


@dataclass(frozen=True)
class _Option:
    flag: str
    dest: str
    help: str
    kind: str = "string"  # "string" | "bool" | "float" | "choice"
    default: Any = None
    choices: tuple[str, ...] = ()


OPTIONS = (
    _Option("--gpu-marker", "gpu_marker", "what to do with tests marked gpu: auto = run when enough CUDA devices "
            "(and memory) are present, else skip saying what is missing; skip = skip them all; require = a gpu "
            "test that cannot run FAILS. Memory: min_memory_gb=N is GB as cards are sold, met by a device whose "
            "total_memory is at least 0.96 x N x 10^9 bytes (every card sold as N GB: an A10G, L4, RTX 3090 or "
            "4090 for 24, a T4 or V100 for 16, an A100 or H100 for 40/80; no card sold smaller); "
            "min_memory_gib=N is exact binary GiB (N x 2^30 bytes)", "choice", "auto", GPU_MARKER_MODES),
    _Option("--rlhfmem-update-baselines", "rlhfmem_update_baselines",
            "write the measured figures as the budgets (only the scenarios that ran) and pass", "bool", False),
    _Option("--rlhfmem-baselines-dir", "rlhfmem_baselines_dir",
            "directory of budget files <profile>/<suite>.yaml (default: baselines/ beside the rootdir)"),
    _Option("--rlhfmem-profile", "rlhfmem_profile", "hardware profile naming the budget directory (default: cpu "
            "for simulated figures, else cuda-<gpu model>-x<count>)"),
    _Option("--rlhfmem-device", "rlhfmem_device", "where iterations run: auto = CUDA with one device per rank, "
            "CPU with the allocator model (simulated) when there is no CUDA device, and a run with fewer CUDA "
            "devices than ranks is refused; cuda without a CUDA device is a usage error", "choice", "auto",
            ("auto", "cpu", "cuda")),
    _Option("--rlhfmem-cuda-emulation", "rlhfmem_cuda_emulation", "CPU runs: emulate CUDA's own allocations "
            "(cuBLAS workspaces, host scalars, CPU kernel scratch) in the capture; results record it and budgets "
            "of another capture are refused as not comparable", "choice", "on", ("on", "off")),
    _Option("--rlhfmem-timeout", "rlhfmem_timeout", "seconds one iteration (all ranks) may take before its "
            "processes are killed and the test fails as hung", "float", 900.0),
    _Option("--rlhfmem-json", "rlhfmem_json", "write every result of the session (with budget verdicts) to this "
            "JSON file"),
    _Option("--rlhfmem-snapshots", "rlhfmem_snapshots", "save each rank's trace as a memory_viz snapshot pickle in "
            "this directory (simulated ones are labelled so inside)"),
    _Option("--rlhfmem-report", "rlhfmem_report", "write the per-PR memory diff report (markdown) against the "
            "baselines to this path; a JSON twin is written beside it"),
    _Option("--rlhfmem-benchmark-json", "rlhfmem_benchmark_json", "write github-action-benchmark "
            "customSmallerIsBetter JSON (one entry per scenario and metric, unit bytes)"),
    _Option("--rlhfmem-time-rounds", "rlhfmem_time_rounds", "run each iteration N times: times become the "
            "median with their spread (memory figures from the first round)", "int", 1),
    _Option("--rlhfmem-advise", "rlhfmem_advise", "for a scenario over its budget, add rlhfmem advise's "
            "recommendation (from the run's own trace) to the failure message and the report", "bool", False),
    _Option("--rlhfmem-keep-work", "rlhfmem_keep_work", "keep each run's work directory (ranks' files, launcher "
            "log, traces); by default it is removed at the session's end once its traces are stored beside "
            "--rlhfmem-json, and kept, its path printed, when the run failed", "bool", False),
)


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


def _opt(config: pytest.Config, dest: str) -> Any:
    """Command line wins over the ini file; ini values are validated like the command line."""
    o = next(x for x in OPTIONS if x.dest == dest)
    v = config.getoption(dest)
    if v is not None:
        return v
    v = config.getini(dest)
    if v in (None, ""):
        return o.default
    if o.kind in ("float", "int"):
        try:
            return float(v) if o.kind == "float" else int(v)
        except ValueError:
            raise pytest.UsageError(f"ini option {dest} = {v!r}: expected a number") from None
    if o.choices and v not in o.choices:
        raise pytest.UsageError(f"ini option {dest} = {v!r}: allowed values are {', '.join(o.choices)}")
    return v


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu(count=1, min_memory_gb=None): needs `count` CUDA devices, each sold as at least "
        "`min_memory_gb` GB: a device qualifies when its total_memory is at least 0.96 x min_memory_gb x 10^9 "
        "bytes, so every card sold as N GB qualifies for N (an A10G reports 23,028 MiB, an RTX 3090 24,268 MiB: "
        "both 24) and none sold a size smaller; min_memory_gib=N instead asks for exactly N binary GiB "
        "(N x 2^30 bytes; no card sold as 24 GB has 24 GiB); see --gpu-marker for what happens when they are missing")
    for dest in ("gpu_marker", "rlhfmem_device", "rlhfmem_timeout", "rlhfmem_time_rounds"):
        _opt(config, dest)  # validate ini values early: a bad one is a usage error
    manager = RlhfmemSession(config)
    if _opt(config, "rlhfmem_device") == "cuda" and not manager.devices:  # before any test: no rank can start
        from .rlhf.launch import no_cuda_device

        raise pytest.UsageError(f"--rlhfmem-device cuda: {no_cuda_device()}")
    config.pluginmanager.register(manager, "rlhfmem_session")


# ---------------------------------------------------------------------------------------------------
# Session state
# ---------------------------------------------------------------------------------------------------


@dataclass
class BudgetVerdict:
    file: str
    entry: str
    status: str  # "ok" | "over" | "missing" | "updated" | "new" | "unchanged" | "error" | "not-comparable"
    worst_delta_pct: float | None = None
    detail: str = ""


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
        self.kept_work: list[str] = []

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
        d = _opt(self.config, "rlhfmem_baselines_dir")
        return Path(d) if d else Path(self.config.rootpath) / "baselines"

    def profile_for(self, result: IterationResult) -> str:
        p = _opt(self.config, "rlhfmem_profile")
        if p:
            return p
        return "cpu" if result.simulated else profile_name(self.devices)

    # -- gpu marker -------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        mark = item.get_closest_marker("gpu")
        if mark is None:
            return
        mode = _opt(self.config, "gpu_marker")
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
        p = _opt(self.config, "rlhfmem_profile")
        if p:
            return [p]
        out = ["cpu"]
        if _opt(self.config, "rlhfmem_device") != "cpu" and self.devices:
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
        update = bool(_opt(self.config, "rlhfmem_update_baselines"))
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
        import shutil

        keep = _opt(self.config, "rlhfmem_keep_work")
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
        out = _opt(self.config, "rlhfmem_json")
        if out:
            from .memory.trace_io import write_result_json

            # each rank's trace beside the JSON, for rlhfmem advise
            write_result_json(out, self.session_json(), self.results)
        from . import report

        report.write_session_outputs(self, _opt(self.config, "rlhfmem_report"),
                                     _opt(self.config, "rlhfmem_benchmark_json"))
        self.kept_work = self.finish_work()

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
    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
        if self.is_xdist_worker:
            return
        for d in self.kept_work:
            terminalreporter.write_line(f"rlhfmem: work directory kept: {d}")
        if not (self.results or self.update_summaries):
            return
        tr = terminalreporter
        tr.section("rlhfmem: memory per scenario")
        for line in summary_table(self.results):
            tr.write_line(line)
        if any(r.get("simulated") for r in self.results):
            tr.write_line("simulated = an allocation trace (a CPU run's, or the simulated CUDA device's) replayed "
                          "through the CUDA caching allocator model; not a GPU measurement")
        if self.results:
            tr.write_line("host peak RSS (anon growth) / host pinned: measured in each rank's process (max over "
                          "ranks), never simulated; anon growth = peak anonymous RSS (sampled) minus its value after "
                          "imports, the budgeted figure; on CPU 'pinned' = offload buffers held in host memory "
                          "(nothing is page-locked)")
        from .report import flush_tradeoffs

        from .timing import session_spreads

        trade = flush_tradeoffs(self.results, session_spreads(self.baselines_dir()))
        if trade:
            tr.write_line("flush policies: memory saving next to the iteration-time change (with its noise) and "
                          "the flush's own cost in allocator calls")
            for line in trade:
                tr.write_line("  " + line)
        for r in self.results:
            if r.get("advice"):
                tr.write_line(f"{r['scenario_id']}: {r['advice']}")
        for s in self.update_summaries:
            tr.write_line(f"rlhfmem: {s.path}: {len(s.updated)} updated, {len(s.new)} new, "
                          f"{len(s.unchanged)} unchanged")
        for err in self.update_errors:
            tr.write_line(f"rlhfmem: baseline NOT written: {err}", red=True)
        for f, stale in self.stale_entries().items():
            tr.write_line(f"rlhfmem: {f}: {len(stale)} stale entries (no collected test produces them): "
                          + ", ".join(stale), yellow=True)


_REQUIRE_FAIL = pytest.StashKey[str]()


GPU_MARK_KEYS = ("count", "min_memory_gb", "min_memory_gib")


def gpu_mark_args(mark: pytest.Mark) -> tuple[int, float | None, float | None]:
    """``(count, min_memory_gib, min_memory_gb)`` of a ``gpu`` mark: ``gpu(count=1, min_memory_gb=None)``,
    or ``min_memory_gib`` (binary GiB) instead of ``min_memory_gb`` (GB as sold; see
    :func:`~pytest_rlhfmem.hardware.gpu_shortfall`). Raises ``ValueError`` (one line naming the key and the
    allowed ones) for an unknown keyword, a memory given by position (GB or GiB?), both memory keys, or a
    count or memory that is not a positive number."""
    unknown = [k for k in mark.kwargs if k not in GPU_MARK_KEYS]
    if unknown:
        raise ValueError(f"gpu mark: unknown keyword {unknown[0]!r}; allowed: count, min_memory_gb (GB as sold), "
                         f"min_memory_gib (binary GiB)")
    if len(mark.args) > 1:
        raise ValueError(f"gpu mark: memory given by position ({mark.args[1]!r}); give it by keyword: "
                         f"min_memory_gb (GB as sold) or min_memory_gib (binary GiB)")
    if "min_memory_gb" in mark.kwargs and "min_memory_gib" in mark.kwargs:
        raise ValueError("gpu mark: min_memory_gb and min_memory_gib both given; allowed: one of them")
    values = {"count": mark.kwargs.get("count", mark.args[0] if mark.args else 1),
              "min_memory_gb": mark.kwargs.get("min_memory_gb"), "min_memory_gib": mark.kwargs.get("min_memory_gib")}
    for key, v in values.items():
        ok = v is None and key != "count" or (
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and (key != "count" or v == int(v)))
        if not ok:
            kind = "an integer >= 1" if key == "count" else "a number > 0"
            raise ValueError(f"gpu mark: {key}={v!r}; allowed: {kind}")
    gib, gb = values["min_memory_gib"], values["min_memory_gb"]
    return int(values["count"]), (float(gib) if gib is not None else None), (float(gb) if gb is not None else None)


def summary_table(results: list[dict]) -> list[str]:
    """scenario | capture | peak reserved | peak allocated | fragmentation | vs budget."""
    rows = [("scenario", "capture", "peak reserved", "peak allocated", "fragmentation", "peak phase",
             "host peak RSS (anon growth)", "host pinned", "vs budget")]
    for r in results:
        m = r.get("metrics") or {}
        b = r.get("budget") or {}
        if r["status"] != "ok":
            vs = "FAILED: " + str((r.get("failure") or {}).get("error"))
        elif not b:
            vs = "-"
        elif b["status"] == "ok":
            vs = "ok" + (f" ({b['worst_delta_pct']:+.1f}%)" if b.get("worst_delta_pct") is not None else "")
        elif b["status"] == "over":
            vs = f"OVER ({b['worst_delta_pct']:+.1f}%)" if b.get("worst_delta_pct") is not None else "OVER"
        else:
            vs = b["status"]
        rows.append((r["scenario_id"], "simulated" if r.get("simulated") else "cuda",
                     format_size(m.get("peak_reserved")), format_size(m.get("peak_allocated")),
                     format_size(m.get("fragmentation_at_peak")), str(r.get("peak_phase") or "-"),
                     format_rss(m), format_size(m.get("host_pinned_peak")), vs))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


# ---------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def rlhfmem_session(request: pytest.FixtureRequest) -> RlhfmemSession:
    """The session's :class:`RlhfmemSession` (options, results, budgets)."""
    return request.config.pluginmanager.get_plugin("rlhfmem_session")


def _stop_session(exc: KeyboardInterrupt) -> NoReturn:
    """A run that SIGINT, SIGTERM or SIGHUP stopped (``rlhf/launch.py``'s ``RunInterrupted``: every process of
    the run already stopped): end the session with its one line (each rank's phase, the work directory) and exit
    status 128 + the signal (130, 143, 129), as a shell reports a process the signal ended."""
    if hasattr(exc, "exit_status"):
        pytest.exit(f"rlhfmem: {exc}", returncode=exc.exit_status)
    raise exc


@pytest.fixture
def ppo_iteration(request: pytest.FixtureRequest, rlhfmem_session: RlhfmemSession,
                  tmp_path_factory: pytest.TempPathFactory) -> Callable[..., IterationResult]:
    """Factory: ``ppo_iteration(framework="deepspeed-chat", models="tiny-opt", strategy="none",
    flush="none", world_size=2, device=None, algorithm="ppo", **overrides)`` runs ONE RLHF iteration (PPO,
    or ``remax`` / ``grpo``) in fresh worker processes (torchrun) and returns an :class:`IterationResult`.
    A crashed, hung or OOM run fails the test with the rank, phase and memory so far. Unknown names fail
    with the list of valid ones; a device that cannot run it (``cuda`` without a GPU; fewer CUDA devices
    than ranks, under ``auto`` too) or a JIT op build that fails fails in one line before any rank starts."""
    from .rlhf.launch import run_scenario
    from .rlhf.scenario import Scenario, ScenarioError
    from .timing import run_rounds

    def run(framework: str = "deepspeed-chat", models: str = "tiny-opt", strategy: str = "none",
            flush: str = "none", world_size: int = 2, device: str | None = None, algorithm: str = "ppo",
            **overrides: Any) -> IterationResult:
        try:
            scenario = Scenario(framework, models, strategy, flush, world_size, overrides, algorithm)
        except ScenarioError as exc:
            pytest.fail(str(exc), pytrace=False)
        def once(snapshots: str | None) -> dict:
            work = tmp_path_factory.mktemp("rlhfmem-run")
            rlhfmem_session.note_work(work, None)
            data = run_scenario(scenario, device=device or _opt(request.config, "rlhfmem_device"),
                                timeout=_opt(request.config, "rlhfmem_timeout"), snapshot_dir=snapshots,
                                work_dir=work, cuda_emulation=_opt(request.config, "rlhfmem_cuda_emulation"))
            rlhfmem_session.note_work(work, data)
            return data

        try:
            data, _ = run_rounds(once, _opt(request.config, "rlhfmem_time_rounds") or 1,
                                 _opt(request.config, "rlhfmem_snapshots"))
        except ScenarioError as exc:
            pytest.fail(str(exc), pytrace=False)
        except KeyboardInterrupt as exc:
            _stop_session(exc)
        result = IterationResult(data)
        rlhfmem_session.record(request.node.nodeid, result)
        if not result.ok:
            pytest.fail(result.describe_failure(), pytrace=False)
        return result

    return run


@pytest.fixture
def rlhfmem_command(request: pytest.FixtureRequest, rlhfmem_session: RlhfmemSession,
                    tmp_path_factory: pytest.TempPathFactory) -> Callable[..., IterationResult]:
    """Factory: ``rlhfmem_command(cmd, *, id, world_size=None, timeout=None, env=None, device=None,
    cwd=None)`` runs YOUR training command (a script, ``python -m module`` or a torchrun line; a list or a
    shell-like string) with every rank recorded from its first allocation, as ``rlhfmem capture`` does, and
    returns the same :class:`IterationResult` as ``ppo_iteration``: ``memory_budget.check(result)`` keys the
    budget entry by ``id``. ``world_size`` > 1 wraps a plain command in torchrun; ``timeout`` (seconds)
    defaults to ``--rlhfmem-timeout``; ``env`` adds environment variables. A crashed, hung or OOM rank
    fails the test with its rank, phase and memory so far; a command that cannot run (not found, exits
    before its first allocation, never imports torch; a device without a CUDA device per rank) fails the test
    in one line."""
    from .command.run import CommandError, run_command
    from .timing import run_rounds

    def run(cmd: Sequence[str] | str, *, id: str, world_size: int | None = None,  # noqa: A002
            timeout: float | None = None, env: dict | None = None, device: str | None = None,
            cwd: str | Path | None = None) -> IterationResult:
        def once(snapshots: str | None) -> dict:
            work = tmp_path_factory.mktemp("rlhfmem-command")
            rlhfmem_session.note_work(work, None)
            data = run_command(cmd, id, world_size=world_size,
                               device=device or _opt(request.config, "rlhfmem_device"),
                               timeout=timeout or _opt(request.config, "rlhfmem_timeout"),
                               snapshot_dir=snapshots, work_dir=work, env=env, cwd=cwd,
                               cuda_emulation=_opt(request.config, "rlhfmem_cuda_emulation") or "on")
            rlhfmem_session.note_work(work, data)
            return data

        try:
            data, _ = run_rounds(once, _opt(request.config, "rlhfmem_time_rounds") or 1,
                                 _opt(request.config, "rlhfmem_snapshots"))
        except CommandError as exc:
            bad = str(exc)
        except KeyboardInterrupt as exc:
            _stop_session(exc)
        else:
            bad = None
        if bad:  # outside the except block: one message, no chained traceback
            pytest.fail(f"rlhfmem_command({id!r}): {bad}", pytrace=False)
        result = IterationResult(data)
        rlhfmem_session.record(request.node.nodeid, result)
        if not result.ok:
            pytest.fail(result.describe_failure(), pytrace=False)
        return result

    return run


@dataclass
class MemoryBudget:
    """``memory_budget.check(result, suite=None)``: compare with ``baselines/<profile>/<suite>.yaml``.

    ``suite`` defaults to the test module's name without its ``test_`` prefix. Fails the test with a
    table (metric | budget | measured | delta | tolerance) and the phase of the peak when a budget is
    exceeded; with a command to create it when the entry is missing; with the file, entry and key when
    the file is malformed. Under ``--rlhfmem-update-baselines`` it records the figures instead.
    """

    request: pytest.FixtureRequest
    session: RlhfmemSession
    checked: list[str] = field(default_factory=list)

    def path_for(self, result: IterationResult, suite: str | None = None) -> Path:
        mod = Path(str(self.request.node.path)).stem
        suite = suite or (mod[5:] if mod.startswith("test_") else mod)
        return self.session.baselines_dir() / self.session.profile_for(result) / f"{suite}.yaml"

    def check(self, result: IterationResult, suite: str | None = None) -> None:
        path = self.path_for(result, suite)
        nodeid = self.request.node.nodeid
        eid = result.scenario_id
        self.session.note_produced(path, eid, nodeid)
        if _opt(self.session.config, "rlhfmem_update_baselines"):
            self.session.queue_update(path, eid, B.entry_from_result(result.data), self.session.profile_for(result))
            self.session.record(nodeid, result, BudgetVerdict(str(path), eid, "updated"))
            return
        fix = f"create it with: pytest {nodeid.split('::')[0]} --rlhfmem-update-baselines"
        if not path.exists():
            self.session.record(nodeid, result, BudgetVerdict(str(path), eid, "missing"))
            pytest.fail(f"no baseline file {path} for {eid}; {fix}", pytrace=False)
        try:
            bf = B.load_budget_file(path)
        except B.BudgetError as exc:
            bad, bf = str(exc), None
        if bf is None:  # outside the except block: one message, no chained traceback
            self.session.record(nodeid, result, BudgetVerdict(str(path), eid, "error", detail=bad))
            pytest.fail(f"malformed baseline file: {bad}", pytrace=False)
        entry = bf.entries.get(eid)
        if entry is None:
            self.session.record(nodeid, result, BudgetVerdict(str(path), eid, "missing"))
            pytest.fail(f"no baseline entry {eid!r} in {path}; {fix}", pytrace=False)
        cut = B.incomplete(path, entry)
        if cut:
            self.session.record(nodeid, result, BudgetVerdict(str(path), eid, "error", detail=cut))
            pytest.fail(cut, pytrace=False)
        reason = B.not_comparable(path, entry, result.capture, result.data.get("capture_description"))
        if reason:
            self.session.record(nodeid, result, BudgetVerdict(str(path), eid, "not-comparable"))
            pytest.fail(reason, pytrace=False)
        rows = B.compare(bf, entry, result.metrics)
        over = [r for r in rows if r.status == "over"]
        pcts = [r.delta_pct for r in rows if r.delta_pct is not None and r.metric in B.DEVICE_SIZE_BUDGETS]
        worst = max(pcts, key=abs) if pcts else None
        if over:
            worst = max(r.delta_pct or 0.0 for r in over)
        verdict = BudgetVerdict(str(path), eid, "over" if over else "ok", worst)
        self.session.record(nodeid, result, verdict)
        self.checked.append(eid)
        if over:
            label = (f"simulated ({result.data.get('capture')} trace through the allocator model)" if result.simulated
                     else "measured on CUDA")
            advice = ""
            if _opt(self.session.config, "rlhfmem_advise"):
                from .advise import one_line

                budget = entry.metrics.get("peak_reserved")
                advice = one_line(result.data, budget=int(budget) if budget else None)
                self.session.record(nodeid, result, verdict)["advice"] = advice
                advice = "\n" + advice
            pytest.fail(
                f"{eid} is over its memory budget ({label}); budget file {path}\n"
                f"peak reserved reached in phase: {result.peak_phase}\n\n{B.format_table(rows)}{advice}"
                f"{host_note(result.data.get('host_cpu'), entry.raw.get('host_cpu'))}",
                pytrace=False)


def host_note(mine: dict | None, budget: dict | None) -> str:
    """A failure's last line when this run's host differs from the budget's (hostcpu.py), else ``""``."""
    from .hostcpu import host_differences

    diffs = host_differences(mine, budget)
    return ("\nthis host differs from the budget's (this run vs budget): " + "; ".join(diffs)) if diffs else ""


@pytest.fixture
def memory_budget(request: pytest.FixtureRequest, rlhfmem_session: RlhfmemSession) -> MemoryBudget:
    """Compares an :class:`IterationResult` with its YAML budget; see :class:`MemoryBudget`."""
    return MemoryBudget(request, rlhfmem_session)
