"""Host memory of one rank, measured for real (never simulated): peak resident set size and pinned (or
offloaded) host bytes, per phase and over the iteration.

Why: offloading (ZeRO-Offload, ZeRO-3 + CPU offload) moves model states out of the GPU into host memory;
MemAscend (2025) shows such a run can fit the GPU and still exhaust the host (pinned buffers, peaks while
offloading). The device figures say nothing about that, so every result also carries these.

Figures, all in bytes, per rank:

- ``host_peak_rss``: the most resident memory the process held (Linux ``VmHWM``). At each phase start
  the peak is read (it folds into the iteration's peak) and reset by writing ``5`` to
  ``/proc/self/clear_refs`` (Linux >= 4.0, ``Documentation/filesystems/proc.rst``); it is read again at
  the phase end. Where that write is refused, a thread samples ``/proc/self/statm`` every millisecond
  instead (a peak shorter than the interval can be missed); :attr:`HostMemory.rss_method` says which.
  On the CPU path RSS includes the tensors the device trace models (they live in host RAM there): the
  device figures are simulated, these are the process's real footprint.
- ``host_rss_growth``: ``host_peak_rss`` minus the RSS when measuring began (``host_rss_at_start``: the
  interpreter, torch and the framework, imported before the first model is built). This is the part the
  iteration itself adds (model states, optimizer states, offload buffers, activations held in host memory)
  and the host figure budgets gate: the RSS after imports is the environment's, not the recipe's. Measured
  here: the same ColossalChat scenario (tiny OPT x2) peaked at 639-647 MiB in an older environment and at
  831-848 MiB in fresh ones with identical packages (the resident pages of the mapped shared libraries
  differ: libtorch_cpu.so 103.5 vs 52.3 MiB after the same imports), with growths of 98-109 and 112-131 MiB.
- ``host_anon_peak`` / ``host_anon_growth``: the most anonymous resident memory the process held
  (``/proc/self/statm`` resident minus shared pages, i.e. ``RssAnon``: heap, ``mmap``'d tensors, written
  private pages), sampled every millisecond by a thread and read at every phase boundary, and its growth
  over the value when measuring began. This is what the iteration itself allocates on the host, and the
  host figure budgets gate: file-backed pages (the resident parts of mapped shared libraries, which the
  kernel faults in lazily and which differed between environments with identical packages by 10-46 MiB of
  growth) are not in it. Linux has no high-water mark for it, so a peak shorter than the interval can be
  missed (a tensor allocated and freed within 1 ms between two boundaries).
- ``host_pinned_peak``: on CUDA, the most page-locked memory held by PyTorch's caching host allocator
  (``torch.cuda.host_memory_stats()['allocated_bytes.peak']``, peak reset per phase with
  ``torch.cuda.reset_peak_host_memory_stats``; DeepSpeed pins its offload buffers through it). On CPU
  nothing is page-locked (DeepSpeed's CPU accelerator's ``pin_memory`` returns the tensor as is), so the
  figure is the live bytes of the buffers the recipe declared host-resident (``Recorder.host_resident``:
  the offload buffers DeepSpeed pins on CUDA), read at each phase's start and end and at each declaration.
  PyTorch before 2.6 has no host-allocator statistics; there the CPU rule is used on CUDA too.
  :attr:`HostMemory.pinned_method` says which.
- ``host_rss_outside_device`` (CPU path only, not budgeted): on a CPU the simulated device's tensors live
  in the same RSS, so offloading cannot raise it the way it raises a GPU machine's host memory. This
  estimate takes, at each phase end, the RSS at that moment minus the device trace's live tensor bytes
  (``requested_at_phase_end``: exact bytes, no allocator model), and keeps the largest: the host
  footprint a GPU machine would have (glibc keeps freed pages, so it leans high).
- ``host_staging_bytes`` / ``host_staging_buffers``: bytes and number of the swap staging buffers the run's
  registered probes report (:func:`register_staging_probe`; the DeepSpeed-Chat recipe registers one for
  ZeRO-Infinity's NVMe swappers), the most held in the window. ``host_staging_idle_bytes_at_peak`` /
  ``host_staging_idle_buffers_at_peak``: how many of them held no tensor at the window's anonymous-memory
  peak (read by the sampler thread whenever that peak rises, and at the window's start). 0 without probes.
- ``host_heap_*_bytes_at_peak``: glibc's allocator at the window's anonymous-memory peak (``mallinfo2()``,
  glibc >= 2.33, summed over its arenas): ``arena`` (bytes obtained with ``brk``/heap ``mmap``),
  ``used`` (``uordblks``, in allocated chunks), ``free`` (``fordblks``: freed chunks the allocator keeps,
  its fragmentation; the releasable top is ``keepcost``, in ``host_heap_top_bytes_at_peak``) and ``mmapped``
  (``hblkhd``: chunks above the mmap threshold, returned to the system on free). ``mallinfo2`` walks every
  free list (70 ms with 200,000 free chunks here), so the sampler reads it at a new peak only when the peak has
  risen 8 MiB above its last reading (the figure is from within 8 MiB of the peak), and at the window's start.
  Absent (``None``) where glibc has no ``mallinfo2``.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

HOST_METRIC_NAMES = ("host_peak_rss", "host_rss_growth", "host_anon_peak", "host_anon_growth", "host_pinned_peak")
# Bytes this process read from / wrote to storage (/proc/self/io read_bytes / write_bytes: block-device I/O, e.g.
# ZeRO-Infinity's NVMe swapping through O_DIRECT async I/O); per window, summed over a name's windows.
HOST_IO_NAMES = ("storage_read_bytes", "storage_write_bytes")
# Swap staging buffers and glibc's heap, per window (bytes; *_buffers are counts); "at peak": at the window's
# anonymous-memory peak. See the module docstring.
HOST_STAGING_NAMES = ("host_staging_bytes", "host_staging_buffers", "host_staging_idle_bytes_at_peak",
                      "host_staging_idle_buffers_at_peak")
HOST_HEAP_NAMES = ("host_heap_arena_bytes_at_peak", "host_heap_used_bytes_at_peak", "host_heap_free_bytes_at_peak",
                   "host_heap_top_bytes_at_peak", "host_heap_mmapped_bytes_at_peak")
HOST_SWAP_NAMES = HOST_STAGING_NAMES + HOST_HEAP_NAMES
HEAP_MALLINFO2 = "glibc mallinfo2() at the anonymous-memory peak (within 8 MiB), summed over arenas"
RSS_HWM = "VmHWM, reset per phase through /proc/self/clear_refs"
RSS_SAMPLED = "sampled from /proc/self/statm every 1 ms"
ANON_SAMPLED = "resident minus shared pages of /proc/self/statm, sampled every 1 ms and at phase boundaries"
PINNED_CUDA = "torch.cuda.host_memory_stats allocated_bytes.peak (page-locked)"
PINNED_CPU = "live bytes of the offload buffers declared host-resident (not page-locked on CPU)"


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm() -> tuple[int, int]:
    """(resident, anonymous resident) bytes now: ``/proc/self/statm`` fields 2 and 2 - 3 (resident minus
    shared, i.e. RssAnon, ``Documentation/filesystems/proc.rst``); (0, 0) where ``/proc`` is missing."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        return int(fields[1]) * _PAGE, (int(fields[1]) - int(fields[2])) * _PAGE
    except OSError:
        return 0, 0


def storage_io() -> tuple[int, int]:
    """This process's (read_bytes, write_bytes) of storage I/O from /proc/self/io; (0, 0) where unreadable."""
    try:
        fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines() if ": " in line)
        return int(fields.get("read_bytes", 0)), int(fields.get("write_bytes", 0))
    except (OSError, ValueError):
        return 0, 0


# A staging probe returns (held bytes, held buffers, idle bytes, idle buffers) of the swap staging buffers now.
StagingProbe = Callable[[], tuple[int, int, int, int]]
_STAGING_PROBES: list[StagingProbe] = []


def register_staging_probe(probe: StagingProbe) -> None:
    """Count ``probe``'s staging buffers in every host meter of this process (once per probe)."""
    if probe not in _STAGING_PROBES:
        _STAGING_PROBES.append(probe)


def staging_now() -> tuple[int, int, int, int]:
    """(held bytes, held buffers, idle bytes, idle buffers) over the registered probes; a probe that raises
    (its objects half-built or torn down) counts nothing this time."""
    total = [0, 0, 0, 0]
    for probe in list(_STAGING_PROBES):
        try:
            for i, v in enumerate(probe()):
                total[i] += int(v)
        except Exception:  # noqa: BLE001 - a reading must never fail the run
            continue
    return total[0], total[1], total[2], total[3]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _load_mallinfo2():  # noqa: ANN202
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _load_mallinfo2()


def heap_now() -> dict[str, int] | None:
    """glibc's heap now (``mallinfo2``), under :data:`HOST_HEAP_NAMES`; ``None`` without glibc >= 2.33."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return {"host_heap_arena_bytes_at_peak": m.arena, "host_heap_used_bytes_at_peak": m.uordblks,
            "host_heap_free_bytes_at_peak": m.fordblks, "host_heap_top_bytes_at_peak": m.keepcost,
            "host_heap_mmapped_bytes_at_peak": m.hblkhd}


HEAP_STEP = 8 << 20  # read mallinfo2 again at a new peak once it is this far above the last reading


def current_rss() -> int:
    """Resident set size now (bytes); 0 where ``/proc`` is missing."""
    return _statm()[0]


def current_anon() -> int:
    """Anonymous resident memory now (bytes; resident minus file-backed and shared pages)."""
    return _statm()[1]


def _has_host_allocator_stats() -> bool:
    import torch

    return hasattr(torch.cuda, "host_memory_stats") and hasattr(torch.cuda, "reset_peak_host_memory_stats")


def cuda_pinned_peak() -> int:
    """CUDA: the pinned host allocator's peak (bytes): ``torch.cuda.host_memory_stats()["allocated_bytes.peak"]``."""
    import torch

    return int(torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0))


def reset_cuda_pinned_peak() -> None:
    """CUDA: ``torch.cuda.reset_peak_host_memory_stats()`` (a phase's pinned peak starts here)."""
    import torch

    torch.cuda.reset_peak_host_memory_stats()


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    """Peak meter polling ``/proc/self/statm``: ``peak`` (RSS; the fallback where VmHWM cannot be reset) and
    ``anon_peak`` (anonymous RSS, which has no kernel high-water mark); ``reset()`` restarts both at now."""

    def __init__(self, interval_s: float = 0.001) -> None:
        super().__init__(name="rlhfmem-rss-sampler", daemon=True)
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self.peak, self.anon_peak = _statm()
        self.staging_max = (0, 0)  # (bytes, buffers): the most held in the window
        self.at_peak: dict[str, int | None] = {}  # staging idle and heap figures at the anonymous-memory peak
        self._heap_anon = 0  # anonymous RSS when mallinfo2 was last read
        self._note_peak(self.anon_peak, heap=True)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self._sample()

    def _note_peak(self, anon: int, heap: bool) -> None:
        """The staging buffers (and, when ``heap``, glibc's heap) now, as the figures at the peak."""
        held, n_held, idle, n_idle = staging_now()
        if (held, n_held) > self.staging_max:
            self.staging_max = (held, n_held)
        self.at_peak.update(host_staging_idle_bytes_at_peak=idle, host_staging_idle_buffers_at_peak=n_idle)
        if heap:
            self.at_peak.update(heap_now() or dict.fromkeys(HOST_HEAP_NAMES))
            self._heap_anon = anon

    def _sample(self) -> None:
        with self._lock:
            rss, anon = _statm()
            if rss > self.peak:
                self.peak = rss
            if anon > self.anon_peak:
                self.anon_peak = anon
                self._note_peak(anon, heap=anon >= self._heap_anon + HEAP_STEP)

    def read(self) -> int:
        self._sample()
        return self.peak

    def read_anon(self) -> int:
        self._sample()
        return self.anon_peak

    def reset(self) -> None:
        with self._lock:
            self.peak, self.anon_peak = _statm()
            self.staging_max = (0, 0)
            self._note_peak(self.anon_peak, heap=True)

    def window(self) -> tuple[tuple[int, int], dict[str, int | None]]:
        """(staging held max, figures at the anonymous-memory peak) of the window so far."""
        with self._lock:
            held, n_held, _idle, _n_idle = staging_now()
            if (held, n_held) > self.staging_max:
                self.staging_max = (held, n_held)
            return self.staging_max, dict(self.at_peak)

    def stop(self) -> None:
        self._stop_event.set()


@dataclass
class HostMemory:
    """One rank's host meter. The recorder calls :meth:`begin_phase` / :meth:`end_phase` at its phase
    boundaries and :meth:`note_offloaded` for every host-resident declaration; :meth:`to_dict` gives the
    figures (bytes).

    Windows are those of the device trace: the time between two boundaries belongs to the innermost open
    phase, else to ``root`` (``rlhfmem capture``'s ``run`` window; ``None``: to the iteration only). A name
    seen in several windows (a phase per step, an outer phase resumed after a nested one) keeps the
    maximum of its windows' peaks."""

    device: str  # "cpu" | "cuda"
    root: str | None = None
    rss_method: str = ""
    pinned_method: str = ""
    peak_rss: int = 0
    rss_at_start: int = 0  # RSS when measuring began: the interpreter and the imported frameworks
    anon_peak: int = 0
    anon_at_start: int = 0  # anonymous RSS when measuring began
    anon_method: str = ANON_SAMPLED
    pinned_peak: int = 0
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    _sampler: _Sampler | None = None
    _offloaded: dict[int, tuple[int, weakref.ref]] = field(default_factory=dict)  # storage ptr -> (bytes, ref)
    _open: list[str] = field(default_factory=list)  # open phases, innermost last
    _phase_pinned: int = 0
    _cuda_stats: bool = False  # torch.cuda.host_memory_stats available and used
    _hwm: bool = False  # VmHWM read and reset per window (else the sampler's RSS peak)
    _io_last: tuple[int, int] = (0, 0)
    io_total: tuple[int, int] = (0, 0)  # storage (read, write) bytes since start
    heap_method: str = HEAP_MALLINFO2
    swap_totals: dict[str, int | None] = field(default_factory=dict)  # HOST_SWAP_NAMES over the iteration
    # a run of several iterations (Recorder.iteration): the one running (0: the setup) and, per iteration, its
    # peaks (host_peak_rss, host_anon_peak; bytes), folded in at every boundary
    iteration: int = 0
    iterations: dict[int, dict[str, int]] = field(default_factory=dict)

    def start(self) -> None:
        """Begin measuring (before the first model is built)."""
        self._cuda_stats = self.device == "cuda" and _has_host_allocator_stats()
        self.rss_at_start, self.anon_at_start = _statm()
        self.pinned_method = PINNED_CUDA if self._cuda_stats else PINNED_CPU
        self._hwm = _status_kib("VmHWM") is not None and _reset_hwm()
        self.rss_method = RSS_HWM if self._hwm else RSS_SAMPLED
        self.heap_method = HEAP_MALLINFO2 if _MALLINFO2 is not None else "unavailable (no glibc mallinfo2)"
        self._sampler = _Sampler()  # anonymous RSS always (no kernel high-water mark); RSS where VmHWM is not
        self._sampler.start()
        self._reset_pinned_peak()
        self._io_last = storage_io()

    def stop(self) -> None:
        """Close the last window (the root window's, or the iteration's only) and stop the sampler."""
        self._boundary()
        if self._sampler is not None:
            self._sampler.stop()

    # -- phase boundaries -------------------------------------------------------------------------
    def begin_phase(self, name: str) -> None:
        self._boundary()
        self._open.append(name)

    def begin_iteration(self, k: int) -> None:
        """Iteration ``k`` begins: the peaks so far close the previous one (:attr:`iterations`)."""
        self._boundary()
        self.iteration = k

    def end_phase(self, name: str) -> None:
        self._boundary()
        if self._open and self._open[-1] == name:
            self._open.pop()

    def _boundary(self) -> None:
        """Fold the peaks since the last boundary into the window that just ended (and the iteration's),
        then reset them for the next window."""
        rss, pinned = self._read_rss_peak(), self._read_pinned_peak()
        anon = self._sampler.read_anon() if self._sampler is not None else current_anon()
        swap = self._swap_window()
        if anon >= self.anon_peak:  # this window holds the iteration's anonymous peak: its figures at the peak
            self.swap_totals.update({k: swap[k] for k in swap if k not in ("host_staging_bytes",
                                                                             "host_staging_buffers")})
        for k in ("host_staging_bytes", "host_staging_buffers"):
            self.swap_totals[k] = max(self.swap_totals.get(k) or 0, swap[k])
        self.peak_rss = max(self.peak_rss, rss)
        self.anon_peak = max(self.anon_peak, anon)
        if self.iteration:
            it = self.iterations.setdefault(self.iteration, {"host_peak_rss": 0, "host_anon_peak": 0})
            it["host_peak_rss"] = max(it["host_peak_rss"], rss)
            it["host_anon_peak"] = max(it["host_anon_peak"], anon)
        self.pinned_peak = max(self.pinned_peak, pinned)
        io = storage_io()
        dr, dw = io[0] - self._io_last[0], io[1] - self._io_last[1]
        self._io_last = io
        self.io_total = (self.io_total[0] + dr, self.io_total[1] + dw)
        window = self._open[-1] if self._open else self.root
        if window is not None:
            prev = self.phases.get(window, {})
            peak = max(rss, prev.get("host_peak_rss", 0))
            anon_peak = max(anon, prev.get("host_anon_peak", 0))
            self.phases[window] = {"host_peak_rss": peak, "host_rss_growth": max(0, peak - self.rss_at_start),
                                   "host_anon_peak": anon_peak,
                                   "host_anon_growth": max(0, anon_peak - self.anon_at_start),
                                   "host_pinned_peak": max(pinned, prev.get("host_pinned_peak", 0)),
                                   "host_rss_at_end": current_rss(),
                                   "storage_read_bytes": prev.get("storage_read_bytes", 0) + dr,
                                   "storage_write_bytes": prev.get("storage_write_bytes", 0) + dw}
            at_peak = anon_peak == anon or not prev  # this reading's peak is the window's (a resumed name)
            for k, v in swap.items():
                if k in ("host_staging_bytes", "host_staging_buffers"):
                    v = max(v, prev.get(k) or 0)
                elif not at_peak:
                    v = prev.get(k)
                self.phases[window][k] = v
        self._reset_rss_peak()
        self._reset_pinned_peak()

    def _swap_window(self) -> dict[str, int | None]:
        """The window's staging buffers (most held; idle at its anonymous peak) and heap at that peak."""
        if self._sampler is None:
            held, n_held, idle, n_idle = staging_now()
            at_peak = {"host_staging_idle_bytes_at_peak": idle, "host_staging_idle_buffers_at_peak": n_idle,
                       **(heap_now() or dict.fromkeys(HOST_HEAP_NAMES))}
            staging = (held, n_held)
        else:
            staging, at_peak = self._sampler.window()
        return {"host_staging_bytes": staging[0], "host_staging_buffers": staging[1],
                **{k: at_peak.get(k) for k in HOST_SWAP_NAMES[2:]}}

    def note_offloaded(self, tensors: Iterable) -> None:
        """CPU: remember these host-resident buffers (weakly) so their live bytes can be read."""
        for t in tensors:
            if t is None:
                continue
            s = t.untyped_storage()
            if s.data_ptr() and s.nbytes():
                self._offloaded[s.data_ptr()] = (s.nbytes(), weakref.ref(t))
        if not self._cuda_stats:
            self._phase_pinned = max(self._phase_pinned, self._offloaded_live())

    # -- readings ---------------------------------------------------------------------------------
    def _read_rss_peak(self) -> int:
        if not self._hwm:
            return self._sampler.read() if self._sampler is not None else current_rss()
        return _status_kib("VmHWM") or 0

    def _reset_rss_peak(self) -> None:
        if self._sampler is not None:
            self._sampler.reset()
        if self._hwm:
            _reset_hwm()

    def _offloaded_live(self) -> int:
        dead = [p for p, (_n, ref) in self._offloaded.items() if ref() is None]
        for p in dead:
            del self._offloaded[p]
        return sum(n for n, _ref in self._offloaded.values())

    def _read_pinned_peak(self) -> int:
        if self._cuda_stats:
            return cuda_pinned_peak()
        self._phase_pinned = max(self._phase_pinned, self._offloaded_live())
        return self._phase_pinned

    def _reset_pinned_peak(self) -> None:
        if self._cuda_stats:
            reset_cuda_pinned_peak()
        else:
            self._phase_pinned = self._offloaded_live()

    def to_dict(self) -> dict:
        """``{"host_peak_rss", "host_rss_at_start", "host_rss_growth", "host_anon_peak", "host_anon_at_start",
        "host_anon_growth", "host_pinned_peak", "rss_method", "anon_method", "pinned_method", "measured": True,
        "phases": {phase: {"host_peak_rss", "host_rss_growth", "host_anon_peak", "host_anon_growth",
        "host_pinned_peak", "host_rss_at_end"}}}`` (bytes)."""
        return {"host_peak_rss": self.peak_rss, "host_rss_at_start": self.rss_at_start,
                "host_rss_growth": max(0, self.peak_rss - self.rss_at_start),
                "host_anon_peak": self.anon_peak, "host_anon_at_start": self.anon_at_start,
                "host_anon_growth": max(0, self.anon_peak - self.anon_at_start), "anon_method": self.anon_method,
                "host_pinned_peak": self.pinned_peak, "rss_method": self.rss_method,
                "pinned_method": self.pinned_method, "measured": True, "phases": dict(self.phases),
                "storage_read_bytes": self.io_total[0], "storage_write_bytes": self.io_total[1],
                "heap_method": self.heap_method,
                **{k: self.swap_totals.get(k, 0 if k in HOST_STAGING_NAMES else None) for k in HOST_SWAP_NAMES}}


def format_rss(m: dict) -> str:
    """``"646.86 MiB (anon +105.66 MiB)"``: a result's peak RSS and, in brackets, the growth of anonymous
    memory that budgets gate (``+... RSS`` for results written before it was measured)."""
    from ..units import format_size

    if m.get("host_anon_growth") is not None:
        return format_size(m.get("host_peak_rss")) + f" (anon +{format_size(m['host_anon_growth'])})"
    growth = m.get("host_rss_growth")
    return format_size(m.get("host_peak_rss")) + (f" (+{format_size(growth)})" if growth is not None else "")


def attach_host(result: dict, host: HostMemory) -> dict:
    """Put ``host``'s figures into a rank result: ``result["host"]`` (methods and per-phase figures) and,
    under :data:`HOST_METRIC_NAMES`, into ``result["total"]`` and each ``result["phases"]`` entry, where
    the launcher takes the maximum over ranks. Returns ``result``."""
    d = host.to_dict()
    result["host"] = d
    result["total"].update({k: d[k] for k in HOST_METRIC_NAMES + HOST_IO_NAMES + HOST_SWAP_NAMES})
    live = result.get("requested_at_phase_end") or {}
    outside = []
    for p in result["phases"]:
        h = d["phases"].get(p["phase"], {})
        p.update({k: h.get(k, 0) for k in HOST_METRIC_NAMES + HOST_IO_NAMES + HOST_SWAP_NAMES})
        if result.get("simulated") and p["phase"] in live and h.get("host_rss_at_end"):
            p["host_rss_outside_device"] = h["host_rss_at_end"] - live[p["phase"]]
            outside.append(p["host_rss_outside_device"])
    if outside:
        result["total"]["host_rss_outside_device"] = max(outside)
    return result
