"""The plugin's command line, ini twins and gpu marker, through real pytest sessions (pytester)."""

import pytest

pytest_plugins = ["pytester"]

FLAGS = ["--gpu-marker", "--rlhfmem-update-baselines", "--rlhfmem-baselines-dir", "--rlhfmem-profile",
         "--rlhfmem-device", "--rlhfmem-timeout", "--rlhfmem-json", "--rlhfmem-snapshots", "--rlhfmem-report",
         "--rlhfmem-benchmark-json"]
INIS = ["gpu_marker", "rlhfmem_update_baselines", "rlhfmem_baselines_dir", "rlhfmem_profile", "rlhfmem_device",
        "rlhfmem_timeout", "rlhfmem_json", "rlhfmem_snapshots", "rlhfmem_report", "rlhfmem_benchmark_json"]

GPU_TEST = """
import pytest

@pytest.mark.gpu(count=2, min_memory_gib=40)
def test_needs_two_big_gpus():
    assert True

def test_plain():
    assert True
"""

FAKE_GPUS = """
import pytest_rlhfmem.hardware as hw

hw.detect_cuda_devices = lambda: [hw.CudaDevice("NVIDIA A100-SXM4-80GB", 80 * 2**30)] * {n}
"""


def test_help_lists_every_option_and_ini(pytester):
    result = pytester.runpytest_subprocess("--help")
    out = result.stdout.str()
    assert "RLHF memory budgets (pytest-rlhfmem)" in out
    for flag in FLAGS:
        assert flag in out, flag
    for ini in INIS:
        assert ini in out, ini


def test_markers_lists_gpu(pytester):
    result = pytester.runpytest_subprocess("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gpu(count=1, min_memory_gb=None):*"])


@pytest.mark.parametrize("gpus", [0, 1])
def test_gpu_marker_auto_skips_naming_what_is_missing(pytester, gpus):
    pytester.makepyfile(GPU_TEST)
    pytester.makeconftest(FAKE_GPUS.format(n=gpus))
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    found = "found no CUDA device" if gpus == 0 else "found NVIDIA A100-SXM4-80GB (80.0 GiB)"
    result.stdout.fnmatch_lines([f"*gpu: needs 2 CUDA device(s) with >= 40 GiB each; {found}*"])


def test_gpu_marker_auto_runs_with_enough_devices(pytester):
    pytester.makepyfile(GPU_TEST)
    pytester.makeconftest(FAKE_GPUS.format(n=2))
    pytester.runpytest_subprocess().assert_outcomes(passed=2)


def test_gpu_marker_skip_skips_even_with_devices(pytester):
    pytester.makepyfile(GPU_TEST)
    pytester.makeconftest(FAKE_GPUS.format(n=4))
    result = pytester.runpytest_subprocess("--gpu-marker=skip", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*skipped by --gpu-marker=skip*"])


def test_gpu_marker_require_fails_without_devices(pytester):
    pytester.makepyfile(GPU_TEST)
    pytester.makeconftest(FAKE_GPUS.format(n=1))
    result = pytester.runpytest_subprocess("--gpu-marker=require")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*--gpu-marker=require: this gpu test cannot run: needs 2 CUDA device(s)*"])
    assert result.ret == 1


def test_gpu_marker_require_runs_with_devices(pytester):
    pytester.makepyfile(GPU_TEST)
    pytester.makeconftest(FAKE_GPUS.format(n=2))
    pytester.runpytest_subprocess("--gpu-marker=require").assert_outcomes(passed=2)


def test_ini_twin_sets_gpu_marker(pytester):
    pytester.makepyfile(GPU_TEST)
    pytester.makeini("[pytest]\ngpu_marker = skip\n")
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*skipped by --gpu-marker=skip*"])


def test_bad_ini_value_is_a_usage_error(pytester):
    pytester.makepyfile(GPU_TEST)
    pytester.makeini("[pytest]\ngpu_marker = sometimes\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*gpu_marker = 'sometimes': allowed values are auto, skip, require*"])


@pytest.mark.parametrize("args, message", [
    (["--rlhfmem-timeout=-5"], "ERROR: --rlhfmem-timeout=-5.0: allowed values are a finite number > 0"),
    (["--rlhfmem-timeout=nan"], "ERROR: --rlhfmem-timeout=nan: allowed values are a finite number > 0"),
    (["--rlhfmem-timeout=0"], "ERROR: --rlhfmem-timeout=0.0: allowed values are a finite number > 0"),
    (["--rlhfmem-time-rounds=0"], "ERROR: --rlhfmem-time-rounds=0: allowed values are a whole number >= 1"),
    (["-o", "rlhfmem_timeout=inf"],
     "ERROR: ini option rlhfmem_timeout = 'inf': allowed values are a finite number > 0"),
])
def test_a_number_out_of_range_is_a_usage_error_before_any_test(pytester, args, message):
    pytester.makepyfile("def test_x():\n    assert True\n")
    r = pytester.runpytest_subprocess(*args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([message])
