"""Memory budgets in YAML: ``baselines/<profile>/<suite>.yaml``, one entry per scenario id.

A file::

    schema: 1
    profile: cpu
    notes: why the tolerances are what they are  # optional free text, kept by updates (comments are not)
    defaults:                      # optional; built-in defaults below apply otherwise
      tolerances:
        peak_reserved: {rel: 0.01, abs: 2 MiB}
    entries:
      deepspeed-chat/tiny-opt/zero3/flush-none/x2:
        capture: cpu-trace-simulated     # how the figures were obtained: simulated or real
        capture_description:             # CPU: the CUDA emulation (absent = written without emulation)
          cuda_emulation: {adjustments: [host-scalars, cpu-kernel-scratch, cublas-workspace,
                                         cuda-kernel-temporaries], cublas_workspace_bytes: 8519680}
        device: cpu
        peak_phase: train_actor
        versions: {torch: 2.13.0, deepspeed: 0.19.8}
        metrics:
          peak_reserved: 100 MiB         # sizes always carry a unit (B, KiB, MiB, GiB, TiB)
          peak_allocated: 81.03 MiB
          fragmentation_at_peak: 22.94 MiB
          cuda_malloc_count: 32          # counts are plain integers
          alloc_retries: 0
          host_anon_growth: 98 MiB       # measured on the host, never simulated
          host_pinned_peak: 0 B
        tolerances:                      # optional per-entry overrides
          peak_reserved: {rel: 0.02}

A result is compared only with an entry of the same capture (kind and description, see
:func:`not_comparable`). A measured value passes when ``measured <= budget + max(abs, rel * budget)``.
Loading is strict: an unknown key, a key given twice in one mapping, a size without a unit, a negative size or
tolerance and an empty file raise :class:`BudgetError` naming the file, the entry and the key; an entry without one
of the metrics every entry gates (:data:`BUDGET_METRICS`; the ZeRO-Infinity ones all or none) fails the check that
reads it, naming the metric (:func:`incomplete`). Updates merge into the file (entries a run did not touch are
kept), are atomic (temporary file + rename, keeping the file's mode and ownership) and serialised by a file lock
that is never removed (:func:`lock_path`, in the user cache, not beside the file), so any number of concurrent
writers cannot lose an entry; :func:`check_writable` refuses an unwritable or full directory before a session runs.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .iterations import GROWTH_METRICS
from .units import format_size, parse_size, read_file_bounded

SCHEMA = 1
DEVICE_SIZE_BUDGETS = ("peak_reserved", "peak_allocated", "fragmentation_at_peak")
# Host figures are measured for real on every machine (record/host.py). The gated host figure is the growth of
# anonymous resident memory over its value once the frameworks are imported: what the iteration itself
# allocates on the host. RSS (``host_peak_rss``, ``host_rss_growth``, still reported) also holds the resident
# pages of mapped shared libraries, which moved between environments with identical packages (the same
# ColossalChat scenario peaked at 639-647 MiB in an older environment and 831-848 MiB in fresh ones; the growth
# of DeepSpeed-Chat runs by 10-46 MiB): a budget recorded in one environment did not hold in another.
HOST_BUDGETS = ("host_anon_growth", "host_pinned_peak")
REPORTED_NOT_BUDGETED = {
    "host_peak_rss": "peak RSS includes the environment's resident library pages",
    "host_rss_growth": "RSS growth includes library pages faulted in during the iteration, which differ "
                       "between environments",
}
# ZeRO-Infinity's (NVMe offload) figures, measured: bytes read from / written to storage (/proc/self/io) and
# bytes in DeepSpeed's swap staging buffers (record/host.py). Gated only where an entry records them:
# entry_from_result writes them for results that held staging buffers, so no other entry changes.
SWAP_BUDGETS = ("storage_read_bytes", "storage_write_bytes", "host_staging_bytes")
# a colocated rollout engine's scenarios only (docs/colocated-rollout.md), replayed at the engine's card
# (capacity_mib): the bytes it maps outside the caching allocator at once, reserved + those at their peak, and the
# allocations the card could not back (the trainer's, and a wake-up's mapping) (simulated)
ENGINE_SIZE_NAMES = ("engine_mapped_peak", "peak_device_used")
ENGINE_METRIC_NAMES = ENGINE_SIZE_NAMES + ("ooms",)  # ooms: every result has it; entries of engine runs gate it
# Growth across iterations (iterations.py), bytes per iteration from iteration 2 on: the slope of the per-iteration
# device peaks (simulated on CPU) and host anonymous peak (measured). Gated only where an entry records them:
# entry_from_result writes them for results of three or more iterations (iterations=N, rlhfmem.iteration()).
GROWTH_BUDGETS = tuple(GROWTH_METRICS)
SIZE_BUDGETS = DEVICE_SIZE_BUDGETS + HOST_BUDGETS + SWAP_BUDGETS + ENGINE_SIZE_NAMES + GROWTH_BUDGETS
COUNT_BUDGETS = ("cuda_malloc_count", "alloc_retries")
BUDGET_METRICS = DEVICE_SIZE_BUDGETS + COUNT_BUDGETS + HOST_BUDGETS  # compared for every entry
_KNOWN_METRICS = BUDGET_METRICS + SWAP_BUDGETS + ENGINE_METRIC_NAMES + GROWTH_BUDGETS
# groups an entry names together or not at all (entry_from_result writes each whole where the result has it)
OPTIONAL_GROUPS = (SWAP_BUDGETS, ENGINE_METRIC_NAMES, GROWTH_BUDGETS)


@dataclass(frozen=True)
class Tolerance:
    rel: float = 0.0
    abs: int = 0  # bytes for sizes, a count for counts

    def allowed(self, budget: int) -> int:
        return budget + max(self.abs, int(self.rel * budget))


# Measured spread (studies/spread.py, 3 runs of each CPU-matrix scenario, and the sessions since; tiny
# OPT, 2 ranks): peak allocated varies by up to 0.9 MiB, ZeRO-3 peak reserved by one 2 MiB segment between
# sessions (so 4 MiB = two segments of margin), the cudaMalloc count of ZeRO-3 runs with flushing by 2. A
# GPU's own nondeterminism (the reference reports ~0.5% of the peak for ZeRO-3) is covered by the
# relative parts.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "peak_reserved": Tolerance(0.01, 4 * 2**20),
    "peak_allocated": Tolerance(0.01, 2 * 2**20),
    "fragmentation_at_peak": Tolerance(0.05, 4 * 2**20),
    "cuda_malloc_count": Tolerance(0.1, 3),
    "alloc_retries": Tolerance(0.0, 0),
    "ooms": Tolerance(0.0, 0),
    # Host RSS growth (peak minus the RSS after imports) moves with libraries' lazy allocations and glibc's
    # arenas: within one environment the peak repeated within 3 MiB (studies/spread.py) and the growth of
    # the same ColossalChat scenario within 8 MiB (98-106 MiB) across runs; a fifth, at least 48 MiB, leaves
    # room for another environment's lazy allocations without hiding a model state the size of the tiny
    # pair's (the absolute peak, 540-848 MiB between environments, is reported but not gated).
    # The offload buffers' bytes are exact on CPU and rounded by the pinned pool on CUDA.
    "host_anon_growth": Tolerance(0.2, 48 * 2**20),
    "host_pinned_peak": Tolerance(0.01, 2**20),
    # NVMe entries set their own from measured spread (baselines/cpu/nvme_cpu.yaml); staging buffers are sized
    # by the config (exact); storage traffic moves with the page cache (a read it serves is not storage I/O).
    "storage_read_bytes": Tolerance(0.1, 16 * 2**20),
    "storage_write_bytes": Tolerance(0.1, 16 * 2**20),
    "host_staging_bytes": Tolerance(0.0, 2**20),
    # Growth per iteration from iteration 2 on (docs/budgets.md, "Growth across iterations"). A simulated peak
    # repeats to the byte between iterations of a loop that keeps nothing; one segment more in the last iteration
    # moves the reserved slope by a segment over the iterations counted (2 MiB / 2 for four iterations), and
    # peak allocated by gloo's late frees (up to 0.9 MiB between runs, above). The host's anonymous peak per
    # iteration moved by up to 8.8 MiB between iterations of a loop that keeps nothing (glibc keeps and reuses
    # freed chunks; the tiny DeepSpeed-Chat ZeRO-2 cell, tox -e growth), hence 16 MiB.
    "growth_peak_reserved": Tolerance(0.1, 2 * 2**20),
    "growth_peak_allocated": Tolerance(0.1, 2**20),
    "growth_host_anon": Tolerance(0.1, 16 * 2**20),
}

_TOP_KEYS = ("schema", "profile", "notes", "defaults", "entries")
_DEFAULTS_KEYS = ("tolerances",)
_ENTRY_KEYS = ("capture", "device", "world_size", "peak_phase", "versions", "metrics", "tolerances",
               "capture_description", "host_cpu")
_TOL_KEYS = ("rel", "abs")
MAX_BUDGET_FILE_BYTES = 64 * 2**20  # a budget file is read only when it is a regular file of at most this
# An entry's fields other than metrics and tolerances: what each may hold (None is always allowed: absent).
_ENTRY_TEXT = ("capture", "device", "peak_phase")
_ENTRY_MAPPINGS = ("versions", "capture_description", "host_cpu")


class BudgetError(ValueError):
    """A malformed budget file; the message names the file, the entry and the key."""


class BudgetWriteError(BudgetError):
    """A budget file that cannot be written (read-only or full directory); one line naming the file and why."""


@dataclass
class BudgetEntry:
    id: str
    metrics: dict[str, int]
    tolerances: dict[str, Tolerance]
    capture: str | None = None
    device: str | None = None
    peak_phase: str | None = None
    raw: dict = field(default_factory=dict)


@dataclass
class BudgetFile:
    path: Path
    profile: str | None
    defaults: dict[str, Tolerance]
    entries: dict[str, BudgetEntry]
    raw: dict


def _err(path: Path, where: str, msg: str) -> BudgetError:
    return BudgetError(f"{path}: {where}: {msg}")


def _unknown(path: Path, where: str, d: dict, allowed: tuple[str, ...]) -> None:
    for k in d:
        if k not in allowed:
            raise _err(path, where, f"unknown key {k!r}; allowed: {', '.join(allowed)}")


def _parse_tolerance(path: Path, where: str, metric: str, d: Any, base: Tolerance) -> Tolerance:
    if metric not in _KNOWN_METRICS:
        raise _err(path, where, f"unknown metric {metric!r} in tolerances; allowed: {', '.join(_KNOWN_METRICS)}")
    if not isinstance(d, dict):
        raise _err(path, f"{where}.{metric}", "a tolerance is a mapping like {rel: 0.01, abs: 2 MiB}")
    _unknown(path, f"{where}.{metric}", d, _TOL_KEYS)
    rel, ab = base.rel, base.abs
    if "rel" in d:
        r = d["rel"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            raise _err(path, f"{where}.{metric}.rel", f"must be a number >= 0 (finite; a fraction: 0.01 is 1%), "
                       f"got {r!r}")
        rel = float(r)
    if "abs" in d:
        v = d["abs"]
        if metric in SIZE_BUDGETS:
            try:
                ab = parse_size(v)
            except ValueError as exc:
                raise _err(path, f"{where}.{metric}.abs", str(exc)) from None
        elif isinstance(v, bool) or not isinstance(v, int):
            raise _err(path, f"{where}.{metric}.abs", f"a count tolerance is an integer, got {v!r}")
        else:
            ab = v
        if ab < 0:
            raise _err(path, f"{where}.{metric}.abs", f"must be >= 0, got {v!r}")
    return Tolerance(rel, ab)


def _child_where(where: str, key: str) -> str:
    if where == "top level":
        return key
    if where == "entries":
        return f"entry {key!r}"
    return f"{where}.{key}"


def _refuse_duplicate_keys(path: Path, node: Any, where: str = "top level") -> None:
    """A key given twice in one mapping: YAML loaders keep the last value silently; refused here."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key is not None:
                line = k.start_mark.line + 1
                if key in seen:
                    raise _err(path, where, f"key {key!r} given twice (lines {seen[key]} and {line}); "
                               "allowed: each key once")
                seen[key] = line
            _refuse_duplicate_keys(path, v, _child_where(where, str(key)))
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            _refuse_duplicate_keys(path, v, where)


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where built


def _refuse_anchors(p: Path, text: str) -> None:
    """An anchor (``&a``) or alias (``*a``) in a budget file, refused before anything is built from it: aliases
    nest (a 424-byte file of nine nested aliases stands for 9**9 values, which any walk over it expands) and can
    refer to themselves; the tool never writes them (``_Dumper``). One pass over the parser's events."""
    loader = _Loader(text)
    try:
        while loader.check_event():
            ev = loader.get_event()
            if isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None) is not None:
                kind = f"alias *{ev.anchor}" if isinstance(ev, yaml.AliasEvent) else f"anchor &{ev.anchor}"
                raise _err(p, f"line {ev.start_mark.line + 1}", f"YAML {kind}: budget files hold no anchors or "
                           "aliases (write the value out)")
    finally:
        loader.dispose()


def safe_yaml(p: Path, text: str) -> Any:
    """``text`` (the file ``p``) as YAML for a file a user hands the tool: safe types only, no anchor or alias
    (:func:`_refuse_anchors`), no key given twice, no nesting deeper than Python's recursion allows; ``None`` for
    no document. Raises :class:`BudgetError` (one line: the file, the line, what is allowed)."""
    try:
        _refuse_anchors(p, text)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _refuse_duplicate_keys(p, node)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}" if mark else "?"
        raise _err(p, at, f"not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except RecursionError:
        raise _err(p, "top level", "nested too deeply to read (a budget file is a few levels of mappings)") from None



def read_yaml_file(path: str | Path) -> Any:
    """The regular file ``path`` (at most :data:`MAX_BUDGET_FILE_BYTES`) read by :func:`safe_yaml`. Raises
    :class:`BudgetError`; ``FileNotFoundError`` if it does not exist."""
    p = Path(path)
    try:
        data = read_file_bounded(p, MAX_BUDGET_FILE_BYTES, "YAML file")
    except FileNotFoundError:
        raise
    except ValueError as exc:
        raise BudgetError(str(exc)) from None
    except OSError as exc:
        raise _err(p, "top level", f"cannot be read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _err(p, "top level", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return safe_yaml(p, text)


def load_budget_file(path: str | Path) -> BudgetFile:
    """Read and validate a budget file. Raises :class:`BudgetError` (file, entry, key) on any problem: not a
    regular file or larger than :data:`MAX_BUDGET_FILE_BYTES`, an empty file (damaged), a YAML anchor or alias, a
    key given twice, a size without a unit or negative, a tolerance that is not a finite number >= 0, a field of
    the wrong type, an unknown key. An entry missing a
    gated metric is refused when it is checked (:func:`incomplete`), not here: an update rewrites it whole.
    ``FileNotFoundError`` if it does not exist."""
    p = Path(path)
    raw = read_yaml_file(p)
    if raw is None:
        raise _err(p, "top level", "the file is empty (damaged?): a budget file holds schema, profile and entries; "
                   "restore it, or delete it and write it again with --rlhfmem-update-baselines")
    if not isinstance(raw, dict):
        raise _err(p, "top level", "must be a mapping with keys " + ", ".join(_TOP_KEYS))
    _unknown(p, "top level", raw, _TOP_KEYS)
    if "notes" in raw and not isinstance(raw["notes"], str):
        raise _err(p, "notes", "must be text")
    if raw.get("profile") is not None and not isinstance(raw["profile"], str):
        raise _err(p, "profile", f"must be text (a profile name such as cpu), got {raw['profile']!r}")
    if raw.get("schema", SCHEMA) != SCHEMA:
        raise _err(p, "schema", f"unsupported schema {raw.get('schema')!r}; this version reads {SCHEMA}")
    defaults = dict(DEFAULT_TOLERANCES)
    d = raw.get("defaults") or {}
    if not isinstance(d, dict):
        raise _err(p, "defaults", "must be a mapping")
    _unknown(p, "defaults", d, _DEFAULTS_KEYS)
    if not isinstance(d.get("tolerances") or {}, dict):
        raise _err(p, "defaults.tolerances", "must be a mapping of metric -> {rel, abs}")
    for metric, tol in (d.get("tolerances") or {}).items():
        defaults[metric] = _parse_tolerance(p, "defaults.tolerances", metric, tol, defaults.get(metric, Tolerance()))
    entries: dict[str, BudgetEntry] = {}
    raw_entries = raw.get("entries") or {}
    if not isinstance(raw_entries, dict):
        raise _err(p, "entries", "must be a mapping of scenario id -> entry")
    for eid, e in raw_entries.items():
        where = f"entry {eid!r}"
        if not isinstance(eid, str):
            raise _err(p, where, "a scenario id is text")
        if not isinstance(e, dict):
            raise _err(p, where, "must be a mapping")
        _unknown(p, where, e, _ENTRY_KEYS)
        _check_entry_fields(p, where, e)
        metrics: dict[str, int] = {}
        for m, v in (e.get("metrics") or {}).items():
            if m in REPORTED_NOT_BUDGETED:
                raise _err(p, f"{where}.metrics", f"{m} is reported, not budgeted ({REPORTED_NOT_BUDGETED[m]}): "
                           "the gated host figure is host_anon_growth (peak anonymous RSS minus its value after "
                           "imports); regenerate the entry with --rlhfmem-update-baselines")
            if m not in _KNOWN_METRICS:
                raise _err(p, f"{where}.metrics", f"unknown metric {m!r}; allowed: {', '.join(_KNOWN_METRICS)}")
            if m in SIZE_BUDGETS:
                try:
                    metrics[m] = parse_size(v)
                except ValueError as exc:
                    raise _err(p, f"{where}.metrics.{m}", str(exc)) from None
                if metrics[m] < 0:
                    raise _err(p, f"{where}.metrics.{m}", f"a size is >= 0, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _err(p, f"{where}.metrics.{m}", f"a count is an integer >= 0, got {v!r}")
            else:
                metrics[m] = v
        tols = {m: _parse_tolerance(p, f"{where}.tolerances", m, t, defaults.get(m, Tolerance()))
                for m, t in (e.get("tolerances") or {}).items()}
        entries[eid] = BudgetEntry(eid, metrics, tols, e.get("capture"), e.get("device"), e.get("peak_phase"), e)
    return BudgetFile(p, raw.get("profile"), defaults, entries, raw)


def _check_entry_fields(p: Path, where: str, e: dict) -> None:
    """An entry's fields hold what they are written as (``entry_from_result``): text, a world size, mappings of
    text keys to scalars (versions) or to anything (capture_description, host_cpu), metrics and tolerances as
    mappings. Raises :class:`BudgetError` naming the file, the entry, the key and what is allowed."""
    for k in _ENTRY_TEXT:
        if e.get(k) is not None and not isinstance(e[k], str):
            raise _err(p, f"{where}.{k}", f"must be text, got {e[k]!r}")
    ws = e.get("world_size")
    if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or ws < 1):
        raise _err(p, f"{where}.world_size", f"must be an integer >= 1, got {ws!r}")
    for k in _ENTRY_MAPPINGS + ("metrics", "tolerances"):
        v = e.get(k)
        if v is not None and not (isinstance(v, dict) and all(isinstance(x, str) for x in v)):
            raise _err(p, f"{where}.{k}", f"must be a mapping with text keys, got {v!r}")
    for name, v in (e.get("versions") or {}).items():
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise _err(p, f"{where}.versions.{name}", f"must be a version (text or a number), got {v!r}")


def growth_unmeasured(path: str | Path, entry: BudgetEntry, result: dict) -> str | None:
    """``None`` unless ``entry`` gates growth across iterations (:data:`GROWTH_BUDGETS`) and ``result`` (a scenario
    result, bytes inside) has no growth figures; then one line naming the file, the entry, the metrics and how
    many iterations the run recorded (a growth budget must not pass a run that could not measure growth)."""
    wanted = [m for m in GROWTH_BUDGETS if m in entry.metrics]
    have = result.get("metrics") or {}
    missing = [m for m in wanted if m not in have]
    if not missing:
        return None
    n = len(result.get("iterations") or [])
    return (f"{path}: entry {entry.id!r} gates growth across iterations ({', '.join(missing)}), but this run "
            f"recorded {n} iteration(s): growth needs at least 3 (ppo_iteration(..., iterations=N), "
            "rlhfmem_command(..., iterations=N) with rlhfmem.iteration() at the top of each step)")


def incomplete(path: str | Path, entry: BudgetEntry) -> str | None:
    """``None`` when ``entry`` names every metric it is checked on: all of :data:`BUDGET_METRICS`, and all of
    :data:`SWAP_BUDGETS` when it names one of them (``entry_from_result`` writes them together); else one line
    naming the file, the entry and the missing metrics (an entry cut short would otherwise pass unchecked)."""
    missing = [m for m in BUDGET_METRICS if m not in entry.metrics]
    for group in OPTIONAL_GROUPS:
        if any(m in entry.metrics for m in group):
            missing += [m for m in group if m not in entry.metrics]
    if not missing:
        return None
    return (f"{path}: entry {entry.id!r}.metrics: missing {', '.join(missing)}; every entry gates "
            f"{', '.join(BUDGET_METRICS)} (write the entry again with --rlhfmem-update-baselines)")


@dataclass
class Row:
    metric: str
    budget: int | None
    measured: int | None
    tolerance: Tolerance
    status: str  # "ok" | "over" | "under" | "new-metric"

    @property
    def delta(self) -> int | None:
        return None if self.budget is None or self.measured is None else self.measured - self.budget

    @property
    def delta_pct(self) -> float | None:
        if self.delta is None or not self.budget:
            return None
        return 100.0 * self.delta / self.budget

    def fmt(self, v: int | None) -> str:
        if v is None:
            return "-"
        return format_size(v) if self.metric in SIZE_BUDGETS else str(v)


def compare(bf: BudgetFile, entry: BudgetEntry, measured: dict[str, int | None]) -> list[Row]:
    """One row per budgeted metric. ``over`` when measured exceeds the tolerance; ``under`` when it is
    lower than the budget by more than the tolerance (an improvement worth recording)."""
    rows = []
    for m in BUDGET_METRICS + tuple(m for g in OPTIONAL_GROUPS for m in g if m in entry.metrics):
        tol = entry.tolerances.get(m, bf.defaults.get(m, Tolerance()))
        b, v = entry.metrics.get(m), measured.get(m)
        if b is None:
            rows.append(Row(m, None, v, tol, "new-metric"))
            continue
        v = v or 0
        if v > tol.allowed(b):
            status = "over"
        elif b - v > max(tol.abs, int(tol.rel * b)):
            status = "under"
        else:
            status = "ok"
        rows.append(Row(m, b, v, tol, status))
    return rows


def format_table(rows: list[Row]) -> str:
    """metric | budget | measured | delta | tolerance, as a fixed-width text table."""
    head = ("metric", "budget", "measured", "delta", "tolerance", "")
    lines = [head]
    for r in rows:
        d = r.delta
        delta = "-" if d is None else (("+" if d > 0 else "") + r.fmt(d) +
                                       (f" ({r.delta_pct:+.1f}%)" if r.delta_pct is not None else ""))
        lines.append((r.metric, r.fmt(r.budget), r.fmt(r.measured), delta, _tol_text(r),
                      "OVER BUDGET" if r.status == "over" else ""))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _tol_text(r: Row) -> str:
    ab = format_size(r.tolerance.abs) if r.metric in SIZE_BUDGETS else str(r.tolerance.abs)
    return f"max({r.tolerance.rel * 100:g}%, {ab})"


# What a capture did, not how it was set up: the simulated device's counts of its run (simcuda/library.py: describe).
# They move with the program (a doubled batch makes more reduction staging buffers, another thread another cuBLAS
# workspace), so two runs of one setup that differ in them are held against each other, not refused as not comparable.
RUN_COUNTS = frozenset({"record_stream_delayed_frees", "efficient_attention_backwards",
                        "efficient_attention_backward_workspaces_not_modelled", "cublas_workspaces",
                        "reduction_staging_buffers", "index_put_sort_buffers", "scalar_answers", "values_not_computed"})


def _setup(description: dict) -> dict:
    """``description`` without :data:`RUN_COUNTS`, at any depth."""
    return {k: _setup(v) if isinstance(v, dict) else v for k, v in description.items() if k not in RUN_COUNTS}


def _describe_capture(capture: str | None, description: dict | None) -> str:
    """One phrase for a capture: its kind plus how it was set up (for a CPU capture, its CUDA emulation; for the
    simulated device, its settings, not its counts: :data:`RUN_COUNTS`)."""
    desc = _setup(dict(description or {}))
    if capture == "cpu-trace-simulated":
        desc.setdefault("cuda_emulation", "off")  # entries written before the emulation existed
    if not desc:
        return repr(capture)
    return f"{capture!r} with " + ", ".join(f"{k}={v}" for k, v in sorted(desc.items()))


def not_comparable(path: str | Path, entry: BudgetEntry, capture: str | None, description: dict | None) -> str | None:
    """``None`` when a result of ``capture``/``description`` can be held against ``entry``; else the one-line
    reason, naming the file, the entry and both capture descriptions. A budget entry without a
    ``capture_description`` was written by a CPU capture without CUDA emulation."""
    if not entry.capture:
        return None
    mine = _describe_capture(entry.capture, entry.raw.get("capture_description"))
    theirs = _describe_capture(capture, description)
    if mine == theirs:
        return None
    return (f"{path}: entry {entry.id!r} was measured with capture {mine}, this run with {theirs}: the figures "
            "are not comparable (regenerate the entry with --rlhfmem-update-baselines, or use a separate "
            "--rlhfmem-profile)")


def entry_from_result(result: dict) -> dict:
    """The YAML entry for a scenario result (sizes exact, with units)."""
    m = result["metrics"]
    metrics: dict[str, Any] = {}
    for k in SIZE_BUDGETS:
        if k in SWAP_BUDGETS and not m.get("host_staging_bytes"):
            continue
        if k in ENGINE_METRIC_NAMES + GROWTH_BUDGETS and k not in m:
            continue
        metrics[k] = format_size(int(m.get(k) or 0), exact=True)
    for k in COUNT_BUDGETS:
        metrics[k] = int(m.get(k) or 0)
    if "engine_mapped_peak" in m:  # a colocated engine's run (replayed at its card): its OOMs there are gated too
        metrics["ooms"] = int(m.get("ooms") or 0)
    v = result.get("versions", {})
    return {
        "capture": result.get("capture"),
        **({"capture_description": result["capture_description"]} if result.get("capture_description") else {}),
        "device": result.get("device"),
        "world_size": result.get("world_size"),
        "peak_phase": result.get("peak_phase"),
        "versions": {k: v[k] for k in ("torch", "deepspeed", "transformers", "peft", "colossalai") if k in v},
        **({"host_cpu": result["host_cpu"]} if result.get("host_cpu") else {}),  # named when a later run differs
        "metrics": metrics,
    }


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # libyaml's emitter: the same text, 6x faster
    def ignore_aliases(self, data: Any) -> bool:  # no &anchors / *aliases in budget files
        return True


@dataclass
class UpdateSummary:
    path: Path
    new: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


def lock_path(path: str | Path) -> Path:
    """The lock file that serialises updates of the budget file ``path``:
    ``$XDG_CACHE_HOME/pytest-rlhfmem/budget-locks/<sha256 of the file's resolved path>.lock`` (default
    ``~/.cache``; the temporary directory where the cache cannot be created). It is created once and never
    removed: a lock file unlinked after release lets a third writer lock a new inode while a second still holds
    the old one (two writers at once, entries lost). Kept out of ``baselines/`` so nothing is left there."""
    key = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-rlhfmem" / "budget-locks"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / f"pytest-rlhfmem-budget-locks-{os.getuid()}"
        cache.mkdir(parents=True, exist_ok=True)
    return cache / f"{key}.lock"


_PROBE_SPARE = 64 * 1024  # bytes an update may add to the file: a probe this much larger than the file must fit


def check_writable(path: str | Path) -> str | None:
    """``None`` when an update of the budget file ``path`` can be written; else one line naming the file,
    the directory and why (read-only, full, not a directory). Writes and removes a probe file (the file's
    size plus 64 KiB, in the directory or its nearest existing parent), so nothing is left behind."""
    p = Path(path)
    d = p.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    if not d.is_dir():
        return f"{p}: baselines cannot be written: {d} is not a directory"
    try:
        size = p.stat().st_size if p.is_file() else 0
    except OSError:
        size = 0
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".rlhfmem-probe-", suffix=".tmp", dir=d)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * (size + _PROBE_SPARE))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return (f"{p}: baselines cannot be written: directory {d}: {exc.strerror or exc} "
                "(--rlhfmem-update-baselines needs a writable baselines directory with room for the file)")
    finally:
        _unlink_quietly(tmp)
    return None


def _unlink_quietly(path: str | None) -> None:
    """Remove the temporary file ``path`` (``None``: nothing was made, or it became the budget file)."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def update_budget_file(path: str | Path, updates: dict[str, dict], profile: str) -> UpdateSummary:
    """Merge ``updates`` (scenario id -> entry from :func:`entry_from_result`) into ``path``.

    Keeps every entry it is not given and each updated entry's own ``tolerances``; writes atomically
    (a temporary file in the same directory, given the file's own mode and ownership, then renamed over it;
    a new file gets ``0666 & ~umask``) under the file lock of :func:`lock_path`. Raises :class:`BudgetError`
    if the existing file is malformed (it is never overwritten then) and :class:`BudgetWriteError` (one line;
    no temporary file left) when the directory cannot be created or written (read-only, full).
    """
    from filelock import FileLock

    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BudgetWriteError(f"{p}: not written: cannot create {p.parent}: {exc.strerror or exc}") from None
    summary = UpdateSummary(p)
    with FileLock(str(lock_path(p))):
        raw: dict = {"schema": SCHEMA, "profile": profile, "entries": {}}
        st = None
        if p.exists():
            st = p.stat()
            raw = load_budget_file(p).raw  # validated before anything is touched
            raw.setdefault("entries", {})
            raw["entries"] = raw["entries"] or {}
        for eid, new in sorted(updates.items()):
            old = raw["entries"].get(eid)
            merged = dict(new)
            if old and old.get("tolerances"):
                merged["tolerances"] = old["tolerances"]
            if old is None:
                summary.new.append(eid)
            elif all(old.get(k) == merged.get(k) for k in ("metrics", "capture", "capture_description")):
                summary.unchanged.append(eid)
                continue
            else:
                summary.updated.append(eid)
            raw["entries"][eid] = merged
        raw["entries"] = dict(sorted(raw["entries"].items()))
        text = ("# Memory budgets written by `pytest --rlhfmem-update-baselines`; edit tolerances freely.\n"
                "# capture 'cpu-trace-simulated' = simulated by the allocator model from a CPU run;\n"
                "# 'cuda-memory-history' = measured on the GPU's own caching allocator.\n")
        text += yaml.dump(raw, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode) if st else 0o666 & ~_umask())
                if st and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                    try:  # only root (or the owner, for a group it belongs to) may; else the writer owns it
                        os.fchown(f.fileno(), st.st_uid, st.st_gid)
                    except PermissionError:
                        pass
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
            tmp = None
        except OSError as exc:
            bad = f"{p}: not written: {exc.strerror or exc} (directory {p.parent})"
        else:
            bad = None
        finally:
            _unlink_quietly(tmp)
        if bad:
            raise BudgetWriteError(bad)
    return summary
