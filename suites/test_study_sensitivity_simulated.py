"""The README's sensitivity table, run again and held to its recorded run (opt-in: ``tox -e study-sensitivity``).

Each row of ``studies/study_sensitivity.py`` (the study's pair on the fake-CUDA route with the simulated CUDA
device, five strategies, each once with the after-inference flush marks and replayed without them) runs into its own
directory and is compared with ``docs/study-runs/2026-11-25/<row>/summary.json``, the run the README's tables come
from: every result ok, peak reserved and peak allocated to the byte, the peak's phase, fragmentation at the peak
within 2 MiB (ZeRO-3 + offload and ``all`` vary from run to run by up to 1.3 MiB there, README), and each finding's
verdict. Every figure is simulated. About 15 minutes on 2 cores (the two rows without the Hybrid Engine's kernels
take 5 of them each). ``RLHFMEM_STUDY_SENSITIVITY_RESULTS=DIR`` reuses the row directories that
``studies/study_sensitivity.py --out DIR`` wrote instead of running again.
"""

import os
from pathlib import Path

import pytest

from studies import study_scale, study_sensitivity

ROOT = Path(__file__).resolve().parent.parent

RECORDED = ROOT / "docs" / "study-runs" / "2026-11-25"
FRAGMENTATION_SLACK = 2 * 2**20  # bytes


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    reuse = os.environ.get("RLHFMEM_STUDY_SENSITIVITY_RESULTS")
    return Path(reuse) if reuse else tmp_path_factory.mktemp("study-sensitivity")


def _run_row(slug: str, runs_dir: Path) -> dict[str, dict]:
    d = runs_dir / slug
    if not os.environ.get("RLHFMEM_STUDY_SENSITIVITY_RESULTS"):
        _, overrides, flags = study_sensitivity.ROWS[slug]
        assert study_sensitivity.main(["--out", str(runs_dir), "--rows", slug, "--jobs", "2"]) == 0
        assert (d / "summary.json").exists(), f"row {slug} ({overrides}, {flags}) wrote no summary"
    return study_scale.load_run(d)


@pytest.mark.parametrize("slug", list(study_sensitivity.ROWS))
def test_sensitivity_row_is_the_recorded_run(slug, runs_dir):
    recorded = study_scale.load_run(RECORDED / slug)
    fresh = _run_row(slug, runs_dir)
    assert recorded, f"{RECORDED / slug}: no recorded summary"
    assert set(fresh) == set(recorded), f"row {slug}: scenario ids differ from the recorded run"
    for sid, rec in recorded.items():
        got = fresh[sid]
        assert got["status"] == "ok", (sid, got.get("error"))
        assert got["capture"] == rec["capture"] == "sim-cuda-simulated"
        t, r = got["total"], rec["total"]
        assert (t["peak_reserved"], t["peak_allocated"], got["peak_phase"]) \
            == (r["peak_reserved"], r["peak_allocated"], rec["peak_phase"]), sid
        assert abs(t["fragmentation_at_peak"] - r["fragmentation_at_peak"]) <= FRAGMENTATION_SLACK, sid
    _, overrides, _ = study_sensitivity.ROWS[slug]
    verdicts = {k: ok for k, (ok, _) in study_scale.finding_checks(fresh, "opt-1.3b", overrides).items()}
    assert verdicts == {k: ok for k, (ok, _) in study_scale.finding_checks(recorded, "opt-1.3b", overrides).items()}
