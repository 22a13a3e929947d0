"""The session's terminal summary: the section ``rlhfmem: memory per scenario`` and the lines after it.

What it shows is read from a :class:`SummarySource` (the session, ``session.py``): a table with one row
per scenario (:func:`summary_table`), what ``simulated`` and the host columns mean, the flush policies'
memory-time trade-offs (``report.py``), the advisor's line for each scenario over budget, the budget files
written, the ones NOT written, the stale entries, and the work directories kept. Figures are bytes in the
results and GiB/MiB (``units.format_size``) on screen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import pytest

from .budgets import UpdateSummary
from .record.host import format_rss
from .report import flush_tradeoffs
from .timing import session_spreads
from .units import format_size


@runtime_checkable
class SummarySource(Protocol):
    """What the summary reads of a session."""

    results: list[dict]  # one per scenario: strip_for_summary of its result, with "nodeid" and "budget"
    update_summaries: list[UpdateSummary]  # budget files written under --rlhfmem-update-baselines
    update_errors: list[str]  # budget files NOT written, one line each
    kept_work: list[str]  # work directories left in place
    lost_outputs: list[str]  # outputs that could not be written at the end, one line each (where they went)

    def baselines_dir(self) -> Path: ...

    def stale_entries(self) -> dict[str, list[str]]: ...


def summary_table(results: list[dict]) -> list[str]:
    """scenario | capture | peak reserved | peak allocated | fragmentation | peak phase | host peak RSS (anon
    growth) | host pinned | vs budget: one text line per row, the header first, columns padded to their widest
    cell. ``results`` are the session's (sizes in bytes); the cells show them in human units."""
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


def write_terminal_summary(tr: pytest.TerminalReporter, s: SummarySource) -> None:
    """Write the summary to ``tr``: the kept work directories always; the section and what follows it only
    when the session has results or wrote budget files. Reads the recorded time spreads under
    ``s.baselines_dir()`` (:func:`~pytest_rlhfmem.timing.session_spreads`) and each budget file for its stale
    entries; an unreadable one is passed over (:meth:`SummarySource.stale_entries`)."""
    for d in s.kept_work:
        tr.write_line(f"rlhfmem: work directory kept: {d}")
    for line in s.lost_outputs:
        tr.write_line(f"rlhfmem: {line}", red=True)
    if not (s.results or s.update_summaries):
        return
    tr.section("rlhfmem: memory per scenario")
    for line in summary_table(s.results):
        tr.write_line(line)
    if any(r.get("simulated") for r in s.results):
        tr.write_line("simulated = an allocation trace (a CPU run's, or the simulated CUDA device's) replayed "
                      "through the CUDA caching allocator model; not a GPU measurement")
    if s.results:
        tr.write_line("host peak RSS (anon growth) / host pinned: measured in each rank's process (max over "
                      "ranks), never simulated; anon growth = peak anonymous RSS (sampled) minus its value after "
                      "imports, the budgeted figure; on CPU 'pinned' = offload buffers held in host memory "
                      "(nothing is page-locked)")
    trade = flush_tradeoffs(s.results, session_spreads(s.baselines_dir()))
    if trade:
        tr.write_line("flush policies: memory saving next to the iteration-time change (with its noise) and "
                      "the flush's own cost in allocator calls")
        for line in trade:
            tr.write_line("  " + line)
    for r in s.results:
        if r.get("advice"):
            tr.write_line(f"{r['scenario_id']}: {r['advice']}")
    for u in s.update_summaries:
        tr.write_line(f"rlhfmem: {u.path}: {len(u.updated)} updated, {len(u.new)} new, "
                      f"{len(u.unchanged)} unchanged")
    for err in s.update_errors:
        tr.write_line(f"rlhfmem: baseline NOT written: {err}", red=True)
    for f, stale in s.stale_entries().items():
        tr.write_line(f"rlhfmem: {f}: {len(stale)} stale entries (no collected test produces them): "
                      + ", ".join(stale), yellow=True)
