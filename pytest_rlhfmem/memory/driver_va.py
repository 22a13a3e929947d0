"""Where the CUDA driver maps each ``cudaMalloc``: the segment placement of a free-running replay.

Which block the caching allocator reuses depends on addresses: among free blocks of the best-fitting size it
takes the lowest (``BlockComparatorSize``: stream, size, address; ``c10/cuda/CUDACachingAllocator.cpp``). So
the peak reserved of a program can depend on where the driver put its segments (``address_order.py``
measures how much). Two placements:

``above-last`` (the model's default)
    every new segment above the previous one: creation order is address order.
``first-fit``
    what the segments of two GPU recordings of one machine show (``../shared/snapshots``
    wedson_medium_128_inference and wedson_medium_256_training: 98 and 495 segments): the driver maps a
    ``cudaMalloc`` at the lowest free address range that fits, in 2 MiB granules, segment after segment with no
    gap, and reuses what ``cudaFree`` gave back. Below the program's first segment lies a range the CUDA
    context holds (``context_reserve`` bytes: 188 MiB on that machine, read off the inference recording: its
    lowest segment sits 188 MiB below the embedding's, the program's first). The context gives it back when
    the program's first cuBLAS handle is created (before that handle's workspace is allocated): in both
    recordings every segment made after that moment fills the range from its bottom up, and the rest go above.
    The training recording's 495 segment addresses all follow from this rule and the program's allocation
    sequence, given also three other ranges the driver maps outside the caching allocator (2 MiB before the
    first step, 240 MiB when the first cuBLAS handle is created, 8 MiB at the second), which only shift the
    segments above them and so change no choice of the allocator; they are not modelled
    (``python -m studies.driver_layout`` replays with them: 495 of 495 addresses).

The context's range is released by :meth:`FirstFitAddressSpace.cublas_handle_created`, which the replay
calls at the first ALLOC named :data:`~.events.CUBLAS_WORKSPACE` (the simulated CUDA device names its
workspaces; a trace without such a name never releases it, and a ``context_reserve`` of 0, the default, has
nothing to release). The sizes are the driver's and the GPU's: another machine's are read the same way off
one of its recordings. Sizes are bytes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from sortedcontainers import SortedList

ABOVE_LAST = "above-last"
FIRST_FIT = "first-fit"
PLACEMENTS = (ABOVE_LAST, FIRST_FIT)
# a capture's placement (``rlhfmem capture --segment-placement`` sets it for the run's processes)
ENV_SEGMENT_PLACEMENT = "RLHFMEM_SEGMENT_PLACEMENT"
GRANULE = 2 << 20  # every segment address in the recordings is a multiple of 2 MiB
BASE = 1 << 56  # far above real CUDA virtual addresses, as the model's synthetic ones
_SIZE = re.compile(r"^(\d+)\s*(B|KiB|MiB|GiB)?$")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
SPEC_FORMS = "above-last, first-fit, or first-fit:SIZE (the context's reserved range: bytes, or with KiB/MiB/GiB)"


@dataclass(frozen=True)
class SegmentPlacement:
    """How new segments get addresses: ``kind`` (:data:`PLACEMENTS`) and, for ``first-fit``, the bytes of
    the range the CUDA context holds below the first segment until the first cuBLAS handle
    (``context_reserve``, a multiple of 2 MiB after rounding up)."""

    kind: str = ABOVE_LAST
    context_reserve: int = 0

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"segment placement {self.kind!r}: allowed values are {SPEC_FORMS}")
        if self.context_reserve < 0 or (self.context_reserve and self.kind != FIRST_FIT):
            raise ValueError(f"segment placement {self.spec()!r}: a context reserve (>= 0 bytes) goes with "
                             f"first-fit only; allowed values are {SPEC_FORMS}")

    @classmethod
    def parse(cls, spec: str | None, where: str = "segment placement") -> SegmentPlacement:
        """``above-last`` / ``first-fit`` / ``first-fit:188MiB`` (``None`` or empty: the default). Raises
        ``ValueError`` naming ``where`` and the allowed forms."""
        if not spec or not spec.strip():
            return cls()
        kind, _, size = spec.strip().partition(":")
        try:
            if not size:
                return cls(kind)
            m = _SIZE.match(size.strip())
            if m is None:
                raise ValueError(f"size {size!r}")
            return cls(kind, -(-int(m.group(1)) * _UNITS[m.group(2)] // GRANULE) * GRANULE)
        except ValueError:
            raise ValueError(f"{where} {spec!r}: allowed values are {SPEC_FORMS}") from None

    @classmethod
    def from_env(cls) -> SegmentPlacement:
        """The placement ``$RLHFMEM_SEGMENT_PLACEMENT`` names (unset: the default). Raises ``ValueError`` as
        :meth:`parse` does, naming the variable."""
        return cls.parse(os.environ.get(ENV_SEGMENT_PLACEMENT), f"${ENV_SEGMENT_PLACEMENT}")

    def spec(self) -> str:
        """The string :meth:`parse` reads back (sizes in bytes)."""
        return f"{self.kind}:{self.context_reserve}" if self.context_reserve else self.kind

    def address_space(self) -> FirstFitAddressSpace | None:
        """A fresh :class:`FirstFitAddressSpace` for ``first-fit``, ``None`` for ``above-last``."""
        return FirstFitAddressSpace(self.context_reserve) if self.kind == FIRST_FIT else None


class FirstFitAddressSpace:
    """The driver's virtual address ranges for ``cudaMalloc`` (``first-fit``, see the module docstring).

    ``holes`` are the free ranges below ``top`` as ``(address, size)``, sorted; :meth:`map` takes the lowest
    that fits, else maps at ``top``. The context's range ``[BASE, BASE + context_reserve)`` is mapped first.
    """

    def __init__(self, context_reserve: int = 0) -> None:
        self.holes: SortedList = SortedList()
        self.top = BASE
        self.mapped: dict[int, int] = {}  # address -> bytes of each live mapping made here
        self.context_range: tuple[int, int] | None = None
        if context_reserve:
            self.context_range = (self.map(context_reserve), context_reserve)

    def map(self, size: int) -> int:
        """The address of a new mapping of ``size`` bytes (rounded up to :data:`GRANULE`)."""
        size = -(-size // GRANULE) * GRANULE
        for i, (addr, hole) in enumerate(self.holes):
            if hole >= size:
                del self.holes[i]
                if hole > size:
                    self.holes.add((addr + size, hole - size))
                break
        else:
            addr = self.top
            self.top += size
        self.mapped[addr] = size
        return addr

    def unmap(self, address: int) -> None:
        """``cudaFree`` of the mapping at ``address``: its range becomes free, merged with free neighbours (a range
        reaching ``top`` lowers it). An address not mapped here (a segment placed by a recording or a hook)
        changes nothing."""
        size = self.mapped.pop(address, None)
        if size is None:
            return
        i = self.holes.bisect_left((address, 0))
        if i > 0:
            prev_addr, prev_size = self.holes[i - 1]
            if prev_addr + prev_size == address:
                del self.holes[i - 1]
                address, size = prev_addr, prev_size + size
                i -= 1
        if i < len(self.holes) and self.holes[i][0] == address + size:
            size += self.holes[i][1]
            del self.holes[i]
        if address + size == self.top:
            self.top = address
        else:
            self.holes.add((address, size))

    def occupy(self, address: int, size: int) -> None:
        """A segment mapped before the replay began (a snapshot's) at ``address``: later mappings avoid its range,
        and :meth:`unmap` gives it back. A range below :data:`BASE` (a real GPU address) is outside this space;
        one inside the context's range means the context had given it back (:meth:`cublas_handle_created`).
        Raises ``ValueError`` if the range overlaps one mapped here."""
        size = -(-size // GRANULE) * GRANULE
        end = address + size
        if end <= BASE:
            return
        ctx = self.context_range
        if ctx is not None and address < ctx[0] + ctx[1] and end > ctx[0]:
            self.cublas_handle_created()
        if address >= self.top:
            if address > self.top:
                self.holes.add((self.top, address - self.top))
            self.top = end
        else:
            i = self.holes.bisect_right((address, float("inf"))) - 1
            if i < 0 or self.holes[i][0] + self.holes[i][1] < min(end, self.top):
                raise ValueError(f"segment 0x{address:x}+{size} overlaps an address range already mapped")
            h_addr, h_size = self.holes.pop(i)
            if h_addr < address:
                self.holes.add((h_addr, address - h_addr))
            if h_addr + h_size > end:
                self.holes.add((end, h_addr + h_size - end))
            self.top = max(self.top, end)
        self.mapped[address] = size

    def cublas_handle_created(self) -> None:
        """The program's first cuBLAS handle: the context gives its range back (once; later calls do nothing)."""
        if self.context_range is not None:
            self.unmap(self.context_range[0])
            self.context_range = None
