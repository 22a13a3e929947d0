"""A CUDA program whose second thread reads torch.cuda.memory_stats() while the main thread allocates, frees and reads
them too (a monitoring thread, as a rank's progress heartbeat is, beside a training loop that logs its memory):
prints both threads' errors and the final statistics."""

import json
import threading

import torch

done = threading.Event()
errors = []


def read_stats():
    while not done.is_set():
        try:
            torch.cuda.memory_stats()
        except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
            errors.append(f"{type(exc).__name__}: {exc}")
            return


reader = threading.Thread(target=read_stats)
reader.start()
for step in range(300):
    kept = [torch.empty(1024 * (1 + (step + k) % 7), device="cuda") for k in range(40)]
    del kept[::2]
    del kept
    try:
        torch.cuda.memory_allocated()
    except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
        errors.append(f"main: {type(exc).__name__}: {exc}")
        break
done.set()
reader.join()
stats = torch.cuda.memory_stats()
print("STATS " + json.dumps({"errors": errors, "allocated": stats["allocated_bytes.all.current"],
                             "allocs": stats["allocation.all.allocated"], "frees": stats["allocation.all.freed"]}))
