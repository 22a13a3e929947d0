"""Reports: the per-PR memory diff (markdown + JSON), the GitHub step summary, benchmark JSON, and the
flush policies' memory saving next to their time overhead.

Diff inputs are session results (``--rlhfmem-json``), a single ``rlhfmem run --json`` result, or a
budget file (``baselines/<profile>/<suite>.yaml``). Layout follows what reviewers know from CodSpeed and
asv: a verdict line with counts, the environments compared (a mismatch is flagged), regressions first,
the full table folded in ``<details>``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from .budgets import (BUDGET_METRICS, DEFAULT_TOLERANCES, GROWTH_BUDGETS, SIZE_BUDGETS, BudgetError,
                      load_budget_file)
from .memory.events import SIMULATED_CAPTURES
from .units import MAX_SIZE, format_size, read_file_bounded

# "unmeasured": the scenario is on both sides but one side lacks this metric (e.g. budgets written before
# host memory was measured): it does not decide the scenario's verdict.
STATUS_ORDER = {"regressed": 0, "failed": 1, "new": 2, "missing": 3, "improved": 4, "unchanged": 5, "unmeasured": 6}


@runtime_checkable
class SessionResults(Protocol):
    """What a session's end-of-run files are made of: its results, one per scenario (a result JSON less its
    per-rank detail, sizes in bytes, with ``nodeid``, ``budget`` (a budget verdict: its ``file``, ``entry``,
    ``status``) and, over budget with ``--rlhfmem-advise``, ``advice``). The plugin's ``RlhfmemSession`` is one."""

    @property
    def results(self) -> list[dict]: ...


class ReportInputError(ValueError):
    """An input file that is neither a session result, a run result nor a budget file."""


# -- result JSONs: read with a bound, checked against what the reports read of them ---------------------------

MAX_RESULT_JSON_BYTES = 2**30  # a result JSON (run, capture, session) is read only when a regular file of at most this

# What diff, plot and advise read of a result, and what each may hold (every key may be absent or null except
# scenario_id; keys not listed are passed over): "text", "integer" and "number" (finite, |v| <= 2**63-1, never a
# bool), "bool", "mapping" (any), a dict (a mapping whose listed keys are checked), [spec] (a list of spec), ("map",
# spec) (a mapping of text keys to spec), ("pair", a, b) (a list of two).
_SERIES = {"index": ["integer"], "reserved": ["number"], "allocated": ["number"],
           "reserved_without_fragmentation": ["number"], "phase_starts": [("pair", "text", "integer")]}
_RANK = {"rank": "integer", "trace_file": "text", "recipe": {"rollout_engine": "mapping"},
         "flush_cost": {"measured_flush_s": ["number"], "segments_released": "integer"}, "series": _SERIES,
         "total": {"peak_reserved": "number"}, "phases": [{"phase": "text", "host_peak_rss": "number"}]}
RESULT_SCHEMA = {
    "scenario_id": "text", "status": "text", "capture": "text", "device": "text", "world_size": "integer",
    "simulated": "bool", "peak_phase": "text", "scenario": {"flush": "text"}, "metrics": ("map", "number"),
    "versions": ("map", "text"), "host_cpu": "mapping", "capture_description": "mapping",
    "iteration_wall_s": "number", "time_rounds": ["number"], "ranks": [_RANK],
    "phases": ("map", {"peak_reserved": "number", "peak_allocated": "number"}),
    "iterations": [{"iteration": "integer", "peak_reserved": "number", "peak_allocated": "number",
                    "host_anon_peak": "number"}],
}
_WHAT = {"text": "text", "integer": "an integer", "number": "a finite number", "bool": "true or false",
         "mapping": "a mapping", "scalar": "text or a number"}


def _type_error(spec: object, v: object) -> str | None:
    """What ``v`` should be under ``spec`` (a leaf), or ``None`` when it is that."""
    if spec == "text":
        ok = isinstance(v, str)
    elif spec == "bool":
        ok = isinstance(v, bool)
    elif spec == "mapping":
        ok = isinstance(v, dict)
    elif spec in ("integer", "number", "scalar"):
        if isinstance(v, str):
            ok = spec == "scalar"
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or (spec == "integer" and isinstance(v, float)):
            ok = False
        else:
            ok = math.isfinite(v) and abs(v) <= MAX_SIZE
            if not ok:
                return f"{_WHAT[spec]} within +-(2**63-1)"
    else:
        raise AssertionError(spec)
    return None if ok else _WHAT[spec]


def _check(v: object, spec: object, where: str) -> tuple[str, str] | None:
    """The first place in ``v`` that ``spec`` refuses, as ``(key path, what is allowed)``; ``None`` if none."""
    if v is None:
        return None
    if isinstance(spec, dict):
        if not isinstance(v, dict):
            return where, "a mapping"
        for k, sub in spec.items():
            bad = _check(v.get(k), sub, f"{where}.{k}" if where else k)
            if bad:
                return bad
        return None
    if isinstance(spec, list):
        if not isinstance(v, list):
            return where, "a list"
        for i, item in enumerate(v):
            bad = _check(item, spec[0], f"{where}[{i}]") if item is not None else (f"{where}[{i}]", "not null")
            if bad:
                return bad
        return None
    if isinstance(spec, tuple) and spec[0] == "map":
        if not isinstance(v, dict):
            return where, "a mapping"
        for k, item in v.items():
            bad = _check(item, spec[1], f"{where}.{k}")
            if bad:
                return bad
        return None
    if isinstance(spec, tuple) and spec[0] == "pair":
        if not isinstance(v, list) or len(v) != 2 or None in v:
            return where, f"a list of two: {_WHAT[spec[1]]}, {_WHAT[spec[2]]}"
        return _check(v[0], spec[1], f"{where}[0]") or _check(v[1], spec[2], f"{where}[1]")
    what = _type_error(spec, v)
    return (where, what) if what else None


def read_results(path: str | Path) -> list[dict]:
    """The results of a result JSON: a run's or a capture's (one result, ``rlhfmem run --json``) or a session's
    (``--rlhfmem-json``: ``{"results": [...]}``), each checked against :data:`RESULT_SCHEMA` before any report
    reads it. Raises :class:`ReportInputError`, one line naming the file, the result, the key and what is
    allowed (a file that is not a regular file of at most :data:`MAX_RESULT_JSON_BYTES`, not JSON, neither kind of
    result, a key holding the wrong type, a number that is not finite)."""
    p = Path(path)
    try:
        data = json.loads(read_file_bounded(p, MAX_RESULT_JSON_BYTES, "result JSON"))
    except FileNotFoundError:
        raise ReportInputError(f"{p}: cannot read a result (no such file)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{p}: not JSON ({exc})") from None
    except RecursionError:
        raise ReportInputError(f"{p}: not JSON a result holds (nested too deeply)") from None
    except ValueError as exc:  # not a regular file, too large
        raise ReportInputError(str(exc)) from None
    except OSError as exc:
        raise ReportInputError(f"{p}: cannot be read: {exc.strerror or exc}") from None
    if isinstance(data, dict) and "results" in data:
        results, session = data["results"], True
        if not isinstance(results, list):
            raise ReportInputError(f"{p}: results: must be a list of scenario results, got {_short(results)}")
    elif isinstance(data, dict) and "scenario_id" in data:
        results, session = [data], False
    else:
        raise ReportInputError(f"{p}: no scenario_id: neither a run result (rlhfmem run/capture --json: a mapping "
                               "with scenario_id), a session result (--rlhfmem-json: a mapping with results) nor a "
                               "budget file (.yaml)")
    for i, r in enumerate(results):
        label = f"results[{i}]" if session else "the result"
        if not isinstance(r, dict) or not isinstance(r.get("scenario_id"), str):
            raise ReportInputError(f"{p}: {label}: must be a scenario result (a mapping whose scenario_id is text), "
                                   f"got {_short(r)}")
        bad = _check(r, RESULT_SCHEMA, "")
        if bad:
            key, what = bad
            v = r
            raise ReportInputError(f"{p}: {label} ({r['scenario_id']}): {key}: must be {what}, got "
                                   f"{_short(_at(v, key))}")
    return results


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:56] + " ..."


def _at(v: object, key: str) -> object:
    """The value at ``key`` (a path as :func:`_check` writes it: ``a.b[2].c``) in ``v``."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        v = v[int(part[1:-1])] if part.startswith("[") else v[part]  # type: ignore[index]
    return v


class NothingMatched(ReportInputError):
    """Two sides of a diff without one scenario id in common: nothing was compared."""


@dataclass
class Side:
    """One side of a diff: per scenario its metrics (bytes / counts) and environment."""

    label: str
    scenarios: dict[str, dict] = field(default_factory=dict)  # id -> {"metrics", "status", "env"}


def _env(r: dict) -> dict:
    """A result's or budget entry's environment: device, capture, versions, and the host properties that could
    move a CPU figure (``host_cpu``, hostcpu.py; named ``host <property>``)."""
    v = r.get("versions") or {}
    return {"device": r.get("device"), "capture": r.get("capture"), "world_size": r.get("world_size"),
            **{k: v[k] for k in ("torch", "deepspeed", "transformers", "peft", "colossalai") if k in v},
            **{f"host {k}": val for k, val in (r.get("host_cpu") or {}).items()}}


def without_flush(side: Side) -> Side:
    """The same side keyed by scenario id without its flush component, so that ``flush-none`` in one
    file meets ``flush-after-inference`` in the other: what a flush policy changes."""
    out = Side(side.label)
    for sid, s in side.scenarios.items():
        out.scenarios[re.sub(r"/flush-[a-z-]+/", "/flush-*/", sid)] = s
    return out


def load_side(path: str | Path) -> Side:
    """Read a session JSON, a run JSON or a budget YAML. Raises :class:`ReportInputError` naming the file."""
    p = Path(path)
    if not p.exists():
        raise ReportInputError(f"{p}: no such file")
    if p.suffix in (".yaml", ".yml"):
        try:
            bf = load_budget_file(p)
        except BudgetError as exc:
            raise ReportInputError(str(exc)) from None
        side = Side(str(p))
        for eid, e in bf.entries.items():
            env = _env({"device": e.device, **e.raw})
            side.scenarios[eid] = {"metrics": dict(e.metrics), "status": "ok", "env": env}
        return side
    results = read_results(p)
    side = Side(str(p))
    for r in results:
        side.scenarios[r["scenario_id"]] = {"metrics": r.get("metrics") or {}, "status": r.get("status", "ok"),
                                            "env": _env(r), "result": r}
    return side


def parse_threshold(text: str) -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05: a finite fraction >= 0. Raises ``ValueError`` (one line naming the option and
    what is allowed) for anything else: no number, nan, inf, a negative threshold."""
    t = text.strip()
    allowed = "a percentage like 5% or a fraction like 0.05 (finite, >= 0)"
    try:
        v = float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"--threshold {text!r}: expected {allowed}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"--threshold {text!r}: out of range: expected {allowed}")
    return v


TIME_METRIC = "iteration_time"


@dataclass
class DiffRow:
    scenario: str
    metric: str
    base: int | float | None
    head: int | float | None
    status: str
    note: str = ""  # time rows: the noise verdict ("within noise (+-X%)", "noise unknown")

    @property
    def delta(self) -> int | None:
        return None if self.base is None or self.head is None else self.head - self.base

    @property
    def delta_pct(self) -> float | None:
        d = self.delta
        return None if d is None or not self.base else 100.0 * d / self.base

    def fmt(self, v: int | float | None) -> str:
        if v is None:
            return "-"
        if self.metric == TIME_METRIC:
            return f"{v:.2f} s"
        metric = self.metric.rpartition(":")[2]  # a phase row's metric is <phase>:<metric>
        return format_size(v) if metric in SIZE_BUDGETS else str(v)

    def to_dict(self) -> dict:
        return {"scenario": self.scenario, "metric": self.metric, "base": self.base, "head": self.head,
                "delta": self.delta, "delta_pct": None if self.delta_pct is None else round(self.delta_pct, 3),
                "status": self.status, "note": self.note}


@dataclass
class Diff:
    base: Side
    head: Side
    threshold: float
    rows: list[DiffRow]
    phase_rows: list[DiffRow] = field(default_factory=list)  # per phase (phase_diff): run results on both sides

    def counts(self) -> dict[str, int]:
        """Per scenario, its worst status."""
        worst: dict[str, str] = {}
        for r in self.rows:
            cur = worst.get(r.scenario)
            if cur is None or STATUS_ORDER[r.status] < STATUS_ORDER[cur]:
                worst[r.scenario] = r.status
        out = {k: 0 for k in ("regressed", "improved", "unchanged", "new", "missing", "failed")}
        for s in worst.values():
            out["unchanged" if s == "unmeasured" else s] += 1
        return out

    @property
    def regressed(self) -> bool:
        return any(r.status in ("regressed", "failed") for r in self.rows)

    def environment_mismatches(self) -> list[str]:
        keys: dict[str, tuple[set, set]] = {}
        for side, idx in ((self.base, 0), (self.head, 1)):
            for s in side.scenarios.values():
                for k, v in s["env"].items():
                    if v is not None:
                        keys.setdefault(k, (set(), set()))[idx].add(str(v))
        return [f"{k}: base {', '.join(sorted(b)) or '-'} vs head {', '.join(sorted(h)) or '-'}"
                for k, (b, h) in sorted(keys.items()) if b and h and b != h]

    def environments(self) -> dict[str, dict]:
        def summary(side: Side) -> dict:
            out: dict[str, set] = {}
            for s in side.scenarios.values():
                for k, v in s["env"].items():
                    if v is not None:
                        out.setdefault(k, set()).add(str(v))
            return {k: ", ".join(sorted(v)) for k, v in sorted(out.items())}

        return {"base": summary(self.base), "head": summary(self.head)}


def _time_row(sid: str, b: dict | None, h: dict | None, threshold: float, spreads: dict | None) -> DiffRow | None:
    """Iteration time, treated like memory: a regression (improvement) must be beyond ``threshold`` AND
    beyond the noise floor (``timing.compare_times``); with the noise unknown it is never one."""
    from .timing import compare_times, time_figure

    if not b or not h or "result" not in b or "result" not in h or h["status"] != "ok":
        return None
    fb, fh = time_figure(b["result"], spreads), time_figure(h["result"], spreads)
    if fb is None or fh is None:
        return None
    verdict, text = compare_times(fb, fh)
    rel = (fh.seconds - fb.seconds) / fb.seconds if fb.seconds else 0.0
    status = "unchanged"
    if verdict == "slower" and rel > threshold:
        status = "regressed"
    elif verdict == "faster" and -rel > threshold:
        status = "improved"
    note = f"noise unknown ({fb.source} vs {fh.source})" if verdict == "unknown" else text.split(": ", 1)[1]
    return DiffRow(sid, TIME_METRIC, round(fb.seconds, 6), round(fh.seconds, 6), status, note)


def diff(base: Side, head: Side, threshold: float = 0.05, spreads: dict | None = None,
         allow_disjoint: bool = False) -> Diff:
    """Compare every budgeted metric of every scenario. A change beyond ``threshold`` (relative) and beyond
    the metric's run-to-run noise (the default budget tolerance's absolute part: 4 MiB for peak reserved,
    2 MiB for peak allocated, 3 for cudaMalloc counts) is a regression (higher) or an improvement (lower);
    a scenario only in head is new, only in base missing. The iteration time (where both sides are results)
    is one more row whose noise floor is the rounds' or the recorded spread (``spreads``; ``timing.py``).
    Raises :class:`NothingMatched` (one line naming both sides' ids) when both sides hold scenarios but no
    id is on both, unless ``allow_disjoint``: such a diff compared nothing and must not pass."""
    if base.scenarios and head.scenarios and not set(base.scenarios) & set(head.scenarios) and not allow_disjoint:
        def ids(side: Side) -> str:
            names = sorted(side.scenarios)
            return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

        raise NothingMatched(f"nothing compared: no scenario id is in both {base.label} ({ids(base)}) and "
                             f"{head.label} ({ids(head)}); give both runs the same id (rlhfmem capture --id, "
                             "rlhfmem_command(id=...)), --ignore-flush for flush policies, or --allow-disjoint "
                             "to accept it")
    rows: list[DiffRow] = []
    for sid in sorted(set(base.scenarios) | set(head.scenarios)):
        b, h = base.scenarios.get(sid), head.scenarios.get(sid)
        grown = tuple(m for m in GROWTH_BUDGETS if any(s is not None and m in s["metrics"] for s in (b, h)))
        for m in BUDGET_METRICS + grown:
            bv = None if b is None else b["metrics"].get(m)
            hv = None if h is None else h["metrics"].get(m)
            if h is not None and h["status"] != "ok":
                status = "failed"
            elif b is None:
                status = "new"
            elif h is None:
                status = "missing"
            elif bv is None or hv is None:
                status = "unmeasured"
            else:
                bv, hv = int(bv), int(hv)
                limit = max(abs(bv) * threshold, DEFAULT_TOLERANCES[m].abs)
                if hv - bv > limit and hv != bv:
                    status = "regressed"
                elif bv - hv > limit and hv != bv:
                    status = "improved"
                else:
                    status = "unchanged"
            rows.append(DiffRow(sid, m, bv, hv, status))
        tr = _time_row(sid, b, h, threshold, spreads)
        if tr is not None:
            rows.append(tr)
    order = BUDGET_METRICS + GROWTH_BUDGETS + (TIME_METRIC,)
    rows.sort(key=lambda r: (STATUS_ORDER[r.status], r.scenario, order.index(r.metric)))
    return Diff(base, head, threshold, rows, phase_diff(base, head, threshold))


PHASE_METRICS = ("peak_reserved", "peak_allocated")


def phase_diff(base: Side, head: Side, threshold: float) -> list[DiffRow]:
    """Per phase of every scenario that is a run result on both sides (a budget file holds no phases) and finished on
    both: its peak reserved and peak allocated, each a :class:`DiffRow` whose ``metric`` is ``<phase>:<metric>``,
    with the whole-iteration rule (beyond ``threshold`` and the metric's noise floor). A phase on one side only is
    ``new`` or ``missing``. Changed rows first, the largest absolute change first."""
    out = []
    for sid in sorted(set(base.scenarios) & set(head.scenarios)):
        b, h = base.scenarios[sid].get("result"), head.scenarios[sid].get("result")
        if not b or not h or b.get("status") != "ok" or h.get("status") != "ok":
            continue
        bp, hp = b.get("phases") or {}, h.get("phases") or {}
        for name in [*bp, *(n for n in hp if n not in bp)]:
            for m in PHASE_METRICS:
                bv = (bp.get(name) or {}).get(m)
                hv = (hp.get(name) or {}).get(m)
                if bv is None or hv is None:
                    status = "new" if bv is None else "missing"
                else:
                    bv, hv = int(bv), int(hv)
                    limit = max(abs(bv) * threshold, DEFAULT_TOLERANCES[m].abs)
                    status = ("regressed" if hv - bv > limit else "improved" if bv - hv > limit else "unchanged")
                out.append(DiffRow(sid, f"{name}:{m}", bv, hv, status))
    out.sort(key=lambda r: (r.status == "unchanged", -abs(r.delta or 0)))
    return out


def moved_phase(d: Diff) -> DiffRow | None:
    """The phase row that moved most among those beyond threshold and noise, or ``None`` when no phase moved. Peak
    allocated decides first: what a phase allocates moves its own peak, while memory it leaves cached raises the
    peak reserved of every later window (the root window's too); then peak reserved. Among equal changes the phase
    that comes first."""
    moved = [r for r in d.phase_rows if r.status in ("regressed", "improved")]
    for metric in PHASE_METRICS[::-1]:  # peak_allocated, then peak_reserved
        rows = [r for r in moved if r.metric.endswith(":" + metric)]
        if rows:
            return max(rows, key=lambda r: abs(r.delta or 0))  # max keeps the first of equals
    return None


_MARK = {"regressed": "🔴 regressed", "improved": "🟢 improved", "unchanged": "unchanged", "new": "🆕 new",
         "missing": "missing", "failed": "❌ failed", "unmeasured": "not measured on one side"}


def _md_table(rows: list[DiffRow]) -> list[str]:
    out = ["| scenario | metric | base | head | delta | delta % | status |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r.delta
        delta = "-" if d is None else ("+" if d > 0 else "") + r.fmt(d)
        pct = r.note or ("-" if r.delta_pct is None else f"{r.delta_pct:+.1f}%")
        out.append(f"| `{r.scenario}` | {r.metric} | {r.fmt(r.base)} | {r.fmt(r.head)} | {delta} | {pct} | "
                   f"{_MARK[r.status]} |")
    return out


def to_markdown(d: Diff, title: str = "RLHF memory diff") -> str:
    c = d.counts()
    lines = [f"# {title}", ""]
    verdict = ", ".join(f"**{n} {k}**" if k in ("regressed", "failed") and n else f"{n} {k}" for k, n in c.items())
    lines += [("❌ " if d.regressed else "✅ ") + verdict + f" (threshold {d.threshold * 100:g}%, and beyond "
              "run-to-run noise: the default budget tolerances' absolute parts; for iteration time the spread "
              "of repeated rounds or the recorded spread)", ""]
    only = {k: sorted({r.scenario for r in d.rows if r.status == k}) for k in ("new", "missing")}
    if only["new"] or only["missing"]:
        lines += ["⚠️ **Not compared** (an id on one side only): "
                  + "; ".join(f"{'only in head (new)' if k == 'new' else 'only in base (missing)'}: "
                              + ", ".join(f"`{i}`" for i in v) for k, v in only.items() if v), ""]
    lines += [f"Base: `{d.base.label}`  ", f"Head: `{d.head.label}`", ""]
    env = d.environments()
    lines += ["| environment | base | head |", "|---|---|---|"]
    for k in sorted(set(env["base"]) | set(env["head"])):
        lines.append(f"| {k} | {env['base'].get(k, '-')} | {env['head'].get(k, '-')} |")
    mism = d.environment_mismatches()
    if mism:
        lines += ["", "⚠️ **Environments differ** (figures may not be comparable): " + "; ".join(mism)]
    simulated = sorted({s["env"].get("capture") for side in (d.base, d.head) for s in side.scenarios.values()}
                       & set(SIMULATED_CAPTURES))
    if simulated:
        lines += ["", f"_{', '.join(simulated)} figures are simulated: an allocation trace (a CPU run's, or the "
                  "simulated CUDA device's) replayed through the CUDA caching allocator model. host_anon_growth, "
                  "host_pinned_peak and the RSS figures are measured (each rank's process), never simulated._"]
    changed = [r for r in d.rows if r.status not in ("unchanged", "unmeasured")]
    lines += ["", "## Changes", ""]
    lines += _md_table(changed) if changed else ["No metric moved beyond the threshold."]
    if d.phase_rows:
        lines += ["", "## Per phase", ""]
        top = moved_phase(d)
        if top is None:
            lines.append("No phase moved beyond the threshold.")
        else:
            phase, _, metric = top.metric.partition(":")
            pct = f", {top.delta_pct:+.1f}%" if top.delta_pct is not None else ""
            lines += [f"**The phase that moved most: `{phase}`** ({metric.replace('_', ' ')} {top.fmt(top.base)} -> "
                      f"{top.fmt(top.head)}, {'+' if (top.delta or 0) > 0 else ''}{top.fmt(top.delta)}{pct}, "
                      f"`{top.scenario}`)", ""]
            lines += _md_table([r for r in d.phase_rows if r.status != "unchanged"])
    lines += iteration_section(d)
    lines += ["", "<details><summary>All metrics</summary>", ""] + _md_table(d.rows) + ["", "</details>", ""]
    return "\n".join(lines)


def iteration_section(d: Diff) -> list[str]:
    """The per-iteration figures of every run result of either side that recorded several iterations (bytes shown
    in MiB/GiB; device figures simulated where the capture is), as markdown lines; ``[]`` when none did."""
    rows = []
    for label, side in (("base", d.base), ("head", d.head)):
        for sid, s in sorted(side.scenarios.items()):
            for it in (s.get("result") or {}).get("iterations") or []:
                rows.append(f"| `{sid}` | {label} | {it['iteration']} | {format_size(it.get('peak_reserved'))} | "
                            f"{format_size(it.get('peak_allocated'))} | {format_size(it.get('host_anon_peak'))} |")
    if not rows:
        return []
    return ["", "## Per iteration", "", "| scenario | side | iteration | peak reserved | peak allocated | "
            "host anon peak |", "|---|---|---|---|---|---|", *rows]


def to_json(d: Diff) -> dict:
    top = moved_phase(d)
    return {"title": "RLHF memory diff", "threshold": d.threshold, "base": d.base.label, "head": d.head.label,
            "verdict": d.counts(), "regressed": d.regressed, "environments": d.environments(),
            "environment_mismatches": d.environment_mismatches(), "rows": [r.to_dict() for r in d.rows],
            "phase_rows": [r.to_dict() for r in d.phase_rows],
            "moved_phase": None if top is None else top.metric.partition(":")[0]}


def benchmark_json(results: list[dict]) -> list[dict]:
    """github-action-benchmark ``customSmallerIsBetter``: one entry per scenario and metric."""
    out = []
    for r in results:
        if r.get("status") != "ok":
            continue
        label = "simulated" if r.get("simulated") else "cuda"
        for m in BUDGET_METRICS:
            out.append({"name": f"{r['scenario_id']} {m}", "unit": "bytes" if m in SIZE_BUDGETS else "count",
                        "value": int(r["metrics"].get(m) or 0), "extra": f"capture={r.get('capture')} ({label})"})
    return out


def flush_tradeoffs(results: list[dict], spreads: dict | None = None) -> list[str]:
    """For each scenario run both without flushing and with a flush policy: the policy's peak-reserved
    change, its iteration-time change WITH its noise (``timing.compare_times``: "within noise (+-X%)" unless
    the intervals are disjoint; ``spreads`` = recorded run-to-run spreads) and the flush's own cost read
    from the trace (flushes, cudaMalloc/cudaFree calls caused; on CUDA their measured time)."""
    from .timing import compare_times, flush_cost_text, time_figure

    by_id = {r["scenario_id"]: r for r in results if r.get("status") == "ok"}
    lines = []
    for sid, r in sorted(by_id.items()):
        if "/flush-none/" in sid or "flush" not in r.get("scenario", {}):  # recipes only, not commands
            continue
        base = by_id.get(sid.replace(f"/flush-{r['scenario']['flush']}/", "/flush-none/"))
        if not base:
            continue
        pr_b, pr_h = base["metrics"]["peak_reserved"], r["metrics"]["peak_reserved"]
        mem = f"peak reserved {format_size(pr_b)} -> {format_size(pr_h)} ({100.0 * (pr_h - pr_b) / pr_b:+.1f}%)"
        _, tim = compare_times(time_figure(base, spreads), time_figure(r, spreads))
        cost = flush_cost_text(r)
        lines.append(f"{sid}: {mem}, {tim}" + (f"; {cost}" if cost else ""))
    return lines


def session_diff(session: SessionResults) -> Diff | None:
    """This session's results (head) against the budget entries they were checked against (base)."""
    head = Side("this run")
    base = Side("baselines")
    for r in session.results:
        head.scenarios[r["scenario_id"]] = {"metrics": r.get("metrics") or {}, "status": r["status"], "env": _env(r),
                                            "result": r}
        b = r.get("budget") or {}
        f = b.get("file")
        if f and Path(f).exists():
            try:
                s = load_side(f)
            except ReportInputError:
                continue
            if r["scenario_id"] in s.scenarios:
                base.scenarios[r["scenario_id"]] = s.scenarios[r["scenario_id"]]
            base.label = str(Path(f).parent)
    if not head.scenarios:
        return None
    return diff(base, head)


def write_session_outputs(session: SessionResults, report: str | None, bench: str | None) -> None:
    """The files a session writes at its end: the diff report (``report``, markdown plus a JSON twin, also
    appended to ``$GITHUB_STEP_SUMMARY`` when set) and github-action-benchmark JSON (``bench``, figures in
    bytes); a path given as ``None`` is not written. Reads only ``session.results`` (and the budget files they name).
    Raises ``OSError`` when a file cannot be written."""
    if bench:
        Path(bench).parent.mkdir(parents=True, exist_ok=True)
        Path(bench).write_text(json.dumps(benchmark_json(session.results), indent=1))
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not (report or summary_path):
        return
    d = session_diff(session)
    if d is None:
        return
    md = to_markdown(d)
    advice = [f"- `{r['scenario_id']}`: {r['advice']}" for r in session.results if r.get("advice")]
    if advice:
        md += "\n## What to try (rlhfmem advise, from each run's own trace)\n\n" + "\n".join(advice) + "\n"
    if report:
        rp = Path(report)
        rp.parent.mkdir(parents=True, exist_ok=True)
        rp.write_text(md)
        rp.with_suffix(".json").write_text(json.dumps(to_json(d), indent=1))
    if summary_path:
        data = md.encode()
        if len(data) > 1_000_000:  # GitHub's limit is 1 MiB per step
            md = md[:900_000] + "\n\n_(truncated: the full report is in --rlhfmem-report)_\n"
        with open(summary_path, "a") as f:
            f.write(md + "\n")
