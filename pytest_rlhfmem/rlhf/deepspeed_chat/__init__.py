"""The DeepSpeed-Chat step-3 recipe: one iteration on real DeepSpeed, phase by phase, chosen by the scenario.

Follows microsoft/DeepSpeedExamples ``applications/DeepSpeed-Chat`` (facts: ``shared/reference/rlhf-frameworks.md``).
One small package, read bottom up; each module imports only those below it:

- ``configs.py``: what each memory strategy turns on (:data:`STRATEGY_SETTINGS`) and DeepSpeed-Chat's
  train/eval configs (``dschat/utils/ds_utils.py``);
- ``builders.py``: the models and engines (``rlhf_engine.py``: actor, reference, critic, reward; the
  critic/reward model of ``reward_model.py``; LoRA), and Hydra-PPO's one model with two adapters;
- ``experience.py``: what every iteration makes the same way: the actor's answers (phases ``generate``,
  ``generate_greedy``) and the reward model's scores;
- ``ppo_iteration.py``: PPO (``ppo_trainer.py``: ``generate_experience``, ``train_rlhf``);
  ``critic_free_iteration.py``: ReMax and GRPO; ``hydra_iteration.py``: Hydra-PPO;
- this module: :func:`run_iteration`, the one entry (the rank worker and the fake-CUDA route call it).

Every phase is a step of ``common.PhaseSteps`` (``with steps("infer_actor"):``): the recorder marks it, the fault
hook fires at its end, the flush policy empties the cache after it.

The rewards, advantages and losses are the framework-free code of ``rlhf/ppo.py`` and ``rlhf/critic_free.py``,
shared with the ColossalChat recipe; the two recipes import nothing from each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ...record.recorder import Recorder
from ..scenario import Scenario
from .builders import create_critic_model
from .configs import STRATEGY_SETTINGS
from .critic_free_iteration import run_critic_free_iteration
from .hydra_iteration import run_hydra_iteration
from .ppo_iteration import run_ppo_iteration

__all__ = ["STRATEGY_SETTINGS", "copy_offloaded_fetches", "create_critic_model", "record_deepspeed_empty_cache",
           "run_iteration"]

# The capture_description entry of a DeepSpeed-Chat CPU run: DeepSpeed's own empty_cache() calls.
DEEPSPEED_EMPTY_CACHE = "recorded as flushes where CUDA's accelerator calls torch.cuda.empty_cache()"


def record_deepspeed_empty_cache() -> str:
    """On the CPU route: make DeepSpeed's CPU accelerator's ``empty_cache()`` (a no-op,
    ``accelerator/cpu_accelerator.py``) do what its CUDA accelerator's does (``accelerator/cuda_accelerator.py``:
    ``torch.cuda.empty_cache()``), so the capture records the flushes DeepSpeed makes on a GPU: ZeRO's own
    calls and the Hybrid Engine's in ``eval()`` under ZeRO-3, each named ``empty_cache@<DeepSpeed file>:<line>``
    by the capture's interception (``Recorder.intercept_empty_cache``); without CUDA the call does nothing else.
    Returns the ``capture_description`` text."""
    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    def empty_cache(self: CPU_Accelerator) -> None:
        torch.cuda.empty_cache()  # looked up at call time: the capture's interception

    CPU_Accelerator.empty_cache = empty_cache
    return DEEPSPEED_EMPTY_CACHE


@contextlib.contextmanager
def copy_offloaded_fetches(scenario: Scenario, device: str) -> Iterator[bool]:
    """On the CPU route under ZeRO-3 parameter offload: make DeepSpeed's fetch of a parameter that needs no
    all-gather (partition world size 1) copy the host partition, as on a GPU.

    DeepSpeed 0.19.8 (``runtime/zero/partition_parameters.py``: ``NoGatherHandle``, ``NoGatherCoalescedHandle``)
    fetches such a parameter as ``param.data = param.ds_tensor.data.to(current_device_name()).view(ds_shape)``.
    Under ``offload_param`` the partition ``ds_tensor`` is in host memory, so on a GPU this is a host-to-device
    copy: a new device block of ``ds_numel x element size`` bytes, freed when the parameter is released
    (``free_param``). On a CPU run ``.to("cpu")`` returns the partition itself, which the recipe declares
    host-resident (``placement.py``), so the fetch left no allocation in the device trace. Here the fetched
    ``param.data`` is a copy (``clone``), recorded as the GPU's device block. Parameters whose partition lives on
    the device (no offload; ZeRO-3 at world size 1 aliases it on a GPU too) and ranks that all-gather are left
    as they are. Yields whether it applies (``device`` cpu, ZeRO-3, offload); restores DeepSpeed's classes on exit.
    """
    stage, offload, _ = STRATEGY_SETTINGS.get(scenario.strategy, (0, False, False))
    if device != "cpu" or stage != 3 or not offload:
        yield False
        return
    from deepspeed.runtime.zero import partition_parameters as pp

    def aliased(param) -> bool:  # noqa: ANN001 - a ZeRO-3 parameter
        ds = getattr(param, "ds_tensor", None)
        return (ds is not None and param.data.numel() > 0
                and param.data.untyped_storage().data_ptr() == ds.untyped_storage().data_ptr())

    def copying(init):  # noqa: ANN001, ANN202
        def __init__(self, params, *args, **kwargs) -> None:  # noqa: ANN001, N807
            init(self, params, *args, **kwargs)
            for p in params if isinstance(params, (list, tuple)) else [params]:
                if aliased(p):
                    p.data = p.data.clone()  # the host-to-device copy of a GPU run

        return __init__

    originals = {cls: cls.__init__ for cls in (pp.NoGatherHandle, pp.NoGatherCoalescedHandle)}
    for cls, init in originals.items():
        cls.__init__ = copying(init)
    try:
        yield True
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


def run_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    """Build the scenario's engines and run one iteration of its algorithm under ``rec``: Hydra-PPO for the
    ``hydra`` strategy, ReMax or GRPO for those algorithms, PPO otherwise. Returns losses and settings.
    On the CPU route under ZeRO-3 offload a fetched parameter is a copy of its host partition
    (:func:`copy_offloaded_fetches`)."""
    with copy_offloaded_fetches(scenario, device):
        return _run_iteration(scenario, rec, device, rank, world_size)


def _run_iteration(scenario: Scenario, rec: Recorder, device: str, rank: int, world_size: int) -> dict:
    if scenario.strategy == "hydra":
        return run_hydra_iteration(scenario, rec, device, rank, world_size)
    if scenario.algorithm != "ppo":
        return run_critic_free_iteration(scenario, rec, device, rank, world_size)
    return run_ppo_iteration(scenario, rec, device, rank, world_size)
