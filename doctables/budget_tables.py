"""Markdown tables generated from the committed budgets, so the README and docs never restate a figure by hand.

    python -m doctables.budget_tables cpu-matrix     # docs/cpu-path.md: the CPU matrix (deepspeed_chat_cpu.yaml)
    python -m doctables.budget_tables methods        # docs/methods.md: the methods beside PPO (methods_cpu.yaml)
    python -m doctables.budget_tables flush-diff     # docs/reports.md: rlhfmem diff, flush after inference vs none
    python -m doctables.budget_tables flush-diff-report  # docs/diff-flush-none-vs-after-inference.md
    python -m doctables.budget_tables mid-matrix     # docs/cpu-path.md: the mid-size pair (methods_cpu_mid.yaml)
    python -m doctables.budget_tables mid-methods    # docs/methods.md: the methods on the mid-size pair
    python -m doctables.budget_tables tolerances     # README: the default tolerances (pytest_rlhfmem/budgets.py)
    python -m doctables.budget_tables colocated-study  # docs/colocated-rollout.md: the study's scale, colocated

Each block a document shows is fenced by ``<!-- generated: python -m doctables.budget_tables NAME -->`` and
``<!-- end generated -->``; tests/test_generated_tables.py reruns the command and fails when a block differs
from what it prints (after a budget update: rerun the command and paste its output). Figures are those of the
budget files: simulated device figures (CPU trace through the allocator model) and measured host figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from pytest_rlhfmem.units import format_size, parse_size

BASELINES = Path(__file__).resolve().parent.parent / "baselines" / "cpu"
STRATEGIES = ("none", "zero1", "zero2", "zero3", "zero3-offload", "grad-ckpt", "all")


def _entries(name: str) -> dict[str, dict]:
    return yaml.safe_load((BASELINES / name).read_text())["entries"]


def _m(entry: dict, metric: str) -> int:
    v = entry["metrics"][metric]
    return parse_size(v) if isinstance(v, str) else int(v)


def cpu_matrix() -> list[str]:
    """One row per strategy: flush none's peak reserved / allocated / fragmentation / peak phase / cudaMalloc,
    then the after-inference flush's reserved and fragmentation (tiny OPT, 2 ranks)."""
    e = _entries("deepspeed_chat_cpu.yaml")
    rows = ["| strategy | peak reserved | peak allocated | fragmentation at peak | peak phase | cudaMalloc | "
            "reserved, flush after inference | frag., flush |", "|---|---|---|---|---|---|---|---|"]
    for s in STRATEGIES:
        a = e[f"deepspeed-chat/tiny-opt/{s}/flush-none/x2"]
        f = e[f"deepspeed-chat/tiny-opt/{s}/flush-after-inference/x2"]
        rows.append(f"| {s} | {format_size(_m(a, 'peak_reserved'))} | {format_size(_m(a, 'peak_allocated'))} | "
                    f"{format_size(_m(a, 'fragmentation_at_peak'))} | {a['peak_phase']} | "
                    f"{_m(a, 'cuda_malloc_count')} | {format_size(_m(f, 'peak_reserved'))} | "
                    f"{format_size(_m(f, 'fragmentation_at_peak'))} |")
    return rows


def methods() -> list[str]:
    """PPO's strategies (deepspeed_chat_cpu.yaml) and the methods (methods_cpu.yaml), flush none, each device
    figure relative to PPO ``none``; host figures measured (anonymous growth, offload buffers)."""
    ppo, meth = _entries("deepspeed_chat_cpu.yaml"), _entries("methods_cpu.yaml")
    cells = [("PPO `none`", ppo["deepspeed-chat/tiny-opt/none/flush-none/x2"]),
             ("PPO `zero2`", ppo["deepspeed-chat/tiny-opt/zero2/flush-none/x2"]),
             ("`zero2-offload` (ZeRO-Offload)", meth["deepspeed-chat/tiny-opt/zero2-offload/flush-none/x2"]),
             ("PPO `zero3`", ppo["deepspeed-chat/tiny-opt/zero3/flush-none/x2"]),
             ("PPO `zero3-offload`", ppo["deepspeed-chat/tiny-opt/zero3-offload/flush-none/x2"]),
             ("`lora` (LoRA-PPO)", meth["deepspeed-chat/tiny-opt/lora/flush-none/x2"]),
             ("`hydra` (Hydra-PPO)", meth["deepspeed-chat/tiny-opt/hydra/flush-none/x2"]),
             ("`none` + ReMax", meth["deepspeed-chat/tiny-opt/none/remax/flush-none/x2"]),
             ("`none` + GRPO, group of 2", meth["deepspeed-chat/tiny-opt/none/grpo/flush-none/x2/group_size=2"])]
    base = cells[0][1]

    def cell(entry: dict, metric: str) -> str:
        v, b = _m(entry, metric), _m(base, metric)
        return format_size(v) + ("" if entry is base else f" ({100.0 * (v - b) / b:+.0f}%)")

    rows = ["| scenario | device peak reserved (sim.) | device peak allocated (sim.) | fragmentation at peak (sim.) | "
            "host anonymous growth (meas.) | host offload buffers (meas.) |", "|---|---|---|---|---|---|"]
    for label, e in cells:
        rows.append(f"| {label} | {cell(e, 'peak_reserved')} | {cell(e, 'peak_allocated')} | "
                    f"{format_size(_m(e, 'fragmentation_at_peak'))} | {cell(e, 'host_anon_growth')} | "
                    f"{format_size(_m(e, 'host_pinned_peak'))} |")
    return rows


def mid_matrix() -> list[str]:
    """The mid-size pair (OPT-125m x 4, fp16, 2 ranks; methods_cpu_mid.yaml), MiB (2**20 B, rounded): flush none's
    peak reserved / fragmentation / allocated / peak phase / cudaMalloc, then the after-inference flush's reserved
    (change against none) and fragmentation; last line: the flush's extra cudaMalloc calls, lowest to highest."""
    e = _entries("methods_cpu_mid.yaml")
    names = {"none": "none", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "zero3-offload": "ZeRO-3 + offload", "all": "all"}
    rows = ["| strategy | peak reserved | frag. | peak allocated | peak phase | cudaMalloc | "
            "reserved, flush after inference | frag., flush |", "|---|---|---|---|---|---|---|---|"]
    extra = []

    def mib(entry: dict, metric: str) -> int:
        return round(_m(entry, metric) / 2**20)

    for s, label in names.items():
        a = e[f"deepspeed-chat/opt-125m/{s}/flush-none/x2"]
        f = e[f"deepspeed-chat/opt-125m/{s}/flush-after-inference/x2"]
        change = 100 * (_m(f, "peak_reserved") - _m(a, "peak_reserved")) / _m(a, "peak_reserved")
        rows.append(f"| {label} | {mib(a, 'peak_reserved')} | {mib(a, 'fragmentation_at_peak')} | "
                    f"{mib(a, 'peak_allocated')} | {a['peak_phase']} | {_m(a, 'cuda_malloc_count')} | "
                    f"{mib(f, 'peak_reserved')} ({change:+.1f}%) | {mib(f, 'fragmentation_at_peak')} |")
        extra.append(_m(f, "cuda_malloc_count") - _m(a, "cuda_malloc_count"))
    rows += ["", f"The after-inference flush's extra cudaMalloc calls per iteration: +{min(extra)} to +{max(extra)}."]
    return rows


def mid_methods() -> list[str]:
    """The methods beside PPO's strategies on the mid-size pair (OPT-125m x 4, fp16, 2 ranks, flush none;
    methods_cpu_mid.yaml), MiB (2**20 B, rounded), each device figure against PPO ``none``; host figures measured.
    Last line: ZeRO-Offload against ZeRO-2, the paper's own comparison."""
    e = _entries("methods_cpu_mid.yaml")
    cells = [("PPO `none`", "none/flush-none"), ("PPO `zero2`", "zero2/flush-none"),
             ("`zero2-offload` (ZeRO-Offload)", "zero2-offload/flush-none"), ("PPO `zero3`", "zero3/flush-none"),
             ("PPO `zero3-offload`", "zero3-offload/flush-none"), ("`lora` (LoRA-PPO)", "lora/flush-none"),
             ("`hydra` (Hydra-PPO)", "hydra/flush-none"), ("`none` + ReMax", "none/remax/flush-none"),
             ("`none` + GRPO, group of 2", "none/grpo/flush-none")]
    entry = {label: e[f"deepspeed-chat/opt-125m/{key}/x2" + ("/group_size=2" if "grpo" in key else "")]
             for label, key in cells}
    base = entry["PPO `none`"]

    def mib(en: dict, metric: str, rel: bool = False) -> str:
        v, b = _m(en, metric), _m(base, metric)
        return f"{round(v / 2**20)}" + (f" ({100.0 * (v - b) / b:+.0f}%)" if rel and en is not base else "")

    rows = ["| scenario | device peak reserved (sim.) | device peak allocated (sim.) | frag. at peak (sim.) | "
            "peak phase | host anonymous growth (meas.) | host offload buffers (meas.) |",
            "|---|---|---|---|---|---|---|"]
    for label, en in entry.items():
        rows.append(f"| {label} | {mib(en, 'peak_reserved', True)} | {mib(en, 'peak_allocated', True)} | "
                    f"{mib(en, 'fragmentation_at_peak')} | {en['peak_phase']} | {mib(en, 'host_anon_growth')} | "
                    f"{mib(en, 'host_pinned_peak')} |")
    z2, off = entry["PPO `zero2`"], entry["`zero2-offload` (ZeRO-Offload)"]
    change = 100.0 * (_m(off, "peak_reserved") - _m(z2, "peak_reserved")) / _m(z2, "peak_reserved")
    rows += ["", f"ZeRO-Offload against ZeRO-2: peak reserved {mib(z2, 'peak_reserved')} -> "
             f"{mib(off, 'peak_reserved')} MiB ({change:+.0f}%)."]
    return rows


def flush_diff() -> list[str]:
    """``rlhfmem diff``'s verdict and changed rows for the after-inference flush against no flush, every
    strategy of the CPU matrix (deepspeed_chat_cpu.yaml; ``--ignore-flush`` pairing), as the README quotes it."""
    from pytest_rlhfmem.report import Side, _md_table, diff, load_side, without_flush

    side = load_side(BASELINES / "deepspeed_chat_cpu.yaml")

    def policy(name: str) -> Side:
        return without_flush(Side(f"{name}", {k: v for k, v in side.scenarios.items() if f"/flush-{name}/" in k}))

    d = diff(policy("none"), policy("after-inference"))
    c = d.counts()
    verdict = ", ".join(f"**{n} {k}**" if k in ("regressed", "failed") and n else f"{n} {k}" for k, n in c.items())
    changed = [r for r in d.rows if r.status not in ("unchanged", "unmeasured")]
    lines = [("❌ " if d.regressed else "✅ ") + verdict + f" (threshold {d.threshold * 100:g}%, and beyond "
             "run-to-run noise: the default budget tolerances' absolute parts)", ""]
    lines += _md_table(changed) if changed else ["No metric moved beyond the threshold."]
    return ["> " + ln if ln else ">" for ln in lines]


def flush_diff_report() -> list[str]:
    """The whole ``rlhfmem diff`` report (markdown) behind :func:`flush_diff`: every metric of every strategy."""
    from pytest_rlhfmem.report import Side, diff, load_side, to_markdown, without_flush

    side = load_side(BASELINES / "deepspeed_chat_cpu.yaml")

    def policy(name: str) -> Side:
        return without_flush(Side(f"flush-{name} entries of baselines/cpu/deepspeed_chat_cpu.yaml",
                                  {k: v for k, v in side.scenarios.items() if f"/flush-{name}/" in k}))

    return to_markdown(diff(policy("none"), policy("after-inference"))).rstrip("\n").splitlines()


def tolerances() -> list[str]:
    """The default tolerances (budgets.py ``DEFAULT_TOLERANCES``): a value passes when measured <= budget + max(abs,
    rel x budget); a budget file's ``defaults.tolerances`` and an entry's ``tolerances`` override them."""
    from pytest_rlhfmem.budgets import DEFAULT_TOLERANCES, SIZE_BUDGETS

    rows = ["| metric | rel | abs |", "|---|---|---|"]
    for metric, tol in DEFAULT_TOLERANCES.items():
        size = metric in SIZE_BUDGETS
        rows.append(f"| {metric} | {tol.rel * 100:g}% | {format_size(tol.abs) if size else tol.abs} |")
    return rows


def colocated_study() -> list[str]:
    """A colocated rollout engine beside the study's DeepSpeed-Chat iteration (OPT-1.3b/350m, ZeRO-2, 4 ranks; the
    simulated CUDA device; baselines/cpu/colocated_study.yaml, suites/test_colocated_study.py): per sleep level and
    flush before wake-up, at a 24 GiB and an 80 GiB card, the trainer's peak reserved, the engine's mapped bytes, the
    device's peak used (reserved + mapped), the trainer's alloc retries and the OOMs (a wake-up the card cannot back
    counts as one). GiB = 2**30 B, two decimals."""
    e = _entries("colocated_study.yaml")
    base = "deepspeed-chat/opt-1.3b/zero2/flush-none/x4"
    gib = 2**30

    def cell(entry: dict | None) -> str:
        if entry is None:
            return "not recorded"
        m = entry["metrics"]
        mapped = _m(entry, "engine_mapped_peak") if "engine_mapped_peak" in m else 0
        used = _m(entry, "peak_device_used") if "peak_device_used" in m else _m(entry, "peak_reserved")
        return (f"{_m(entry, 'peak_reserved') / gib:.2f} / {mapped / gib:.2f} / {used / gib:.2f} / "
                f"{_m(entry, 'alloc_retries')} / {int(m.get('ooms', 0))}")

    def engine(card: int, level: int, flush: bool) -> dict | None:
        keys = [f"capacity_mib={card * 1024}", *([] if flush else ["flush_before_wake_up=False"]),
                "gpu_memory_utilization=0.9", "rollout_engine=True", f"sleep_level={level}"]
        return e.get(f"{base}/{','.join(keys)}")

    rows = ["| gpu_memory_utilization 0.9 | 24 GiB card: trainer peak reserved / engine mapped / peak used (GiB) / "
            "retries / OOMs | 80 GiB card: the same |", "|---|---|---|"]
    off = cell(e.get(base))
    rows.append(f"| engine off | {off} | {off} |")
    for level in (1, 2):
        for flush in (False, True):
            label = f"sleep level {level}, " + ("flush before wake-up" if flush else "no flush")
            rows.append(f"| {label} | " + " | ".join(cell(engine(c, level, flush)) for c in (24, 80)) + " |")
    return rows


TABLES = {"colocated-study": colocated_study, "cpu-matrix": cpu_matrix, "methods": methods, "flush-diff": flush_diff,
          "mid-matrix": mid_matrix, "mid-methods": mid_methods, "flush-diff-report": flush_diff_report,
          "tolerances": tolerances}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in TABLES:
        print(f"usage: python -m doctables.budget_tables {{{','.join(TABLES)}}}", file=sys.stderr)
        return 2
    print("\n".join(TABLES[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
