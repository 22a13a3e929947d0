"""A plain CUDA script calling the torch.cuda functions memory-profiling scripts use: device queries, seeds,
peak resets, memory history, streams, events, nvtx, synchronize, memory statistics, empty_cache, .item(),
_dump_snapshot. `rlhfmem capture --device cuda-sim` must run it to the end.

    python cuda_functions.py SNAPSHOT.pickle
"""

import json
import sys

import torch

assert torch.cuda.is_available()
device = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.cuda.device_count(), torch.cuda.current_device(),
      torch.cuda.get_device_capability(), torch.cuda.get_device_properties(0).total_memory)
torch.cuda.set_device(0)
torch.manual_seed(0)
torch.cuda.manual_seed_all(0)
torch.cuda.reset_peak_memory_stats()
torch.cuda.memory._record_memory_history(max_entries=100_000)
x = torch.randn(1024, 1024, device=device)
layer = torch.nn.Linear(1024, 1024).cuda()
side = torch.cuda.Stream()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
torch.cuda.nvtx.range_push("forward")
with torch.cuda.stream(side):
    y = layer(x)
torch.cuda.current_stream().wait_stream(side)
torch.cuda.nvtx.range_pop()
with torch.cuda.nvtx.range("backward"):
    y.sum().backward()
end.record()
torch.cuda.synchronize()
answers = {"item": x.sum().item(), "any": bool((x > 0).any())}  # .item() on the device: answered
figures = {**answers, "elapsed_ms": start.elapsed_time(end), "allocated": torch.cuda.memory_allocated(),
           "max_allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved(),
           "max_reserved": torch.cuda.max_memory_reserved(),
           "stats_peak": torch.cuda.memory_stats()["allocated_bytes.all.peak"],
           "free_total": list(torch.cuda.mem_get_info())}
del y
torch.cuda.empty_cache()
figures["reserved_after_empty_cache"] = torch.cuda.memory_reserved()
torch.cuda.memory._dump_snapshot(sys.argv[1])
torch.cuda.memory._record_memory_history(enabled=None)
print("FIGURES " + json.dumps(figures))
