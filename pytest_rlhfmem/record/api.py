"""The public recorder API: the only thing a user adds to a training script, and all of it optional.

    import pytest_rlhfmem as rlhfmem

    with rlhfmem.phase("generate"):          # a phase of the per-phase table
        sequences = actor.generate(prompts)
    rlhfmem.begin_phase("optimizer_step")    # the same, in two calls (a framework's callbacks)
    optimizer.step()
    rlhfmem.end_phase("optimizer_step")
    rlhfmem.flush_point("after-generate")    # "the device cache is emptied here"
    rlhfmem.iteration()                      # a training iteration (step) begins here
    rlhfmem.deepspeed_offload(engine)        # DeepSpeed offload: host-resident state leaves the device trace

Every call is a no-op when no capture is active in this process (the script runs outside
``rlhfmem capture`` / the ``rlhfmem_command`` fixture): ``phase`` returns one shared null context, the
others return at once. Nothing here imports torch, and the recorder is not even imported until a capture
starts, so the marks can stay in production code (``benchmarks/api_overhead.py`` measures the cost).

Under a capture, the handle is the rank's :class:`~pytest_rlhfmem.record.recorder.Recorder`; the recipes
receive the same object as ``rec`` (one capture path).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .recorder import Recorder

_active: Recorder | None = None  # the capturing recorder of this process, set by command/rank.py


class _NullPhase:
    """What :func:`phase` returns when nothing is captured: one shared, reentrant, do-nothing context."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False

    def __repr__(self) -> str:
        return "rlhfmem.NULL_PHASE"


NULL_PHASE = _NullPhase()


def active() -> Recorder | None:
    """The recorder capturing this process, or ``None`` when no capture is active."""
    return _active


def phase(name: str) -> Any:
    """Context manager marking a phase named ``name`` (a non-empty ``str``) of the per-phase table.

    Under a capture, allocations made inside the block belong to the window ``name``; wall time is
    measured (seconds, nested phases included). Phases nest: inside ``phase("train")``, a
    ``phase("backward")`` opens its own window and, when it ends, ``train`` resumes. A name used more
    than once (repeated, e.g. once per step, or resumed after a nested phase) is ONE row of the table:
    peaks (reserved, allocated) are the maximum over its windows, counts (cudaMalloc, retries, OOMs) and
    wall time the sum. Allocations outside every phase belong to the window ``run``; a script that marks
    nothing gets that single window, covering the whole run. Raises ``TypeError``/``ValueError`` for a
    name that is not a non-empty string (only under a capture: the null path checks nothing).

    Without a capture: returns :data:`NULL_PHASE` (the same object every time); the block just runs.
    """
    rec = _active
    if rec is None:
        return NULL_PHASE
    _check_name(name, "phase")
    return rec.phase(name)


_opened: list[tuple[str, Any]] = []  # phases opened by begin_phase, innermost last: (name, its context)


def begin_phase(name: str) -> None:
    """Open the phase ``name`` now and keep it open until :func:`end_phase` (the begin/end form of
    :func:`phase`, for code that is told where a phase starts and ends in two calls: a training framework's
    callbacks, ``on_pre_optimizer_step`` / ``on_optimizer_step``). Phases so opened nest like ``with`` blocks.
    No-op without a capture; raises like :func:`phase`."""
    rec = _active
    if rec is None:
        return
    _check_name(name, "begin_phase")
    context = rec.phase(name)
    context.__enter__()
    _opened.append((name, context))


def end_phase(name: str) -> None:
    """Close the phase ``name`` that :func:`begin_phase` opened. Raises ``ValueError`` when ``name`` is not the
    innermost phase that :func:`begin_phase` left open (phases close in the reverse order of their opening).
    No-op without a capture."""
    if _active is None:
        return
    if not _opened or _opened[-1][0] != name:
        innermost = repr(_opened[-1][0]) if _opened else "none"
        raise ValueError(f"rlhfmem.end_phase({name!r}): the innermost phase begin_phase opened is {innermost}")
    _opened.pop()[1].__exit__(None, None, None)


def iteration() -> int | None:
    """Mark the start of a training iteration (a step: rollout, scoring, update), at the top of the loop body::

        for step in range(steps):
            rlhfmem.iteration()
            ...

    Under a capture the k-th call starts iteration k (returned): the result gains per-iteration figures (device
    peaks, cudaMalloc count, host peaks, what each phase left allocated to the end) and, from three iterations on,
    their growth per iteration from iteration 2 (``growth_peak_reserved``, ``growth_peak_allocated``,
    ``growth_host_anon``, bytes per iteration), which a budget gates (docs/budgets.md, "Growth across
    iterations"). What runs before the first call (building the models) is the setup, iteration 0. Phases keep
    their names: a phase repeated every iteration is still one row of the per-phase table, and each iteration's
    figures are in ``result["iterations"]``. Without a capture: returns ``None`` and does nothing. Call it from
    the main thread."""
    rec = _active
    if rec is None:
        return None
    return rec.iteration()


def flush_point(name: str) -> None:
    """Declare that the device cache is emptied here (``torch.cuda.empty_cache()``), named ``name``.

    Under a capture on CUDA it calls the real ``torch.cuda.empty_cache()`` and records a flush; on CPU
    it records a FLUSH event, at which the allocator model releases its cached blocks, as the CUDA
    caching allocator would (``release_cached_blocks``). Use it where your code empties the cache behind
    a guard that never runs on CPU (``if torch.cuda.is_available(): torch.cuda.empty_cache()``), or to
    name a flush. Unguarded ``torch.cuda.empty_cache()`` calls, yours or a library's, are recorded on
    their own (named ``empty_cache@file:line``); a flush right after another releases 0 bytes. Without a
    capture: does nothing (keep your own ``empty_cache`` call for production). Raises like :func:`phase`.
    """
    rec = _active
    if rec is None:
        return
    _check_name(name, "flush_point")
    rec.flush(name)


def host_resident(tensors: Iterable) -> None:
    """These tensors live in host memory (e.g. offloaded optimizer states): their allocations, and later
    frees, leave the device trace. ``tensors``: any iterable of ``torch.Tensor`` (``None`` entries and
    views are fine: each storage counts once). On CUDA nothing is needed and nothing is done: the real
    allocator already knows. No-op without a capture."""
    rec = _active
    if rec is not None and rec.device != "cuda":
        rec.host_resident(tensors)


def moved_to_host(tensors: Iterable) -> None:
    """These device tensors move to host memory now (``.to("cpu")`` on a GPU): a free of their storages
    at this moment in the device trace (on CPU the move was a no-op). Same ``tensors`` as
    :func:`host_resident`. No-op on CUDA and without a capture."""
    rec = _active
    if rec is not None and rec.device != "cuda":
        rec.moved_to_host(tensors)


def moved_to_device(tensors: Iterable) -> None:
    """These host tensors come back to the device now: an allocation of their storages' bytes at this
    moment. Same ``tensors`` as :func:`host_resident`. No-op on CUDA and without a capture."""
    rec = _active
    if rec is not None and rec.device != "cuda":
        rec.moved_to_device(tensors)


def deepspeed_offload(engine: Any, offload: bool | None = None) -> None:
    """Apply DeepSpeed's ZeRO CPU-offload placement to ``engine`` (a ``deepspeed.DeepSpeedEngine``), as
    the DeepSpeed-Chat recipe does: its fp32 partitions, gradients, optimizer states and (parameter
    offload) parameter partitions become host-resident. ``offload=None`` reads the engine's config
    (``offload_optimizer`` / ``offload_param`` device); ``True``/``False`` force it. Call it after
    ``deepspeed.initialize`` and once more after the first ``engine.step()`` (optimizer states are
    created there). See :func:`pytest_rlhfmem.placement.deepspeed_offloaded_tensors`. No-op on CUDA
    and without a capture."""
    rec = _active
    if rec is None or rec.device == "cuda":
        return
    from ..placement import deepspeed_offloaded_tensors

    rec.host_resident(deepspeed_offloaded_tensors(engine, offload))


def _check_name(name: object, what: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"rlhfmem.{what}(name): name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError(f"rlhfmem.{what}(name): name must not be empty")


def _activate(rec: Recorder | None) -> None:
    """Make ``rec`` this process's capturing recorder (``None``: capture off). Used by command/rank.py."""
    global _active
    _active = rec
