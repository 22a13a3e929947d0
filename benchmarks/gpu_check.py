"""The prepared device check (issue 35): the one-GPU suite measured on a GPU beside the same cells simulated on the
same machine, the public CS336 workloads both ways, one directory of tables and raw results.

    python benchmarks/gpu_check.py prepare            # HERE, with a torch beside pip: .whl/, .gpu-check-shared/,
                                                      # then the exact device command line, its carry and timeout
    bash .ci/gpu-check                                # ON THE GPU MACHINE: wheels into /tmp/site, then `run --mode gpu`
    python benchmarks/gpu_check.py run --mode cpu --out DIR   # CPU-only: a small subset, GPU columns "not run"
    python benchmarks/gpu_check.py unpack TARBALL     # the tarball that came back, into docs/gpu-runs/ and baselines/
    python benchmarks/gpu_check.py render DIR         # DIR/README.md again from DIR/results.json

``run --mode gpu`` (at most ``--deadline-s`` seconds, default 420, so the device command ends inside its 480 s):

1. ``env``: the card (``nvidia-smi``: name, driver, memory), torch/DeepSpeed/transformers/peft versions.
2. ``builds``: DeepSpeed's JIT ops timed one by one, in parallel processes (``FusedAdamBuilder``, ``CPUAdamBuilder``,
   ``InferenceBuilder`` for the Hybrid Engine of OPT-1.3b; ``deepspeed/ops/op_builder``), the CPU route's ops and
   allocation recorder (``rlhf/launch.py: prebuild_ops``), and a probe of the simulated CUDA device
   (``simcuda/build.py: load(SIM_SOURCE)`` before ``import torch``), whose failure marks the fake-CUDA and
   cuda-sim steps failed with its one line instead of running them.
3. ``gpu-cells``: ``suites/test_deepspeed_chat_gpu1.py``, one pytest session per cell (``--rlhfmem-update-baselines
   --rlhfmem-json``, ``--gpu-marker require``), several at once under an estimate of each cell's GPU memory
   (:data:`GPU_GIB`, capacity :data:`GPU_CAPACITY_GIB`): budgets land in ``baselines/cuda-<gpu>-x1/``.
4. ``cpu-route`` and ``fake-cuda``: the same cells simulated (``rlhfmem run --device cpu --world-size 1``: tiny OPT and
   OPT-125m; ``fakecuda.run.run_fake_cuda(scenario, tensors="sim")``: all three pairs), :data:`SIM_WORKERS` processes.
5. ``workloads``: ``tests/data/commands/cs336_memory_profile.py`` (inference ctx 128, training ctx 256) under
   ``rlhfmem capture --device cuda`` and ``--device cuda-sim``; each dumped snapshot and the GPU recording it
   reproduces (``wedson_medium_*``) replayed anchored (``fidelity/workloads.py: recorded_figures``).

Every step records ``ok``, ``failed: <one line>`` or ``not run: <why>``; a failed step never stops the others, and
every process is killed at its step's limit. The directory ``docs/gpu-runs/<date>-<gpu slug>/`` gets ``README.md``
(per-cell, per-phase tables: GPU-measured beside simulated; sizes in MiB/GiB, bytes in the JSONs), ``results.json``
(every figure the tables show, bytes) and ``raw/`` (the result JSONs as the product wrote them); ``--pack DIR``
writes ``gpu-check.tar.gz`` holding that directory and ``baselines/cuda-*-x1/`` into DIR (the device's ``$OUT``).

Standard library and the project's own API only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the working tree's package, also where it is not installed (the device machine)

from pytest_rlhfmem.units import format_size  # noqa: E402

WHEEL_DIR = ".whl"  # carried: DeepSpeed's wheel and what the GPU image lacks (ignored: .gitignore)
SHARED_DIR = ".gpu-check-shared"  # carried: the GPU recordings this check reads from ../shared (ignored)
RECORDINGS = ("wedson_medium_128_inference", "wedson_medium_256_training")
DEEPSPEED = "deepspeed==0.19.8"
# What the GPU image (KINDS.md's package list, 2026-11-17) lacks for DeepSpeed 0.19.8 and transformers 5.23.0, or
# holds at a version not known to fit: deepspeed's Requires-Dist hjson and pydantic>=2 are not in the image;
# pydantic 2.14.3 requires pydantic-core==2.50.4, annotated-types, typing-inspection>=0.4.4 and typing-extensions
# >=4.16.0 (the image's version unknown); transformers 5.23.0 requires regex>=2025.10.22 (the image's unknown); its
# other requirements are met there (huggingface-hub 1.33.0 >=1.31, tokenizers 0.23.2 in [0.23.1, 0.24), safetensors
# 0.8.0, typer, pyyaml, tqdm, numpy, packaging). peft 0.21.2: the CPU environment's, so both sides share it.
CARRIED_WHEELS = ("transformers==5.23.0", "peft==0.21.2", "hjson==3.1.0", "pydantic==2.14.3", "pydantic_core==2.50.4",
                  "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing_extensions==4.16.0",
                  "regex==2026.11.15")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# The device tool allows 600 s a command and 15 min of device time a session, starts included; the check gets at
# most two calls and 12 min in all (issue 35): a first call of at most 480 s (about 1.5 min to start the machine
# before it) leaves room for a second, warm call that reruns what failed (`--cell ID`, repeated).
DEVICE_TIMEOUT_S = 480  # the timeout_s of the device call
DEFAULT_DEADLINE_S = 420  # run's own limit: packing and the transfer stay inside DEVICE_TIMEOUT_S
TRAVEL_LIMIT = 64 * 2**20  # bytes: tracked + untracked-not-ignored files + carried paths (device README)
COMMAND_LIMIT = 2000  # characters of one device command
CARRY_LIMIT = 8
EXPECTED_WHEELS_BYTES = 20 * 2**20  # upper bound of .whl/ where it is not built yet (19.1 MiB measured 2026-11-26)

GPU_SUITE = "suites/test_deepspeed_chat_gpu1.py"
GPU_TEST = "test_iteration_within_budget"
PAIRS_GPU = ("tiny-opt", "opt-125m", "opt-1.3b")
PAIRS_CPU_ROUTE = ("tiny-opt", "opt-125m")  # OPT-1.3b on the CPU route: tens of GiB of host memory, minutes
STRATEGIES = ("none", "zero2", "zero3", "zero3-offload", "grad-ckpt", "all")
FLUSHES = ("none", "after-inference")
# Estimated GPU memory of one cell (GiB), what the scheduler lets run at once on one card: OPT-1.3b unsharded at world
# size 1 holds fp16 weights, fp32 master weights, Adam's two moments and the critic's (about 21 GiB; the study's
# 4-rank none cell reserved 18.8 GB), offload keeps the optimizer in host memory. An overlap shows as retries.
GPU_GIB = {"tiny-opt": 2, "opt-125m": 4, "opt-1.3b": 26, "opt-1.3b-offload": 14, "workload": 12}
GPU_CAPACITY_GIB = 72
GPU_CONCURRENCY = 6
SIM_WORKERS = 8
METRICS = (("peak_reserved", "peak reserved", True), ("peak_allocated", "peak allocated", True),
           ("fragmentation_at_peak", "fragmentation at peak", True), ("cuda_malloc_count", "cudaMalloc", False),
           ("alloc_retries", "retries", False))
SOURCES = (("gpu", "GPU"), ("cpu", "CPU route (simulated)"), ("fake", "fake-CUDA (simulated)"))
NO_CUDA = "not run: no CUDA device"
WORKLOADS = (  # (name, script arguments, recording it reproduces)
    ("inference-128", ["--mode", "inference", "--context-length", "128"], "wedson_medium_128_inference"),
    ("training-256", ["--mode", "training", "--context-length", "256"], "wedson_medium_256_training"),
)
CPU_WORKLOADS = (("inference-small-32", ["--size", "small", "--mode", "inference", "--context-length", "32",
                                         "--batch-size", "1", "--warmups", "1"], None),)
CPU_SUBSET = ("deepspeed-chat/tiny-opt/zero2/flush-after-inference/x1",)


def cell_id(pair: str, strategy: str, flush: str) -> str:
    """The scenario id of a world-size-1 DeepSpeed-Chat PPO cell (``rlhf/scenario.py``'s format)."""
    return f"deepspeed-chat/{pair}/{strategy}/flush-{flush}/x1"


def slug(text: str) -> str:
    """A file name of ``text``: letters, digits, ``.``, ``_`` and ``-`` only (what comes back from ``$OUT``)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text).strip("_")


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def phase_figures(result: dict) -> dict[str, dict[str, int | None]]:
    """Per phase and for the whole iteration (``iteration``), the table's figures of one result: peak reserved,
    peak allocated, fragmentation at peak (bytes; ``None`` where the result has none), cudaMalloc count and
    allocation retries. Reads both result shapes: a scenario result (``rlhf/launch.py: aggregate``: ``phases`` a
    dict, ``metrics``) and a fake-CUDA rank result (``fakecuda/worker.py``: ``phases`` a list, ``total``)."""
    phases = result.get("phases") or {}
    if isinstance(phases, list):
        rows, total = {p["phase"]: p for p in phases}, result.get("total") or {}
    else:
        rows, total = dict(phases), result.get("metrics") or {}
    out = {name: {k: p.get(k) for k, _, _ in METRICS} for name, p in rows.items()}
    out["iteration"] = {k: total.get(k) for k, _, _ in METRICS}
    return out


def figure_text(value: int | None, is_size: bool) -> str:
    """A figure as the tables print it: sizes by :func:`format_size` (MiB/GiB), counts as integers, ``-`` for none."""
    if value is None:
        return "-"
    return format_size(value) if is_size else str(value)


# --------------------------------------------------------------------------------------------------------------
# Processes with limits
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """One finished process: return code (``None`` when killed at its limit), wall seconds, the log's path."""

    rc: int | None
    wall_s: float
    log: Path

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cause(self) -> str:
        """One line: the last non-empty line of the log (a traceback's error line), or the limit reached."""
        if self.rc is None:
            return f"killed at its time limit after {self.wall_s:.0f} s"
        lines = [ln.strip() for ln in self.tail().splitlines() if ln.strip()]
        last = lines[-1] if lines else "no output"
        return f"exit {self.rc}: {last[:300]}"


def run_limited(cmd: list[str], log: Path, timeout: float, env: dict | None = None, cwd: Path = REPO) -> Proc:
    """Run ``cmd`` in its own session, output to ``log``; at ``timeout`` seconds kill its whole process group."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if timeout <= 0:
        log.write_text("not started: no time left\n")
        return Proc(None, 0.0, log)
    with open(log, "wb") as fh:
        try:
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        except OSError as exc:
            fh.write(f"cannot start {cmd[0]}: {exc}\n".encode())
            return Proc(127, 0.0, log)
        try:
            rc: int | None = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    return Proc(rc, round(time.perf_counter() - t0, 2), log)


class Clock:
    """The run's one deadline (``time.monotonic`` seconds)."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left(self, reserve: float = 0.0) -> float:
        return self.end - reserve - time.monotonic()


class GpuMemory:
    """How many GiB of the card the running jobs are estimated to hold (:data:`GPU_GIB`), at most ``concurrency``
    at once. :meth:`take` waits for room; a waiting job of a lower ``prio`` number goes first, and one of a higher
    number passes it only where both fit."""

    def __init__(self, capacity: float, concurrency: int):
        self.capacity, self.concurrency = capacity, concurrency
        self.used, self.running = 0.0, 0
        self.waiting: list[tuple[int, float]] = []
        self.cond = threading.Condition()

    def _fits(self, gib: float, prio: int) -> bool:
        if self.running >= self.concurrency or (self.running and self.used + gib > self.capacity):
            return False
        ahead = [g for p, g in self.waiting if p < prio]
        return not ahead or self.used + gib + min(ahead) <= self.capacity

    def take(self, gib: float, clock: Clock, prio: int = 1) -> bool:
        """Wait until ``gib`` fits; ``False`` when the run's deadline passed first."""
        with self.cond:
            self.waiting.append((prio, gib))
            try:
                while not self._fits(gib, prio):
                    if clock.left(20) <= 0:
                        return False
                    self.cond.wait(timeout=1.0)
            finally:
                self.waiting.remove((prio, gib))
                self.cond.notify_all()
            self.used += gib
            self.running += 1
            return True

    def give(self, gib: float) -> None:
        with self.cond:
            self.used -= gib
            self.running -= 1
            self.cond.notify_all()


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Check:
    """Everything the run measured, as ``results.json`` holds it (sizes in bytes, times in seconds)."""

    mode: str
    meta: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)  # {name, status, wall_s, detail}
    cells: dict = field(default_factory=dict)  # cell id -> source -> {status, figures?, raw?, wall_s}
    workloads: dict = field(default_factory=dict)  # name -> source -> {status, figures?, ...}
    files: dict = field(default_factory=dict)  # snapshot/trace path -> bytes (not packed)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def step(self, name: str, status: str, wall_s: float, detail: str = "") -> None:
        with self.lock:
            self.steps.append({"name": name, "status": status, "wall_s": round(wall_s, 2), "detail": detail})

    def put(self, table: str, key: str, source: str, entry: dict) -> None:
        with self.lock:
            getattr(self, table).setdefault(key, {})[source] = entry

    def to_json(self) -> dict:
        return {"schema": 1, "mode": self.mode, "meta": self.meta, "steps": self.steps, "cells": self.cells,
                "workloads": self.workloads, "files": self.files}


EXT_ROOT: list[Path] = []  # set by run --mode gpu: a fresh extension cache per route under the work directory


def base_env(ext: str | None = None, **extra: str) -> dict:
    """This process's environment with the hubs offline and the working tree on ``PYTHONPATH``; on the GPU run
    torch's extension cache is ``<work>/ext-<ext>``, one per route (the CPU route's and the GPU's builds of one op
    differ); on CPU the caller's ``$TORCH_EXTENSIONS_DIR`` stays (tox's, already built)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        paths.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if ext and EXT_ROOT:
        env["TORCH_EXTENSIONS_DIR"] = str(EXT_ROOT[0] / f"ext-{ext}")
    env.update(extra)
    return env


ENV_PROBE = r"""
import json, importlib.metadata as md, platform
out = {"python": platform.python_version()}
for name in ("torch", "deepspeed", "transformers", "peft", "pytest-rlhfmem"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = "not installed"
import torch
out["torch"] = torch.__version__
out["torch_cuda"] = torch.version.cuda
out["cuda_devices"] = [{"name": torch.cuda.get_device_name(i),
                        "total_memory": torch.cuda.get_device_properties(i).total_memory}
                       for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
print("ENV " + json.dumps(out))
"""


def probe_env(check: Check, work: Path, clock: Clock) -> None:
    t0 = time.perf_counter()
    p = run_limited([sys.executable, "-c", ENV_PROBE], work / "logs" / "env.log", min(120, clock.left()), base_env())
    line = next((ln for ln in p.tail(20000).splitlines() if ln.startswith("ENV ")), None)
    info = json.loads(line[4:]) if line else {}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip() or "unknown"
    info["cpu_count"] = os.cpu_count()
    check.meta.update(info)
    check.step("env", "ok" if line else f"failed: {p.cause()}", time.perf_counter() - t0,
               "card, driver and versions" if line else "")


GPU_OP = ("import sys, time\nfrom deepspeed.accelerator import get_accelerator\nt = time.perf_counter()\n"
          "get_accelerator().create_op_builder(sys.argv[1]).load(verbose=False)\n"
          "print(f'BUILT {sys.argv[1]} {time.perf_counter() - t:.2f}')\n")
CPU_OPS = ("from pytest_rlhfmem.rlhf.launch import prebuild_ops\n"
           "print(f\"BUILT cpu {prebuild_ops('cpu', ['ShareMemCommBuilder', 'CPUAdamBuilder']):.2f}\")\n")
# torch registers its CUDA hooks while it is imported: a CUDA build's own registration beside the simulated device's
# is what can fail here (c10's registry refuses a key registered twice)
SIM_PROBE = ("from pytest_rlhfmem.simcuda.build import SIM_SOURCE, load\nload(SIM_SOURCE)\nimport torch\n"
             "print('SIM ok', torch.__version__)\n")


@dataclass
class Builds:
    """Events the later steps wait on, and the simulated device's verdict (``None``: it works)."""

    gpu_ops: dict = field(default_factory=lambda: {n: threading.Event() for n in
                                                   ("FusedAdamBuilder", "CPUAdamBuilder", "InferenceBuilder")})
    cpu_ops: threading.Event = field(default_factory=threading.Event)
    sim: threading.Event = field(default_factory=threading.Event)
    sim_failure: str | None = None
    gpu_failures: dict = field(default_factory=dict)
    cpu_failure: str | None = None


def start_builds(check: Check, work: Path, clock: Clock, gpu: bool, pool: ThreadPoolExecutor) -> Builds:
    """Each JIT build in its own process at once, each timed alone (a step per build)."""
    b = Builds()

    def gpu_op(name: str) -> None:
        p = run_limited([sys.executable, "-c", GPU_OP, name], work / "logs" / f"build-{name}.log",
                        min(420, clock.left(60)), base_env("gpu"))
        ok = p.rc == 0
        if not ok:
            b.gpu_failures[name] = p.cause()
        check.step(f"build {name} (DeepSpeed JIT, CUDA)", "ok" if ok else f"failed: {p.cause()}", p.wall_s)
        b.gpu_ops[name].set()

    def cpu_ops() -> None:
        p = run_limited([sys.executable, "-c", CPU_OPS], work / "logs" / "build-cpu-ops.log", min(420, clock.left(60)),
                        base_env("cpu"))
        if p.rc != 0:
            b.cpu_failure = p.cause()
        check.step("build CPU route ops (ShareMemComm, CPUAdam, allocation recorder)",
                   "ok" if p.rc == 0 else f"failed: {p.cause()}", p.wall_s)
        b.cpu_ops.set()

    def sim() -> None:
        p = run_limited([sys.executable, "-c", SIM_PROBE], work / "logs" / "build-sim-device.log",
                        min(300, clock.left(60)), base_env("fake", CUDA_VISIBLE_DEVICES=""))
        if p.rc != 0 or "SIM ok" not in p.tail():
            b.sim_failure = "the simulated CUDA device does not load beside this torch: " + p.cause()
        check.step("build + load the simulated CUDA device (fake-CUDA, cuda-sim)",
                   "ok" if b.sim_failure is None else f"failed: {b.sim_failure}", p.wall_s)
        b.sim.set()

    if gpu:
        for name in b.gpu_ops:
            pool.submit(gpu_op, name)
    else:
        for name, ev in b.gpu_ops.items():
            check.step(f"build {name} (DeepSpeed JIT, CUDA)", NO_CUDA, 0.0)
            ev.set()
    pool.submit(cpu_ops)
    pool.submit(sim)
    return b


def gpu_cell_gib(pair: str, strategy: str) -> float:
    if pair == "opt-1.3b":
        return GPU_GIB["opt-1.3b-offload" if strategy in ("zero3-offload", "all") else "opt-1.3b"]
    return GPU_GIB[pair]


def pytest_plugin_args() -> list[str]:
    """``-p pytest_rlhfmem.plugin`` where the project is not installed (its ``pytest11`` entry point missing)."""
    from importlib.metadata import entry_points

    return [] if any(ep.name == "rlhfmem" for ep in entry_points(group="pytest11")) else ["-p", "pytest_rlhfmem.plugin"]


def junit_outcome(xml_path: Path) -> tuple[str, str]:
    """(``passed`` | ``skipped`` | ``failed`` | ``error`` | ``missing``, its message) of the one test in a JUnit XML."""
    try:
        case = ET.parse(xml_path).getroot().find(".//testcase")
    except (OSError, ET.ParseError):
        return "missing", "no JUnit XML"
    if case is None:
        return "missing", "no test collected"
    for tag in ("failure", "error", "skipped"):
        el = case.find(tag)
        if el is not None:
            msg = (el.get("message") or el.text or "").strip().splitlines()
            return ("failed" if tag == "failure" else tag), (msg[0][:300] if msg else tag)
    return "passed", ""


def gpu_cell(check: Check, work: Path, clock: Clock, cid: str, gpu: bool) -> None:
    """One cell of the GPU suite in its own pytest session; its result JSON under ``work/gpu``."""
    name = slug(cid)
    out, xml = work / "gpu" / f"{name}.json", work / "gpu" / f"{name}.xml"
    left = clock.left(20)
    cmd = [sys.executable, "-m", "pytest", f"{GPU_SUITE}::{GPU_TEST}[{cid}]", "-q", "-p", "no:cacheprovider",
           *pytest_plugin_args(), "--rlhfmem-json", str(out), "--junitxml", str(xml),
           "--rlhfmem-timeout", str(max(30, int(left) - 15))]
    cmd += ["--gpu-marker", "require", "--rlhfmem-update-baselines"] if gpu else ["--gpu-marker", "auto"]
    p = run_limited(cmd, work / "logs" / f"gpu-{name}.log", left, base_env("gpu"))
    outcome, msg = junit_outcome(xml)
    data = json.loads(out.read_text()) if out.is_file() else {}
    res = next((r for r in data.get("results", []) if r.get("scenario_id") == cid), None)
    if not gpu and outcome == "skipped":
        check.put("cells", cid, "gpu", {"status": NO_CUDA, "detail": msg, "wall_s": p.wall_s})
    elif res is not None and res.get("status") == "ok":
        verdict = (res.get("budget") or {}).get("status")
        check.put("cells", cid, "gpu", {"status": "ok", "figures": phase_figures(res), "raw": f"raw/gpu/{name}.json",
                                        "budget": verdict, "wall_s": p.wall_s, "capture": res.get("capture"),
                                        "op_build_s": res.get("op_build_s")})
    else:
        f = (res or {}).get("failure") or {}
        why = (f"rank {f.get('rank')} in {f.get('phase')!r}: {f.get('error')}: {str(f.get('message'))[:200]}"
               if f else msg if outcome in ("failed", "error", "skipped") else p.cause())
        check.put("cells", cid, "gpu", {"status": f"failed: {why}", "wall_s": p.wall_s,
                                        "raw": f"raw/gpu/{name}.json" if out.is_file() else None})


def cpu_route_cell(check: Check, work: Path, clock: Clock, cid: str) -> None:
    """One cell on the CPU route: ``rlhfmem run --device cpu --world-size 1`` (simulated)."""
    _, pair, strategy, flush, _ = cid.split("/")
    name = slug(cid)
    out = work / "cpu" / f"{name}.json"
    left = clock.left(20)
    cmd = [sys.executable, "-m", "pytest_rlhfmem.cli", "run", "--models", pair, "--strategy", strategy,
           "--flush", flush.removeprefix("flush-"), "--device", "cpu", "--world-size", "1", "--json", str(out),
           "--timeout", str(max(30, int(left) - 10))]
    p = run_limited(cmd, work / "logs" / f"cpu-{name}.log", left, base_env("cpu"))
    res = json.loads(out.read_text()) if out.is_file() else None
    if res is not None and res.get("status") == "ok":
        check.put("cells", cid, "cpu", {"status": "ok", "figures": phase_figures(res), "raw": f"raw/cpu/{name}.json",
                                        "wall_s": p.wall_s, "capture": res.get("capture")})
    else:
        f = (res or {}).get("failure") or {}
        why = f"{f.get('error')}: {str(f.get('message'))[:200]}" if f else p.cause()
        check.put("cells", cid, "cpu", {"status": f"failed: {why}", "wall_s": p.wall_s})


FAKE_CELL = ("import json, sys\nfrom pytest_rlhfmem.fakecuda.run import run_fake_cuda\n"
             "from pytest_rlhfmem.rlhf.scenario import Scenario\n"
             "s = Scenario('deepspeed-chat', sys.argv[1], sys.argv[2], sys.argv[3], 1)\n"
             "r = run_fake_cuda(s, tensors='sim', timeout=float(sys.argv[5]))[s.id]\n"
             "open(sys.argv[4], 'w').write(json.dumps(r, indent=1))\n")


def fake_cell(check: Check, work: Path, clock: Clock, cid: str, builds: Builds) -> None:
    """One cell on the fake-CUDA route (``run_fake_cuda(scenario, tensors="sim")``, simulated)."""
    builds.sim.wait()
    if builds.sim_failure:
        check.put("cells", cid, "fake", {"status": f"failed: {builds.sim_failure}", "wall_s": 0.0})
        return
    _, pair, strategy, flush, _ = cid.split("/")
    name = slug(cid)
    out = work / "fake" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    left = clock.left(20)
    p = run_limited([sys.executable, "-c", FAKE_CELL, pair, strategy, flush.removeprefix("flush-"), str(out),
                     str(max(30, int(left) - 10))], work / "logs" / f"fake-{name}.log", left,
                    base_env("fake"))
    res = json.loads(out.read_text()) if out.is_file() else None
    if res is not None and res.get("status") == "ok":
        check.put("cells", cid, "fake", {"status": "ok", "figures": phase_figures(res),
                                         "raw": f"raw/fake/{name}.json", "wall_s": p.wall_s,
                                         "capture": res.get("capture")})
    else:
        why = f"{(res or {}).get('error')}" if res else p.cause()
        check.put("cells", cid, "fake", {"status": f"failed: {why[:300]}", "wall_s": p.wall_s})


def workload(check: Check, work: Path, clock: Clock, name: str, args: list[str], recording: str | None,
             device: str, builds: Builds) -> None:
    """The CS336 profiling script under ``rlhfmem capture --device DEVICE``; the snapshot it dumps of its recorded
    step, replayed anchored, beside the GPU recording it reproduces."""
    source = "gpu" if device == "cuda" else "sim"
    if device == "cuda-sim":
        builds.sim.wait()
        if builds.sim_failure:
            check.put("workloads", name, source, {"status": f"failed: {builds.sim_failure}", "wall_s": 0.0})
            return
    tag = f"{source}-{name}"
    snap, out = work / "workloads" / f"{tag}.pickle", work / "workloads" / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    left = clock.left(20)
    cmd = [sys.executable, "-m", "pytest_rlhfmem.cli", "capture", "--device", device, "--id", f"cs336-{name}",
           "--json", str(out), "--timeout", str(max(30, int(left) - 10)), "--", sys.executable,
           str(REPO / "tests/data/commands/cs336_memory_profile.py"), *args, "--out", str(snap)]
    p = run_limited(cmd, work / "logs" / f"workload-{tag}.log", left,
                    base_env("gpu" if device == "cuda" else "fake"))
    entry: dict = {"wall_s": p.wall_s, "command": "rlhfmem capture --device " + device + " -- python "
                   "tests/data/commands/cs336_memory_profile.py " + " ".join(args)}
    res = json.loads(out.read_text()) if out.is_file() else None
    if res is not None:
        entry["capture_status"] = res.get("status")
        entry["raw"] = f"raw/workloads/{tag}.json"
        if res.get("status") == "ok":
            entry["capture_figures"] = phase_figures(res)
    if snap.is_file():
        entry["snapshot_bytes"] = snap.stat().st_size
        try:
            entry["figures"] = snapshot_figures(snap)
            entry["status"] = "ok" if (res or {}).get("status") == "ok" else \
                f"snapshot ok; capture failed: {p.cause()}"
        except Exception as exc:  # noqa: BLE001 - one line in the table, the rest still runs
            entry["status"] = f"failed: replaying the dumped snapshot: {type(exc).__name__}: {exc}"[:300]
    else:
        entry["status"] = f"failed: {p.cause()}"
    check.put("workloads", name, source, entry)
    if recording and "recording" not in check.workloads.get(name, {}):
        from pytest_rlhfmem.shared_snapshots import missing_reason, snapshot_path

        path = snapshot_path(recording)
        why = missing_reason(path)
        rec = {"status": f"not available: {why}"} if why else {"status": "ok", "figures": snapshot_figures(path),
                                                               "snapshot_bytes": path.stat().st_size,
                                                               "file": path.name}
        check.put("workloads", name, "recording", rec)


def snapshot_figures(path: Path) -> dict:
    """A snapshot's recorded window replayed anchored (``fidelity/workloads.py: recorded_figures``, exact on these
    files): peak reserved, peak allocated, fragmentation at peak (bytes), cudaMalloc count, allocations."""
    from pytest_rlhfmem.fidelity.workloads import recorded_figures

    r = recorded_figures(path)
    return {"peak_reserved": r["peak_reserved"], "peak_allocated": r["peak_allocated"],
            "fragmentation_at_peak": r["fragmentation_at_peak"], "cuda_malloc_count": r["cuda_malloc_count"],
            "reserved_at_start": r["reserved_at_start"], "allocations": len(r["sizes"])}


def run_check(mode: str, out_dir: Path | None, deadline_s: float, install_s: float | None = None,
              cells: list[str] | None = None, keep_work: bool = False,
              pack_dir: Path | None = None) -> tuple[Check, Path]:
    """Run the check (``mode`` ``gpu`` or ``cpu``; at most ``deadline_s`` seconds) and write its directory; returns
    the check and the directory (``out_dir``, else ``docs/gpu-runs/<date>-<gpu slug>``). The work directory
    (``$RLHFMEM_GPU_CHECK_WORK``, else ``/tmp/rlhfmem-gpu-check-<pid>``: logs, traces, snapshots) is removed
    afterwards unless ``keep_work``; before that, with ``pack_dir``, :func:`pack` and :func:`pack_logs` write there."""
    clock = Clock(deadline_s)
    check = Check(mode, meta={"date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}"})
    gpu = mode == "gpu"
    work = Path(os.environ.get("RLHFMEM_GPU_CHECK_WORK") or f"/tmp/rlhfmem-gpu-check-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    EXT_ROOT[:] = [work] if gpu else []
    if install_s is not None:
        check.step("install carried wheels into /tmp/site", "ok", install_s)
    if (REPO / SHARED_DIR / "snapshots").is_dir() and "RLHFMEM_SNAPSHOTS_DIR" not in os.environ:
        os.environ["RLHFMEM_SNAPSHOTS_DIR"] = str(REPO / SHARED_DIR / "snapshots")  # carried from ../shared
    probe_env(check, work, clock)
    if gpu and not check.meta.get("cuda_devices"):
        check.step("gpu", "failed: --mode gpu but torch sees no CUDA device", 0.0)
        gpu = False
    all_cells = [cell_id(p, s, f) for p in PAIRS_GPU for s in STRATEGIES for f in FLUSHES]
    chosen = cells or (all_cells if mode == "gpu" else list(CPU_SUBSET))
    t_start = time.perf_counter()
    builds_pool = ThreadPoolExecutor(5)
    builds = start_builds(check, work, clock, gpu, builds_pool)
    gpu_mem = GpuMemory(GPU_CAPACITY_GIB, GPU_CONCURRENCY)
    # one thread per GPU job (each waits for its builds, then for room on the card); SIM_WORKERS for the CPU
    gpu_pool, sim_pool = ThreadPoolExecutor(len(chosen) + len(WORKLOADS) + 1), ThreadPoolExecutor(SIM_WORKERS)
    track_t0 = {}

    def on_gpu(gib: float, prio: int, need: list[str], fn, *args) -> None:  # noqa: ANN001
        for op in need:
            builds.gpu_ops[op].wait()
        failed = [f"{op}: {builds.gpu_failures[op]}" for op in need if op in builds.gpu_failures]
        if failed:
            return fn_failed(fn, args, "failed: JIT build " + "; ".join(failed))
        if not gpu_mem.take(gib, clock, prio):
            return fn_failed(fn, args, f"not run: time limit ({deadline_s:.0f} s) reached")
        try:
            fn(*args)
        finally:
            gpu_mem.give(gib)

    def fn_failed(fn, args, status: str) -> None:  # noqa: ANN001
        if fn is gpu_cell:
            check.put("cells", args[3], "gpu", {"status": status, "wall_s": 0.0})
        else:
            check.put("workloads", args[3], "gpu", {"status": status, "wall_s": 0.0})

    def on_cpu(fn, *args) -> None:  # noqa: ANN001
        if clock.left(20) <= 0:
            key, table = (args[3], "cells") if fn is not workload else (args[3], "workloads")
            src = {cpu_route_cell: "cpu", fake_cell: "fake", workload: "sim"}[fn]
            check.put(table, key, src, {"status": f"not run: time limit ({deadline_s:.0f} s) reached", "wall_s": 0})
            return
        fn(*args)

    futures = {"gpu": [], "cpu": [], "fake": [], "workloads": []}
    # GPU track: the workloads first (cheap, the fidelity's ground truth), then OPT-1.3b (the longest cells) as soon
    # as the Hybrid Engine's op is built, the small pairs meanwhile
    wl = WORKLOADS if gpu else CPU_WORKLOADS
    if gpu:
        for name, args, rec in wl:
            futures["workloads"].append(gpu_pool.submit(on_gpu, GPU_GIB["workload"], 0, [], workload, check, work,
                                                        clock, name, args, rec, "cuda", builds))
    order = sorted(chosen, key=lambda c: (c.split("/")[1] != "opt-1.3b", c))
    for cid in order:
        pair, strategy = cid.split("/")[1:3]
        if gpu:
            need = ["FusedAdamBuilder", "CPUAdamBuilder"] + (["InferenceBuilder"] if pair == "opt-1.3b" else [])
            prio = 0 if pair == "opt-1.3b" else 1  # the longest cells first, once their builds are done
            futures["gpu"].append(gpu_pool.submit(on_gpu, gpu_cell_gib(pair, strategy), prio, need, gpu_cell, check,
                                                  work, clock, cid, True))
        else:
            futures["gpu"].append(gpu_pool.submit(gpu_cell, check, work, clock, cid, False))
    # CPU track: the simulated twins
    for name, args, rec in wl:
        futures["workloads"].append(sim_pool.submit(on_cpu, workload, check, work, clock, name, args, rec,
                                                    "cuda-sim", builds))
    for cid in sorted(chosen, key=lambda c: (c.split("/")[1] != "opt-1.3b", c)):
        futures["fake"].append(sim_pool.submit(on_cpu, fake_cell, check, work, clock, cid, builds))
    builds.cpu_ops.wait()
    for cid in sorted(chosen, key=lambda c: (c.split("/")[1] != "opt-125m", c)):  # the longest CPU cells first
        if cid.split("/")[1] in PAIRS_CPU_ROUTE:
            if builds.cpu_failure:
                check.put("cells", cid, "cpu", {"status": f"failed: CPU route build: {builds.cpu_failure}",
                                                "wall_s": 0})
            else:
                futures["cpu"].append(sim_pool.submit(on_cpu, cpu_route_cell, check, work, clock, cid))
        else:
            check.put("cells", cid, "cpu", {"status": "not run: OPT-1.3b is not run on the CPU route (tens of GiB "
                                                      "of host memory, minutes per cell); see fake-CUDA", "wall_s": 0})
    for track, futs in futures.items():
        t = time.perf_counter()
        for f in futs:
            f.result()
        track_t0[track] = time.perf_counter() - t_start
        done = len(futs)
        if track == "gpu" and not gpu:
            check.step("gpu-cells (suites/test_deepspeed_chat_gpu1.py)", NO_CUDA, time.perf_counter() - t,
                       f"{done} cell(s) collected and skipped by the gpu marker")
        else:
            table, sources = ("workloads", ("gpu", "sim")) if track == "workloads" else ("cells", (track,))
            entries = [e[s] for e in getattr(check, table).values() for s in sources if s in e]
            counts = {k: sum(1 for e in entries if e["status"].startswith(k)) for k in ("ok", "failed", "not run")}
            status = "ok" if counts["ok"] == len(entries) else ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            check.step({"gpu": "gpu-cells (suites/test_deepspeed_chat_gpu1.py, one pytest session per cell)",
                        "cpu": "cpu-route cells (rlhfmem run --device cpu --world-size 1)",
                        "fake": "fake-CUDA cells (run_fake_cuda, tensors='sim')",
                        "workloads": "workloads (rlhfmem capture: cuda and cuda-sim)"}[track],
                       status, track_t0[track], f"{done} job(s); wall time from the first build's start")
    for pool in (builds_pool, gpu_pool, sim_pool):
        pool.shutdown(wait=True)
    check.meta["deadline_s"] = deadline_s
    check.meta["total_wall_s"] = round(time.monotonic() - clock.start, 2)
    target = out_dir or default_run_dir(check)
    write_dir(check, work, target)
    if pack_dir is not None:
        print(f"gpu_check: packed {pack(target, pack_dir)} and {pack_logs(work, pack_dir)}")
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)  # traces, snapshots, logs: their sizes are in results.json
    return check, target


def gpu_slug(meta: dict) -> str:
    devs = meta.get("cuda_devices") or []
    if not devs:
        return "cpu-only"
    from pytest_rlhfmem.hardware import CudaDevice, profile_name

    return profile_name([CudaDevice(devs[0]["name"], devs[0]["total_memory"])])[len("cuda-"):].rsplit("-x", 1)[0]


def default_run_dir(check: Check) -> Path:
    return REPO / "docs" / "gpu-runs" / f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}-{gpu_slug(check.meta)}"


def write_dir(check: Check, work: Path, target: Path) -> None:
    """``target``: ``raw/`` (the result JSONs), ``results.json``, ``README.md``; the sizes of the traces and
    snapshots left in ``work`` (not copied) recorded in ``results.json``."""
    raw = target / "raw"
    for sub in ("gpu", "cpu", "fake", "workloads"):
        for f in sorted((work / sub).glob("*.json")) if (work / sub).is_dir() else []:
            if json.loads(f.read_text()).get("results") == []:  # a session whose one test skipped: no result
                continue
            (raw / sub).mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, raw / sub / f.name)
    for f in sorted(work.rglob("*")):
        if f.is_file() and (f.suffix in (".pickle", ".rlhftrace")):
            check.files[str(f.relative_to(work))] = f.stat().st_size
    (target / "results.json").write_text(json.dumps(check.to_json(), indent=1))
    (target / "README.md").write_text(render(check.to_json()))


# --------------------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------------------


def source_text(entry: dict | None, phase: str, key: str, is_size: bool) -> str:
    """One table cell: the figure where its source ran, else the source's status (``not run: ...``, ``failed: ...``)."""
    if entry is None:
        return "not in this run"
    if entry.get("status") != "ok":  # "not run: <why>" in full; a failure's cause is listed above the table
        return "failed" if entry["status"].startswith("failed") else entry["status"]
    row = entry["figures"].get(phase)
    return "-" if row is None else figure_text(row.get(key), is_size)


def _md(rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows[1:]]
    return out


def _pct(a: int | None, b: int | None) -> str:
    return "-" if a is None or not b else f"{100 * (a - b) / b:+.1f}%"


def render(data: dict) -> str:
    """``README.md`` of one run from its ``results.json`` data: the card and versions, each step's status and wall
    time, per cell a per-phase table (GPU-measured beside the two simulated routes), the workloads beside their
    recordings, the files kept and their sizes."""
    m = data.get("meta", {})
    devs = m.get("cuda_devices") or []
    gpu_mode = data["mode"] == "gpu"
    lines = [f"# GPU check {m.get('date', '')}: " + (devs[0]["name"] if devs else "no CUDA device (CPU-only run)"), ""]
    lines += ["Produced by `bash .ci/gpu-check` on the lent GPU machine (`benchmarks/gpu_check.py run --mode gpu`)"
              if gpu_mode else "Produced by `benchmarks/gpu_check.py run --mode cpu` (no CUDA device: the GPU "
              "columns say `not run`, the simulated routes ran a subset)", ""]
    lines += ["GPU = measured by PyTorch's CUDA caching allocator on this card (memory history + `memory_stats()`). "
              "CPU route and fake-CUDA = **simulated** (an allocation trace replayed through the allocator model), "
              "on the same machine, torch, DeepSpeed and transformers. Sizes: MiB/GiB here, bytes in "
              "`results.json` and `raw/`.", ""]
    card = [["what", "value"],
            ["card", ", ".join(f"{d['name']} ({format_size(d['total_memory'])})" for d in devs) or "none"],
            ["nvidia-smi (name, driver, memory)", m.get("nvidia_smi", "not available")],
            ["torch", f"{m.get('torch', '?')} (CUDA {m.get('torch_cuda')})"],
            ["DeepSpeed", m.get("deepspeed", "?")], ["transformers", m.get("transformers", "?")],
            ["peft", m.get("peft", "?")], ["python", m.get("python", "?")],
            ["CPU cores", str(m.get("cpu_count", "?"))], ["commit", m.get("commit", "?")],
            ["whole run", f"{m.get('total_wall_s', '?')} s (limit {m.get('deadline_s', '?')} s)"]]
    lines += ["## Machine and versions", "", *_md(card), ""]
    steps = [["step", "status", "wall s", "detail"]]
    steps += [[s["name"], s["status"], f"{s['wall_s']:.1f}", s.get("detail", "")] for s in data["steps"]]
    lines += ["## Steps", "", "Steps overlap (builds, the GPU cells and the simulated routes run at once); each "
              "build's time is its own process's.", "", *_md(steps), ""]
    cells = data.get("cells", {})
    if cells:
        summary = [["cell", "GPU peak reserved", "CPU route (simulated)", "fake-CUDA (simulated)",
                    "CPU route vs GPU", "fake-CUDA vs GPU", "GPU retries", "GPU budget"]]
        for cid in sorted(cells):
            c = cells[cid]
            it = {s: (c.get(s) or {}).get("figures", {}).get("iteration", {}) for s, _ in SOURCES}
            summary.append([cid] + [source_text(c.get(s), "iteration", "peak_reserved", True) for s, _ in SOURCES]
                           + [_pct(it["cpu"].get("peak_reserved"), it["gpu"].get("peak_reserved")),
                              _pct(it["fake"].get("peak_reserved"), it["gpu"].get("peak_reserved")),
                              source_text(c.get("gpu"), "iteration", "alloc_retries", False),
                              str((c.get("gpu") or {}).get("budget") or "-")])
        lines += ["## Cells: whole iteration", "", *_md(summary), ""]
        lines += ["## Cells: per phase", ""]
        for cid in sorted(cells):
            c = cells[cid]
            lines += [f"### {cid}", ""]
            for s, label in SOURCES:
                e = c.get(s)
                status = "not in this run" if e is None else e["status"]
                wall = "" if e is None else f", {e.get('wall_s', 0):.1f} s"
                lines.append(f"- {label}: {status}{wall}" + (f" ({e['raw']})" if e and e.get("raw") else ""))
            lines.append("")
            phases: list[str] = []
            for s, _ in SOURCES:
                for ph in ((c.get(s) or {}).get("figures") or {}):
                    if ph not in phases and ph != "iteration":
                        phases.append(ph)
            header = ["phase"] + [f"{title}: {lab}" for _, title, _ in METRICS for _, lab in SOURCES]
            rows = [header]
            for ph in phases + ["iteration"]:
                rows.append([ph] + [source_text(c.get(s), ph, k, size) for k, _, size in METRICS for s, _ in SOURCES])
            lines += [*_md(rows), ""]
    wls = data.get("workloads", {})
    if wls:
        lines += ["## Workloads (CS336 profiling script, `tests/data/commands/cs336_memory_profile.py`)", "",
                  "Each row: the snapshot of the script's recorded step (its own `_dump_snapshot`) replayed anchored "
                  "(`fidelity/workloads.py: recorded_figures`); `recording` is the public GPU recording the "
                  "workload reproduces (`shared/snapshots`, another GPU).", ""]
        rows = [["workload", "source", "status", "peak reserved", "peak allocated", "fragmentation at peak",
                 "cudaMalloc", "allocations", "snapshot size", "wall s"]]
        labels = {"recording": "recording (other GPU)", "gpu": "GPU (rlhfmem capture --device cuda)",
                  "sim": "cuda-sim (simulated)"}
        for name in sorted(wls):
            for src in ("recording", "gpu", "sim"):
                e = wls[name].get(src)
                if e is None:
                    rows.append([name, labels[src], NO_CUDA if src == "gpu" and not gpu_mode else "not in this run"]
                                + ["-"] * 7)
                    continue
                f = e.get("figures") or {}
                rows.append([name, labels[src], e["status"]]
                            + [figure_text(f.get(k), k not in ("cuda_malloc_count", "allocations")) for k in
                               ("peak_reserved", "peak_allocated", "fragmentation_at_peak", "cuda_malloc_count",
                                "allocations")]
                            + [format_size(e.get("snapshot_bytes")), f"{e.get('wall_s', 0):.1f}" if "wall_s" in e
                               else "-"])
        lines += [*_md(rows), ""]
    files = data.get("files", {})
    lines += ["## Files", "", "`results.json`: every figure above (bytes), each step and source's status. `raw/`: the "
              "result JSONs as the product wrote them (`--rlhfmem-json`, `rlhfmem run/capture --json`, "
              "`run_fake_cuda`). Traces and snapshots stayed on the machine; their sizes:", ""]
    if files:
        lines += [*_md([["file", "size"]] + [[k, format_size(v)] for k, v in sorted(files.items())]), ""]
        lines += [f"Total: {format_size(sum(files.values()))} in {len(files)} files.", ""]
    else:
        lines += ["none", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Packing, unpacking, preparing
# --------------------------------------------------------------------------------------------------------------

TARBALL = "gpu-check.tar.gz"
PACK_LIMIT = 16 * 2**20  # one file back from $OUT


def pack(run_dir: Path, dest: Path) -> Path:
    """``dest/gpu-check.tar.gz``: ``run_dir`` (relative to the repository) and ``baselines/cuda-*-x1/``. Over
    :data:`PACK_LIMIT`, the raw JSONs' time series (``series``: what ``rlhfmem plot`` draws) are dropped and the
    tarball written again."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / TARBALL

    def write() -> None:
        with tarfile.open(out, "w:gz") as tar:
            try:
                arc = str(run_dir.resolve().relative_to(REPO))
            except ValueError:  # a directory outside the repository (--out): where unpack puts it
                arc = f"docs/gpu-runs/{run_dir.name}"
            tar.add(run_dir, arcname=arc)
            for b in sorted((REPO / "baselines").glob("cuda-*-x1")):
                tar.add(b, arcname=str(b.relative_to(REPO)))

    write()
    if out.stat().st_size > PACK_LIMIT:
        for f in run_dir.glob("raw/*/*.json"):
            d = json.loads(f.read_text())
            _drop_series(d)
            f.write_text(json.dumps(d))
        write()
    return out


LOGS_TARBALL = "gpu-check-logs.tar.gz"
LOG_TAIL = 64 * 1024  # bytes of each log kept


def pack_logs(work: Path, dest: Path) -> Path:
    """``dest/gpu-check-logs.tar.gz``: the last :data:`LOG_TAIL` bytes of every step's log (not unpacked into the
    repository: what a failed step printed)."""
    import io

    out = dest / LOGS_TARBALL
    with tarfile.open(out, "w:gz") as tar:
        for f in sorted((work / "logs").glob("*.log")):
            data = f.read_bytes()[-LOG_TAIL:]
            info = tarfile.TarInfo(f"logs/{f.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def _drop_series(obj) -> None:  # noqa: ANN001
    if isinstance(obj, dict):
        obj.pop("series", None)
        for v in obj.values():
            _drop_series(v)
    elif isinstance(obj, list):
        for v in obj:
            _drop_series(v)


def unpack(tarball: Path, root: Path = REPO) -> list[str]:
    """Extract ``tarball`` into ``root`` (the repository): only ``docs/gpu-runs/...`` and ``baselines/cuda-*-x1/...``
    members (anything else refused with one line, before anything is written). Returns the files written."""
    written = []
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
        for mem in members:
            parts = Path(mem.name).parts
            ok = (parts[:2] == ("docs", "gpu-runs") or (parts[:1] == ("baselines",) and len(parts) > 1
                                                        and parts[1].startswith("cuda-") and parts[1].endswith("-x1")))
            if not ok or ".." in parts or mem.issym() or mem.islnk():
                raise SystemExit(f"gpu_check: {tarball}: refusing member {mem.name!r} (allowed: docs/gpu-runs/..., "
                                 "baselines/cuda-*-x1/...)")
        tar.extractall(root, members=members, filter="data")
        written = [m.name for m in members if m.isfile()]
    return written


def tracked_bytes() -> int:
    """Bytes of what travels besides the carried paths: tracked files and untracked files git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file())


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def device_command() -> dict:
    """The device tool's call: ``command`` (at most :data:`COMMAND_LIMIT` characters), ``carry`` (at most
    :data:`CARRY_LIMIT` ignored paths), ``timeout_s``."""
    cmd = "set -o pipefail; bash .ci/gpu-check 2>&1 | tee $OUT/gpu-check.log"
    return {"command": cmd, "carry": [WHEEL_DIR, SHARED_DIR], "timeout_s": DEVICE_TIMEOUT_S}


def travel_report() -> dict:
    """What the device call sends, bytes: the tree, each carried path (where not prepared yet, ``estimated``:
    ``.whl`` at :data:`EXPECTED_WHEELS_BYTES`, the recordings at their size in ``shared/snapshots``), and the total
    against :data:`TRAVEL_LIMIT`."""
    tree = tracked_bytes()
    from pytest_rlhfmem.shared_snapshots import snapshot_path

    carried = {}
    for c in device_command()["carry"]:
        n = dir_bytes(REPO / c)
        guess = (EXPECTED_WHEELS_BYTES if c == WHEEL_DIR else
                 sum(snapshot_path(r).stat().st_size for r in RECORDINGS if snapshot_path(r).is_file()))
        carried[c] = {"bytes": n or guess, "estimated": not n}
    total = tree + sum(v["bytes"] for v in carried.values())
    return {"tree_bytes": tree, "carried": carried, "total_bytes": total, "limit_bytes": TRAVEL_LIMIT}


def prepare(wheels: bool = True) -> dict:
    """Build ``.whl/`` (DeepSpeed 0.19.8 built here with ``DS_BUILD_OPS=0``, :data:`CARRIED_WHEELS` downloaded for
    CPython 3.12 x86-64) and ``.gpu-check-shared/snapshots/`` (the recordings of :data:`RECORDINGS`), both ignored
    by git; returns the device call with the travel sizes. Raises ``SystemExit`` with one line when a build or
    download fails, a recording is missing, or what travels is over a limit."""
    from pytest_rlhfmem.shared_snapshots import missing_reason, snapshot_path

    if wheels:
        whl = REPO / WHEEL_DIR
        if whl.exists():
            shutil.rmtree(whl)
        whl.mkdir()
        env = dict(os.environ, DS_BUILD_OPS="0")
        p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-cache-dir", "--no-deps",
                            "--no-build-isolation", DEEPSPEED, "-w", str(whl)], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"gpu_check prepare: building {DEEPSPEED} failed (needs torch, setuptools and wheel "
                             f"in {sys.executable}): {p.stderr.strip().splitlines()[-1:]}")
        plat = [a for p_ in PLATFORMS for a in ("--platform", p_)]
        p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(whl),
                            *CARRIED_WHEELS], capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"gpu_check prepare: pip download failed: {p.stderr.strip().splitlines()[-1:]}")
    shared = REPO / SHARED_DIR / "snapshots"
    shared.mkdir(parents=True, exist_ok=True)
    for name in RECORDINGS:
        src = snapshot_path(name)
        why = missing_reason(src)
        if why:
            raise SystemExit(f"gpu_check prepare: {why}")
        shutil.copy2(src, shared / src.name)
    call = device_command()
    travel = travel_report()
    if len(call["command"]) > COMMAND_LIMIT or len(call["carry"]) > CARRY_LIMIT:
        raise SystemExit("gpu_check prepare: the device command is over its limits")
    if travel["total_bytes"] >= TRAVEL_LIMIT:
        raise SystemExit(f"gpu_check prepare: {format_size(travel['total_bytes'])} would travel, over the device's "
                         f"{format_size(TRAVEL_LIMIT)}")
    return {**call, "travel": travel,
            "wheels": {f.name: f.stat().st_size for f in sorted((REPO / WHEEL_DIR).glob("*.whl"))}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="build .whl/ and .gpu-check-shared/ here; print the device call")
    pp.add_argument("--no-wheels", action="store_true", help="only the carried recordings and the sizes")
    r = sub.add_parser("run", help="run the check (gpu: everything; cpu: a small subset, GPU columns not run)")
    r.add_argument("--mode", choices=("auto", "gpu", "cpu"), default="auto")
    r.add_argument("--out", type=Path, default=None, help="the run's directory (default docs/gpu-runs/<date>-<gpu>)")
    r.add_argument("--pack", type=Path, default=None, help="write gpu-check.tar.gz into this directory")
    r.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S)
    r.add_argument("--install-s", type=float, default=None, help="the wheel install's seconds (from .ci/gpu-check)")
    r.add_argument("--cell", action="append", default=None, help="only this cell id (repeatable)")
    r.add_argument("--keep-work", action="store_true", help="keep the work directory (logs, traces, snapshots)")
    u = sub.add_parser("unpack", help="extract a returned gpu-check.tar.gz into the repository")
    u.add_argument("tarball", type=Path)
    d = sub.add_parser("render", help="write DIR/README.md again from DIR/results.json")
    d.add_argument("dir", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        call = prepare(wheels=not a.no_wheels)
        t = call["travel"]
        for name, n in call["wheels"].items():
            print(f"wheel {name}: {format_size(n)}")
        print(f"travels: tree {format_size(t['tree_bytes'])} + " + " + ".join(
            f"{k} {format_size(v['bytes'])}{' (estimated)' if v['estimated'] else ''}" for k, v in t["carried"].items())
              + f" = {format_size(t['total_bytes'])} (limit {format_size(t['limit_bytes'])})")
        print("device run:")
        print(f"  command:   {call['command']}")
        print(f"  carry:     {json.dumps(call['carry'])}")
        print(f"  timeout_s: {call['timeout_s']}")
        print("then here: python benchmarks/gpu_check.py unpack <files_at>/gpu-check.tar.gz")
        return 0
    if a.cmd == "unpack":
        for n in unpack(a.tarball):
            print(n)
        return 0
    if a.cmd == "render":
        (a.dir / "README.md").write_text(render(json.loads((a.dir / "results.json").read_text())))
        return 0
    mode = a.mode
    if mode == "auto":
        from pytest_rlhfmem.hardware import detect_cuda_devices

        mode = "gpu" if detect_cuda_devices() else "cpu"
    check, target = run_check(mode, a.out, a.deadline_s, a.install_s, a.cell, a.keep_work, a.pack)
    print(f"gpu_check: wrote {target}")
    for s in check.steps:
        print(f"  {s['name']}: {s['status']} ({s['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
