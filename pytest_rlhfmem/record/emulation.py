"""CUDA emulation for the CPU capture: turn a CPU run's allocations into those a GPU run makes.

A CPU run executes the same Python and the same ATen ops as a GPU run, so the tensors it allocates
are the GPU's, with a few systematic exceptions. Each exception is one named adjustment below,
applied to the raw recorder rows after the run (:func:`apply`); none is fitted to a workload, and the
fidelity benchmark (``python -m studies.fidelity``) measures each one against real GPU recordings.

To tell allocations apart, :class:`OpMarker` (a ``TorchDispatchMode`` active during the CPU capture)
writes a marker before and after every ATen op the dispatcher sees on the recording thread, autograd's
backward ops included (the engine carries the mode into backward). The marker payload is small
(op name, the matmul flag, the thread a GPU run would use, the count of Python numbers passed where
the schema takes a Tensor). Allocations are then classified by where they fall:

``host-scalars``
    A Python number passed where an op takes a Tensor becomes a "wrapped number": a 0-dim CPU tensor
    built by the Python argument parser just before the op (``torch/csrc/utils/python_arg_parser.cpp``,
    ``scalar_to_tensor`` + ``set_wrapped_number``), freed right after it. On a GPU it is a CPU
    tensor, not a device allocation (CUDA kernels take CPU scalars as kernel arguments,
    ``TensorIterator``'s ``is_cpu_scalar``). Dropped: the latest that many allocations made on the
    recording thread outside any op before the op begins. Measured: 9,636 in the 6 steps of the
    ``wedson_medium_256_training`` run, mostly CS336's AdamW.
``cpu-kernel-scratch``
    An allocation made and freed inside one op, by no nested marked op, is not a device allocation of a
    GPU run: a CPU kernel's scratch (a float copy of a scalar operand, ``copy_``'s 60x60 transpose tile
    of 14,400 B in ``aten/src/ATen/native/Copy.cpp``, bmm's per-batch slices, the dispatch mode's
    re-wrapped scalars) or a scalar that C++ wraps on the host (``wrapped_scalar_tensor``,
    ``aten/src/ATen/ScalarOps.h``, in ``mul.Scalar``/``div.Scalar`` backward). Dropped. Ops of a
    device-generic (CompositeExplicitAutograd) kernel are not marked one by one, so their temporaries
    are dropped too; on the benchmark workloads these were only such host scalars and transpose tiles.
    A CUDA kernel's own device scratch is added by ``cuda-kernel-temporaries``.
``cublas-workspace``
    The first cuBLAS call on each (thread, stream) takes a workspace from the caching allocator and
    keeps it for the process's life (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
    ``setWorkspaceForHandle``/``getChosenWorkspaceSize``, PyTorch 2.9): 8,519,680 B
    (``:4096:2:16:8``) by default, 32 MiB on Hopper (sm90), or the sum of ``CUBLAS_WORKSPACE_CONFIG``'s
    ``:SIZE_KiB:COUNT`` pairs. A GPU run's backward runs on autograd's device thread, its forward on the
    caller's: two workspaces for a training step, one for inference (both seen, 8,519,680 B live and
    never freed, in the ``wedson_*`` recordings). Added right after the op's output, as ``mm``/``bmm``
    allocate their output before calling cuBLAS. Matmul ops: :data:`CUBLAS_OPS`.
``cuda-kernel-temporaries``
    Known device temporaries of CUDA kernels that a CPU kernel does not make: :data:`CUDA_TEMPORARIES`.

Known limit (measured, docs/fidelity.md): a ``TorchDispatchMode`` on the stack makes autograd take its
"tensor subclass like" branches (``isTensorSubclassLike`` in ``aten/src/ATen/TensorSubclassLikeUtils.h``:
out-of-place ``scatter``/``scatter_add`` in gather/max backward, out-of-place gradient accumulation in
the engine's ``InputBuffer``), so a marked training step holds a few extra temporaries a GPU run does
not. Marking ops from a ``RecordFunction`` callback in the C++ recorder instead would not change them.

Settings are recorded in every result (:meth:`EmulationSettings.describe`), and budgets compare only
results of the same capture description.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

OP_BEGIN = "op_begin"
OP_END = "op_end"

ADJUSTMENTS = ("host-scalars", "cpu-kernel-scratch", "cublas-workspace", "cuda-kernel-temporaries")

# ATen ops whose CUDA kernels call cuBLAS through getCurrentCUDABlasHandle (aten/src/ATen/native/cuda/Blas.cpp).
CUBLAS_OPS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation",
})

# cuBLAS workspace default (CublasHandlePool.cpp, parseChosenWorkspaceSize): ":4096:2:16:8" before Hopper.
DEFAULT_WORKSPACE_CONFIG = ":4096:2:16:8"
HOPPER_WORKSPACE_CONFIG = ":4096:8"


def cublas_workspace_bytes(compute_capability: str | None = None, config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace, as ``parseChosenWorkspaceSize`` (CublasHandlePool.cpp, PyTorch 2.9)
    computes it: ``config`` (a ``CUBLAS_WORKSPACE_CONFIG`` value, ``:SIZE_KiB:COUNT`` pairs summed) wins;
    else 32 MiB for compute capability ``"9.0"`` (Hopper), else 8,519,680 B.

    Raises ``ValueError`` for a config without any ``:SIZE:COUNT`` pair (PyTorch warns and uses the
    default; a profile setting must be right, so it is refused here).
    """
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if not pairs:
            raise ValueError(f"CUBLAS_WORKSPACE_CONFIG {config!r}: expected ':SIZE_KiB:COUNT' pairs, "
                             "e.g. ':4096:8' or ':4096:2:16:8'")
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    default = HOPPER_WORKSPACE_CONFIG if compute_capability == "9.0" else DEFAULT_WORKSPACE_CONFIG
    return cublas_workspace_bytes(config=default)


@dataclass(frozen=True)
class CudaTemporary:
    """Device temporaries a CUDA kernel allocates and frees inside one op: ``sizes(args, kwargs)`` gives
    their requested bytes, in allocation order (evaluated during the capture, from the op's arguments)."""

    op: str
    source: str
    sizes: Callable[[tuple, dict], tuple[int, ...]]


CUDA_TEMPORARIES: dict[str, CudaTemporary] = {}


@dataclass(frozen=True)
class EmulationSettings:
    """Which adjustments run, and the GPU they emulate. ``adjustments`` is a subset of :data:`ADJUSTMENTS`.

    ``compute_capability`` (e.g. ``"8.0"``, ``"9.0"``) and ``cublas_workspace_config`` (a
    ``CUBLAS_WORKSPACE_CONFIG`` value) size the cuBLAS workspace; by default they come from the
    environment variable ``CUBLAS_WORKSPACE_CONFIG`` and a pre-Hopper GPU.
    """

    adjustments: tuple[str, ...] = ADJUSTMENTS
    compute_capability: str | None = None
    cublas_workspace_config: str | None = field(default_factory=lambda: os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    def __post_init__(self) -> None:
        bad = [a for a in self.adjustments if a not in ADJUSTMENTS]
        if bad:
            raise ValueError(f"CUDA emulation adjustment {bad[0]!r}: allowed values are {', '.join(ADJUSTMENTS)}")
        cublas_workspace_bytes(self.compute_capability, self.cublas_workspace_config)  # validates the config

    @property
    def workspace_bytes(self) -> int:
        return cublas_workspace_bytes(self.compute_capability, self.cublas_workspace_config)

    def describe(self) -> dict:
        """The capture description recorded in results and budgets (JSON-able, stable keys)."""
        return {"adjustments": list(self.adjustments),
                "cublas_workspace_bytes": self.workspace_bytes if "cublas-workspace" in self.adjustments else 0}


def parse_switch(value: str | bool | None) -> EmulationSettings | None:
    """``on`` / ``off`` (CLI, plugin option) -> settings or ``None``. Raises ``ValueError`` naming the
    allowed values."""
    if value is None or value is True:
        return EmulationSettings()
    if value is False:
        return None
    v = str(value).strip().lower()
    if v in ("on", "true", "1", "yes"):
        return EmulationSettings()
    if v in ("off", "false", "0", "no"):
        return None
    raise ValueError(f"CUDA emulation {value!r}: allowed values are on, off")


def capture_description(settings: EmulationSettings | None) -> dict:
    """``{"cuda_emulation": ...}``: what a CPU result records about its capture (``"off"`` without emulation)."""
    return {"cuda_emulation": settings.describe() if settings is not None else "off"}


# -- capture side ---------------------------------------------------------------------------------

def _make_marker_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    graph_task_id = torch._C._current_graph_task_id
    tensor_type = torch._C.TensorType.get()

    class OpMarker(TorchDispatchMode):
        """Marks op boundaries into the recorder's ordered buffer (see the module docstring)."""

        def __init__(self, mark: Callable[[str, object], None]):
            super().__init__()
            self._mark = mark
            self._owner = threading.get_ident()
            self._info: dict = {}  # op -> (name, Tensor-typed argument positions, composite, CPU kernel)
            # each distinct OP_BEGIN payload once: a run's marks share them (8 bytes a mark in the list, not a new
            # tuple per op: the recorder's own host memory grows by what it must, Recorder.own_bytes)
            self._payloads: dict = {}

        def _op_info(self, func) -> tuple:
            info = self._info.get(func)
            if info is None:
                qualname = func._schema.name
                if func._overloadname != "default":
                    qualname += "." + func._overloadname
                has = torch._C._dispatch_has_kernel_for_dispatch_key
                info = self._info[func] = (
                    func._schema.name.split("::", 1)[-1],
                    tuple(i for i, a in enumerate(func._schema.arguments) if a.type == tensor_type),
                    has(qualname, "CompositeImplicitAutograd"),
                    has(qualname, "CPU"),
                )
            return info

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if threading.get_ident() != self._owner:  # other threads are not classified
                return func(*args, **kwargs)
            name, tensor_pos, composite, cpu_kernel = self._op_info(func)
            if composite:  # seen whole under inference_mode: decompose, so its ops are marked one by one
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            n_scalars = sum(1 for i in tensor_pos if i < len(args) and isinstance(args[i], (int, float, complex)))
            thread = "autograd" if graph_task_id() != -1 else "caller"
            temp = CUDA_TEMPORARIES.get(name)
            temps = temp.sizes(args, kwargs) if temp is not None else ()
            payload = (name, thread, n_scalars, cpu_kernel, temps)
            self._mark(OP_BEGIN, self._payloads.setdefault(payload, payload))
            try:
                return func(*args, **kwargs)
            finally:
                self._mark(OP_END, None)

    return OpMarker


_MODE_CLS = None


def marker_mode(mark: Callable[[str, object], None]):
    """A new :class:`OpMarker` dispatch mode writing through ``mark(kind, payload)``."""
    global _MODE_CLS
    if _MODE_CLS is None:
        _MODE_CLS = _make_marker_mode()
    return _MODE_CLS(mark)


# -- trace side -----------------------------------------------------------------------------------

WORKSPACE_PTR_BASE = -(1 << 40)  # synthetic pointers of emulated allocations (never real addresses)


@dataclass
class EmulationReport:
    """What :func:`apply` changed (counts and bytes per adjustment)."""

    dropped: dict[str, list[int]] = field(default_factory=lambda: {a: [0, 0] for a in ADJUSTMENTS})
    added: dict[str, list[int]] = field(default_factory=lambda: {a: [0, 0] for a in ADJUSTMENTS})
    ops: int = 0
    workspace_ptrs: list[int] = field(default_factory=list)  # the added cuBLAS workspaces' rows (their ptr)

    def to_dict(self) -> dict:
        return {"ops": self.ops,
                "dropped": {k: {"count": c, "bytes": b} for k, (c, b) in self.dropped.items() if c},
                "added": {k: {"count": c, "bytes": b} for k, (c, b) in self.added.items() if c}}


@dataclass
class _Frame:
    """One op on the marker stack while :func:`apply` walks the rows."""

    name: str
    thread: str
    temps: tuple
    direct: set = field(default_factory=set)  # rows allocated in this op, outside any nested marked op
    since_child: list = field(default_factory=list)  # of those, the ones since the last nested op ended


def apply(rows: list, marks: list, settings: EmulationSettings) -> tuple[list, EmulationReport]:
    """The CUDA-emulated recorder rows. ``rows`` are the recorder's ``(time_ns, ptr, size, kind, on_main)``
    (kind 0 alloc, 1 free, 2 marker with ``ptr`` = index into ``marks``); ``marks`` the recorder's
    ``(kind, payload)`` list. Op markers (possibly nested: a composite op's own ops are marked inside it)
    are consumed; other markers pass through unchanged. Returns (new rows, report)."""
    em = Emulator(marks, settings)
    em.feed(rows)
    return em.take(), em.report


class Emulator:
    """:func:`apply` fed in pieces while the capture runs (the progress files' figures so far): :meth:`feed` the
    recorder's rows in order, :meth:`take` the emulated rows whose fate is settled. A row is settled once no
    later row can drop it: every row before the oldest allocation still on the op stack's candidate lists (an
    open op's own allocations, the allocations since an op last began: :func:`apply`'s two retroactive drops).
    Rows taken in pieces are, concatenated, :func:`apply`'s rows of the same input, to the row."""

    def __init__(self, marks: list, settings: EmulationSettings) -> None:
        self.marks = marks
        self.on = set(settings.adjustments)
        self.ws_bytes = settings.workspace_bytes
        self.report = EmulationReport()
        self.rows: list = []  # the rows from index ``base`` on, not yet taken
        self.base = 0
        self.drop = bytearray()  # per row fed: 1 = remove this row (and, for an alloc, its free)
        self.inserts: dict[int, list] = {}  # row index -> synthetic rows to put before it
        self.live: dict[int, int] = {}  # ptr -> row index of its alloc
        self.top = _Frame("", "caller", ())  # allocations outside every op
        self.stack: list[_Frame] = []
        self.workspaces: set[str] = set()
        self.next_ptr = WORKSPACE_PTR_BASE

    def feed(self, rows: list) -> None:
        """Process the next ``rows`` (recorder rows, in order)."""
        on, report, marks, live, top, stack = self.on, self.report, self.marks, self.live, self.top, self.stack
        first = self.base + len(self.rows)
        self.rows.extend(rows)
        self.drop.extend(bytes(len(rows)))
        drop, buf, base = self.drop, self.rows, self.base

        def count(kind: str, adjustment: str, size: int) -> None:
            entry = (report.dropped if kind == "dropped" else report.added)[adjustment]
            entry[0] += 1
            entry[1] += size

        for i, (t, ptr, _size, kind, main) in enumerate(rows, first):
            if kind == 0:
                live[ptr] = i
                if main:
                    frame = stack[-1] if stack else top
                    frame.since_child.append(i)
                    if stack:
                        frame.direct.add(i)
            elif kind == 1:
                j = live.pop(ptr, None)
                if j is None:
                    continue
                if drop[j]:
                    drop[i] = 1
                elif stack and j in stack[-1].direct and "cpu-kernel-scratch" in on:
                    drop[j] = drop[i] = 1  # made and freed inside one op, by no nested op: not a device allocation
                    count("dropped", "cpu-kernel-scratch", buf[j - base][2])
            else:
                mkind, payload = marks[ptr]
                if mkind == OP_BEGIN:
                    name, thread, n_scalars, _cpu_kernel, temps = payload
                    report.ops += 1
                    parent = stack[-1] if stack else top
                    if n_scalars and "host-scalars" in on:  # the wrapped numbers built just before this op
                        for j in [j for j in parent.since_child
                                  if not drop[j] and buf[j - base][1] in live][-n_scalars:]:
                            drop[j] = 1
                            count("dropped", "host-scalars", buf[j - base][2])
                    parent.since_child = []
                    stack.append(_Frame(name, thread, temps))
                    drop[i] = 1
                elif mkind == OP_END:
                    frame = stack.pop()
                    if ("cublas-workspace" in on and frame.name in CUBLAS_OPS
                            and frame.thread not in self.workspaces):
                        self.workspaces.add(frame.thread)
                        self.inserts.setdefault(i, []).append((t, self.next_ptr, self.ws_bytes, 0, 1))
                        report.workspace_ptrs.append(self.next_ptr)
                        self.next_ptr -= 1
                        count("added", "cublas-workspace", self.ws_bytes)
                    if "cuda-kernel-temporaries" in on:
                        for sz in frame.temps:
                            self.inserts.setdefault(i, []).extend([(t, self.next_ptr, sz, 0, 1),
                                                                   (t, self.next_ptr, sz, 1, 1)])
                            self.next_ptr -= 1
                            count("added", "cuda-kernel-temporaries", sz)
                    if stack:
                        stack[-1].since_child = []
                    drop[i] = 1

    def settled(self) -> int:
        """The index of the first row fed whose fate a later row may still change (every row fed when none)."""
        pending = [self.base + len(self.rows)]
        for frame in (self.top, *self.stack):
            if frame.since_child:
                pending.append(min(frame.since_child))
            if frame.direct:
                pending.append(min(frame.direct))
        return min(pending)

    def take(self, upto: int | None = None) -> list:
        """The emulated rows of the rows fed from the last :meth:`take` up to index ``upto`` (default: all fed;
        pass :meth:`settled` while recording goes on), synthetic rows included; they leave the buffer."""
        upto = self.base + len(self.rows) if upto is None else upto
        out, drop, inserts, base = [], self.drop, self.inserts, self.base
        for i, row in enumerate(self.rows[:upto - base], base):
            if i in inserts:
                out.extend(inserts.pop(i))
            if not drop[i]:
                out.append(row)
        del self.rows[:upto - base]
        self.base = upto
        return out
