"""The two seams the plugin's session is read through: the end-of-session files (``report.SessionResults``) and
the terminal summary (``summary.SummarySource``). Each reads only what its protocol names, so the session
satisfies both and any object of that shape is enough; the summary reads budget files and time spreads only
when it has something to show. No pytest session is started: these are the seams' own checks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pytest_rlhfmem.budgets import UpdateSummary
from pytest_rlhfmem.report import SessionResults, write_session_outputs
from pytest_rlhfmem.session import RlhfmemSession
from pytest_rlhfmem.summary import SummarySource, write_terminal_summary

GiB = 1 << 30


def _result(sid: str, peak_reserved: int) -> dict:
    return {"scenario_id": sid, "status": "ok", "simulated": True, "capture": "cpu", "nodeid": "t.py::t",
            "budget": None, "metrics": {"peak_reserved": peak_reserved, "peak_allocated": peak_reserved // 2}}


@dataclass(frozen=True)
class ResultsOnly:
    results: list[dict]


def test_session_outputs_are_written_from_the_results_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    report, bench = tmp_path / "out" / "report.md", tmp_path / "out" / "bench.json"
    write_session_outputs(ResultsOnly([_result("cmd/my-trainer", 3 * GiB)]), str(report), str(bench))
    entries = {e["name"]: e for e in json.loads(bench.read_text())}
    assert entries["cmd/my-trainer peak_reserved"]["value"] == 3 * GiB
    assert entries["cmd/my-trainer peak_reserved"]["unit"] == "bytes"
    assert "cmd/my-trainer" in report.read_text()
    assert report.with_suffix(".json").is_file()


def test_the_session_has_what_both_seams_read():
    session = RlhfmemSession(config=None)  # type: ignore[arg-type]  # the seams never read the config
    assert isinstance(session, SessionResults) and isinstance(session, SummarySource)
    assert not isinstance(ResultsOnly([]), SummarySource)  # the check can fail: a results-only object lacks the rest


class Terminal:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def section(self, title: str) -> None:
        self.lines.append(f"== {title} ==")

    def write_line(self, line: str, **markup: bool) -> None:
        self.lines.append(line)


@dataclass
class Source:
    results: list[dict] = field(default_factory=list)
    update_summaries: list[UpdateSummary] = field(default_factory=list)
    update_errors: list[str] = field(default_factory=list)
    kept_work: list[str] = field(default_factory=list)
    lost_outputs: list[str] = field(default_factory=list)
    stale: dict[str, list[str]] = field(default_factory=dict)
    baselines: Path | None = None

    def baselines_dir(self) -> Path:
        if self.baselines is None:
            raise AssertionError("the summary read the baselines with nothing to show")
        return self.baselines

    def stale_entries(self) -> dict[str, list[str]]:
        if self.baselines is None:
            raise AssertionError("the summary read the budget files with nothing to show")
        return self.stale


def test_summary_with_nothing_to_show_reads_no_budget_file():
    tr = Terminal()
    write_terminal_summary(tr, Source(kept_work=["/tmp/rlhfmem-run0"]))  # type: ignore[arg-type]
    assert tr.lines == ["rlhfmem: work directory kept: /tmp/rlhfmem-run0"]


def test_summary_shows_each_scenario_in_human_units_and_the_stale_entries(tmp_path):
    tr = Terminal()
    src = Source(results=[_result("deepspeed-chat/tiny-opt/zero2/flush-none/ws2", 3 * GiB)], baselines=tmp_path,
                 stale={"baselines/cpu/x.yaml": ["old/one"]})
    write_terminal_summary(tr, src)  # type: ignore[arg-type]
    assert tr.lines[0] == "== rlhfmem: memory per scenario =="
    assert tr.lines[1].split()[:3] == ["scenario", "capture", "peak"]
    row = tr.lines[2]
    assert row.startswith("deepspeed-chat/tiny-opt/zero2/flush-none/ws2  simulated") and "3.00 GiB" in row
    assert tr.lines[-1] == "rlhfmem: baselines/cpu/x.yaml: 1 stale entries (no collected test produces them): old/one"

