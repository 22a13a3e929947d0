"""What each strategy's peak is made of at the study's scale: which phase left the free blocks (simulated).

For every ``.rlhftrace`` a study run saved (``RLHFMEM_FAKECUDA_SAVE_TRACE=1 python -m studies.study_scale --out DIR``;
each trace carries the after-inference flush marks), replays it with and without the flush policy's marks
(DeepSpeed's own ``empty_cache()`` calls stay, as in the run's flush-none result) and prints, at the peak reserved,
the fragmentation by the phase whose cudaMalloc made each segment (``memory/peak_origin.py``), GiB.

    python -m studies.study_peak_origin DIR [DIR ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from pytest_rlhfmem.fakecuda.worker import without_policy_flushes
from pytest_rlhfmem.memory.peak_origin import peak_origin
from pytest_rlhfmem.memory.replay import replay
from pytest_rlhfmem.memory.trace_io import load_trace

GIB = 2**30


def describe(path: Path) -> list[str]:
    with_flush = load_trace(path)
    lines = []
    for label, trace in (("flush none", without_policy_flushes(with_flush)), ("flush after inference", with_flush)):
        r = replay(trace, engine="auto")
        po = peak_origin(trace, r.total.peak_reserved)
        parts = ", ".join(f"{phase} {n / GIB:.2f}" for phase, n in
                          sorted(po.free_by_segment_phase.items(), key=lambda kv: -kv[1]) if n >= 0.01 * GIB)
        lines.append(f"  {label:22s} peak {po.peak_reserved / GIB:.2f} GiB in {po.phase}, fragmentation "
                     f"{po.fragmentation / GIB:.2f} GiB; free, by the phase that made the segment: {parts}")
    return lines


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for d in argv:
        for path in sorted(Path(d).glob("*.rlhftrace")):
            print(f"{d}: {path.stem.replace('__', '/')}")
            for line in describe(path):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
