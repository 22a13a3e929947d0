"""How many segment addresses of a GPU recording a first-fit replay of the same program reproduces exactly.

    python -m studies.driver_layout TRACE RECORDING --context-reserve 188MiB [--range N:SIZE ...]

TRACE is the ``.rlhftrace`` of ``rlhfmem capture --device cuda-sim`` (any placement: a trace does not depend on
it), RECORDING the GPU's ``_dump_snapshot`` pickle of the same program. The replay places segments as
``--segment-placement first-fit:SIZE`` does (``memory/driver_va.py``); each ``--range N:SIZE`` maps SIZE more
bytes just before the program's N-th new segment, as the driver did for itself (ranges the caching allocator
never sees: they move the segments above them and change no choice of the allocator, so the peak figures are
the same with or without them). Prints the peak reserved and how many of the recording's segments sit at the
replay's address with the replay's size.

Measured (2026-11-24; the CS336 medium training step of tests/test_sim_cuda.py, the recording
wedson_medium_256_training, 495 segments): ``--context-reserve 188MiB`` alone: peak reserved 9,265,217,536 B
(the GPU's), the segments in the recording's address order; with ``--range 94:2MiB --range 95:240MiB --range
320:8MiB`` (2 MiB after the parameters, before the first step's first segment; 240 MiB mapped when the context
gave its 188 MiB back, at the first cuBLAS handle; 8 MiB at autograd's thread's cuBLAS handle, whose next new
segment is the 320th) all 495 addresses are the recording's. The three ranges' sizes are read off the recording
(the gaps its segments leave); only the context's 188 MiB changes what the allocator does.
"""

from __future__ import annotations

import argparse


from pytest_rlhfmem.memory.allocator import AllocatorConfig
from pytest_rlhfmem.memory.driver_va import BASE, FirstFitAddressSpace, SegmentPlacement
from pytest_rlhfmem.memory.python_engine import replay_python
from pytest_rlhfmem.memory.replay_types import FREE_RUNNING
from pytest_rlhfmem.memory.trace import load_snapshot
from pytest_rlhfmem.memory.trace_io import load_trace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("recording")
    ap.add_argument("--context-reserve", default="188MiB")
    ap.add_argument("--range", dest="ranges", action="append", default=[], metavar="N:SIZE")
    args = ap.parse_args()
    placement = SegmentPlacement.parse(f"first-fit:{args.context_reserve}", "--context-reserve")
    extra = {}
    for r in args.ranges:
        n, _, size = r.partition(":")
        extra[int(n)] = SegmentPlacement.parse(f"first-fit:{size}", "--range").context_reserve

    trace = load_trace(args.trace)
    SegmentPlacement.address_space = lambda self: _observed_driver(self.context_reserve, extra)
    result = replay_python(trace, AllocatorConfig(segment_placement=placement), FREE_RUNNING, None, False, True,
                           "driver layout")
    recorded = load_snapshot(args.recording)["segments"]
    lowest = min(s["address"] for s in recorded)
    replayed = {(a - BASE + lowest, s) for a, s in result.segment_allocs}
    exact = sum(1 for s in recorded if (s["address"], s["total_size"]) in replayed)
    print(f"placement {placement.spec()}, ranges {extra or 'none'}: peak reserved {result.total.peak_reserved:,} B; "
          f"{len(result.segment_allocs)} segments replayed, {exact} of the recording's {len(recorded)} at the same "
          "address (both counted from their lowest)")
    return 0


def _observed_driver(context_reserve: int, extra: dict[int, int]) -> FirstFitAddressSpace:
    """The model's first-fit address space, plus the driver's own ranges: ``extra[n]`` bytes mapped just before
    the program's n-th segment."""
    va = FirstFitAddressSpace(context_reserve)
    plain, count = va.map, 0

    def map_segment(size: int) -> int:
        nonlocal count
        count += 1
        if count in extra:
            plain(extra[count])
        return plain(size)

    va.map = map_segment  # type: ignore[method-assign]
    return va


if __name__ == "__main__":
    raise SystemExit(main())
