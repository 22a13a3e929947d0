"""A colocated rollout engine's device memory: vLLM's sleep mode, modelled, for a trainer's recorded trace.

The engine is a stand-in: no vLLM runs. What it maps, when, and how much follows vLLM's code (read at the commits
docs/colocated-rollout.md names):

- ``vllm/device_allocator/cumem.py`` (``CuMemAllocator``): the engine's weights (tag ``weights``, mapped by
  ``Worker.load_model``) and KV cache (tag ``kv_cache``, ``Worker.initialize_from_config``) are mapped with
  ``cuMemCreate``/``cuMemMap`` by a pluggable allocator behind a ``MemPool``: physical memory the trainer's caching
  allocator cannot release. ``sleep(offload_tags)`` unmaps and releases every mapping (those tagged in
  ``offload_tags`` copied to pinned host memory first), then calls ``torch.cuda.empty_cache()``; ``wake_up(tags)``
  maps the tagged ones again (a failure rolls back that call's mappings and raises).
- ``vllm/v1/worker/gpu_worker.py``: ``sleep(level)`` offloads ``("weights",)`` at level 1 and nothing at level 2 (both
  release all the engine's device memory; level 1 keeps the weights in host memory); ``determine_available_memory``
  sizes the KV cache as ``total * gpu_memory_utilization - peak``, where ``peak`` is the process's torch
  ``allocated_bytes.all.peak`` during the profile run (the trainer's live tensors included: same process) plus the
  memory used outside torch. CUDA graphs (``capture_model``) are captured outside ``use_memory_pool``: their pool
  stays through sleep.
- TRL (``trl/generation/vllm_generation.py``): colocate mode builds the ``LLM`` after the trainer's models and puts
  it to sleep at once; before each rollout ``empty_cache()`` then ``wake_up(tags=["weights"])`` (weight sync), then
  ``wake_up(tags=["kv_cache"])``, generate, ``sleep(level=2)``.

In a trace these are ``EXTERNAL_MAP``/``EXTERNAL_UNMAP`` events (memory/events.py): the replay's capacity minus
them is what the trainer's cudaMalloc can have, and a wake-up the device cannot back is an OOM. Sizes are bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from ..memory.allocator import kMinBlockSize
from ..memory.events import ALLOC, EXTERNAL_MAP, EXTERNAL_UNMAP, FLUSH, FREE, FREE_REQUESTED, PHASE, PHASE_END, \
    Event, Trace

WEIGHTS = "weights"  # CuMemAllocator tags (gpu_worker.py: load_model, initialize_from_config)
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"  # not a CuMemAllocator tag: the graphs' private pool, held through sleep
SLEEP_LEVELS = (1, 2)  # gpu_worker.py: Worker.sleep(level); None here: sleep mode off (enable_sleep_mode=False)
MAPPING_GRANULARITY = 2 * 1024 * 1024  # bytes: the caching allocator's large segments (kRoundLarge) the pool maps
_MAP_ID = {WEIGHTS: 1, KV_CACHE: 2, CUDA_GRAPH: 3}
_ENGINE_ALLOC = 1 << 62  # the engine's forward temporaries: an address no recorded tensor has
FLUSH_BEFORE_WAKE_UP = "before-wake-up"  # FLUSH names this module writes
FLUSH_AT_SLEEP = "engine-sleep"  # CuMemAllocator.sleep's own torch.cuda.empty_cache()


class EngineSettingsError(ValueError):
    """A colocated engine setting out of range; the message is one line naming the allowed values."""


def _round_up(size: int) -> int:
    return -(-size // MAPPING_GRANULARITY) * MAPPING_GRANULARITY


def kv_cache_bytes(capacity: int, gpu_memory_utilization: float, torch_peak_bytes: int,
                   non_torch_bytes: int = 0) -> int:
    """The KV cache vLLM allocates on a device of ``capacity`` bytes: ``capacity * gpu_memory_utilization -
    (torch_peak_bytes + non_torch_bytes)`` (``vllm/v1/worker/gpu_worker.py``: ``determine_available_memory`` at
    vLLM 0012cf6), rounded down to the mapping granularity (2 MiB; vLLM's block rounding is not modelled).
    ``torch_peak_bytes``: the process's allocated peak during the profile run (the trainer's live tensors, the
    engine's weights and its forward's temporaries). Raises :class:`EngineSettingsError` when nothing is left
    (vLLM raises "No available memory for the cache blocks")."""
    available = int(capacity * gpu_memory_utilization) - torch_peak_bytes - non_torch_bytes
    if available < MAPPING_GRANULARITY:
        raise EngineSettingsError(
            f"gpu_memory_utilization {gpu_memory_utilization} of {capacity} bytes leaves no KV cache: the process "
            f"already holds {torch_peak_bytes + non_torch_bytes} bytes at the engine's profile run (raise it, up to 1)")
    return available // MAPPING_GRANULARITY * MAPPING_GRANULARITY


@dataclass(frozen=True)
class ColocatedEngine:
    """A vLLM engine in the trainer's process (TRL's ``vllm_mode="colocate"``).

    ``weights_bytes``: the engine's copy of the policy (bytes, in its dtype). ``gpu_memory_utilization``: vLLM's
    setting, in (0, 1]. ``sleep_level``: 1 or 2 (``vllm_enable_sleep_mode``), ``None``: the engine never sleeps.
    ``flush_before_wake_up``: the trainer's ``torch.cuda.empty_cache()`` right before ``wake_up`` (TRL's
    ``sync_weights``). ``activation_peak_bytes``: the engine's forward temporaries (the profile run's peak above
    the weights), allocated by the trainer's caching allocator during a rollout. ``cuda_graph_bytes``: the CUDA
    graphs' private pool (0: ``enforce_eager``), mapped at start and never released by sleep.
    Raises :class:`EngineSettingsError` for a setting out of range."""

    weights_bytes: int
    gpu_memory_utilization: float = 0.3  # TRL's vllm_gpu_memory_utilization default (grpo_config.py)
    sleep_level: int | None = 1
    flush_before_wake_up: bool = True
    activation_peak_bytes: int = 0
    cuda_graph_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineSettingsError(f"gpu_memory_utilization {self.gpu_memory_utilization!r}: allowed values are "
                                      "in (0, 1]")
        if self.sleep_level is not None and self.sleep_level not in SLEEP_LEVELS:
            raise EngineSettingsError(f"sleep level {self.sleep_level!r}: allowed values are 1, 2 or None (no sleep)")
        for name in ("weights_bytes", "activation_peak_bytes", "cuda_graph_bytes"):
            if getattr(self, name) < 0:
                raise EngineSettingsError(f"{name} {getattr(self, name)}: allowed values are 0 or more bytes")

    def sizes(self, capacity: int, trainer_allocated: int) -> dict[str, int]:
        """The bytes each mapping takes on a device of ``capacity`` bytes when the engine starts beside a trainer
        holding ``trainer_allocated`` bytes of live tensors: ``{weights, kv_cache, cuda_graph}`` (2 MiB multiples).
        Raises :class:`EngineSettingsError` when no KV cache fits (:func:`kv_cache_bytes`)."""
        weights = _round_up(self.weights_bytes)
        peak = trainer_allocated + weights + self.activation_peak_bytes
        return {WEIGHTS: weights, KV_CACHE: kv_cache_bytes(capacity, self.gpu_memory_utilization, peak),
                CUDA_GRAPH: _round_up(self.cuda_graph_bytes)}

    def host_bytes_asleep(self, sizes: dict[str, int]) -> int:
        """Pinned host bytes the engine holds while asleep: the weights at level 1, nothing at level 2 or awake."""
        return sizes[WEIGHTS] if self.sleep_level == 1 else 0

    # -- events -------------------------------------------------------------------------------

    def start_events(self, sizes: dict[str, int]) -> list[Event]:
        """``LLM(...)``: weights, then KV cache, then the CUDA graphs; asleep at once in sleep mode (TRL)."""
        out = [Event(EXTERNAL_MAP, _MAP_ID[t], sizes[t], name=t) for t in (WEIGHTS, KV_CACHE, CUDA_GRAPH) if sizes[t]]
        return out + (self.sleep_events(sizes) if self.sleep_level is not None else [])

    def sleep_events(self, sizes: dict[str, int]) -> list[Event]:
        """``sleep(level)``: every CuMemAllocator mapping released (both levels), then ``empty_cache()``."""
        return [Event(EXTERNAL_UNMAP, _MAP_ID[t], sizes[t], name=t) for t in (WEIGHTS, KV_CACHE) if sizes[t]] + [
            Event(FLUSH, name=FLUSH_AT_SLEEP)]

    def wake_events(self, sizes: dict[str, int]) -> list[Event]:
        """The trainer's flush if asked, then ``wake_up(["weights"])`` and ``wake_up(["kv_cache"])``."""
        out = [Event(FLUSH, name=FLUSH_BEFORE_WAKE_UP)] if self.flush_before_wake_up else []
        return out + [Event(EXTERNAL_MAP, _MAP_ID[t], sizes[t], name=t) for t in (WEIGHTS, KV_CACHE) if sizes[t]]


def _live_bytes(events: list[Event]) -> int:
    """Requested bytes live after ``events``, each rounded to the allocator's blocks (kMinBlockSize, 512 B)."""
    live: dict[int, int] = {}
    for e in events:
        if e.action == ALLOC:
            live[e.addr] = max(kMinBlockSize, -(-e.size // kMinBlockSize) * kMinBlockSize)
        elif e.action in (FREE, FREE_REQUESTED):
            live.pop(e.addr, None)
    return sum(live.values())


def sizes_at(record: dict, capacity: int, gpu_memory_utilization: float) -> dict[str, int]:
    """The mapping sizes (bytes: ``{weights, kv_cache, cuda_graph}``) the engine of ``record`` (a run's
    :meth:`EngineStandIn.describe`) would have on a card of ``capacity`` bytes at ``gpu_memory_utilization``, beside
    the same trainer (its ``trainer_allocated_at_start``). Raises :class:`EngineSettingsError` where no KV cache
    fits (vLLM raises) or the utilization is out of range."""
    engine = ColocatedEngine(record["weights_bytes"], gpu_memory_utilization, record.get("sleep_level"),
                             record.get("flush_before_wake_up", True), record.get("activation_peak_bytes", 0),
                             record.get("cuda_graph_bytes", 0))
    return engine.sizes(capacity, record["trainer_allocated_at_start"])


def with_mapping_sizes(events: list[Event], sizes: dict[str, int]) -> list[Event]:
    """``events`` with every ``EXTERNAL_MAP``/``EXTERNAL_UNMAP`` of a tag in ``sizes`` resized to it (the same
    program beside an engine sized otherwise: :func:`sizes_at`); the list keeps its length and order."""
    return [e._replace(size=sizes[e.name]) if e.action in (EXTERNAL_MAP, EXTERNAL_UNMAP) and e.name in sizes else e
            for e in events]


NEXT_ROLLOUT = "next_rollout"  # the phase colocated_trace appends: the next iteration's wake-up


def colocated_trace(trace: Trace, engine: ColocatedEngine, capacity: int, generate_phase: str = "generate",
                    init_phase: str = "init", next_rollout: bool = True) -> tuple[Trace, dict]:
    """``trace`` (a trainer's recorded iteration) as it runs beside ``engine`` on a device of ``capacity`` bytes;
    returns ``(trace, info)``.

    The engine generates the rollout: the trainer's allocations made and freed inside ``generate_phase`` are
    dropped (those that outlive it, the rollout handed to the trainer, stay). The engine starts as ``init_phase``
    ends (its KV cache sized against the trainer's live bytes then: :meth:`ColocatedEngine.sizes`); in sleep mode
    it wakes up right after each ``generate_phase`` begins and sleeps as it ends; its forward temporaries
    (``activation_peak_bytes``) are one trainer-allocator block across the rollout. ``next_rollout``: a phase
    ``next_rollout`` appended after the last event, the next iteration's rollout beginning (wake-up and the
    engine's forward temporaries) while the trainer's allocator still holds what its training left: the moment
    the seed study's finding is about (one recorded iteration has no other wake-up after training). ``info``: the
    mapping sizes, ``engine_mapped_bytes`` (awake), ``host_bytes_asleep``, ``trainer_allocated_at_start``,
    ``generate_allocations_dropped``. Raises :class:`EngineSettingsError` when the trace has no ``init_phase`` or
    ``generate_phase``, or no KV cache fits."""
    events = trace.events
    phases = [e.name for e in events if e.action == PHASE]
    for need in (init_phase, generate_phase):
        if need not in phases:
            raise EngineSettingsError(f"phase {need!r} is not in the trace: its phases are {', '.join(phases)}")
    # which events belong to generate_phase, and which of its allocations it frees itself
    drop: set[int] = set()
    born: dict[int, int] = {}  # address -> index of its ALLOC, inside the current generate_phase
    requested: set[int] = set()  # dropped blocks freed with record_stream: their FREE follows
    current = None
    for i, e in enumerate(events):
        if e.action == PHASE:
            current, born = e.name, {}
        elif current != generate_phase:
            continue
        elif e.action == ALLOC:
            born[e.addr] = i
        elif e.action in (FREE, FREE_REQUESTED) and e.addr in born:
            drop.update((born.pop(e.addr), i))
            if e.action == FREE_REQUESTED:
                requested.add(e.addr)
        elif e.action == FREE and e.addr in requested:
            requested.discard(e.addr)
            drop.add(i)
    init_end = next(i for i, e in enumerate(events) if e.action == PHASE and e.name != init_phase
                    and any(p.action == PHASE and p.name == init_phase for p in events[:i]))
    trainer_allocated = _live_bytes(events[:init_end])
    sizes = engine.sizes(capacity, trainer_allocated)
    out: list[Event] = []
    in_generate = False
    for i, e in enumerate(events):
        ends_generate = in_generate and (e.action == PHASE or (e.action == PHASE_END and e.name == generate_phase))
        if ends_generate:
            if engine.activation_peak_bytes:
                out.append(Event(FREE, _ENGINE_ALLOC, engine.activation_peak_bytes, time_us=e.time_us))
            if engine.sleep_level is not None:
                out += [x._replace(time_us=e.time_us) for x in engine.sleep_events(sizes)]
            in_generate = False
        if i == init_end:
            out += [x._replace(time_us=e.time_us) for x in engine.start_events(sizes)]
        if i in drop:
            continue
        out.append(e)
        if e.action == PHASE and e.name == generate_phase:
            in_generate = True
            if engine.sleep_level is not None:
                out += [x._replace(time_us=e.time_us) for x in engine.wake_events(sizes)]
            if engine.activation_peak_bytes:
                out.append(Event(ALLOC, _ENGINE_ALLOC, engine.activation_peak_bytes, time_us=e.time_us))
    t = events[-1].time_us if events else 0
    if in_generate:  # the trace ends inside the rollout
        if engine.activation_peak_bytes:
            out.append(Event(FREE, _ENGINE_ALLOC, engine.activation_peak_bytes, time_us=t))
        if engine.sleep_level is not None:
            out += [x._replace(time_us=t) for x in engine.sleep_events(sizes)]
    if next_rollout:
        out.append(Event(PHASE, time_us=t, name=NEXT_ROLLOUT))
        if engine.sleep_level is not None:
            out += [x._replace(time_us=t) for x in engine.wake_events(sizes)]
        if engine.activation_peak_bytes:
            out += [Event(ALLOC, _ENGINE_ALLOC, engine.activation_peak_bytes, time_us=t),
                    Event(FREE, _ENGINE_ALLOC, engine.activation_peak_bytes, time_us=t)]
    info = {**sizes, "engine_mapped_bytes": sum(sizes.values()), "host_bytes_asleep": engine.host_bytes_asleep(sizes),
            "trainer_allocated_at_start": trainer_allocated, "generate_allocations_dropped": len(drop)}
    return (Trace(events=out, initial_segments=trace.initial_segments, allocator_settings=trace.allocator_settings,
                  capture=trace.capture, source=trace.source, device=trace.device), info)


class EngineStandIn:
    """The engine's calls in a recorded run, where the frameworks make them: ``start`` as the trainer's ``init``
    ends (``LLM(...)``, asleep at once in sleep mode), then around each rollout ``with stand_in.rollout():`` (the
    trainer's flush if asked, ``wake_up(["weights"])``, ``wake_up(["kv_cache"])``; the body's allocations made and
    freed inside are the engine's, not the trainer's; ``sleep(level)`` and its ``empty_cache()`` after).

    ``rec``: the rank's recorder (:meth:`~pytest_rlhfmem.record.recorder.Recorder.external_map`, ``external_unmap``,
    ``engine_region``, ``flush``, ``figures_so_far``). ``capacity``: the device's bytes the KV cache is sized
    against. Its mappings are numbers in the trace, never memory: the replay's capacity decides what fits.
    """

    def __init__(self, engine: ColocatedEngine, rec, capacity: int) -> None:
        self.engine, self.rec, self.capacity = engine, rec, capacity
        self.sizes: dict[str, int] | None = None
        self.awake = False

    def start(self) -> dict[str, int]:
        """``LLM(...)``: the mappings sized against the trainer's allocated bytes so far (simulated:
        ``figures_so_far``; 0 where the recorder cannot say), mapped, and put to sleep in sleep mode. Returns the
        sizes. Raises :class:`EngineSettingsError` when no KV cache fits."""
        so_far = self.rec.figures_so_far() if hasattr(self.rec, "figures_so_far") else None
        trainer = int((so_far or {}).get("allocated", 0))
        self.sizes = self.engine.sizes(self.capacity, trainer)
        self.sizes_info = {**self.sizes, "trainer_allocated_at_start": trainer}
        self._apply(self.engine.start_events(self.sizes))
        self.awake = self.engine.sleep_level is None
        return self.sizes

    def describe(self) -> dict:
        """What the engine was, for the result's recipe record and ``rlhfmem advise``'s utilization search (bytes):
        its settings, the card ``capacity``, the mapping sizes and ``trainer_allocated_at_start`` (what vLLM's
        profile run counted besides its own weights and temporaries: :meth:`ColocatedEngine.sizes`)."""
        assert self.sizes is not None, "EngineStandIn.describe before start"
        e = self.engine
        return {"engine": "vLLM sleep mode (stand-in, rollout/engine.py)", "capacity": self.capacity,
                "gpu_memory_utilization": e.gpu_memory_utilization, "sleep_level": e.sleep_level,
                "flush_before_wake_up": e.flush_before_wake_up, "weights_bytes": e.weights_bytes,
                "activation_peak_bytes": e.activation_peak_bytes, "cuda_graph_bytes": e.cuda_graph_bytes,
                "mappings": dict(self.sizes),
                "trainer_allocated_at_start": self.sizes_info["trainer_allocated_at_start"]}

    @contextlib.contextmanager
    def rollout(self) -> Iterator[None]:
        """One rollout: wake up (in sleep mode), the body in the engine's region, sleep again."""
        assert self.sizes is not None, "EngineStandIn.rollout before start"
        if not self.awake:
            self._apply(self.engine.wake_events(self.sizes))
        with self.rec.engine_region():
            yield
        if self.engine.sleep_level is not None:
            self._apply(self.engine.sleep_events(self.sizes))
            self.awake = False
        else:
            self.awake = True

    def wake_up(self) -> None:
        """The next rollout's wake-up alone (a recorded run is one iteration: this is the moment after training
        that the next one begins with, phase :data:`NEXT_ROLLOUT` in the recipe)."""
        assert self.sizes is not None, "EngineStandIn.wake_up before start"
        if not self.awake:
            self._apply(self.engine.wake_events(self.sizes))
            self.awake = True

    def _apply(self, events: list[Event]) -> None:
        for e in events:
            if e.action == EXTERNAL_MAP:
                self.rec.external_map(e.addr, e.size, e.name)
            elif e.action == EXTERNAL_UNMAP:
                self.rec.external_unmap(e.addr, e.size, e.name)
            elif e.action == FLUSH:
                self.rec.flush(e.name)
