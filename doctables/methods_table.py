"""The methods side by side, from a session JSON (``--rlhfmem-json``): one markdown row per scenario with the
device figures (simulated on CPU), the model states at the end of init, the host figures (measured) and
the iteration time, each relative to PPO ``none`` where that ran.

    pytest suites/test_deepspeed_chat_cpu.py suites/test_methods_cpu.py -k flush-none --rlhfmem-json out/methods.json
    python -m doctables.methods_table out/methods.json
"""

import json
import re
import sys

MIB = 2**20


def init_states(r: dict) -> int:
    return max(rank["requested_at_phase_end"].get("init", 0) for rank in r["ranks"])


def main(path: str) -> int:
    results = {r["scenario_id"]: r for r in json.load(open(path))["results"] if r.get("status") == "ok"}
    base = next((r for sid, r in results.items() if re.fullmatch(r"[a-z-]+/[a-z0-9.-]+/none/flush-none/x\d+", sid)),
                None)  # PPO, no ZeRO: the reference of the relative figures

    def rel(v: float, b: float | None) -> str:
        return f" ({100.0 * (v - b) / b:+.0f}%)" if b else ""

    print("| scenario | device peak reserved (sim.) | device peak allocated (sim.) | model states after init | "
          "host peak RSS (meas.) | host offload/pinned (meas.) | host RSS outside device (est.) | iteration |")
    print("|---|---|---|---|---|---|---|---|")
    for sid, r in sorted(results.items()):
        m = r["metrics"]
        b = base["metrics"] if base else {}
        bi = init_states(base) if base else None
        print(f"| `{sid}` | {m['peak_reserved'] / MIB:.1f} MiB{rel(m['peak_reserved'], b.get('peak_reserved'))} "
              f"| {m['peak_allocated'] / MIB:.2f} MiB{rel(m['peak_allocated'], b.get('peak_allocated'))} "
              f"| {init_states(r) / MIB:.2f} MiB{rel(init_states(r), bi)} "
              f"| {m['host_peak_rss'] / MIB:.0f} MiB{rel(m['host_peak_rss'], b.get('host_peak_rss'))} "
              f"| {m['host_pinned_peak'] / MIB:.2f} MiB "
              f"| {m.get('host_rss_outside_device', 0) / MIB:.0f} MiB "
              f"| {r.get('iteration_wall_s') or 0:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
