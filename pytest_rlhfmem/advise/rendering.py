"""The advisor's reports: the text table ``rlhfmem advise`` prints, its markdown, and the plugin's one line.

Each reads the JSON document of ``ranking.advise`` (``docs/advise.md``) and nothing else. Sizes are
printed with ``units.format_size``; simulated figures are labelled as such.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..memory.allocator import AllocatorConfigError
from ..units import format_size
from .inputs import AdviseInputError
from .ranking import advise


def _fmt_row(r: dict) -> tuple:
    frag = format_size(r["fragmentation_at_peak"]) if r["fragmentation_at_peak"] else "-"
    te = r.get("time_estimate")
    cost = f"{r['extra_cuda_malloc']:+d} / {r['extra_cuda_free']:+d}"
    t = f"~{te['seconds'] * 1e3:.1f} ms (est.)" if te else "-"
    oom = " OOM" if r["ooms"] else ""
    return (str(r["rank"]), r["description"] + oom, format_size(r["peak_reserved"]), f"{r['delta_peak_pct']:+.1f}%",
            frag, str(r["peak_phase"] or "-"), cost, format_size(r["bytes_reacquired"]), t)


def text_lines(doc: dict, top: int = 8) -> list[str]:
    """The human report: per scenario the top rows, the study's policies beside them, the recommendation."""
    lines = []
    for s in doc["scenarios"]:
        label = ("CUDA trace replayed through the allocator model (free-running)" if not s["simulated"] else
                 "simulated: CPU trace replayed through the allocator model" if s["capture"] == "cpu-trace-simulated"
                 else f"simulated: {s['capture']} trace replayed through the allocator model")
        lines.append(f"{s['scenario_id']}: {s['ranks']} rank(s), {sum(s['events'])} events, "
                     f"{len(s['boundaries'])} flush boundaries ({s['boundary_kind']}); {label}")
        if s.get("hint"):
            lines.append(f"  {s['hint']}")
        header = ("#", "candidate", "peak reserved", "vs none", "frag. at peak", "peak phase",
                  "cudaMalloc / cudaFree", "re-acquired", "time")
        rows = [header]
        shown = s["candidates"][:top]
        ids = {r["id"] for r in shown}
        extra = [r for r in s["candidates"] if r["id"] not in ids and (r["kind"] in ("policy", "recorded")
                                                                      or r["id"] == "none")]
        rows += [_fmt_row(r) for r in shown]
        if extra:
            rows.append(("", "study's policies and references:", "", "", "", "", "", "", ""))
            rows += [_fmt_row(r) for r in extra]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        pol = ", ".join(f"{p}: {'not applicable (no recipe phases)' if c is None else '#' + str(_rank_of(s, c))}"
                        for p, c in s["policies"].items())
        lines.append(f"  study's policies: {pol}")
        for ne in s["not_evaluated"]:
            lines.append(f"  {ne['setting']}: {ne['reason']}")
        capacity = format_size(s["assumptions"]["gc_capacity"])
        lines.append(f"  garbage_collection_threshold assumes a device of {capacity}"
                     f" ({s['assumptions']['gc_capacity_source']})")
        mc = s["premise"]["measured_check"]
        if mc:
            lines.append(f"  check: {mc['note']} (measured {format_size(mc['measured_peak_reserved'])}, replayed "
                         f"{format_size(mc['replayed_peak_reserved'])})")
        lines.append(f"  recommendation: {s['recommendation']['text']}")
        if env := s["recommendation"].get("env"):
            lines.append(f"  set it as: {env['variable']}={env['value']}  ({env['why']})")
        if s["budget"]:
            lines.append(f"  budget: {s['budget']['text']}")
        if s.get("colocated_engine"):
            lines.append(f"  colocated engine: {s['colocated_engine']['text']}")
        lines.append(f"  ({s['replays']} replays in {s['seconds']:.1f} s; cost = extra calls and bytes vs no "
                     "flush; times only where CUDA flush durations were measured, and then estimates)")
    return lines


def _rank_of(s: dict, cid: str) -> int:
    return next((r["rank"] for r in s["candidates"] if r["id"] == cid), 0)


def markdown(doc: dict, top: int = 8) -> str:
    """The markdown report (``rlhfmem advise --md``, the session report): per scenario the recommendation and the
    top rows, the study's policies and references below them."""
    out = ["# rlhfmem advise", ""]
    for s in doc["scenarios"]:
        out += [f"## `{s['scenario_id']}`", "",
                ("_simulated: a CPU allocation trace replayed through the CUDA caching allocator model_"
                 if s["simulated"] and s["capture"] == "cpu-trace-simulated" else
                 f"_simulated: a {s['capture']} trace replayed through the CUDA caching allocator model_"
                 if s["simulated"] else "_a CUDA trace replayed through the allocator model (free-running)_"), "",
                f"**Recommendation:** {s['recommendation']['text']}", ""]
        if env := s["recommendation"].get("env"):
            out += [f"Set it as `{env['variable']}={env['value']}` ({env['why']}).", ""]
        if s.get("hint"):
            out += [f"_{s['hint']}_", ""]
        if s["budget"]:
            out += [f"**Budget:** {s['budget']['text']}", ""]
        if s.get("colocated_engine"):
            out += [f"**Colocated engine:** {s['colocated_engine']['text']}", ""]
        out += ["| # | candidate | peak reserved | vs none | fragmentation at peak | peak phase | cudaMalloc / "
                "cudaFree | re-acquired | time |", "|---|---|---|---|---|---|---|---|---|"]
        shown = s["candidates"][:top]
        ids = {r["id"] for r in shown}
        shown += [r for r in s["candidates"] if r["id"] not in ids and (r["kind"] in ("policy", "recorded")
                                                                       or r["id"] == "none")]
        for r in shown:
            out.append("| " + " | ".join(_fmt_row(r)) + " |")
        out.append("")
        for ne in s["not_evaluated"]:
            out.append(f"- `{ne['setting']}`: {ne['reason']}")
        out.append(f"- garbage_collection_threshold assumes a device of "
                   f"{format_size(s['assumptions']['gc_capacity'])} ({s['assumptions']['gc_capacity_source']})")
        out.append("")
    return "\n".join(out)


def one_line(result: dict, budget: int | None = None) -> str:
    """The plugin's line for a scenario over budget: the advisor's recommendation (or the cheapest change
    that fits ``budget``), from the result's own traces. Never raises: a failure becomes the line."""
    try:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "result.json"
            p.write_text(json.dumps(result))
            doc = advise(p, budget=budget, processes=1)  # inside pytest: no fork of the test process
        s = doc["scenarios"][0]
        if s["budget"]:
            return f"rlhfmem advise: {s['budget']['text']} (best: {s['recommendation']['text']})"
        return f"rlhfmem advise: {s['recommendation']['text']}" + (f" ({s['hint']})" if s.get("hint") else "")
    except (AdviseInputError, OSError, AllocatorConfigError) as exc:
        return f"rlhfmem advise: not available ({exc})"
