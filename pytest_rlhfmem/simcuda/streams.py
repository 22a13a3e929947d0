"""CUDA streams and events where no GPU runs anything: the stand-ins both simulated routes install as
``torch.cuda.Stream`` / ``torch.cuda.Event`` (the simulated device, ``torch_cuda.py``; the fake-CUDA route,
``fakecuda/standins.py``).

A stream is an id: allocations made while it is current carry it (the allocator model keeps one pool per
stream, as ``CUDACachingAllocator.cpp`` does). Records and waits do nothing and ``elapsed_time`` is 0.0 ms (no
GPU time exists). Where a route models ``record_stream`` until the host next waits (``library.py:
RECORD_STREAM_MODES``), :func:`set_host_waits` gives it the host's waits: ``Stream.synchronize`` and
``Event.synchronize`` report the stream waited for (``ALL_STREAMS``, -1: every stream).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from .library import ALL_STREAMS  # a wait for every stream (torch.cuda.synchronize; an event never recorded)

_ids = itertools.count(1)
_host_waits: Callable[[int], None] | None = None


def set_host_waits(log: Callable[[int], None] | None) -> None:
    """Report the host's waits to ``log(stream_id)`` from now on (None: report none)."""
    global _host_waits
    _host_waits = log


def host_waits(stream_id: int) -> None:
    """The host waits for ``stream_id`` (-1: every stream): reported where a route asked (:func:`set_host_waits`)."""
    if _host_waits is not None:
        _host_waits(stream_id)


class Stream:
    """A CUDA stream stand-in: an id that the device (or recorder) attaches to allocations made under it."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.stream_id = next(_ids)
        self.priority = priority

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cuda", 0)

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        host_waits(self.stream_id)

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("Stream", self.stream_id))

    def __repr__(self) -> str:
        return f"Stream(id={self.stream_id})"


class Event:
    """A CUDA event stand-in: remembers the stream it was recorded on; waits are no-ops; elapsed time is 0.0."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.stream_id = ALL_STREAMS  # not recorded yet: a wait for it waits for nothing known, so for every stream

    def record(self, stream: Any = None) -> None:
        import torch

        self.stream_id = getattr(stream if stream is not None else torch.cuda.current_stream(), "stream_id",
                                 ALL_STREAMS)

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        host_waits(self.stream_id)

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _DefaultStream(Stream):
    def __init__(self) -> None:
        super().__init__()
        self.stream_id = 0


DEFAULT_STREAM: Stream = _DefaultStream()
STREAMS: dict[int, Stream] = {0: DEFAULT_STREAM}  # every stream made current so far, by id


def current_stream_of(stream_id: int) -> Stream:
    """The stream object with id ``stream_id`` that was made current (the default stream if none)."""
    return STREAMS.get(stream_id, DEFAULT_STREAM)


@contextlib.contextmanager
def device_stream(lib: Any, stream: Any) -> Iterator[None]:
    """``torch.cuda.stream(s)`` on the simulated device (``lib``: its loaded library): the device's allocations
    carry ``s``'s id inside."""
    if stream is None:
        yield
        return
    STREAMS[stream.stream_id] = stream
    old = lib.rlhfmem_sim_cuda_stream()
    lib.rlhfmem_sim_cuda_set_stream(stream.stream_id)
    try:
        yield
    finally:
        lib.rlhfmem_sim_cuda_set_stream(old)
