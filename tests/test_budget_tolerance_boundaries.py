"""A budget's tolerance at its boundaries (issue 45's blind spots): a value passes when
``measured <= budget + max(abs, rel x budget)`` and is ``under`` when it is lower than the budget by more than that
margin. Each case sits exactly at the margin and one unit past it, once where the absolute part decides and once
where the relative part does: a margin computed as abs + rel, or as min(abs, rel), fails here."""

import pytest

from pytest_rlhfmem.budgets import BudgetEntry, BudgetFile, Tolerance, compare

MiB = 2**20


def _status(metric: str, budget: int, measured: int, tol: Tolerance) -> str:
    entry = BudgetEntry("cell", {metric: budget}, {metric: tol})
    bf = BudgetFile(path=None, profile="cpu", defaults={}, entries={"cell": entry}, raw={})
    return next(r.status for r in compare(bf, entry, {metric: measured}) if r.metric == metric)


# (metric, budget, tolerance, the margin max(abs, rel x budget) in the metric's unit)
CASES = [
    pytest.param("peak_reserved", 100 * MiB, Tolerance(0.01, 4 * MiB), 4 * MiB, id="size-abs-decides"),
    pytest.param("peak_reserved", 1000 * MiB, Tolerance(0.01, 4 * MiB), 10 * MiB, id="size-rel-decides"),
    pytest.param("cuda_malloc_count", 10, Tolerance(0.10, 3), 3, id="count-abs-decides"),
    pytest.param("cuda_malloc_count", 100, Tolerance(0.10, 3), 10, id="count-rel-decides"),
    pytest.param("alloc_retries", 0, Tolerance(0.0, 0), 0, id="no-tolerance"),
]


@pytest.mark.parametrize("metric, budget, tol, margin", CASES)
def test_exactly_at_the_margin_passes_and_one_more_is_over(metric, budget, tol, margin):
    assert _status(metric, budget, budget + margin, tol) == "ok"
    assert _status(metric, budget, budget + margin + 1, tol) == "over"


@pytest.mark.parametrize("metric, budget, tol, margin", [c for c in CASES if c.values[1] > c.values[3]])
def test_lower_by_exactly_the_margin_is_ok_and_one_more_is_under(metric, budget, tol, margin):
    assert _status(metric, budget, budget - margin, tol) == "ok"
    assert _status(metric, budget, budget - margin - 1, tol) == "under"


def test_the_margin_is_the_larger_part_not_the_sum():
    tol = Tolerance(0.01, 4 * MiB)
    assert tol.allowed(100 * MiB) == 104 * MiB  # abs + rel would be 105 MiB
    assert tol.allowed(1000 * MiB) == 1010 * MiB  # abs + rel would be 1014 MiB


def test_the_simulated_devices_counts_of_its_run_do_not_make_a_budget_not_comparable(tmp_path):
    """A doubled batch makes more reduction staging buffers: the same setup, held against its budget (found over
    or under), where it read 'not comparable'. A setting (the attention kernel) still refuses."""
    from pytest_rlhfmem.budgets import not_comparable

    def desc(stagings: int, sdpa: str = "math") -> dict:
        return {"simulated_cuda_device": {"kernels": "meta", "scaled_dot_product_attention": sdpa,
                                          "record_stream": "immediate", "reduction_staging_buffers": stagings,
                                          "cublas_workspaces": 2, "scalar_answers": {"bool": stagings}}}

    entry = BudgetEntry("x", {}, {}, capture="sim-cuda-simulated", raw={"capture_description": desc(8)})
    assert not_comparable(tmp_path / "b.yaml", entry, "sim-cuda-simulated", desc(16)) is None
    why = not_comparable(tmp_path / "b.yaml", entry, "sim-cuda-simulated", desc(8, "efficient"))
    assert why and "'scaled_dot_product_attention': 'efficient'" in why and "reduction_staging_buffers" not in why
