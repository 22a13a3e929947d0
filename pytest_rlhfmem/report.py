"""Reports: per-PR memory diff (markdown + JSON), GitHub step summary, benchmark JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .budgets import BUDGET_METRICS, SIZE_BUDGETS


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


def write_session_outputs(session: Any, config: Any) -> None:
    """Files the plugin writes at the end of a session, as its options ask."""
    from .plugin import _opt

    bench = _opt(config, "rlhfmem_benchmark_json")
    if bench:
        Path(bench).parent.mkdir(parents=True, exist_ok=True)
        Path(bench).write_text(json.dumps(benchmark_json(session.results), indent=1))
