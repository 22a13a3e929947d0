"""Stand-ins for what a CPU-only torch lacks on DeepSpeed's CUDA code paths (``DS_ACCELERATOR=cuda``).

Each entry of :func:`install` replaces one function with a no-op or a bookkeeping equivalent; none of
them allocates device memory on a GPU either (streams, events, NVTX, device selection, memory
statistics), except where said. Installed once per worker process, after ``import torch`` and before
``import deepspeed`` creates its accelerator. ``torch.cuda.is_available()`` stays False on purpose:
making it True sends real (non-fake) tensor creation to the missing CUDA backend; only DeepSpeed's
accelerator says it is available.

Stand-ins with a memory consequence (stated in every result's ``standins``):

- ``FusedAdam`` -> ``torch.optim.AdamW(fused=True)``: DeepSpeed's FusedAdam needs a CUDA build; both
  keep two fp32 states per parameter and allocate them at the first step.
- ``DeepSpeedCPUAdam`` -> ``torch.optim.AdamW(foreach=False)``: its states live on the host (``cpu``
  fake tensors), outside the device trace, as DeepSpeedCPUAdam's are.
- ``Tensor.record_stream``: a no-op; the caching allocator's delayed reuse of blocks used on another
  stream is not modelled.
- generation stops by length: ``GenerationMixin._has_unfinished_sequences`` runs as usual (the ZeRO-3
  flag all-reduce included) but answers "unfinished" exactly ``max_new_tokens`` times, as a run with
  ``min_new_tokens == max_new_tokens`` does.
- ZeRO-3's ``assert_ints_same_as_other_ranks`` is skipped: it compares ``.item()`` values broadcast
  over the (fake) process group.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from ..simcuda.streams import (DEFAULT_STREAM, STREAMS, Event, Stream, current_stream_of, device_stream,
                               host_waits, set_host_waits)
from ..simcuda.torch_cuda import ScalarSites, device_properties
from .recorder import FakeCudaRecorder, _caller

_RECORDER: FakeCudaRecorder | None = None


@contextlib.contextmanager
def stream_context(stream: Any):
    """``torch.cuda.stream(s)``: allocations inside are made on ``s``'s pool."""
    if stream is None or _RECORDER is None:
        yield
        return
    STREAMS[stream.stream_id] = stream
    with _RECORDER.stream(stream.stream_id):
        yield


def current_stream(device: Any = None) -> Stream:
    return current_stream_of(_RECORDER.current_stream if _RECORDER is not None else 0)


def _const(value: Any):
    """A fresh function returning ``value`` (a distinct object per name: torch._dynamo's rule map refuses
    one function registered under two torch names)."""
    def const(*_: Any, **__: Any) -> Any:
        return value
    return const


_noop = _const(None)
_zero = _const(0)


class FusedAdam(torch.optim.AdamW):
    """Stand-in for ``deepspeed.ops.adam.FusedAdam`` (CUDA build only): torch's fused AdamW, betas and
    eps as given, the same two states per parameter."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)


class DeepSpeedCPUAdam(torch.optim.AdamW):
    """Stand-in for ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (a C++ kernel on host memory): torch's AdamW on
    the host partitions, states in host memory."""

    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)

    def step(self, closure: Any = None, fp16_param_groups: Any = None):  # DeepSpeed passes fp16 groups
        return super().step(closure)


def _fake_rng_state(*_: Any, **__: Any) -> torch.Tensor:
    return torch.zeros(16, dtype=torch.uint8, device="cpu")  # host tensor, as the CUDA one is


def _swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``Module._apply`` swaps FakeTensor parameters, which fails while the fake mode holds weak
    references to them. A ``.data`` assignment keeps the parameter object (optimizers hold it), as
    ``_apply`` does for real tensors; the fake device follows the new data."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
        t1.data = t2.data
        t1.fake_device = t2.fake_device
        return None
    return _ORIG["swap_tensors"](t1, t2)


_ORIG: dict[str, Any] = {}


def _patch_fake_data_setter() -> None:
    """``t.data = new`` across devices (DeepSpeed moves parameters this way, e.g. ZeRO-3's
    ``_convert_to_zero_parameters``) swaps the storage and dispatch keys but leaves a FakeTensor's
    Python-level ``fake_device`` behind: make it follow the new data."""
    from torch._subclasses.fake_tensor import FakeTensor

    base = torch._C.TensorBase.data

    def get(self):
        return base.__get__(self)

    def set_(self, new):
        base.__set__(self, new)
        dev = getattr(new, "fake_device", None)
        if dev is not None and dev != self.fake_device:
            self.fake_device = dev

    FakeTensor.data = property(get, set_)  # type: ignore[assignment]


def _patch_generation() -> None:
    from transformers.generation.utils import GenerationMixin

    orig_generate = GenerationMixin.generate
    orig_unfinished = GenerationMixin._has_unfinished_sequences

    def generate(self, *args: Any, **kwargs: Any):
        self._rlhfmem_steps_left = kwargs.get("max_new_tokens")
        try:
            return orig_generate(self, *args, **kwargs)
        finally:
            self._rlhfmem_steps_left = None

    def has_unfinished(self, this_peer_finished: bool, synced_gpus: bool, device: Any) -> bool:
        orig_unfinished(self, this_peer_finished, synced_gpus, device)  # its all-reduce, as on a GPU
        left = getattr(self, "_rlhfmem_steps_left", None)
        if left is None:
            raise RuntimeError("fake-CUDA route: generate() needs max_new_tokens (generation stops by length)")
        self._rlhfmem_steps_left = left - 1
        return left > 0

    GenerationMixin.generate = generate
    GenerationMixin._has_unfinished_sequences = has_unfinished


def install(recorder: FakeCudaRecorder, deepspeed: bool = True) -> list[str]:
    """Install every stand-in (torch's and transformers'; DeepSpeed's too unless ``deepspeed`` is False);
    returns their names (recorded in the result)."""
    global _RECORDER
    _RECORDER = recorder
    names = _install_torch_cuda({})
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
    names.append("Tensor.record_stream: no-op")
    _patch_fake_data_setter()
    names.append("FakeTensor.data setter: fake_device follows the new data")
    _ORIG["swap_tensors"] = torch.utils.swap_tensors
    torch.utils.swap_tensors = _swap_tensors
    names.append("torch.utils.swap_tensors: .data assignment for fake parameters")
    _patch_generation()
    names.append("generate: stops after max_new_tokens steps")
    if deepspeed:
        names += _install_deepspeed()
    return names


def install_sim(lib: Any, scalar_answers: dict[str, dict]) -> list[str]:
    """Stand-ins for a run on the simulated CUDA device (``simcuda/csrc/sim_cuda.cpp``; ``lib`` its loaded
    library, ``simcuda/library.py: library()``): real tensors with CUDA dispatch keys, so only what that
    device does not answer. ``torch.cuda.is_available()`` is True there (CUDA tensors can be made);
    streams tag the device's allocations through ``lib``; ``.item()`` call sites on device tensors are
    counted into ``scalar_answers`` (the device answers by dtype, as :data:`.recorder.SCALAR_ANSWERS`);
    a device tensor's ``repr`` prints no values (it has none; on a GPU, printing computes on the device).
    Returns the stand-ins' names."""
    from ..simcuda.library import (ALL_STREAMS, LOG_RECORD_STREAM, LOG_SYNC, drop_python_gpu_kernels,
                                   record_stream_mode)

    until_sync = record_stream_mode() == "until-sync"
    props = device_properties()
    waits = {}
    if until_sync:  # the device's log gets record_stream and host waits (simcuda/library.py: delay_record_stream_frees)
        set_host_waits(lambda sid: lib.rlhfmem_sim_cuda_log(LOG_SYNC, 0, sid))
        waits = {"synchronize": lambda device=None: host_waits(ALL_STREAMS),
                 "empty_cache": lambda: host_waits(ALL_STREAMS)}  # synchronize_and_free_events first
    names = _install_torch_cuda({
        "is_available": lambda: True, "is_initialized": lambda: True, "_lazy_init": _const(None),
        "init": _const(None), "stream": lambda s: device_stream(lib, s),
        "current_stream": lambda device=None: current_stream_of(lib.rlhfmem_sim_cuda_stream()),
        "get_device_properties": lambda device=None: props, "get_device_name": lambda device=None: props.name,
        "mem_get_info": lambda device=None: (props.total_memory, props.total_memory), **waits,
    })
    if until_sync:
        def record_stream(self: torch.Tensor, stream: Any) -> None:
            lib.rlhfmem_sim_cuda_log(LOG_RECORD_STREAM, self.untyped_storage().data_ptr(),
                                     getattr(stream, "stream_id", 0))

        torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
        names.append("Tensor.record_stream: the block returns to its pool when the host next waits for the "
                     "stream (synchronize, Stream/Event.synchronize, empty_cache, a value read): until-sync")
    else:
        torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
        names.append("Tensor.record_stream: no-op (the block is reusable at its free: immediate)")
    ScalarSites(site=lambda call: _caller(skip_libs=("pytest_rlhfmem/simcuda/",)), op_key="op",
                on_read=lambda t: host_waits(getattr(torch.cuda.current_stream(), "stream_id", 0)),
                sites=scalar_answers).install(torch)  # the recorder's dict: counted into its result
    names.append("Tensor.item/__bool__/__int__/__float__/tolist on device tensors: call sites counted")
    original_repr = torch.Tensor.__repr__

    def device_repr(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        if self.device.type == "cuda":
            return f"tensor(<simulated CUDA: no values>, size={tuple(self.shape)}, dtype={self.dtype}, device='cuda:0')"
        return original_repr(self, *args, **kwargs)

    torch.Tensor.__repr__ = device_repr  # type: ignore[method-assign]
    names.append("Tensor.__repr__ of device tensors: no values (DeepSpeed formats tensors into log strings)")
    _patch_generation()
    names.append("generate: stops after max_new_tokens steps")
    _skip_host_weight_init()
    names.append("weight initialisation of host tensors skipped (values never read; tying kept)")
    dropped = drop_python_gpu_kernels()  # a CUDA build's only
    if dropped:
        names.append(f"torch._native CUDA kernels removed ({', '.join(dropped)}): the device's kernels run instead")
    return names + _install_deepspeed()


HOST_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                       "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                       "sparse_")


def _skip_host_weight_init() -> None:
    """On the simulated device a model built on the host (``from_config`` before DeepSpeed moves it) is real
    memory, and its random initialisation real compute: 12.4 s of CPU per OPT-1.3b here, and its fp32 pages
    (5.62 GiB peak RSS against 2.97 without). No value is ever read (device kernels compute none; host values
    only feed the offloaded optimizer's arithmetic), so ``torch.nn.init``'s functions return a host tensor
    unchanged and transformers' per-module ``_initialize_weights`` skips modules whose own parameters are all
    on the host. Device tensors (ZeRO-3's ``zero.Init`` builds on the device) are initialised as before, and
    ``init_weights``' weight tying is untouched."""
    import torch.nn.init as tinit
    from transformers.modeling_utils import PreTrainedModel

    for name in HOST_INIT_FUNCTIONS:
        original = getattr(tinit, name, None)
        if original is None:
            continue

        def init(tensor: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                return tensor
            return _original(tensor, *args, **kwargs)

        init.__name__ = name
        setattr(tinit, name, init)
    original_module_init = PreTrainedModel._initialize_weights

    def _initialize_weights(self: Any, module: Any, is_custom_code: bool = False) -> None:
        own = list(module.parameters(recurse=False))
        if own and all(p.device.type == "cpu" for p in own):
            return
        original_module_init(self, module, is_custom_code)

    PreTrainedModel._initialize_weights = _initialize_weights


def _install_torch_cuda(extra: dict[str, Any]) -> list[str]:
    """``torch.cuda``'s device, stream, event, memory-statistic and RNG functions (``extra`` adds or
    overrides entries); returns the names."""
    names: list[str] = []
    cuda = torch.cuda
    replacements = {
        "set_device": _noop, "current_device": _zero, "device_count": lambda: 8, "synchronize": _noop,
        "Stream": Stream, "Event": Event, "stream": stream_context, "current_stream": current_stream,
        "default_stream": lambda device=None: DEFAULT_STREAM, "empty_cache": _noop,
        "memory_allocated": _zero, "max_memory_allocated": _zero, "memory_reserved": _zero,
        "max_memory_reserved": _zero, "memory_cached": _zero, "max_memory_cached": _zero,
        "reset_peak_memory_stats": _noop, "reset_max_memory_allocated": _noop, "reset_max_memory_cached": _noop,
        "memory_stats": lambda device=None: {}, "get_rng_state": _fake_rng_state, "set_rng_state": _noop,
        "get_rng_state_all": lambda: [_fake_rng_state()], "set_rng_state_all": _noop,
        "manual_seed": _noop, "manual_seed_all": _noop, "is_bf16_supported": lambda *a, **k: True,
        "get_device_capability": lambda device=None: (8, 6), "is_current_stream_capturing": lambda: False,
        **extra,
    }
    import torch._dynamo.trace_rules as trace_rules

    trace_rules.get_torch_obj_rule_map()  # built (and cached) from the real torch.cuda first
    for name, fn in replacements.items():
        if fn is _noop or fn is _zero:
            fn = _const(fn())
        setattr(cuda, name, fn)
    names.append("torch.cuda." + ",".join(sorted(replacements)))
    cuda.nvtx.range_push = _const(0)  # type: ignore[assignment]
    cuda.nvtx.range_pop = _const(0)  # type: ignore[assignment]
    return names


def _install_deepspeed() -> list[str]:
    """DeepSpeed's accelerator answers and its CUDA-only optimizers (see the module docstring)."""
    from deepspeed.accelerator import get_accelerator

    names: list[str] = []
    acc = get_accelerator()
    if type(acc).__name__ != "CUDA_Accelerator":
        raise RuntimeError(f"fake-CUDA route needs DS_ACCELERATOR=cuda; DeepSpeed chose {type(acc).__name__}")
    acc.is_available = lambda: True  # "Cannot use bfloat16 without accelerator"; torch.cuda's stays False
    acc.communication_backend_version = lambda: (2, 18, 1)
    acc.available_memory = lambda device_index=None: 24 * 2**30
    acc.total_memory = lambda device_index=None: 24 * 2**30
    names.append("deepspeed accelerator: is_available, memory (its Stream/Event are torch.cuda's stand-ins)")
    import deepspeed.ops.adam as ds_adam
    import deepspeed.runtime.engine  # noqa: F401 - imports (and binds) the optimizer classes first
    import deepspeed.runtime.zero.stage3  # noqa: F401

    # every module that bound the real classes at import (engine.py's fp16 path picks FP16_Optimizer,
    # the flattened one, only for an ``isinstance(optimizer, FusedAdam)``)
    real = {ds_adam.FusedAdam: FusedAdam, ds_adam.DeepSpeedCPUAdam: DeepSpeedCPUAdam}
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("deepspeed"):
            for attr in ("FusedAdam", "DeepSpeedCPUAdam"):
                if getattr(mod, attr, None) in real:
                    setattr(mod, attr, real[getattr(mod, attr)])
    names.append("FusedAdam -> torch AdamW(fused=True); DeepSpeedCPUAdam -> torch AdamW on host")
    import deepspeed.runtime.zero.utils as zutils

    for mod_name in ("deepspeed.runtime.zero.utils", "deepspeed.runtime.zero.stage3",
                     "deepspeed.runtime.zero.partition_parameters",
                     "deepspeed.runtime.zero.partitioned_param_coordinator"):
        __import__(mod_name)
        if hasattr(sys.modules[mod_name], "assert_ints_same_as_other_ranks"):
            sys.modules[mod_name].assert_ints_same_as_other_ranks = _const(None)
    del zutils
    names.append("zero3 assert_ints_same_as_other_ranks: skipped")
    names.append(_install_hybrid_engine())
    return names


class _NoInferenceOp:
    """What ``InferenceBuilder().load()`` answers here: a module with none of the inference kernels, so
    ``WorkspaceOp`` takes its own fallback functions (the path DeepSpeed takes on its CPU accelerator)."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"DeepSpeed's transformer_inference op has no stand-in ({name})")


def _install_hybrid_engine() -> str:
    """DeepSpeed's Hybrid Engine (``runtime/hybrid_engine.py``) loads the ``transformer_inference`` CUDA op
    when it builds its ``WorkspaceOp``. Loading it allocates nothing on a GPU; its workspace and KV cache are
    allocated only by ``generate()`` once inference containers replaced some layers. With transformers 5,
    DeepSpeed 0.19.8 replaces no OPT layer (``populate_all_inference_policies``), so the op is never called:
    the stand-in is an op with no kernels, and an engine that did inject containers is refused unless the scenario
    asks for the injected kernels (``hybrid_engine_kernels``: ``inference_kernels.install`` replaces this)."""
    from deepspeed.ops.transformer.inference.op_binding.base import BaseOp
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    BaseOp.inference_module = _NoInferenceOp()
    original = DeepSpeedHybridEngine.create_inference_module

    def create_inference_module(self: Any) -> None:
        original(self)
        if self._inference_containers:
            raise NotImplementedError(
                f"the Hybrid Engine replaced {len(self._inference_containers)} layers of "
                f"{type(self.module).__name__} with DeepSpeed inference kernels (this transformers release lets "
                "it): their stand-ins run only with the scenario override hybrid_engine_kernels=True "
                "(fakecuda/inference_kernels.py)")

    create_inference_module.__wrapped__ = original  # inference_kernels.install builds on DeepSpeed's own
    DeepSpeedHybridEngine.create_inference_module = create_inference_module
    return "Hybrid Engine: transformer_inference op with no kernels (refused if any layer is injected)"
