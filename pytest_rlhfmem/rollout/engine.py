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

Which vLLM (``ColocatedEngine.vllm``, :data:`VLLM_VERSIONS`): the KV cache's sizing rule and what the sleep pool does
with ``expandable_segments:True`` changed between the commits read (docs/incidents.md, incidents 2 and 3):

- ``0012cf6`` (the default, as above): ``total * gpu_memory_utilization - (allocated_bytes.all.peak + non-torch)``,
  the process's torch peak over the profile run: a colocated trainer's live tensors shrink the KV cache.
- ``35d5cda`` (``gpu_worker.py``) with ``vllm/utils/mem_utils.py`` at ``a6d5c39``: ``init_device`` snapshots the
  device (``MemorySnapshot``: ``torch.cuda.mem_get_info``, ``memory_reserved``) and raises unless its free memory
  covers ``total * gpu_memory_utilization`` (``requested_memory``); ``determine_available_memory`` returns
  ``requested_memory - non_kv_cache_memory``, where ``memory_profiling`` counts the weights
  (``model_memory_usage``), the torch peak's increase over the profile run alone (``reset_peak_memory_stats`` then
  ``before_profile.measure()``) and the non-torch increase since the init snapshot: what the process held before
  the engine started no longer counts, so beside a colocated trainer the KV cache is larger by the trainer's live
  bytes. ``CacheConfig.kv_cache_memory_bytes`` (vLLM PR 21489) skips the profiling and is the KV cache.
- ``9ac9658`` (``vllm/device_allocator/cumem.py`` of vLLM PR 11743, the first sleep mode; sizing as ``0012cf6``):
  ``use_memory_pool`` does not touch ``expandable_segments``, and PyTorch's ``alloc_block`` (c10/cuda/
  CUDACachingAllocator.cpp at 001074d, torch 2.6) takes the expandable-segments branch before the pool's
  pluggable allocator: ``try_allocate_expandable_block`` maps the memory itself, so ``python_malloc_callback`` never
  records it and ``sleep`` unmaps nothing ("Sleep mode freed 0.00 GiB", vLLM PR 11743's thread, PyTorch issue
  147851). With ``expandable_segments`` in the engine's process, its weights and KV cache are then the caching
  allocator's expandable segments in the engine's ``MemPool``s, held through every sleep. From cumem.py at
  ``010c211`` (the ``0012cf6`` and ``35d5cda`` rows) ``use_memory_pool`` sets ``expandable_segments:False`` inside the
  pool and restores it after.
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
# with expandable_segments where the sleep pool does not turn them off (VllmRules.expandable_segments_in_pool
# "bypass"): the caching allocator's own segments in the engine's MemPools, which sleep never releases
WEIGHTS_EXPANDABLE = "weights@expandable_segment"
KV_CACHE_EXPANDABLE = "kv_cache@expandable_segment"
_MAP_ID = {WEIGHTS: 1, KV_CACHE: 2, CUDA_GRAPH: 3, WEIGHTS_EXPANDABLE: 4, KV_CACHE_EXPANDABLE: 5}
_HELD_AS = {WEIGHTS: WEIGHTS_EXPANDABLE, KV_CACHE: KV_CACHE_EXPANDABLE}
_ENGINE_ALLOC = 1 << 62  # the engine's forward temporaries: an address no recorded tensor has
FLUSH_BEFORE_WAKE_UP = "before-wake-up"  # FLUSH names this module writes
FLUSH_AT_SLEEP = "engine-sleep"  # CuMemAllocator.sleep's own torch.cuda.empty_cache()


class EngineSettingsError(ValueError):
    """A colocated engine setting out of range; the message is one line naming the allowed values."""


def _round_up(size: int) -> int:
    return -(-size // MAPPING_GRANULARITY) * MAPPING_GRANULARITY


TORCH_PEAK = "torch-peak"  # KV cache = total * utilization - (the process's allocated peak + non-torch)
INIT_SNAPSHOT = "init-snapshot"  # KV cache = total * utilization - what the engine added since its init snapshot


@dataclass(frozen=True)
class VllmRules:
    """What one vLLM version decides about the engine's device memory, read at the commits ``source`` names.

    ``sizing``: :data:`TORCH_PEAK` or :data:`INIT_SNAPSHOT` (:meth:`ColocatedEngine.sizes`).
    ``kv_cache_memory_bytes``: whether ``CacheConfig.kv_cache_memory_bytes`` exists (vLLM PR 21489).
    ``expandable_segments_in_pool``: ``"off"`` (``use_memory_pool`` turns them off inside the sleep pool) or
    ``"bypass"`` (the pool never sees the memory: sleep releases nothing)."""

    commit: str
    sizing: str
    kv_cache_memory_bytes: bool
    expandable_segments_in_pool: str
    source: str


VLLM_VERSIONS: dict[str, VllmRules] = {r.commit: r for r in (
    VllmRules("0012cf6", TORCH_PEAK, False, "off",
              "vllm/v1/worker/gpu_worker.py at 0012cf6 (determine_available_memory), vllm/device_allocator/cumem.py "
              "at 010c211 (use_memory_pool)"),
    VllmRules("35d5cda", INIT_SNAPSHOT, True, "off",
              "vllm/v1/worker/gpu_worker.py at 35d5cda (init_device, determine_available_memory), "
              "vllm/utils/mem_utils.py at a6d5c39 (MemorySnapshot, memory_profiling), cumem.py at 010c211"),
    VllmRules("9ac9658", TORCH_PEAK, False, "bypass",
              "vllm/device_allocator/cumem.py at 9ac9658 (vLLM PR 11743), c10/cuda/CUDACachingAllocator.cpp at "
              "001074d (alloc_block); sizing as 0012cf6"),
)}
DEFAULT_VLLM = "0012cf6"  # the rules this module followed before more than one version was modelled


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


def check_free_at_init(capacity: int, gpu_memory_utilization: float, used_bytes: int) -> None:
    """vLLM's start check from ``init_device`` on (``35d5cda``): the device's free memory at the engine's init
    snapshot (``capacity - used_bytes``) must cover ``requested_memory = capacity * gpu_memory_utilization``, else
    it raises. ``used_bytes``: what the process holds then (the trainer's live tensors; vLLM's ``empty_cache()``
    before the snapshot cannot release them). Raises :class:`EngineSettingsError` in vLLM's words."""
    requested = capacity * gpu_memory_utilization
    free = capacity - used_bytes
    if free < requested:
        gib = 2**30
        raise EngineSettingsError(
            f"Free memory on device ({free / gib:.2f}/{capacity / gib:.2f} GiB) on startup is less than desired GPU "
            f"memory utilization ({gpu_memory_utilization}, {requested / gib:.2f} GiB): the trainer holds "
            f"{used_bytes} bytes when the engine starts (lower gpu_memory_utilization)")


@dataclass(frozen=True)
class ColocatedEngine:
    """A vLLM engine in the trainer's process (TRL's ``vllm_mode="colocate"``).

    ``weights_bytes``: the engine's copy of the policy (bytes, in its dtype). ``gpu_memory_utilization``: vLLM's
    setting, in (0, 1]. ``sleep_level``: 1 or 2 (``vllm_enable_sleep_mode``), ``None``: the engine never sleeps.
    ``flush_before_wake_up``: the trainer's ``torch.cuda.empty_cache()`` right before ``wake_up`` (TRL's
    ``sync_weights``). ``activation_peak_bytes``: the engine's forward temporaries (the profile run's peak above
    the weights), allocated by the trainer's caching allocator during a rollout. ``cuda_graph_bytes``: the CUDA
    graphs' private pool (0: ``enforce_eager``), mapped at start and never released by sleep.
    ``vllm``: whose rules (a key of :data:`VLLM_VERSIONS`, default :data:`DEFAULT_VLLM`). ``kv_cache_memory_bytes``:
    vLLM's pin of the KV cache (bytes; ``None``: sized from the utilization), where the version has it.
    ``expandable_segments``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in the engine's process.
    Raises :class:`EngineSettingsError` for a setting out of range, one line naming the allowed values."""

    weights_bytes: int
    gpu_memory_utilization: float = 0.3  # TRL's vllm_gpu_memory_utilization default (grpo_config.py)
    sleep_level: int | None = 1
    flush_before_wake_up: bool = True
    activation_peak_bytes: int = 0
    cuda_graph_bytes: int = 0
    vllm: str = DEFAULT_VLLM
    kv_cache_memory_bytes: int | None = None
    expandable_segments: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineSettingsError(f"gpu_memory_utilization {self.gpu_memory_utilization!r}: allowed values are "
                                      "in (0, 1]")
        if self.sleep_level is not None and self.sleep_level not in SLEEP_LEVELS:
            raise EngineSettingsError(f"sleep level {self.sleep_level!r}: allowed values are 1, 2 or None (no sleep)")
        for name in ("weights_bytes", "activation_peak_bytes", "cuda_graph_bytes"):
            if getattr(self, name) < 0:
                raise EngineSettingsError(f"{name} {getattr(self, name)}: allowed values are 0 or more bytes")
        if self.vllm not in VLLM_VERSIONS:
            raise EngineSettingsError(f"vllm {self.vllm!r}: allowed values are {', '.join(VLLM_VERSIONS)} (the commits "
                                      "whose rules are modelled)")
        pin = self.kv_cache_memory_bytes
        if pin is not None:
            if isinstance(pin, bool) or not isinstance(pin, int) or pin < MAPPING_GRANULARITY:
                raise EngineSettingsError(f"kv_cache_memory_bytes {pin!r}: allowed values are whole bytes, at least "
                                          f"{MAPPING_GRANULARITY} (2 MiB), or None")
            if not self.rules.kv_cache_memory_bytes:
                with_pin = ", ".join(c for c, r in VLLM_VERSIONS.items() if r.kv_cache_memory_bytes)
                raise EngineSettingsError(f"kv_cache_memory_bytes: vLLM {self.vllm} has no such setting (vLLM PR "
                                          f"21489); allowed with vllm {with_pin}")

    @property
    def rules(self) -> VllmRules:
        return VLLM_VERSIONS[self.vllm]

    @property
    def holds_through_sleep(self) -> bool:
        """Whether sleep leaves the weights and KV cache mapped: ``expandable_segments`` in the engine's process
        where the version's sleep pool does not turn them off (``9ac9658``)."""
        return self.expandable_segments and self.rules.expandable_segments_in_pool == "bypass"

    def sizes(self, capacity: int, trainer_allocated: int) -> dict[str, int]:
        """The bytes each mapping takes on a device of ``capacity`` bytes when the engine starts beside a trainer
        holding ``trainer_allocated`` bytes of live tensors: ``{weights, kv_cache, cuda_graph}`` (2 MiB multiples),
        and where sleep releases nothing (:attr:`holds_through_sleep`) ``weights``/``kv_cache`` 0 (the sleep pool
        records nothing) and the same bytes as ``weights@expandable_segment``/``kv_cache@expandable_segment`` (the
        segments' own 2 MiB / 20 MiB pages are not modelled: at most 20 MiB more per pool). The KV cache by
        :attr:`rules`: :data:`TORCH_PEAK` subtracts the trainer's live bytes with the engine's weights and
        temporaries (:func:`kv_cache_bytes`); :data:`INIT_SNAPSHOT` checks the free memory at init
        (:func:`check_free_at_init`) and subtracts the engine's own bytes only, or takes ``kv_cache_memory_bytes``
        (rounded down to 2 MiB). Raises :class:`EngineSettingsError` when no KV cache fits
        or the start check fails."""
        weights = _round_up(self.weights_bytes)
        if self.rules.sizing == INIT_SNAPSHOT:
            check_free_at_init(capacity, self.gpu_memory_utilization, trainer_allocated)
            if self.kv_cache_memory_bytes is not None:
                kv = self.kv_cache_memory_bytes // MAPPING_GRANULARITY * MAPPING_GRANULARITY
            else:
                kv = kv_cache_bytes(capacity, self.gpu_memory_utilization, weights + self.activation_peak_bytes)
        else:
            kv = kv_cache_bytes(capacity, self.gpu_memory_utilization,
                                trainer_allocated + weights + self.activation_peak_bytes)
        out = {WEIGHTS: weights, KV_CACHE: kv, CUDA_GRAPH: _round_up(self.cuda_graph_bytes)}
        if self.holds_through_sleep:
            for tag in (WEIGHTS, KV_CACHE):
                out[_HELD_AS[tag]], out[tag] = out[tag], 0
        return out

    def host_bytes_asleep(self, sizes: dict[str, int]) -> int:
        """Pinned host bytes the engine holds while asleep: the weights at level 1, nothing at level 2 or awake."""
        return sizes[WEIGHTS] if self.sleep_level == 1 else 0

    def _cumem_tags(self, sizes: dict[str, int]) -> list[str]:
        """The sleep pool's tags that have mappings: all of them where sleep releases nothing (0 bytes each, so that
        the trace keeps where the engine slept and woke up), else those with bytes."""
        return [t for t in (WEIGHTS, KV_CACHE) if sizes[t] or self.holds_through_sleep]

    # -- events -------------------------------------------------------------------------------

    def start_events(self, sizes: dict[str, int]) -> list[Event]:
        """``LLM(...)``: weights, then KV cache, then the CUDA graphs (where sleep releases nothing, the sleep pool's
        empty records and then the expandable segments that hold the memory); asleep at once in sleep mode (TRL)."""
        tags = [*self._cumem_tags(sizes), *(t for t in (WEIGHTS_EXPANDABLE, KV_CACHE_EXPANDABLE, CUDA_GRAPH)
                                           if sizes.get(t))]
        out = [Event(EXTERNAL_MAP, _MAP_ID[t], sizes[t], name=t) for t in tags]
        return out + (self.sleep_events(sizes) if self.sleep_level is not None else [])

    def sleep_events(self, sizes: dict[str, int]) -> list[Event]:
        """``sleep(level)``: every CuMemAllocator mapping released (both levels), then ``empty_cache()``."""
        return [Event(EXTERNAL_UNMAP, _MAP_ID[t], sizes[t], name=t) for t in self._cumem_tags(sizes)] + [
            Event(FLUSH, name=FLUSH_AT_SLEEP)]

    def wake_events(self, sizes: dict[str, int]) -> list[Event]:
        """The trainer's flush if asked, then ``wake_up(["weights"])`` and ``wake_up(["kv_cache"])``."""
        out = [Event(FLUSH, name=FLUSH_BEFORE_WAKE_UP)] if self.flush_before_wake_up else []
        return out + [Event(EXTERNAL_MAP, _MAP_ID[t], sizes[t], name=t) for t in self._cumem_tags(sizes)]


def _live_bytes(events: list[Event]) -> int:
    """Requested bytes live after ``events``, each rounded to the allocator's blocks (kMinBlockSize, 512 B)."""
    live: dict[int, int] = {}
    for e in events:
        if e.action == ALLOC:
            live[e.addr] = max(kMinBlockSize, -(-e.size // kMinBlockSize) * kMinBlockSize)
        elif e.action in (FREE, FREE_REQUESTED):
            live.pop(e.addr, None)
    return sum(live.values())


_KEEP = object()


def engine_of(record: dict, gpu_memory_utilization: float | None = None, kv_cache_memory_bytes=_KEEP,
              expandable_segments: bool | None = None) -> ColocatedEngine:
    """The :class:`ColocatedEngine` of ``record`` (a run's :meth:`EngineStandIn.describe`; a record written before
    the vLLM versions were modelled is :data:`DEFAULT_VLLM`'s), with any of ``gpu_memory_utilization``,
    ``kv_cache_memory_bytes`` (bytes, or ``None``: unpinned) and ``expandable_segments`` replaced. Raises
    :class:`EngineSettingsError` for a setting out of range."""
    return ColocatedEngine(
        record["weights_bytes"],
        record["gpu_memory_utilization"] if gpu_memory_utilization is None else gpu_memory_utilization,
        record.get("sleep_level"), record.get("flush_before_wake_up", True), record.get("activation_peak_bytes", 0),
        record.get("cuda_graph_bytes", 0), record.get("vllm", DEFAULT_VLLM),
        record.get("kv_cache_memory_bytes") if kv_cache_memory_bytes is _KEEP else kv_cache_memory_bytes,
        record.get("expandable_segments", False) if expandable_segments is None else expandable_segments)


def sizes_at(record: dict, capacity: int, gpu_memory_utilization: float, kv_cache_memory_bytes=_KEEP,
             expandable_segments: bool | None = None) -> dict[str, int]:
    """The mapping sizes (bytes, by tag: :meth:`ColocatedEngine.sizes`) the engine of ``record`` (a run's
    :meth:`EngineStandIn.describe`) would have on a card of ``capacity`` bytes at ``gpu_memory_utilization``, beside
    the same trainer (its ``trainer_allocated_at_start``), under the record's vLLM rules; ``kv_cache_memory_bytes``
    and ``expandable_segments`` as in :func:`engine_of`; :data:`ALL_TAGS_ZERO` updated with it resizes every
    mapping a run could have made. Raises :class:`EngineSettingsError` where no KV cache fits or vLLM's start check
    fails (vLLM raises) or a setting is out of range."""
    return engine_of(record, gpu_memory_utilization, kv_cache_memory_bytes, expandable_segments).sizes(
        capacity, record["trainer_allocated_at_start"])


ALL_TAGS_ZERO = {WEIGHTS_EXPANDABLE: 0, KV_CACHE_EXPANDABLE: 0}  # the tags a size dict may leave out, at 0 bytes


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
        profile run counted besides its own weights and temporaries: :meth:`ColocatedEngine.sizes`); the vLLM rules
        (``vllm``, ``kv_cache_sizing``, ``kv_cache_memory_bytes``, ``expandable_segments``), what each sleep
        unmaps (``sleep_frees_bytes``, 0 is vLLM's "Sleep mode freed 0.00 GiB") and what it cannot
        (``held_through_sleep_bytes``)."""
        assert self.sizes is not None, "EngineStandIn.describe before start"
        e = self.engine
        return {"engine": "vLLM sleep mode (stand-in, rollout/engine.py)", "capacity": self.capacity,
                "gpu_memory_utilization": e.gpu_memory_utilization, "sleep_level": e.sleep_level,
                "flush_before_wake_up": e.flush_before_wake_up, "weights_bytes": e.weights_bytes,
                "activation_peak_bytes": e.activation_peak_bytes, "cuda_graph_bytes": e.cuda_graph_bytes,
                "vllm": e.vllm, "kv_cache_sizing": e.rules.sizing, "kv_cache_memory_bytes": e.kv_cache_memory_bytes,
                "expandable_segments": e.expandable_segments,
                "sleep_frees_bytes": self.sizes[WEIGHTS] + self.sizes[KV_CACHE],
                "held_through_sleep_bytes": sum(self.sizes.get(t, 0) for t in _HELD_AS.values()),
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


def without_engine_expandable_segments(events: list[Event], record: dict, capacity: int) -> list[Event]:
    """``events`` (a run whose engine held its memory through sleep: ``record["held_through_sleep_bytes"]``) as the
    same program runs with ``expandable_segments:True`` stripped from the engine's process (OpenRLHF PR 1274) or a
    vLLM whose ``use_memory_pool`` turns it off: the sleep pool's mappings get the bytes (:func:`sizes_at` without
    expandable segments, on a card of ``capacity`` bytes), the expandable segments none. The list keeps its length
    and order (the empty sleep-pool records mark where the engine slept and woke up)."""
    return with_mapping_sizes(events, {**ALL_TAGS_ZERO, **sizes_at(record, capacity, record["gpu_memory_utilization"],
                                                                    expandable_segments=False)})


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def oom_causes(result: dict) -> list[str]:
    """One line per rank and phase with OOMs in ``result`` (a run's result JSON, its ``ranks`` each with
    ``phases``, ``external_map_failures`` and the recipe's ``rollout_engine`` record): a colocated engine's wake-up
    that the card could not back (which mapping, bytes, what the trainer reserved and the engine held then, and how
    that vLLM sized its KV cache), or the trainer's allocations failing beside what the engine held (and why sleep
    released nothing, where it did not). ``[]`` without OOMs. Sizes in the lines are MiB (simulated figures)."""
    lines = []
    for rank in result.get("ranks") or []:
        record = (rank.get("recipe") or {}).get("rollout_engine")
        failures = rank.get("external_map_failures") or []
        by_phase: dict[str, int] = {}
        for f in failures:
            by_phase[f["phase"]] = by_phase.get(f["phase"], 0) + 1
        who = f"rank {rank.get('rank', 0)}: " if len(result.get("ranks") or []) > 1 else ""
        sizing = ""
        if record:
            kv = record["mappings"].get(KV_CACHE) or record["mappings"].get(KV_CACHE_EXPANDABLE, 0)
            how = (f"kv_cache_memory_bytes={record['kv_cache_memory_bytes']}" if record.get("kv_cache_memory_bytes")
                   else f"gpu_memory_utilization {record['gpu_memory_utilization']}")
            sizing = (f"; vLLM {record.get('vllm', DEFAULT_VLLM)}'s {record.get('kv_cache_sizing', TORCH_PEAK)} rule "
                      f"sized its KV cache {_mib(kv)} at {how} beside the trainer's "
                      f"{_mib(record['trainer_allocated_at_start'])} at its start")
        for f in failures:
            card = f" on a {_mib(f['capacity'])} card" if f.get("capacity") else ""
            lines.append(f"{who}OOM in phase {f['phase']}: the colocated engine's wake_up could not map {f['name']} "
                         f"({_mib(f['bytes'])}) beside {_mib(f['reserved'])} the trainer reserved and "
                         f"{_mib(f['external'])} the engine held{card}{sizing}")
        for p in rank.get("phases") or []:
            trainer = p.get("ooms", 0) - by_phase.get(p["phase"], 0)
            if trainer <= 0:
                continue
            line = f"{who}{trainer} OOM(s) in phase {p['phase']}: the trainer's cudaMalloc failed"
            if record:
                held = record.get("held_through_sleep_bytes", 0)
                line += f" beside the colocated engine ({_mib(record['capacity'])} card)"
                if held and record.get("sleep_level") is not None:
                    line += (f", which still held {_mib(held)} after its sleep: sleep freed "
                             f"{_mib(record.get('sleep_frees_bytes', 0))} (PYTORCH_CUDA_ALLOC_CONF="
                             f"expandable_segments:True in the engine's process, whose MemPool vLLM "
                             f"{record.get('vllm', DEFAULT_VLLM)}'s CuMemAllocator never sees: strip it from the "
                             "engine's environment)")
                elif record.get("sleep_level") is None:
                    line += ", which never sleeps"
            lines.append(line)
    return lines
