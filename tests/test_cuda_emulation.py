"""The CPU capture's CUDA emulation (pytest_rlhfmem/record/emulation.py): each adjustment on its own."""

from __future__ import annotations

import pytest
import torch

from pytest_rlhfmem import budgets as B
from pytest_rlhfmem.record import emulation as E
from pytest_rlhfmem.record.recorder import Recorder
from pytest_rlhfmem.memory.events import CUBLAS_WORKSPACE
from pytest_rlhfmem.memory.trace import ALLOC

PRE_HOPPER = 8_519_680  # 4096 KiB x 2 + 16 KiB x 8 (CublasHandlePool.cpp default before Hopper)


def test_cublas_workspace_size_by_architecture_and_config():
    assert E.cublas_workspace_bytes() == PRE_HOPPER
    assert E.cublas_workspace_bytes("8.0") == PRE_HOPPER
    assert E.cublas_workspace_bytes("9.0") == 32 * 2**20
    assert E.cublas_workspace_bytes("8.0", ":4096:8") == 32 * 2**20
    assert E.cublas_workspace_bytes(None, ":16:8") == 128 * 1024
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG 'bogus'"):
        E.cublas_workspace_bytes(None, "bogus")


def test_settings_validate_and_describe():
    s = E.EmulationSettings(cublas_workspace_config=None)
    assert s.describe() == {"adjustments": list(E.ADJUSTMENTS), "cublas_workspace_bytes": PRE_HOPPER}
    assert E.EmulationSettings(adjustments=("host-scalars",)).describe()["cublas_workspace_bytes"] == 0
    with pytest.raises(ValueError, match="adjustment 'nope': allowed values are host-scalars"):
        E.EmulationSettings(adjustments=("nope",))
    assert E.parse_switch("off") is None and E.parse_switch("on") is not None
    with pytest.raises(ValueError, match="allowed values are on, off"):
        E.parse_switch("maybe")


# Rows are the recorder's (time_ns, ptr, size, kind 0 alloc / 1 free / 2 marker, on_main).
def _rows(spec):
    marks, rows = [], []
    for item in spec:
        if item[0] in (E.OP_BEGIN, E.OP_END):
            rows.append((0, len(marks), 0, 2, 1))
            marks.append(item)
        else:
            kind, ptr, size = item
            rows.append((0, ptr, size, 0 if kind == "a" else 1, 1))
    return rows, marks


def _sizes(rows):
    return [(("a" if k == 0 else "f"), s) for _t, _p, s, k, _m in rows if k in (0, 1)]


def test_host_scalar_dropped_with_its_free():
    rows, marks = _rows([("a", 1, 8), (E.OP_BEGIN, ("mul", "caller", 1, True, ())), ("a", 2, 4096),
                         (E.OP_END, None), ("f", 1, 8)])
    out, rep = E.apply(rows, marks, E.EmulationSettings(adjustments=("host-scalars",)))
    assert _sizes(out) == [("a", 4096)]
    assert rep.dropped["host-scalars"] == [1, 8]


def test_cpu_kernel_scratch_dropped_but_outputs_and_nested_op_results_kept():
    rows, marks = _rows([(E.OP_BEGIN, ("bmm", "autograd", 0, True, ())), ("a", 1, 64), ("a", 2, 4096), ("f", 1, 64),
                         (E.OP_END, None),
                         # a device-generic (composite) op: what its nested ops make is device memory
                         (E.OP_BEGIN, ("explicit_op", "caller", 0, False, ())), ("a", 3, 8),
                         (E.OP_BEGIN, ("mul", "caller", 1, True, ())), ("a", 4, 32), (E.OP_END, None),
                         ("f", 3, 8), ("a", 5, 32), ("f", 4, 32), (E.OP_END, None)])
    out, rep = E.apply(rows, marks, E.EmulationSettings(adjustments=("host-scalars", "cpu-kernel-scratch")))
    assert _sizes(out) == [("a", 4096), ("a", 32), ("a", 32), ("f", 32)]
    assert rep.dropped["cpu-kernel-scratch"] == [1, 64] and rep.dropped["host-scalars"] == [1, 8]


def test_cublas_workspace_once_per_thread_after_the_output():
    spec = []
    for thread in ("caller", "caller", "autograd", "autograd"):
        spec += [(E.OP_BEGIN, ("mm", thread, 0, True, ())), ("a", len(spec) + 1, 4096), (E.OP_END, None)]
    spec += [(E.OP_BEGIN, ("add", "caller", 0, True, ())), ("a", 99, 4096), (E.OP_END, None)]
    rows, marks = _rows(spec)
    out, rep = E.apply(rows, marks, E.EmulationSettings(adjustments=("cublas-workspace",),
                                                        cublas_workspace_config=None))
    sizes = _sizes(out)
    assert sizes == [("a", 4096), ("a", PRE_HOPPER), ("a", 4096), ("a", 4096), ("a", PRE_HOPPER), ("a", 4096),
                     ("a", 4096)]
    assert rep.added["cublas-workspace"] == [2, 2 * PRE_HOPPER]


def _capture(settings, fn):
    rec = Recorder("cpu", cuda_emulation=settings)
    rec.start()
    try:
        fn()
    finally:
        trace = rec.stop()
    if not rec.backend.startswith("rlhfmem CPU"):
        pytest.skip("the CPU allocation recorder cannot be built here (no C++ compiler)")
    rec.trace = trace
    return [e.size for e in trace.events if e.action == ALLOC], rec


def test_recorder_emulates_a_training_step_of_a_linear_layer():
    lin = torch.nn.Linear(32, 32, bias=False)
    x = torch.randn(8, 32)

    def step():
        loss = (0.5 * lin(x)).sum()
        loss.backward()

    off, _ = _capture(None, step)
    on, rec = _capture(E.EmulationSettings(cublas_workspace_config=None), step)
    assert 8 in off and PRE_HOPPER not in off  # the wrapped 0.5 is a CPU allocation here
    assert 8 not in on
    assert on.count(PRE_HOPPER) == 2  # forward (caller) thread and autograd's backward thread
    # named, as the simulated CUDA device names its own: a first-fit replay releases the context's range there
    assert [e.size for e in rec.trace.events if e.name == CUBLAS_WORKSPACE] == [PRE_HOPPER, PRE_HOPPER]
    assert rec.capture_description() == {"cuda_emulation": E.EmulationSettings(cublas_workspace_config=None).describe()}


def test_recorder_sees_ops_of_composites_under_inference_mode():
    w = torch.randn(16, 16)

    def infer():
        with torch.inference_mode():
            torch.einsum("...i,oi->...o", torch.randn(2, 4, 16), w)

    on, rec = _capture(E.EmulationSettings(cublas_workspace_config=None), infer)
    assert on.count(PRE_HOPPER) == 1  # einsum is decomposed: its bmm is seen as a cuBLAS op
    assert 2 * 4 * 16 * 4 in on


def test_budget_of_another_capture_is_not_comparable(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("schema: 1\nentries:\n  s/x2:\n    capture: cpu-trace-simulated\n    metrics:\n"
                    "      peak_reserved: 2 MiB\n")
    entry = B.load_budget_file(path).entries["s/x2"]
    on = E.capture_description(E.EmulationSettings(cublas_workspace_config=None))
    msg = B.not_comparable(path, entry, "cpu-trace-simulated", on)
    assert msg is not None and str(path) in msg and "'s/x2'" in msg
    assert "cuda_emulation=off" in msg and "cublas_workspace_bytes" in msg
    assert B.not_comparable(path, entry, "cpu-trace-simulated", {"cuda_emulation": "off"}) is None
    assert "not comparable" in B.not_comparable(path, entry, "cuda-memory-history", {})
    path.write_text("schema: 1\nentries:\n  s/x2:\n    capture: cpu-trace-simulated\n    capture_description:\n"
                    f"      cuda_emulation: {on['cuda_emulation']}\n    metrics:\n      peak_reserved: 2 MiB\n")
    assert B.not_comparable(path, B.load_budget_file(path).entries["s/x2"], "cpu-trace-simulated", on) is None
