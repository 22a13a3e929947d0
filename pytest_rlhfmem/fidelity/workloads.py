"""Public GPU-recorded workloads, rerun on CPU under the recorder and held against their recordings.

A workload here is the exact program behind one real snapshot of ``shared/snapshots`` (see its
README): the same model, the same steps, the same order of device allocations. :func:`capture` runs it
on CPU under :class:`~pytest_rlhfmem.record.recorder.Recorder` (CUDA emulation as given) and returns the
trace; :func:`compare` replays both and returns the figures side by side.

The recorded window: ``memory_profile`` (``cs336_systems/nsys_profile.py``, Wedsonlin/assignment2-systems
at 8630bcf) builds the model on the host, moves it to the GPU (``model.to(device)``), draws the inputs
on the GPU, runs the warm-up steps, and only then starts the memory history for ONE step. The capture
mirrors that: the model is built before recording starts (host memory on a GPU run), the move to the
device is a placement annotation in ``Module._apply`` order, and phase ``step`` is the recorded window.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from ..record.recorder import Recorder
from ..record.emulation import EmulationSettings
from ..memory.replay import ANCHORED, FREE_RUNNING, replay
from ..memory.trace import ALLOC, PHASE, Trace, load_snapshot, trace_from_snapshot
from .cs336_lm import AdamW, TransformerLM, cross_entropy, lm_config, module_to_order

STEP_PHASE = "step"
RECORDED_WARMUPS = 5  # memory_profile's default, used for both recordings


@dataclass(frozen=True)
class Workload:
    """One recorded program: a CS336 model size, context length, ``inference`` or ``training``, batch 4."""

    snapshot: str
    size: str
    context_length: int
    mode: str
    batch: int = 4


WORKLOADS = {
    "wedson_medium_128_inference": Workload("wedson_medium_128_inference", "medium", 128, "inference"),
    "wedson_medium_256_training": Workload("wedson_medium_256_training", "medium", 256, "training"),
}


def capture(workload: Workload, emulation: EmulationSettings | None, warmups: int = RECORDED_WARMUPS,
            seed: int = 0, keep_raw_rows: bool = False, **config_overrides) -> tuple[Trace, Recorder, float]:
    """Run ``workload`` on CPU under the recorder; returns (trace, recorder, wall seconds of the run).

    ``warmups`` below the recorded 5 is allowed (the input tensors keep the recorded shape (5, batch,
    context), so the device allocations before the steps do not change); ``config_overrides`` shrink
    the model for unit tests. Phases: ``to_device``, ``inputs``, ``warmup-1`` .. ``warmup-N``, ``step``.
    """
    import torch

    torch.manual_seed(seed)
    cfg = lm_config(workload.size, workload.context_length, **config_overrides)
    model = TransformerLM(cfg)  # built in host memory, as on the GPU run
    optimizer = AdamW(model.parameters())
    rec = Recorder("cpu", cuda_emulation=emulation, keep_raw_rows=keep_raw_rows)
    t0 = time.perf_counter()
    rec.start()
    try:
        with rec.phase("to_device"):
            tensors = list(module_to_order(model))
            rec.host_resident(tensors)
            rec.moved_to_device(tensors)  # model.to("cuda"): one copy per tensor, in _apply order
        _run(workload, model, optimizer, rec, cfg.vocab_size, warmups)
    finally:
        trace = rec.stop()
    return trace, rec, time.perf_counter() - t0


def capture_in_child(name: str, emulation: EmulationSettings | None) -> Trace:
    """:func:`capture` of ``WORKLOADS[name]`` in a fresh process (``spawn``), returning only its trace: the host
    memory the run takes (about 14 GiB for the training step: the 423M-parameter model, its optimizer state and
    the CPU activations) goes back to the system when that process ends, not into the caller's heap. Raises
    what the child raised."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_trace_of, name, emulation).result()


def _trace_of(name: str, emulation: EmulationSettings | None) -> Trace:
    return capture(WORKLOADS[name], emulation)[0]


def _run(w: Workload, model, optimizer, rec: Recorder, vocab: int, warmups: int) -> None:
    import torch

    with rec.phase("inputs"):
        shape = (w.batch, w.context_length)
        warmup_inputs = torch.randint(0, vocab, (RECORDED_WARMUPS, *shape))
        step_inputs = torch.randint(0, vocab, (1, *shape))
        if w.mode == "training":
            warmup_targets = torch.randint(0, vocab, (RECORDED_WARMUPS, *shape))
            step_targets = torch.randint(0, vocab, (1, *shape))
    if w.mode == "inference":
        model.eval()
        with torch.inference_mode():
            for i in range(warmups):
                with rec.phase(f"warmup-{i + 1}"):
                    model(warmup_inputs[i])
            with rec.phase(STEP_PHASE):
                model(step_inputs[0])
        return
    model.train()
    for i in range(warmups):
        with rec.phase(f"warmup-{i + 1}"):
            output = model(warmup_inputs[i])  # the previous step's logits stay alive until here
            loss = cross_entropy(output, warmup_targets[i])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if warmups:
        del output, loss
    optimizer.zero_grad(set_to_none=True)
    with rec.phase(STEP_PHASE):
        output = model(step_inputs[0])
        loss = cross_entropy(output, step_targets[0])
        loss.backward()
        optimizer.step()


def step_window_sizes(trace: Trace, phase: str | None = STEP_PHASE) -> list[int]:
    """Requested sizes of the allocations in ``phase`` (``None``: the whole trace), in order."""
    inside = phase is None
    out = []
    for e in trace.events:
        if e.action == PHASE:
            inside = phase is None or e.name == phase
        elif e.action == ALLOC and inside:
            out.append(e.size)
    return out


def share_matched(recorded: list[int], captured: list[int]) -> float:
    """Share of the recorded allocation sizes that the capture also makes (multiset intersection over the
    recorded count; 1.0 when both make exactly the same sizes, whatever the order)."""
    if not recorded:
        return 1.0 if not captured else 0.0
    common = Counter(recorded) & Counter(captured)
    return sum(common.values()) / max(len(recorded), len(captured))


def recorded_figures(snapshot_file) -> dict:
    """The recording's figures over its window (replayed anchored: exact on these files)."""
    snap = load_snapshot(snapshot_file)
    trace = trace_from_snapshot(snap, source=str(snapshot_file))
    r = replay(trace, mode=ANCHORED, record_series=False)
    return {
        "reserved_at_start": sum(s.total_size for s in trace.initial_segments),
        "peak_reserved": r.total.peak_reserved, "peak_allocated": r.total.peak_allocated,
        "fragmentation_at_peak": r.total.fragmentation_at_peak, "cuda_malloc_count": r.total.cuda_malloc_count,
        "sizes": step_window_sizes(trace, None),
    }


def captured_figures(trace: Trace) -> dict:
    """The CPU capture's simulated figures over its ``step`` phase (free-running replay of the whole run)."""
    r = replay(trace, mode=FREE_RUNNING, record_series=False)
    step = next(p for p in r.phases if p.phase == STEP_PHASE)
    before = r.phases[: r.phases.index(step)]
    return {
        "reserved_at_start": _reserved_at_phase_start(trace, STEP_PHASE),
        "peak_reserved": step.peak_reserved, "peak_allocated": step.peak_allocated,
        "fragmentation_at_peak": step.fragmentation_at_peak, "cuda_malloc_count": step.cuda_malloc_count,
        "cuda_malloc_count_before": sum(p.cuda_malloc_count for p in before),
        "sizes": step_window_sizes(trace),
    }


def _reserved_at_phase_start(trace: Trace, phase: str) -> int:
    cut = next(i for i, e in enumerate(trace.events) if e.action == PHASE and e.name == phase)
    r = replay(Trace(events=trace.events[:cut], capture=trace.capture), mode=FREE_RUNNING, record_series=False)
    return r.final_reserved


def compare(recorded: dict, captured: dict) -> dict:
    """Side by side, with ``equal`` per figure and the share of allocation sizes matched."""
    keys = ("reserved_at_start", "peak_reserved", "peak_allocated", "fragmentation_at_peak", "cuda_malloc_count")
    out = {k: {"recorded": recorded[k], "captured": captured[k], "equal": recorded[k] == captured[k]} for k in keys}
    out["allocations"] = {"recorded": len(recorded["sizes"]), "captured": len(captured["sizes"]),
                          "same_sequence": recorded["sizes"] == captured["sizes"],
                          "share_matched": round(share_matched(recorded["sizes"], captured["sizes"]), 4)}
    return out
