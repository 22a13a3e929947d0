"""Tables of docs/study-scale.md printed from the study's recorded runs (``docs/study-runs/<date>/<row>/summary.json``),
so the page never restates a figure of a run by hand.

    python -m doctables.study_runs scale 2026-11-25        # the study's pair as run_1.3b.sh ran (row `scripts`), GiB
    python -m doctables.study_runs sensitivity 2026-11-25  # one row per setting, one column per finding
"""

from __future__ import annotations

import sys
from pathlib import Path

from studies import study_scale, study_sensitivity

RUNS = Path(__file__).resolve().parent.parent / "docs" / "study-runs"


def scale(date: str) -> str:
    """The ``scripts`` row's strategies: flush none and after inference, beside the study's Table 1 (GB)."""
    results = study_scale.load_run(RUNS / date / "scripts")
    _, overrides, _ = study_sensitivity.ROWS["scripts"]
    return study_scale.table(results, list(study_scale.STUDY), "opt-1.3b", overrides)


def sensitivity(date: str) -> str:
    """Every recorded row, as ``python -m studies.study_sensitivity --from-only --out docs/study-runs/DATE`` prints
    it."""
    return study_sensitivity.table({slug: study_scale.load_run(RUNS / date / slug) for slug in study_sensitivity.ROWS
                                    if (RUNS / date / slug).is_dir()})


TABLES = {"scale": scale, "sensitivity": sensitivity}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in TABLES or not (RUNS / argv[1]).is_dir():
        print(f"usage: python -m doctables.study_runs {{{','.join(TABLES)}}} DATE (a directory of {RUNS})",
              file=sys.stderr)
        return 2
    print(TABLES[argv[0]](argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
