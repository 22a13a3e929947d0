"""The CUDA recording path (issue 35, items 4-7), on CPU: recorded and synthetic snapshot dicts, the real
per-rank capture on CPU, and stand-ins for ``torch.cuda.memory``'s functions in unit tests of one class.

- 4: a memory history whose ring buffer wrapped is detected, and the rank fails naming the cause and the fix;
  the buffer is sized by ``$RLHFMEM_HISTORY_MAX_ENTRIES``, frames are recorded only when asked.
- 5: an error while the rank's capture finishes still writes its result, a failure in phase ``finish``.
- 6: phase marks are merged on the allocator's own clock (``external_annotations``), whatever the wall clock's skew.
- 7: the program's own ``_record_memory_history``/``_snapshot`` calls neither stop nor resize ours, and the
  recorder never resets the program's peak counters.
"""

from __future__ import annotations

import inspect
import json
import time

import pytest

from helpers import shared_snapshot
from pytest_rlhfmem.record.rank import RankCapture
from pytest_rlhfmem.record import recorder as mc
from pytest_rlhfmem.memory.trace import ALLOC, FLUSH, PHASE, PHASE_END, load_snapshot
from pytest_rlhfmem.rlhf.scenario import Scenario

MiB = 2**20
SKEW_US = -2_000_000  # the stand-in allocator's clock against the wall clock


# -- 4: a wrapped history -------------------------------------------------------------------------------

def _wrapped(snap: dict, keep: int) -> dict:
    """``snap`` as PyTorch's ring buffer of ``keep`` entries returns it once more were recorded: the last ones."""
    out = dict(snap)
    out["device_traces"] = [t[-keep:] for t in snap["device_traces"]]
    return out


def test_a_wrapped_history_is_detected_and_names_the_fix():
    snap = load_snapshot(shared_snapshot("cs336_ctx256_fwd"))
    n = len(snap["device_traces"][0])
    allocs = sum(1 for e in snap["device_traces"][0] if e["action"] == "alloc")
    assert mc.history_lost(snap, 0, n + 1, allocs) is None  # whole: room left, every allocation there
    lost = mc.history_lost(_wrapped(snap, n // 2), 0, n // 2)
    assert lost is not None and "\n" not in lost
    assert f"filled its ring buffer of {n // 2:_} entries" in lost
    assert f"RLHFMEM_HISTORY_MAX_ENTRIES={n // 2 * 2:_}" in lost  # the fix, with a value
    # cleared or shrunk (not full): fewer alloc entries than the allocator's own allocation count
    lost = mc.history_lost(_wrapped(snap, n // 2), 0, 10 * n, allocs)
    assert lost is not None and f"of the {allocs:_} the allocator made" in lost


def test_history_settings_come_from_the_environment_and_refuse_bad_values():
    assert mc.history_settings(env={}) == (mc.DEFAULT_HISTORY_MAX_ENTRIES, None)  # no frames by default
    assert mc.DEFAULT_HISTORY_MAX_ENTRIES >= 6_000_000  # the study's scale: ~1.65 M allocations x 3 entries
    env = {mc.ENV_HISTORY_MAX_ENTRIES: "20_000_000", mc.ENV_HISTORY_CONTEXT: "alloc"}
    assert mc.history_settings(env=env) == (20_000_000, "alloc")
    for var, value, allowed in ((mc.ENV_HISTORY_MAX_ENTRIES, "lots", "a positive number"),
                                (mc.ENV_HISTORY_MAX_ENTRIES, "0", "a positive number"),
                                (mc.ENV_HISTORY_CONTEXT, "python", "none, state, alloc, all")):
        with pytest.raises(ValueError) as exc:
            mc.history_settings(env={var: value})
        assert str(exc.value).startswith(f"${var}={value!r}: allowed values: ") and allowed in str(exc.value)


class StandInMemory:
    """A stand-in for ``torch.cuda.memory`` with one history, as ``CUDACachingAllocator.cpp`` keeps it: a ring
    buffer of trace entries and one of annotations (cleared by every ``recordHistory``), on a clock of its own:
    the wall clock 2 s behind (``SKEW_US``), strictly increasing."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.entries: list[dict] = []
        self.annotations: list[dict] = []
        self.max_entries = 0
        self.on = False
        self.clock = 0
        self.peak_resets = 0

        def _record_memory_history(*args, **kwargs):  # torch's own signature, bound as torch binds it
            b = inspect.signature(_record_memory_history).bind(*args, **kwargs)
            b.apply_defaults()
            a = dict(b.arguments)
            self.calls.append(a)
            self.on = a["enabled"] is not None
            self.max_entries = a["max_entries"] if a["enabled"] == "all" else 1
            self.annotations = []

        import torch

        _record_memory_history.__signature__ = inspect.signature(torch.cuda.memory._record_memory_history)
        self._record_memory_history = _record_memory_history
        self._record_memory_history_legacy = torch.cuda.memory._record_memory_history_legacy

    def tick(self, us: int = 1) -> int:
        self.clock = max(self.clock + us, time.time_ns() // 1000 + SKEW_US)
        return self.clock

    def alloc(self, addr: int, size: int) -> None:
        if self.on:
            self.entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": self.tick()})
            del self.entries[:-self.max_entries]

    def record_function(self, name: str):
        memory = self

        class Annotation:
            def __enter__(self):
                if memory.on:
                    memory.annotations.append({"name": name, "stage": "START", "device": 0, "time_us": memory.tick(1)})

            def __exit__(self, *exc):
                if memory.on:
                    memory.annotations.append({"name": name, "stage": "END", "device": 0, "time_us": memory.tick(1)})

        return Annotation()

    def _snapshot(self, device=None):
        return {"segments": [], "device_traces": [list(self.entries)],
                "external_annotations": [dict(a) for a in self.annotations]}

    def memory_stats(self, device=None):
        return {"allocation.all.allocated": sum(1 for e in self.entries if e["action"] == "alloc")}


def test_the_recorder_refuses_a_wrapped_history_on_stop(monkeypatch):
    import torch

    memory = StandInMemory()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"reserved_bytes.all.peak": 40 * MiB,
                                                                          "allocated_bytes.all.peak": 30 * MiB})
    rec = mc.Recorder("cuda")
    rec.history = mc.CudaHistory(memory, 4, None, memory.record_function)
    rec.history.start()
    assert memory.calls[0]["context"] is None and memory.calls[0]["max_entries"] == 4  # no frames by default
    for i in range(6):  # 6 allocations into a ring buffer of 4 entries: the first two are overwritten
        memory.alloc(0x1000 * (i + 1), MiB)
    with pytest.raises(mc.HistoryWrapped) as exc:
        rec.stop()
    assert "filled its ring buffer of 4 entries" in str(exc.value) and exc.value.stats["peak_reserved"] == 40 * MiB
    assert memory.calls[-1]["enabled"] is None  # recording stopped all the same


# -- 5: the finish guarded -----------------------------------------------------------------------------

def _cpu_capture(tmp_path, monkeypatch, fail_with: Exception):
    import torch

    from pytest_rlhfmem.record import rank as cap_mod

    def failing(*args, **kwargs):
        raise fail_with

    cap = RankCapture(Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 1), "cpu", tmp_path, 0, 1, threads=1)
    rec = cap.start()
    with rec.phase("generate"):
        x = torch.empty(4 * MiB, dtype=torch.uint8)
        del x
    monkeypatch.setattr(cap_mod, "rank_result", failing)  # the replay of the trace fails
    return cap


def test_an_error_in_the_finish_still_writes_the_ranks_result(tmp_path, monkeypatch):
    from pytest_rlhfmem.memory.replay import ReplayError

    cap = _cpu_capture(tmp_path, monkeypatch, ReplayError("trace: event 12: unbalanced pool markers\nmore detail"))
    result = cap.finish(None, None)
    on_disk = json.loads((tmp_path / "result-rank0.json").read_text())
    assert on_disk["status"] == result["status"] == "failed"
    err = on_disk["error"]
    assert (err["phase"], err["type"], err["message"]) == ("finish", "ReplayError",
                                                           "trace: event 12: unbalanced pool markers")
    assert on_disk["events"] > 0 and on_disk["simulated"] is True  # the trace was read before the replay failed
    gen = next(p for p in on_disk["phases"] if p["phase"] == "generate")
    assert gen["wall_s"] > 0 and gen["host_peak_rss"] > 0  # what is known: times, the host's measured figures
    assert set(on_disk["total"]) >= {"peak_reserved", "peak_allocated", "host_peak_rss"}


def test_the_programs_own_error_stays_the_ranks_error_when_the_finish_fails_too(tmp_path, monkeypatch):
    cap = _cpu_capture(tmp_path, monkeypatch, RuntimeError("disk full"))
    program = {"phase": "generate", "time": 1.0, "type": "OOM", "message": "CUDA out of memory", "traceback": ""}
    result = cap.finish(None, program)
    assert result["error"] == program
    assert (result["finish_error"]["phase"], result["finish_error"]["message"]) == ("finish", "disk full")


def test_a_wrapped_history_fails_the_rank_naming_the_cause_and_the_fix(tmp_path, monkeypatch):
    message = mc.history_lost({"device_traces": [[{"action": "alloc"}] * 8]}, 0, 8)
    cap = _cpu_capture(tmp_path, monkeypatch, RuntimeError("unused"))

    def wrapped():
        raise mc.HistoryWrapped(message, 8, {"peak_reserved": 40 * MiB, "peak_allocated": 30 * MiB})

    real_stop = cap.rec.stop
    monkeypatch.setattr(cap.rec, "stop", wrapped)
    try:
        result = json.loads(json.dumps(cap.finish(None, None)))
    finally:  # the process-wide CPU allocation recorder must not stay on for the next test in this process
        real_stop()
    assert result["error"]["type"] == "HistoryWrapped" and result["error"]["phase"] == "finish"
    assert result["error"]["message"] == message and "RLHFMEM_HISTORY_MAX_ENTRIES=16" in message
    assert result["total"]["peak_reserved"] == 40 * MiB and result["events"] == 8  # the allocator's own peak


# -- 6: marks on the allocator's clock -----------------------------------------------------------------

def _synthetic(skew_us: int) -> tuple[dict, list]:
    """Allocator-clock trace entries 100..600 us, and marks made at 250 (generate) and 450 (train) on the
    allocator's clock, whose wall-clock times are ``skew_us`` later."""
    entries = [{"action": "alloc", "addr": 0x10000 * i, "size": 512, "stream": 0, "time_us": 100 * i}
               for i in range(1, 7)]
    marks = [(PHASE, 250 + skew_us, "generate"), (FLUSH, 452 + skew_us, "after-generate"),
             (PHASE, 454 + skew_us, "train")]
    ann = [{"name": "user's own", "stage": "START", "device": 0, "time_us": 50}]
    for k, t in enumerate((250, 452, 454)):
        ann += [{"name": f"{mc.CUDA_MARK}{k}", "stage": "START", "device": 0, "time_us": t},
                {"name": f"{mc.CUDA_MARK}{k}", "stage": "END", "device": 0, "time_us": t + 1}]
    snap = {"segments": [{"device": 0, "address": 0, "total_size": 0x80000, "stream": 0, "segment_type": "large",
                          "blocks": []}],
            "device_traces": [entries], "external_annotations": ann}
    snap["segments"][0]["blocks"] = [{"address": 0, "size": 0x80000, "state": "inactive"}]
    return snap, marks


def _phase_of_allocs(trace) -> list[str]:
    phase, out = "startup", []
    for e in trace.events:
        if e.action == PHASE:
            phase = e.name
        elif e.action == ALLOC:
            out.append(phase)
    return out


@pytest.mark.parametrize("skew_us", [0, 5_000_000, -3_000_000])
def test_marks_merge_by_the_allocators_clock_whatever_the_wall_clocks_skew(skew_us):
    snap, marks = _synthetic(skew_us)
    trace = mc.cuda_trace_with_marks(snap, marks)
    assert _phase_of_allocs(trace) == ["startup", "startup", "generate", "generate", "train", "train"]
    assert "allocator clock" in trace.source
    assert [e.name for e in trace.events if e.action == FLUSH] == ["after-generate"]


def test_marks_without_annotations_take_the_wall_clock_and_lost_ones_are_shifted():
    snap, marks = _synthetic(0)
    bare = {**snap, "external_annotations": []}  # torch < 2.6, or annotations off: the wall clock
    assert mc.mark_times(bare, marks)[1].startswith("wall clock")
    # the first mark's annotation lost (buffer cleared by a later history call), the others 7 s off the wall
    snap, marks = _synthetic(7_000_000)
    snap["external_annotations"] = [a for a in snap["external_annotations"] if a["name"] != f"{mc.CUDA_MARK}0"]
    times, clock = mc.mark_times(snap, marks)
    assert times == [250, 452, 454] and "1 of 3 marks from the wall clock shifted by -7000000 us" in clock
    assert _phase_of_allocs(mc.cuda_trace_with_marks(snap, marks))[2:4] == ["generate", "generate"]


def test_the_recorders_marks_are_annotations_on_the_allocators_clock():
    memory = StandInMemory()
    rec = mc.Recorder("cuda")
    rec.history = mc.CudaHistory(memory, 100, None, memory.record_function)
    rec.history.start()
    rec._mark(PHASE, "generate")
    rec._mark(PHASE_END, "generate")
    assert [a["name"] for a in memory.annotations if a["stage"] == "START"] == [f"{mc.CUDA_MARK}0", f"{mc.CUDA_MARK}1"]
    assert [m[2] for m in rec._phase_marks_us] == ["generate", "generate"]


# -- 7: the program's own history calls and peak counters ----------------------------------------------

def test_the_programs_history_calls_neither_stop_nor_resize_ours():
    memory = StandInMemory()
    history = mc.CudaHistory(memory, 1000, None, memory.record_function)
    history.start()
    history.intercept()
    memory.alloc(0x1000, 512)  # before the program asked: not in its snapshot
    memory._record_memory_history(max_entries=2)  # the program's own call (context="all" by default)
    assert memory.on and memory.max_entries == 1000  # still ours: not shrunk to 2
    assert memory.calls[-1]["context"] == "all"  # its request for frames was passed on
    for i in range(2, 6):
        memory.alloc(0x1000 * i, 512)
    mine = memory._snapshot()
    assert [e["addr"] for e in mine["device_traces"][0]] == [0x4000, 0x5000]  # its window, its last 2 entries
    assert not any(a["name"].startswith("rlhfmem::") for a in mine["external_annotations"])
    memory._record_memory_history(enabled=None)  # the program stops its history
    assert memory.on and all(c["enabled"] is not None for c in memory.calls)  # ours never stopped
    memory.alloc(0x6000, 512)
    assert [e["addr"] for e in memory._snapshot()["device_traces"][0]] == [0x4000, 0x5000]  # still its window
    snap, made = history.stop()  # ours: the whole recording, functions restored
    assert [e["addr"] for e in snap["device_traces"][0]] == [0x1000 * i for i in range(1, 7)] and made == 6
    assert memory._snapshot.__func__ is StandInMemory._snapshot and not memory.on  # restored
    assert mc.history_lost(snap, 0, history.max_entries, made) is None


def test_the_legacy_form_of_the_programs_call_is_understood():
    memory = StandInMemory()
    history = mc.CudaHistory(memory, 1000, None, memory.record_function)
    history.start()
    history.intercept()
    memory._record_memory_history(True, trace_alloc_max_entries=5000, trace_alloc_record_context=True)
    assert memory.max_entries == 5000 and memory.calls[-1]["context"] == "alloc"  # grown, never shrunk
    memory._record_memory_history(False)
    assert memory.on


def test_phases_never_reset_the_programs_peak_counters(monkeypatch):
    import torch

    resets = []
    stats = {"num_device_alloc": 3, "num_device_free": 1, "num_alloc_retries": 0, "num_ooms": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: dict(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: resets.append(1))
    rec = mc.Recorder("cuda")
    with rec.phase("generate"):
        stats["num_device_alloc"] = 7
        stats["num_device_free"] = 0  # the program called reset_accumulated_memory_stats() meanwhile
    assert resets == []
    assert rec.phases[0].cuda_stats == {"cuda_malloc_count": 4, "alloc_retries": 0, "ooms": 0}
    assert "peak_reserved" not in rec.phases[0].cuda_stats  # the peaks are the replay's of the whole trace



def test_the_cuda_recorder_runs_its_path_end_to_end_with_stand_ins(monkeypatch):
    """Recorder("cuda") from start to stop, torch.cuda.memory's history functions stood in (their real
    signature kept): no frames recorded, the program's history calls served from ours, peaks never reset,
    the phases cut on the (stand-in) allocator's clock."""
    import torch
    import torch.autograd.profiler as profiler

    memory = StandInMemory()
    for name in ("_record_memory_history", "_snapshot", "memory_stats"):
        monkeypatch.setattr(torch.cuda.memory, name, getattr(memory, name))
    monkeypatch.setattr(torch.cuda, "memory_stats", memory.memory_stats)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: memory.__dict__.update(peak_resets=1))
    monkeypatch.setattr(profiler, "record_function", memory.record_function)
    monkeypatch.setenv(mc.ENV_HISTORY_MAX_ENTRIES, "64")
    rec = mc.Recorder("cuda", root="run")
    rec.start()
    rec.intercept_empty_cache()
    rec.intercept_history()
    assert (memory.calls[0]["enabled"], memory.calls[0]["context"], memory.calls[0]["max_entries"]) == ("all", None, 64)
    memory.alloc(0x1000, 512)
    with rec.phase("generate"):
        torch.cuda.memory._record_memory_history(max_entries=4)  # the program's own history
        memory.alloc(0x2000, 512)
        torch.cuda.empty_cache()  # a flush named by its caller
    memory.alloc(0x3000, 512)
    assert memory.on and memory.max_entries == 64  # the program's call neither stopped nor shrank ours
    trace = rec.stop()
    assert memory.peak_resets == 0 and not memory.on
    assert _phase_of_allocs(trace) == ["run", "generate", "run"]
    # the program's call asked for frames: passed on, PyTorch cleared its annotations, the two marks made before
    # took their wall-clock times shifted by the clocks' offset
    assert "allocator clock" in trace.source and "2 of 5 marks from the wall clock shifted by" in trace.source
    flushes = [e.name for e in trace.events if e.action == FLUSH]
    assert len(flushes) == 1 and flushes[0].startswith("empty_cache@test_cuda_capture_history.py")
    assert torch.cuda.memory._record_memory_history is memory._record_memory_history  # restored


# -- the program's calls at their edges (the GPU route's report: tests/gpu_route.py) -------------------------------

def test_a_wrong_call_of_the_program_raises_as_its_torch_would_and_clear_history_empties_its_windows():
    memory = StandInMemory()
    history = mc.CudaHistory(memory, 1000, None, memory.record_function)
    history.start()
    history.intercept()
    with pytest.raises(TypeError):
        memory._record_memory_history("all", no_such_argument=1)
    with pytest.raises(TypeError):
        memory._record_memory_history(True, trace_alloc_max_entries=10, no_such_argument=1)
    memory._record_memory_history(max_entries=10)
    memory.alloc(0x1000, 512)
    memory._record_memory_history(max_entries=10, clear_history=True)  # its earlier window is gone
    memory.alloc(0x2000, 512)
    assert [e["addr"] for e in memory._snapshot()["device_traces"][0]] == [0x2000]
    history.intercept()  # a second interception changes nothing
    assert memory._record_memory_history == history.user_record
    history.stop()


def test_a_torch_without_signatures_or_counters_still_records():
    """A ``_record_memory_history`` whose signature cannot be read (a builtin) gets every keyword; one without the
    legacy function reads the legacy call's keywords alone; statistics that raise leave the wrap check to the
    ring buffer's size; marks without record_function, or whose record_function raises, keep their wall-clock
    time."""
    memory = StandInMemory()
    calls = []
    memory._record_memory_history = lambda **kw: calls.append(kw)  # noqa: E731
    memory._record_memory_history.__signature__ = "unreadable"  # inspect.signature refuses it (TypeError)
    del memory._record_memory_history_legacy
    memory.memory_stats = lambda device=None: 1 / 0
    history = mc.CudaHistory(memory, 1000, None, None)
    history.start()
    assert calls == [{"enabled": "all", "context": None, "stacks": "python", "max_entries": 1000}]
    assert history.allocs_at_start is None
    history.mark("rlhfmem::cuda_mark::0")  # no record_function: nothing, no error
    history.intercept()
    memory._record_memory_history(True, trace_alloc_max_entries=2000)
    assert calls[-1]["max_entries"] == 2000  # read from the legacy call's keywords

    def failing(name):
        raise RuntimeError("no profiler here")

    history.record_function = failing
    history.mark("rlhfmem::cuda_mark::1")  # the mark keeps its wall-clock time


def test_an_annotation_that_is_not_one_of_our_marks_is_ignored():
    marks = [("phase", 100, "generate")]
    snap = {"external_annotations": [{"name": f"{mc.CUDA_MARK}x", "stage": "START", "time_us": 5},
                                     {"name": f"{mc.CUDA_MARK}0", "stage": "START", "time_us": 7}]}
    assert mc.mark_times(snap, marks) == ([7], "allocator clock (external_annotations)")
