"""The methods on the mid-size pair (OPT-125m) on CPU, 2 ranks: the main job (tox -e suite), minutes per
cell. Budgets: baselines/cpu/methods_cpu_mid.yaml."""

import math

import pytest

from pytest_rlhfmem.rlhf.models import MODEL_PAIRS

if "opt-125m" in MODEL_PAIRS:
    @pytest.mark.matrix("methods_cpu_mid")
    def test_iteration_within_budget(scenario, benchmarked_iteration, memory_budget):
        result = benchmarked_iteration(scenario, "cpu")
        assert result.simulated and result.metrics["host_peak_rss"] > 0
        for rank in result["ranks"]:
            assert all(math.isfinite(v) for k, v in rank["recipe"].items() if k.endswith("_loss"))
        memory_budget.check(result)
else:
    def test_iteration_within_budget():
        pytest.skip("model pair 'opt-125m' is not defined in pytest_rlhfmem/rlhf/models.py")
