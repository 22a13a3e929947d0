"""Which setting each of the study's findings hinges on: the study's scale, one row per setting (simulated).

Runs ``study_scale.py`` (five strategies, each once with the after-inference flush marks and replayed without
them) once per row of :data:`ROWS`, each into its own directory under ``--out``, and prints one markdown row per
setting with one column per finding (``study_scale.finding_checks``): reproduced or not, with the figures. A row
whose directory already holds results runs only its missing strategies (``--from-only`` never runs anything).

    python -m studies.study_sensitivity --out study-sensitivity [--rows scripts,he-off] [--jobs 2]

Every figure is simulated (the fake-CUDA route's device trace replayed through the allocator model), GiB = 2**30 B.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from studies import study_scale

# slug -> (what the row changes against DeepSpeed-Chat's run_1.3b.sh, scenario overrides, study_scale.py flags)
SCRIPTS = study_scale.SCRIPTS_OVERRIDES
ROWS: dict[str, tuple[str, dict, list[str]]] = {
    "scripts": ("as `run_1.3b.sh` ran on the study's DeepSpeed: Hybrid Engine with its inference kernels, EMA, "
                "batch 4, actor dropout 0; math attention; record_stream immediate", SCRIPTS, []),
    "he-native": ("Hybrid Engine without its kernels (DeepSpeed 0.19.8 with transformers 5.23.0: Hugging Face's "
                  "generate, no whole-model gather, no LoRA fusion)", {}, []),
    "he-off": ("Hybrid Engine off", {"hybrid_engine": False}, []),
    "ema-off": ("EMA off", {**SCRIPTS, "ema": False}, []),
    "batch-2": ("generation and training batch 2 (the study's text)", {**SCRIPTS, "batch_size": 2}, []),
    "efficient": ("memory-efficient attention (output + logsumexp, no score matrix)", SCRIPTS, ["--sdpa", "efficient"]),
    "record-stream": ("record_stream's delayed reuse: each block used on another stream held until the host next "
                      "waits for it (upper bound)", SCRIPTS, ["--record-stream", "until-sync"]),
}
STRATEGIES = list(study_scale.STUDY)


def missing_strategies(results: dict[str, dict], overrides: dict) -> list[str]:
    """The strategies of a row without an ``ok`` result for both flush policies: what a resumed row runs."""
    return [s for s in STRATEGIES
            if any(results.get(study_scale.study_scenario(s, f, overrides=overrides).id, {}).get("status") != "ok"
                   for f in ("none", "after-inference"))]


def row(slug: str, results: dict[str, dict]) -> str:
    what, overrides, _ = ROWS[slug]
    checks = study_scale.finding_checks(results, "opt-1.3b", overrides)
    cells = []
    for key in study_scale.FINDINGS:
        if key not in checks:
            cells.append("not run")
            continue
        ok, text = checks[key]
        cells.append(f"{'**reproduced**' if ok else 'not reproduced'}: {text}")
    return f"| {what} | " + " | ".join(cells) + " |"


def table(rows: dict[str, dict[str, dict]]) -> str:
    head = "| setting | " + " | ".join(study_scale.FINDINGS[k].split(". ", 1)[1] for k in study_scale.FINDINGS) + " |"
    return "\n".join([head, "|" + "---|" * (len(study_scale.FINDINGS) + 1)]
                     + [row(slug, res) for slug, res in rows.items()])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="study_sensitivity.py")
    ap.add_argument("--out", default="study-sensitivity")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--from-only", action="store_true", help="print the table of the runs under --out; run nothing")
    args = ap.parse_args(argv)
    slugs = [s for s in args.rows.split(",") if s]
    unknown = [s for s in slugs if s not in ROWS]
    if unknown:
        print(f"rlhfmem: error: --rows: unknown {', '.join(unknown)}; valid: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    rows = {}
    for slug in slugs:
        _, overrides, flags = ROWS[slug]
        d = out / slug
        results = study_scale.load_run(d)
        missing = missing_strategies(results, overrides)
        if not args.from_only and missing:
            cmd = ["--out", str(d), "--jobs", str(args.jobs), "--overrides", json.dumps(overrides),
                   "--strategies", ",".join(missing)] + flags
            print(f"== row {slug}: study_scale.py {' '.join(cmd)}", flush=True)
            study_scale.main(cmd)
            results = study_scale.load_run(d)
            study_scale.write_summary(d, results)  # the row's summary holds its earlier strategies too
        rows[slug] = results
    print("Which setting each finding hinges on (simulated, sim tensors, rank 0 of 4; GiB):")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
