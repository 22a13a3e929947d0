"""What a NCCL process group holds in device memory, read with the program's own torch.cuda.memory_allocated():

    torchrun --nproc-per-node 2 dist_memory.py

Each line ``MEM {"case": ..., ...}`` gives allocated bytes at the points that tell ProcessGroupNCCL's rules apart
(torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, torch 2.13): a blocking collective keeps nothing, an asynchronous
one keeps its tensors until ``wait()`` (and its work object until it is dropped) or, dropped without a wait, until the
group's next collective; an all-gather into a list flattens its output in a buffer of its own; a barrier makes a
1-byte tensor (ProcessGroup.hpp) and all-reduces a 1-element fp32 one.
"""

import json
import os

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
rank, world = dist.get_rank(), dist.get_world_size()
MIB = 1 << 20


def allocated() -> int:
    return torch.cuda.memory_allocated()


def report(case: str, **points: int) -> None:
    if rank == 0:
        print("MEM " + json.dumps({"case": case, **points}), flush=True)


base = allocated()
t = torch.ones(MIB // 4, device="cuda")  # 1 MiB
dist.all_reduce(t)
del t
report("blocking", after_del=allocated() - base)

t = torch.ones(MIB // 4, device="cuda")
work = dist.all_reduce(t, async_op=True)
del t
held = allocated() - base
work.wait()
after_wait = allocated() - base  # the work's outputs_ (and its future) still hold the tensor
del work
report("async_waited", before_wait=held, after_wait=after_wait, after_del_work=allocated() - base)

t = torch.ones(MIB // 4, device="cuda")
work = dist.all_reduce(t, async_op=True)
del t, work
held = allocated() - base
small = torch.ones(4, device="cuda")
dist.all_reduce(small)  # the group's next collective: the earlier stash goes
report("async_dropped", before_next=held, after_next=allocated() - base)  # the 16 B tensor's 512 B block
del small

outs = [torch.empty(MIB // 4, device="cuda") for _ in range(world)]
inp = torch.ones(MIB // 4, device="cuda")
before = allocated()
torch.cuda.reset_peak_memory_stats()
dist.all_gather(outs, inp)
report("all_gather_list", peak_extra=torch.cuda.max_memory_allocated() - before, after=allocated() - before)
del outs, inp

before = allocated()
torch.cuda.reset_peak_memory_stats()
dist.barrier()
report("barrier", peak_extra=torch.cuda.max_memory_allocated() - before, after=allocated() - before)
dist.destroy_process_group()
