"""Start one fake-CUDA rank (``worker.py``) in a fresh process and read its result(s).

The worker must be a fresh interpreter: the fake CUDA hooks are loaded before ``import torch``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..rlhf.launch import RunInterrupted, interruptible
from ..rlhf.scenario import Scenario
from .worker import twin_without_flush

DEFAULT_TIMEOUT_S = 3600.0


class FakeCudaRunError(RuntimeError):
    """The worker died without a result (crash, timeout); the message has its last output."""


def run_fake_cuda(scenario: Scenario, rank: int = 0, timeout: float = DEFAULT_TIMEOUT_S,
                  work_dir: str | Path | None = None, without_flush: bool = False,
                  keep_work: bool = False, tensors: str = "fake", sdpa: str | None = None,
                  record_stream: str | None = None) -> dict[str, dict]:
    """Run ``scenario`` (deepspeed-chat) as rank ``rank`` on the fake-CUDA route.

    ``tensors``: ``fake`` (``FakeTensorMode`` and the dispatcher recorder) or ``sim`` (the simulated CUDA
    device of ``simcuda/csrc/sim_cuda.cpp``: meta kernels in C++, several times less CPU time). ``sdpa``
    (``sim`` only): the attention kernel the device models, ``math`` (default: the score matrix is kept) or
    ``efficient`` (memory-efficient attention: output and logsumexp); the result's ``capture_description`` names it.
    ``record_stream`` (``sim`` only): when a freed block used on another stream returns to its pool,
    ``immediate`` (default) or ``until-sync`` (``simcuda/library.py: RECORD_STREAM_MODES``).

    Returns ``{scenario id: result}``: one result, or two with ``without_flush`` (the same trace replayed
    without its FLUSH events, keyed by the flush-``none`` scenario's id; with a colocated engine
    (``rollout_engine``, ``tensors='sim'`` only) without the trainer's flush before each wake-up, keyed by the
    scenario with ``flush_before_wake_up`` False). A colocated engine's run replays at its card (``capacity_mib``).
    A failure inside the iteration is a result with ``status: failed``; a worker that dies or exceeds ``timeout``
    seconds raises
    :class:`FakeCudaRunError` (its process group is killed first); SIGINT, SIGTERM or SIGHUP meanwhile kills it
    and raises :class:`~pytest_rlhfmem.rlhf.launch.RunInterrupted`. A work directory this function made
    (no ``work_dir``) is removed after a run whose results are all ``ok``, unless ``keep_work``; a failed
    run keeps it (its log is named in the error).
    """
    made_here = work_dir is None
    work = Path(work_dir or tempfile.mkdtemp(prefix="rlhfmem-fakecuda-"))
    work.mkdir(parents=True, exist_ok=True)
    name = scenario.id.replace("/", "__")
    out = work / f"{name}.json"
    cmd = [sys.executable, "-m", "pytest_rlhfmem.fakecuda.worker", "--scenario", json.dumps(scenario.to_dict()),
           "--rank", str(rank), "--out", str(out), "--tensors", tensors]
    plain = twin_without_flush(scenario)
    plain_out = work / f"{plain.id.replace('/', '__')}.json"
    if without_flush and plain.id != scenario.id:
        cmd += ["--without-flush-out", str(plain_out)]
    env = dict(os.environ, DS_ACCELERATOR="cuda", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS=str(scenario.get("threads", 1)), PYTHONUNBUFFERED="1")
    if scenario.get("rollout_engine") and tensors != "sim":
        raise ValueError("rollout_engine=True: the colocated engine's mappings are recorded on the simulated CUDA "
                         "device (tensors='sim') and the CPU route, not with FakeTensorMode "
                         "(docs/colocated-rollout.md)")
    if scenario.get("rollout_engine") and without_flush and record_stream == "until-sync":
        raise ValueError("without_flush with rollout_engine=True derives the run without the flush before wake-up "
                         "from the same trace: under record_stream='until-sync' that flush's host wait returns "
                         "blocks, so record both runs instead")
    if scenario.get("hybrid_engine_kernels"):
        from ..rlhf.deepspeed_chat.configs import ppo_setting

        if tensors != "sim":
            raise ValueError("hybrid_engine_kernels=True runs the injected kernels' stand-ins on the simulated CUDA "
                             "device (their outputs are views of a workspace outside the caching allocator): it "
                             "needs tensors='sim'")
        if not ppo_setting(scenario, "hybrid_engine"):  # the pair's default too, which Scenario cannot see
            raise ValueError(f"hybrid_engine_kernels=True injects the Hybrid Engine's kernels, but {scenario.id} "
                             "runs without the Hybrid Engine (set the override hybrid_engine True)")
    if sdpa is not None:
        if tensors != "sim":
            raise ValueError(f"sdpa={sdpa!r} chooses the simulated CUDA device's attention kernel: "
                             "it needs tensors='sim'")
        from ..simcuda.library import ENV_SDPA, sdpa_backend

        env[ENV_SDPA] = sdpa_backend(sdpa)
    if record_stream is not None:
        if tensors != "sim":
            raise ValueError(f"record_stream={record_stream!r} is modelled on the simulated CUDA device: it needs "
                             "tensors='sim'")
        from ..simcuda.library import ENV_RECORD_STREAM, record_stream_mode

        env[ENV_RECORD_STREAM] = record_stream_mode(record_stream)
    log = work / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "wb") as fh, interruptible():
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise FakeCudaRunError(f"{scenario.id}: timed out after {timeout:.0f} s; log {log}") from None
        except RunInterrupted as exc:  # SIGINT/SIGTERM/SIGHUP: the worker (its own session) goes too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise exc.note(work, {}) from None
    wall = time.perf_counter() - t0
    if not out.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise FakeCudaRunError(f"{scenario.id}: worker exited {proc.returncode} without a result; log {log}:\n{tail}")
    results = {}
    for sid, path in ((scenario.id, out), (plain.id, plain_out)):
        if path.exists() and (path == out or without_flush):
            r = json.loads(path.read_text())
            r["process_wall_s"] = round(wall, 3)  # the whole worker process: startup, run, replays
            path.write_text(json.dumps(r, indent=1))
            results[sid] = r
    if made_here and not keep_work and all(r.get("status") == "ok" for r in results.values()):
        shutil.rmtree(work, ignore_errors=True)  # everything is in the returned results
    return results
