"""Device memory mapped outside the caching allocator (``EXTERNAL_MAP``/``EXTERNAL_UNMAP``, memory/events.py):
a colocated rollout engine's mappings lower what the trainer's cudaMalloc can have, a mapping the device cannot
back is an OOM that releases nothing of the trainer's cache, and the compiled core hands such traces to Python."""

from __future__ import annotations

from pytest_rlhfmem.memory.allocator import MiB
from pytest_rlhfmem.memory.columns import ACTIONS, OTHER, as_columns
from pytest_rlhfmem.memory.events import (
    ALLOC, EXTERNAL_MAP, EXTERNAL_UNMAP, FLUSH, FREE, PHASE, Event, Trace,
)
from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.memory.replay_engine import engine_for
from pytest_rlhfmem.memory.allocator import AllocatorConfig


def _trainer_then_wake(flush: bool) -> Trace:
    """The trainer allocates and frees 60 MiB (cached afterwards), then the engine maps 50 MiB of KV cache on a
    100 MiB device, then the trainer allocates 30 MiB."""
    ev = [Event(PHASE, name="train_actor"), Event(ALLOC, 1, 60 * MiB), Event(FREE, 1, 60 * MiB),
          Event(PHASE, name="generate")]
    if flush:
        ev.append(Event(FLUSH, name="before-wake-up"))
    ev += [Event(EXTERNAL_MAP, 1, 50 * MiB, name="kv_cache"), Event(ALLOC, 2, 30 * MiB),
           Event(EXTERNAL_UNMAP, 1, 50 * MiB, name="kv_cache")]
    return Trace(events=ev)


def test_wake_up_fails_against_the_trainers_cache_and_fits_after_a_flush():
    held = replay(_trainer_then_wake(flush=False), capacity=100 * MiB)
    assert held.total.ooms == 1
    assert [(f["name"], f["bytes"], f["phase"], f["reserved"]) for f in held.external_map_failures] == [
        ("kv_cache", 50 * MiB, "generate", 60 * MiB)]
    assert held.external_peak == 0
    assert held.total.alloc_retries == 0  # the 30 MiB came from the trainer's own cache
    flushed = replay(_trainer_then_wake(flush=True), capacity=100 * MiB)
    assert flushed.total.ooms == 0 and flushed.external_map_failures == []
    assert flushed.external_peak == 50 * MiB
    assert flushed.peak_device_used == 50 * MiB + 30 * MiB  # 60 before the flush is lower than 80 after
    unlimited = replay(_trainer_then_wake(flush=False))
    assert unlimited.total.ooms == 0 and unlimited.external_peak == 50 * MiB
    assert unlimited.peak_device_used == 110 * MiB


def test_the_trainer_retries_while_the_engine_is_mapped():
    """With the engine awake, a trainer request its cache cannot serve fails cudaMalloc, releases the cache
    (``release_cached_blocks``) and retries: ``num_alloc_retries``."""
    ev = [Event(PHASE, name="generate"), Event(EXTERNAL_MAP, 7, 40 * MiB, name="weights"),
          Event(ALLOC, 1, 40 * MiB), Event(FREE, 1, 40 * MiB), Event(ALLOC, 2, 50 * MiB)]
    r = replay(Trace(events=ev), capacity=100 * MiB)
    assert r.total.alloc_retries == 1 and r.total.ooms == 0
    assert r.peak_device_used == 90 * MiB
    r = replay(Trace(events=ev), capacity=85 * MiB)
    assert r.total.ooms == 1  # 40 mapped outside + 50 do not fit in 85 even with the cache released


def test_columns_carry_external_events_and_the_compiled_core_declines_them():
    assert EXTERNAL_MAP in ACTIONS and EXTERNAL_UNMAP in ACTIONS and OTHER == len(ACTIONS)
    cols = as_columns(_trainer_then_wake(flush=False))
    assert cols.has_external_mappings()
    name, why = engine_for(cols, AllocatorConfig(), "free-running", requested="auto")
    assert name == "python" and "outside the caching allocator" in why
    assert not as_columns(Trace(events=[Event(ALLOC, 1, MiB)])).has_external_mappings()
