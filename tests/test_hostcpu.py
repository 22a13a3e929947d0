"""pytest_rlhfmem/hostcpu.py: the host properties a result records, the forced fp16 answer, and the one-line
failure of a dtype with no kernel (unit tests of single functions; the recipes run in test_cpu_portability)."""

import subprocess
import sys

import pytest

from pytest_rlhfmem.hostcpu import (ENV_FP16_KERNELS, HOST_CPU_PROPERTIES, dtype_failure, fp16_answer,
                                    host_cpu_profile, host_differences)


def test_profile_names_every_property_and_reads_atens_dispatch_level():
    prof = host_cpu_profile(threads=1)
    assert tuple(prof) == HOST_CPU_PROPERTIES and prof["intraop_threads"] == 1
    import torch

    assert prof["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability().replace("NO AVX", "DEFAULT")


def test_aten_cpu_capability_lowers_what_the_profile_records():
    code = "from pytest_rlhfmem.hostcpu import host_cpu_profile; print(host_cpu_profile()['aten_cpu_capability'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"ATEN_CPU_CAPABILITY": "default", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "DEFAULT"


def test_forced_fp16_answer_is_recorded_and_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_FP16_KERNELS, "unsupported")
    assert host_cpu_profile()["mkldnn_fp16"] == "forced unsupported"
    monkeypatch.setenv(ENV_FP16_KERNELS, "maybe")
    with pytest.raises(ValueError, match=r"\$RLHFMEM_CPU_FP16_KERNELS='maybe': allowed values: auto, supported, "):
        fp16_answer()


def test_forced_answer_reaches_deepspeeds_dtype_check(monkeypatch):
    code = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
            "from pytest_rlhfmem.hostcpu import force_fp16_answer, answer_deepspeed_dtype_checks\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "force_fp16_answer(); a = get_accelerator(); print(a.is_fp16_supported())\n"
            "answer_deepspeed_dtype_checks(); print(a.is_fp16_supported(), a.is_bf16_supported())")
    for forced, first in (("unsupported", "False"), ("supported", "True")):
        monkeypatch.setenv(ENV_FP16_KERNELS, forced)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.split("\n")[-3:-1] == [first, "True True"], out.stdout


def test_host_differences_name_only_what_both_recorded_and_differs():
    a = {"cpu_model": "A", "aten_cpu_capability": "AVX512", "mkldnn_fp16": False}
    b = {"cpu_model": "B", "aten_cpu_capability": "AVX512"}
    assert host_differences(a, b) == ["cpu_model: A vs B"]
    assert host_differences(a, None) == [] and host_differences({}, b) == []


def test_a_dtype_without_a_kernel_fails_in_one_line_naming_dtype_op_and_what_to_do():
    msg = dtype_failure('"addmm_impl_cpu_" not implemented for \'Half\'', None)
    assert msg.startswith("dtype fp16 cannot compute on this CPU build: op addmm_impl_cpu_ has no Half kernel")
    assert "--dtype fp32" in msg and "\n" not in msg
    assert dtype_failure("CUDA out of memory", None) is None


def test_a_bad_forced_answer_is_one_line_before_any_worker_starts(monkeypatch):
    monkeypatch.setenv(ENV_FP16_KERNELS, "maybe")
    out = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--world-size", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == ("rlhfmem: error: $RLHFMEM_CPU_FP16_KERNELS='maybe': allowed values: auto, "
                                  "supported, unsupported")
