"""``memory_budget.check(result)``: one result against its entry of ``baselines/<profile>/<suite>.yaml``.

The comparison itself (metrics, tolerances, the table) is ``budgets.py``'s; here the entry is found, the
verdict recorded in the session (:class:`~pytest_rlhfmem.session.BudgetVerdict`) and the test failed with
what to do: the table and the phase of the peak when over budget (with ``--rlhfmem-advise``, the advisor's
recommendation), the command that creates a missing file or entry, the file, entry and key of a malformed
one. Under ``--rlhfmem-update-baselines`` the figures are queued as the new entry instead. Sizes are bytes;
the failure's table shows them in GiB/MiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import budgets as B
from .hostcpu import host_differences
from .iterations import growth_message
from .options import option_value
from .results import IterationResult
from .rollout import oom_causes
from .session import BudgetVerdict, RlhfmemSession


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
        """``<baselines dir>/<profile of result>/<suite>.yaml``; ``suite`` defaults to the test module's."""
        mod = Path(str(self.request.node.path)).stem
        suite = suite or (mod[5:] if mod.startswith("test_") else mod)
        return self.session.baselines_dir() / self.session.profile_for(result) / f"{suite}.yaml"

    def check(self, result: IterationResult, suite: str | None = None) -> None:
        """Record ``result``'s verdict in the session; fail the test (``pytest.fail``, no traceback) when it is
        over budget, its file or entry is missing, malformed or cut short, or its capture is not comparable
        with the entry's (``budgets.not_comparable``). Under ``--rlhfmem-update-baselines``: queue the entry."""
        path = self.path_for(result, suite)
        nodeid = self.request.node.nodeid
        eid = result.scenario_id
        self.session.note_produced(path, eid, nodeid)
        if option_value(self.session.config, "rlhfmem_update_baselines"):
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
        unmeasured = B.growth_unmeasured(path, entry, result.data)
        if unmeasured:
            self.session.record(nodeid, result, BudgetVerdict(str(path), eid, "error", detail=unmeasured))
            pytest.fail(unmeasured, pytrace=False)
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
            if option_value(self.session.config, "rlhfmem_advise"):
                from .advise import one_line  # the advisor is loaded only for a scenario over budget

                budget = entry.metrics.get("peak_reserved")
                advice = one_line(result.data, budget=int(budget) if budget else None)
                self.session.record(nodeid, result, verdict)["advice"] = advice
                advice = "\n" + advice
            grows = growth_lines(result.data, [r.metric for r in over])
            pytest.fail(
                f"{eid} is over its memory budget ({label}); budget file {path}\n{grows}"
                f"peak reserved reached in phase: {result.peak_phase}"
                f"{allocated_phase(result.phases, result.peak_phase)}\n"
                f"{oom_lines(result.data)}\n"
                f"{B.format_table(rows)}{advice}"
                f"{host_note(result.data.get('host_cpu'), entry.raw.get('host_cpu'))}",
                pytrace=False)


def growth_lines(result: dict, over: list[str]) -> str:
    """For each growth metric in ``over`` (budgets.GROWTH_BUDGETS), its line (``iterations.growth_message``: the rate,
    the iteration at which a card runs out, the phase that keeps memory), each ending in a newline; ``""`` for
    none. The card is the run's own capacity where it ran against one (a colocated engine's), else 24 GiB."""
    rows = result.get("iterations") or []
    out = [growth_message(m, rows, result.get("capacity"), bool(result.get("simulated")))
           for m in over if m in B.GROWTH_BUDGETS and rows]
    return "".join(f"{line}\n" for line in out)


def allocated_phase(phases: dict, peak_phase: str | None) -> str:
    """``"; peak allocated in phase: P"`` where the live tensors' peak came in another phase than reserved's
    ``peak_phase`` (the cached blocks of a phase's temporaries keep reserved up in the phases after it); ``""``
    otherwise or without phases."""
    if not phases:
        return ""
    name = max(phases, key=lambda p: phases[p].get("peak_allocated", 0))
    return f"; peak allocated in phase: {name}" if name != peak_phase else ""


def oom_lines(result: dict) -> str:
    """The run's OOMs, one line each naming its phase and cause (``rollout.oom_causes``: a colocated engine's
    wake-up the card could not back, the trainer's cudaMalloc beside what the engine held), each ending in a
    newline; ``""`` without OOMs."""
    return "".join(f"{line}\n" for line in oom_causes(result))


def host_note(mine: dict | None, budget: dict | None) -> str:
    """A failure's last line when this run's host differs from the budget's (``hostcpu.py``), else ``""``."""
    diffs = host_differences(mine, budget)
    return ("\nthis host differs from the budget's (this run vs budget): " + "; ".join(diffs)) if diffs else ""
