"""Every collective and point-to-point op DDP, FSDP2, DeepSpeed and accelerate use, on CUDA tensors, with the results
checked (an AssertionError names the op that came out wrong). A plain torchrun script written for a GPU machine:

    torchrun --nproc-per-node 2 dist_collectives.py [BACKEND]   # nccl (default), gloo, cuda:nccl,cpu:gloo

The gloo backend runs the subset gloo supports on CUDA tensors (no PREMUL_SUM, no coalescing manager with a device).
Prints one line per rank: ``rank R ok N ops``.
"""

import os
import sys

import torch
import torch.distributed as dist

backend = sys.argv[1] if len(sys.argv) > 1 else "nccl"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dev = torch.device("cuda", torch.cuda.current_device())
nccl = dist.get_backend() != "gloo"
ran = []


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device == dev, f"{name}: output on {got.device}, expected {dev}"
    assert torch.equal(got.cpu(), want.cpu()), f"{name}: got {got.cpu().tolist()}, expected {want.cpu().tolist()}"
    ran.append(name)


def full(n: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype, device=dev)


ranks_sum = sum(range(1, world + 1))
t = full(8, rank + 1)
dist.all_reduce(t)
check("all_reduce", t, full(8, ranks_sum))

t = full(8, rank + 1)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
check("all_reduce max", t, full(8, world))

t = full(8, rank + 1)
work = dist.all_reduce(t, async_op=True)
work.wait()
check("all_reduce async", t, full(8, ranks_sum))

t = full(8, float(rank + 1), torch.bfloat16)
dist.all_reduce(t, op=dist.ReduceOp.AVG)
check("all_reduce avg bf16", t, full(8, ranks_sum / world, torch.bfloat16))

if nccl:
    t = full(8, rank + 1)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    check("all_reduce premul_sum", t, full(8, ranks_sum * 0.5))
    try:
        dist.all_reduce(full(2, 1), op=dist.ReduceOp.BAND)
        raise AssertionError("all_reduce BAND: no error")
    except ValueError as exc:
        assert "Cannot use ReduceOp.BAND with NCCL" in str(exc), exc
        ran.append("all_reduce band refused")

t = full(8, rank + 1)
dist.broadcast(t, src=world - 1)
check("broadcast", t, full(8, world))

out = torch.empty(8 * world, device=dev)
dist.all_gather_into_tensor(out, full(8, rank + 1))
check("all_gather_into_tensor", out, torch.cat([full(8, r + 1) for r in range(world)]))

outs = [torch.empty(8, device=dev) for _ in range(world)]
dist.all_gather(outs, full(8, rank + 1))
check("all_gather", torch.cat(outs), torch.cat([full(8, r + 1) for r in range(world)]))

if nccl:  # unequal sizes: one broadcast per rank (ProcessGroupNCCL), gloo refuses
    outs = [torch.empty(r + 1, device=dev) for r in range(world)]
    dist.all_gather(outs, full(rank + 1, rank + 1))
    check("all_gather uneven", torch.cat(outs), torch.cat([full(r + 1, r + 1) for r in range(world)]))

out = torch.empty(8, device=dev)
dist.reduce_scatter_tensor(out, torch.arange(8 * world, dtype=torch.float32, device=dev) * (rank + 1))
check("reduce_scatter_tensor", out, torch.arange(8 * rank, 8 * rank + 8, dtype=torch.float32, device=dev) * ranks_sum)

out = torch.empty(8, device=dev)
dist.reduce_scatter(out, [full(8, r + rank) for r in range(world)])
check("reduce_scatter", out, full(8, world * rank + sum(range(world))))

if nccl:
    out = torch.empty(8, device=dev)
    dist.reduce_scatter_tensor(out, full(8 * world, rank + 1), op=dist._make_nccl_premul_sum(1.0 / world))
    check("reduce_scatter_tensor premul_sum", out, full(8, ranks_sum / world))

out = torch.empty(world * 2, device=dev)
dist.all_to_all_single(out, torch.arange(world * 2, dtype=torch.float32, device=dev) + 100 * rank)
check("all_to_all_single", out, torch.tensor([100 * r + 2 * rank + i for r in range(world) for i in range(2)],
                                             dtype=torch.float32, device=dev))

outs = [torch.empty(2, device=dev) for _ in range(world)]
dist.all_to_all(outs, [full(2, 10 * rank + r) for r in range(world)])
check("all_to_all", torch.cat(outs), torch.cat([full(2, 10 * r + rank) for r in range(world)]))

t = full(4, rank + 1)
dist.reduce(t, dst=0)
if rank == 0:
    check("reduce", t, full(4, ranks_sum))
elif nccl:  # ncclReduce writes the root's buffer only; gloo may use the others' as scratch
    check("reduce non-root", t, full(4, rank + 1))

gathered = [torch.empty(4, device=dev) for _ in range(world)] if rank == 0 else None
dist.gather(full(4, rank + 1), gathered, dst=0)
if rank == 0:
    check("gather", torch.cat(gathered), torch.cat([full(4, r + 1) for r in range(world)]))

out = torch.empty(4, device=dev)
dist.scatter(out, [full(4, r + 7) for r in range(world)] if rank == 0 else None, src=0)
check("scatter", out, full(4, rank + 7))

if rank == 0:
    dist.send(full(4, 42), dst=1)
elif rank == 1:
    t = torch.empty(4, device=dev)
    dist.recv(t, src=0)
    check("send/recv", t, full(4, 42))

recv = torch.empty(4, device=dev)
ops = [dist.P2POp(dist.isend, full(4, rank + 1), (rank + 1) % world),
       dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
check("batch_isend_irecv", recv, full(4, (rank - 1) % world + 1))

if nccl:
    outs = [torch.empty(4 * world, device=dev) for _ in range(2)]
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        for i, o in enumerate(outs):
            dist.all_gather_into_tensor(o, full(4, rank + 10 * i), async_op=True)
    cm.wait()
    check("coalescing_manager all_gather", torch.cat(outs),
          torch.cat([full(4, r + 10 * i) for i in range(2) for r in range(world)]))

objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "pad": "x" * 100 * rank})  # unequal sizes: resize_ keeps the bytes
assert objs == [{"rank": r, "pad": "x" * 100 * r} for r in range(world)], objs
ran.append("all_gather_object")

dist.barrier()
ran.append("barrier")
print(f"rank {rank} ok {len(ran)} ops", flush=True)
dist.destroy_process_group()
