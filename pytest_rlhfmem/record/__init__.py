"""Recording: one rank's allocations, phases, flushes, placement and host figures, as a trace.

The layer between the runs (``rlhf/``, ``command/``, ``fakecuda/``) and replay (``memory/``): a recipe and a
user's command are two callers of the same capture. It never replays a trace except to write the rank's result.

Modules, top down:

- ``rank.py``: one rank's capture (``RankCapture``): recording started before the first model, phases, the host
  meter, the failure of a rank (its phase and memory so far), the rank's result file;
- ``api.py``: the phase-mark API a user's program calls (``rlhfmem.phase``, ``flush_point``, ``host_resident``,
  ``deepspeed_offload``);
- ``recorder.py``: the per-rank ``Recorder`` (CUDA memory history on a GPU; the CPU recorder or the simulated
  device's log elsewhere), phases and flushes as trace events;
- ``cpu_recorder.py`` + ``csrc/cpu_alloc_recorder.cpp``: every CPU allocation and free, all threads;
- ``emulation.py``: what a CPU capture lacks of CUDA (cuBLAS workspaces, reduce staging; see its docstring);
- ``host.py``: the host meter (RSS, swap staging, NVMe I/O), measured for real.
"""
