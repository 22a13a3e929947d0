"""Which tensors a framework keeps in host memory: the placement annotations the CPU path needs.

On a CPU run a move to host is a no-op, so offloaded state sits in the same allocator as device
tensors; the recorder is told which tensors are host-resident (``ARCHITECTURE.md``, second trap).
Shared by the DeepSpeed-Chat recipe and :func:`pytest_rlhfmem.deepspeed_offload`.
"""

from __future__ import annotations


def _device_of(offload_config) -> str:  # noqa: ANN001 - DeepSpeed's pydantic offload config, or None
    device = getattr(offload_config, "device", None)
    return str(getattr(device, "value", device) or "none")


def deepspeed_offloaded_tensors(engine, offload: bool | None = None) -> list:  # noqa: ANN001
    """Tensors DeepSpeed keeps in host memory under ZeRO CPU offload (``runtime/zero/stage3.py``,
    ``stage_1_and_2.py``, ``partition_parameters.py``, DeepSpeed 0.16-0.19): the fp32 master partitions
    and their gradients, the optimizer states, the flat gradient buffer, and (parameter offload) the
    parameters' partitions ``ds_tensor``.

    ``engine``: a ``deepspeed.DeepSpeedEngine`` (or a module whose parameters carry ``ds_tensor``).
    ``offload``: ``True`` takes every such tensor (the DeepSpeed-Chat recipe's rule), ``False`` none,
    ``None`` reads the engine's config: optimizer state when ``offload_optimizer.device`` is cpu/nvme,
    partitions when ``offload_param.device`` is. Returns a list of tensors (possibly views sharing
    storage; the recorder counts each storage once). Optimizer states exist only after the first
    ``step()``: call again then. Never raises for an engine without these attributes (returns ``[]``).
    """
    import torch

    if offload is False:
        return []
    opt_off = param_off = bool(offload)
    if offload is None:
        opt_off = _device_of(_call(engine, "zero_offload_optimizer")) in ("cpu", "nvme")
        param_off = _device_of(_call(engine, "zero_offload_param")) in ("cpu", "nvme")
    out: list[torch.Tensor] = []
    opt = getattr(engine, "optimizer", None)
    if opt_off:
        for name in ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat",
                     "param_groups_fp16_flat_cpu_memory", "single_partition_of_fp32_groups",
                     "param_buffer_of_bit16_for_cpu_offload_groups"):  # stage 3, then stages 1-2
            for t in getattr(opt, name, None) or []:
                if isinstance(t, torch.Tensor):
                    out.append(t)
                    if t.grad is not None:
                        out.append(t.grad)
        for name in ("grad_partitions_flat_buffer", "temp_grad_buffer_for_cpu_offload"):
            buf = getattr(opt, name, None)
            if isinstance(buf, torch.Tensor):
                out.append(buf)
        accumulated = getattr(opt, "accumulated_grads_in_cpu", None) or {}  # stage 1-2 offload
        out.extend(t for t in accumulated.values() if isinstance(t, torch.Tensor))
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    if param_off:
        module = engine.module if hasattr(engine, "module") else engine
        for p in module.parameters():
            ds_tensor = getattr(p, "ds_tensor", None)
            if isinstance(ds_tensor, torch.Tensor):
                out.append(ds_tensor)
    return out


def _call(obj, name: str):  # noqa: ANN001, ANN202
    fn = getattr(obj, name, None)
    return fn() if callable(fn) else None
