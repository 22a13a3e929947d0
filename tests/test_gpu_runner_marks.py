"""The ``gpu`` mark's memory in GB as cards are sold (issue 35, item 1): checked with the totals real cards
report (``torch.cuda.get_device_properties(i).total_memory``, bytes = MiB x 2**20), and through real pytest
sessions (pytester) with those cards standing in for the detected devices."""

import pytest

from pytest_rlhfmem.hardware import CudaDevice, gpu_shortfall

pytest_plugins = ["pytester"]

# name, total MiB as the card reports it, GB as sold, the next size sold above it
CARDS = [
    ("NVIDIA GeForce RTX 3090", 24_268, 24, 32),
    ("NVIDIA GeForce RTX 4090", 24_564, 24, 32),
    ("NVIDIA A10G", 23_028, 24, 32),
    ("NVIDIA L4", 23_034, 24, 32),
    ("Tesla T4", 15_360, 16, 20),
    ("Tesla T4 (as torch reports it on Colab)", 15_101, 16, 20),
    ("Tesla V100-SXM2-16GB", 16_160, 16, 20),
    ("NVIDIA A100-SXM4-40GB", 40_536, 40, 48),
    ("NVIDIA A100-SXM4-80GB", 81_920, 80, 94),
    ("NVIDIA H100 80GB HBM3", 81_559, 80, 94),  # the lent H100, driver 580.159.04
    ("NVIDIA H200", 143_771, 141, 192),
]


@pytest.mark.parametrize("name, mib, sold_gb, next_gb", CARDS, ids=[c[0] for c in CARDS])
def test_every_card_sold_as_n_gb_qualifies_for_n_and_not_for_the_next_size(name, mib, sold_gb, next_gb):
    cards = [CudaDevice(name, mib * 2**20)] * 4
    assert gpu_shortfall(cards, 4, min_memory_gb=sold_gb) is None
    why = gpu_shortfall(cards, 4, min_memory_gb=next_gb)
    assert why is not None
    assert why.startswith(f"needs 4 CUDA device(s) sold as >= {next_gb} GB each")
    assert f"found {name} ({mib:,} MiB)" in why  # the card's own MiB


def test_min_memory_gib_stays_exact_binary_gib():
    rtx3090 = [CudaDevice("NVIDIA GeForce RTX 3090", 24_268 * 2**20)]
    assert gpu_shortfall(rtx3090, 1, min_memory_gib=24) == ("needs 1 CUDA device(s) with >= 24 GiB each; found "
                                                           "NVIDIA GeForce RTX 3090 (23.7 GiB)")
    assert gpu_shortfall([CudaDevice("NVIDIA A100-SXM4-80GB", 81_920 * 2**20)], 1, min_memory_gib=80) is None


GB_TEST = """
import pytest

@pytest.mark.gpu(count=4, min_memory_gb=24)
def test_study_cell():
    assert True
"""

STANDIN = """
import pytest_rlhfmem.hardware as hw

hw.detect_cuda_devices = lambda: [hw.CudaDevice({name!r}, {mib} * 2**20)] * 4
"""


def test_require_runs_a_24_gb_cell_on_four_a10g_and_skips_it_on_t4s_naming_gb_and_mib(pytester):
    pytester.makepyfile(GB_TEST)
    pytester.makeconftest(STANDIN.format(name="NVIDIA A10G", mib=23_028))
    pytester.runpytest_subprocess("--gpu-marker=require").assert_outcomes(passed=1)
    pytester.makeconftest(STANDIN.format(name="Tesla T4", mib=15_360))
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*gpu: needs 4 CUDA device(s) sold as >= 24 GB each (total_memory >= 21,973 MiB); "
                                 "found Tesla T4 (15,360 MiB), *"])


@pytest.mark.parametrize("mark, message", [
    ("gpu(count=4, min_memory=24)", "gpu mark: unknown keyword 'min_memory'; allowed: count, min_memory_gb (GB as "
                                    "sold), min_memory_gib (binary GiB)"),
    ("gpu(4, 24)", "gpu mark: memory given by position (24); give it by keyword: min_memory_gb (GB as sold) or "
                   "min_memory_gib (binary GiB)"),
    ("gpu(count=4, min_memory_gb=24, min_memory_gib=22)", "gpu mark: min_memory_gb and min_memory_gib both given"),
    ("gpu(count=0)", "gpu mark: count=0; allowed: an integer >= 1"),
    ("gpu(min_memory_gb='24GB')", "gpu mark: min_memory_gb='24GB'; allowed: a number > 0"),
])
def test_a_bad_gpu_mark_is_one_usage_error_line_naming_file_key_and_allowed_values(pytester, mark, message):
    pytester.makepyfile(test_marked=f"import pytest\n\n@pytest.mark.{mark}\ndef test_cell():\n    assert True\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [ln for ln in result.stderr.lines if ln.strip()]
    assert len(errors) == 1 and "test_marked.py: test_cell: " + message in errors[0], result.stderr.str()


def test_markers_and_help_document_the_gb_rule(pytester):
    result = pytester.runpytest_subprocess("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gpu(count=1, min_memory_gb=None): *at least 0.96 x min_memory_gb x "
                                 "10^9 bytes*min_memory_gib=N instead asks for exactly N binary GiB*"])
    out = " ".join(pytester.runpytest_subprocess("--help").stdout.str().split())
    assert "min_memory_gb=N is GB as cards are sold, met by a device whose total_memory is at least 0.96 x N x " \
           "10^9 bytes" in out
