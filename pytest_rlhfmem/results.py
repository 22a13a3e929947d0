"""The result of one PPO iteration as tests see it (a thin view over the scenario result dict)."""

from __future__ import annotations

from dataclasses import dataclass

from .units import format_size


@dataclass
class IterationResult:
    """``data`` is the scenario result of :func:`pytest_rlhfmem.rlhf.launch.aggregate` (bytes inside).

    ``metrics``: whole-iteration figures, max over ranks; ``phases``: the same per phase;
    ``simulated``: True when the figures come from the allocator model replaying a CPU trace.
    """

    data: dict

    @property
    def scenario_id(self) -> str:
        return self.data["scenario_id"]

    @property
    def ok(self) -> bool:
        return self.data["status"] == "ok"

    @property
    def metrics(self) -> dict:
        return self.data["metrics"]

    @property
    def phases(self) -> dict:
        return self.data["phases"]

    @property
    def simulated(self) -> bool:
        return bool(self.data["simulated"])

    @property
    def capture(self) -> str:
        return self.data["capture"]

    @property
    def peak_phase(self) -> str | None:
        return self.data.get("peak_phase")

    def __getitem__(self, key: str):
        return self.data[key]

    def describe_failure(self) -> str:
        """One paragraph: which rank failed in which phase, why, and the memory up to then: the device peaks
        (``simulated`` on CPU and cuda-sim, as the failure says) and, for a rank that left no result (killed,
        hung), its progress file's figures: the device peaks and its host RSS (measured) of its last report, at its
        last phase change or heartbeat (record/rank.py: every 5 s). Sizes in human units (GiB, MiB)."""
        f = self.data.get("failure") or {}
        mem = dict(f.get("memory_so_far") or {})
        rss = mem.pop("host_rss", None)  # a rank without a result: its progress file's host RSS, always measured
        mem_s = ", ".join(f"{k.replace('_', ' ')} {format_size(v)}" for k, v in mem.items() if v is not None)
        if rss is not None:
            at = f" (its last report, in phase {f.get('phase')!r}); " if mem_s else ""
            mem_s += f"{at}host RSS {format_size(rss)}"
            mem_s += " (measured)" if f.get("simulated") else ""
        label = " (simulated)" if f.get("simulated") else ""
        who = (f"rank {f['rank']} failed in phase {f.get('phase')!r}" if f.get("rank") is not None else
               "the launcher failed" + (f" in phase {f['phase']!r}" if f.get("phase") else ""))
        lines = [f"{self.scenario_id}: {who}: {f.get('error')}: {f.get('message')}"]
        if f.get("rank") is not None or mem_s:
            lines.append(f"memory so far{label}: {mem_s or 'unknown'}")
        for other in self.data.get("failures", [])[1:]:
            lines.append(f"also rank {other['rank']} in phase {other['phase']!r}: {other['error']}")
        if self.data.get("log_tail"):
            lines.append("launcher log (tail):\n" + self.data["log_tail"][-1500:])
        return "\n".join(lines)


def strip_for_summary(data: dict) -> dict:
    """The scenario result as the session keeps it (and xdist workers send it): without the launcher's
    log tail of a successful run. Series stay: ``rlhfmem plot`` reads them from the session JSON."""
    out = dict(data)
    if out.get("status") == "ok":
        out.pop("log_tail", None)
    return out
