"""Issue 47 item 5 (and item 9's numbers): numbers are checked where they enter, finite, in range, with units.

Before: ``rlhfmem diff --fail-on-regression --threshold nan%`` (or ``inf%``) passed a +91% regression and a
negative threshold was taken; budget tolerances ``rel: .nan`` / ``.inf`` loaded, then failed after the run with a
traceback; ``--device-memory-gib`` 0/-1/inf/nan and ``advise --budget/--capacity/--top/--processes`` zero, negative
or not finite were taken or a traceback; ``plot -o ''`` wrote ``./.png``; ``diff --time-spread MISSING`` was
ignored; a budget size in ``GB`` was read as GiB. Now each is one line naming the option (or the file, entry and
key) and what is allowed, before any work runs; ``GB`` is 10**9 bytes, as the gpu marker's ``min_memory_gb``."""

from __future__ import annotations

import json

import pytest

from pytest_rlhfmem.budgets import BudgetError, load_budget_file
from pytest_rlhfmem.cli import main
from pytest_rlhfmem.units import parse_size

METRICS = {"peak_reserved": 100 * 2**20, "peak_allocated": 50 * 2**20, "fragmentation_at_peak": 0,
           "cuda_malloc_count": 3, "alloc_retries": 0, "host_anon_growth": 0, "host_pinned_peak": 0}


def _run(capsys, *argv: str) -> tuple[int, str]:
    """``rlhfmem ARGV`` in this process: (exit status, stderr); argparse's own exit counts as a status."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def _one_line(rc: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("rlhfmem: error: "), (rc, err)
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture
def regression(tmp_path):
    """Two run results, the head's peak reserved 91% over the base's."""
    base = {"scenario_id": "my/run", "status": "ok", "metrics": METRICS}
    head = dict(base, metrics=dict(METRICS, peak_reserved=191 * 2**20))
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "head.json").write_text(json.dumps(head))
    return str(tmp_path / "base.json"), str(tmp_path / "head.json")


@pytest.mark.parametrize("threshold", ["nan%", "inf%", "-5%", "nan", "-0.01"])
def test_a_threshold_that_is_not_a_finite_fraction_is_refused(capsys, regression, threshold):
    rc, err = _run(capsys, "diff", *regression, "--fail-on-regression", f"--threshold={threshold}")
    _one_line(rc, err, f"--threshold {threshold!r}", "expected a percentage like 5% or a fraction like 0.05 "
                                                     "(finite, >= 0)")


def test_the_regression_still_fails_at_a_finite_threshold(capsys, regression):
    rc, _ = _run(capsys, "diff", *regression, "--fail-on-regression", "--threshold=5%")
    assert rc == 1


@pytest.mark.parametrize("rel", [".nan", ".inf", "-.inf", "-0.5"])
def test_a_tolerance_that_is_not_a_finite_fraction_is_refused_when_the_file_loads(tmp_path, rel):
    p = tmp_path / "suite.yaml"
    p.write_text(f"schema: 1\nentries:\n  a/b:\n    metrics: {{peak_reserved: 1 MiB}}\n"
                 f"    tolerances: {{peak_reserved: {{rel: {rel}}}}}\n")
    with pytest.raises(BudgetError) as exc:
        load_budget_file(p)
    assert str(exc.value).startswith(f"{p}: entry 'a/b'.tolerances.peak_reserved.rel: must be a number >= 0 (finite")


def test_gb_in_a_budget_is_ten_to_the_ninth_as_the_gpu_marker_reads_it(tmp_path):
    p = tmp_path / "suite.yaml"
    p.write_text("schema: 1\nentries:\n  a/b:\n    metrics: {peak_reserved: 24 GB, peak_allocated: 1.5 MB, "
                 "host_anon_growth: 2 GiB}\n    tolerances: {peak_reserved: {abs: 1 KB}}\n")
    e = load_budget_file(p).entries["a/b"]
    assert e.metrics["peak_reserved"] == 24 * 10**9 and e.metrics["peak_allocated"] == 1_500_000
    assert e.metrics["host_anon_growth"] == 2 * 2**30 and e.tolerances["peak_reserved"].abs == 1000
    assert parse_size("80 GB") == 80 * 10**9 and parse_size("312.5 MiB") == 327_680_000
    with pytest.raises(ValueError, match="out of range"):
        parse_size("1" + "0" * 400 + " B")  # float('1e400') is inf: refused, not an OverflowError


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "1e9"])
def test_device_memory_gib_out_of_range_is_one_line(capsys, value):
    rc, err = _run(capsys, "replay", "any.pickle", f"--device-memory-gib={value}")
    _one_line(rc, err, "argument --device-memory-gib:", "allowed: a number of GiB above 0 and at most 262144")


@pytest.mark.parametrize("option, value, allowed", [
    ("--top", "0", "allowed: 1 to"), ("--top", "-3", "allowed: 1 to"),
    ("--processes", "0", "allowed: 1 to 256"), ("--processes", "nan", "allowed: 1 to 256"),
    ("--max-flushes", "-1", "allowed: 0 to"),
    ("--budget", "0 B", "a size above 0 B"), ("--budget", "-5 MiB", "a size above 0 B"),
    ("--budget", "nan", "not a size with a unit"), ("--budget", "inf GiB", "not a size with a unit"),
    ("--capacity", "0 MiB", "a size above 0 B and at most 256.00 TiB"),
    ("--capacity", "1000 TiB", "a size above 0 B and at most 256.00 TiB"),
])
def test_advise_numbers_out_of_range_are_one_line_naming_the_option(capsys, tmp_path, option, value, allowed):
    rc, err = _run(capsys, "advise", str(tmp_path / "never-read.json"), f"{option}={value}")
    _one_line(rc, err, f"argument {option}:", allowed)


def test_plot_to_an_empty_name_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = _run(capsys, "plot", "r.json", "-o", "")
    _one_line(rc, err, "-o/--output '': a file name is needed")
    assert not list(tmp_path.iterdir())  # no ./.png


def test_a_missing_or_malformed_time_spread_is_one_line(capsys, regression, tmp_path):
    rc, err = _run(capsys, "diff", *regression, "--time-spread", str(tmp_path / "MISSING.yaml"))
    _one_line(rc, err, f"--time-spread {tmp_path / 'MISSING.yaml'}: no such file")
    bad = tmp_path / "time_spread.yaml"
    bad.write_text("entries:\n  my/run: {runs: 3, spread: .nan}\n")
    rc, err = _run(capsys, "diff", *regression, "--time-spread", str(bad))
    _one_line(rc, err, f"{bad}: entry 'my/run': must be a mapping whose spread is a finite number >= 0")
