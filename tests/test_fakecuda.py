"""The fake-CUDA route (pytest_rlhfmem/fakecuda): its pieces on a tiny model, in seconds.

The route must run in a fresh process (its CUDA hooks load before torch), so the recording tests start
``python -m pytest_rlhfmem.fakecuda.selfcheck`` / the worker as subprocesses.
"""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pytest_rlhfmem.fakecuda.recorder import SCALAR_ANSWERS, cublas_workspace_bytes
from pytest_rlhfmem.fakecuda.run import run_fake_cuda
from pytest_rlhfmem.rlhf.scenario import Scenario

ROOT = Path(__file__).resolve().parent.parent
WORKSPACE = 8_519_680


def test_cublas_workspace_bytes_follows_the_config():
    assert cublas_workspace_bytes(":4096:2:16:8") == WORKSPACE  # PyTorch's default before sm_90
    assert cublas_workspace_bytes(":4096:8") == 32 * 2**20
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        cublas_workspace_bytes("4096:8")
    with pytest.raises(ValueError, match="integers"):
        cublas_workspace_bytes(":4096:x")


def test_scalar_answers_take_the_normal_path():
    assert SCALAR_ANSWERS["uint8"] == 0 and SCALAR_ANSWERS["bool"] is False  # fp16: no overflow
    assert SCALAR_ANSWERS["float"] == 1.0  # finite norms and losses


def _selfcheck(route: str) -> tuple[list, int]:
    proc = subprocess.run([sys.executable, "-m", "pytest_rlhfmem.fakecuda.selfcheck", route], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events, workspaces = json.loads(proc.stdout.strip().splitlines()[-1])
    return events, workspaces


def test_fake_route_records_what_the_cpu_recorder_records():
    """Same tiny OPT step (fp32: forward, loss, backward, AdamW step) on both routes. Documented
    differences: the fake route adds one cuBLAS workspace per matmul thread (forward and autograd's
    device thread); the CPU route also records 0-d scalar tensors (AdamW's ``step`` counters), which on
    a GPU are host tensors too; one attention-path op per layer allocates differently (CPU kernels)."""
    fake, workspaces = _selfcheck("fake")
    cpu, _ = _selfcheck("cpu")
    assert workspaces == 2
    fake_sizes = [s for a, s in fake if a == "alloc"]
    assert fake_sizes.count(WORKSPACE) == 2
    f = Counter(s for s in fake_sizes if s != WORKSPACE)
    c = Counter(s for a, s in cpu if a == "alloc" and s > 8)
    big = lambda cnt: Counter({k: v for k, v in cnt.items() if k >= 64 * 1024})  # noqa: E731
    assert big(f) == big(c)  # every parameter, gradient, optimizer state and activation >= 64 KiB
    total_f, total_c = sum(k * v for k, v in f.items()), sum(k * v for k, v in c.items())
    assert abs(total_f - total_c) < 0.005 * total_c


def test_tiny_deepspeed_chat_iteration_on_the_fake_route(tmp_path):
    """The project's recipe, unchanged, on fake CUDA tensors: fp16, 2 ranks (rank 0), ZeRO stage 0."""
    sc = Scenario("deepspeed-chat", "tiny-opt", "none", "after-inference", 2)
    results = run_fake_cuda(sc, work_dir=tmp_path, without_flush=True, timeout=900)
    assert set(results) == {sc.id, Scenario("deepspeed-chat", "tiny-opt", "none", "none", 2).id}
    for r in results.values():
        assert r["status"] == "ok", r.get("error")
        assert r["capture"] == "fake-cuda-simulated" and r["simulated"] is True
        assert r["recipe"]["dtype"] == "float16"
        assert r["adjustments"]["cublas_workspace"]["count"] >= 2
        assert [p["phase"] for p in r["phases"]][0] == "init" and r["total"]["peak_allocated"] > 0
    flushed = results[sc.id]
    assert len(flushed["flushes"]) == 5  # after generate and each of the four inference forwards
    # the route is deterministic (no thread frees, fixed scalar answers): its figures, pinned to the byte
    # (two runs here gave the same; simulated, rank 0, fp16 model states + cuBLAS workspaces)
    for r in results.values():
        t = r["total"]
        assert (t["peak_reserved"], t["peak_allocated"], t["fragmentation_at_peak"], t["cuda_malloc_count"],
                r["peak_phase"]) == (62_914_560, 51_551_744, 13_672_960, 12, "train_actor"), r["scenario_id"]



@pytest.mark.parametrize("strategy", ("none", "zero3-offload"))
def test_tiny_deepspeed_chat_iteration_on_the_simulated_device(tmp_path, strategy):
    """The same recipe with ``tensors="sim"``: the simulated CUDA device (``simcuda/csrc/sim_cuda.cpp``) in
    place of ``FakeTensorMode``, the route ``studies/study_scale.py`` uses by default."""
    sc = Scenario("deepspeed-chat", "tiny-opt", strategy, "after-inference", 2)
    results = run_fake_cuda(sc, work_dir=tmp_path, without_flush=True, timeout=900, tensors="sim")
    assert set(results) == {sc.id, Scenario("deepspeed-chat", "tiny-opt", strategy, "none", 2).id}
    for r in results.values():
        assert r["status"] == "ok", r.get("error")
        assert r["capture"] == "sim-cuda-simulated" and r["simulated"] is True and r["route"] == "sim-cuda"
        assert r["recipe"]["dtype"] == "float16"
        assert r["adjustments"]["cublas_workspace"]["count"] == 2
        assert r["placement"]["annotated_host_bytes_on_cuda"] == 0
        assert r["scalar_answers"] and r["iteration_cpu_s"] > 0
    if strategy != "none":
        assert results[sc.id]["placement"]["annotated_host_bytes_on_cpu"] > 0  # offloaded: real host tensors
        return
    assert len(results[sc.id]["flushes"]) == 5
    # Pinned (simulated, rank 0). Against the fake route's (62_914_560, 51_551_744, 13_672_960, 12) above:
    # 512 B more fragmentation at the same peak. Measured per op (tiny-opt, 16 + 16 tokens): the simulated
    # device also records the temporaries made inside ``_safe_softmax``'s composite kernel (which a GPU runs
    # too; FakeTensorMode runs it below the fake route's recorder) and ``native_layer_norm``'s mean and rstd
    # as two storages, as the CUDA kernel allocates them (one on the fake route).
    for r in results.values():
        t = r["total"]
        assert (t["peak_reserved"], t["peak_allocated"], t["fragmentation_at_peak"], t["cuda_malloc_count"],
                r["peak_phase"]) == (62_914_560, 51_551_744, 13_673_472, 12, "train_actor"), r["scenario_id"]


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_ema_keeps_a_fifth_model_and_updates_it_after_training(tmp_path):
    """DeepSpeed-Chat's ``--enable_ema`` (``rlhf_engine.py: _init_ema``, ``utils.py: moving_average``): the
    actor's moving-average copy is built in ``init`` (reference's eval config) and updated in an ``ema``
    phase after the critic's update. Needs the scenario override ``ema`` (``rlhf/scenario.py``)."""
    from pytest_rlhfmem.rlhf.scenario import OVERRIDES

    if "ema" not in OVERRIDES:
        pytest.skip("rlhf/scenario.py has no 'ema' override yet (the recipe reads scenario.get('ema'))")
    base = Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 2)
    with_ema = Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 2, {"ema": True})
    off = run_fake_cuda(base, work_dir=tmp_path / "off", timeout=900, tensors="sim")[base.id]
    on = run_fake_cuda(with_ema, work_dir=tmp_path / "on", timeout=900, tensors="sim")[with_ema.id]
    assert off["status"] == "ok" and on["status"] == "ok", on.get("error")
    assert on["recipe"]["ema"] is True and [p["phase"] for p in on["phases"]][-1] == "ema"
    init = lambda r: next(p for p in r["phases"] if p["phase"] == "init")  # noqa: E731
    assert init(on)["peak_allocated"] > init(off)["peak_allocated"]  # the fifth model's partition


def test_simulated_device_models_the_memory_efficient_attention_kernel(tmp_path):
    """``sdpa="efficient"``: the simulated device answers scaled_dot_product_attention's backend choice with
    memory-efficient attention (output and logsumexp, no score matrix); the result names the kernel."""
    sc = Scenario("deepspeed-chat", "tiny-opt", "none", "none", 2)
    r = run_fake_cuda(sc, work_dir=tmp_path, timeout=900, tensors="sim", sdpa="efficient")[sc.id]
    assert r["status"] == "ok", r.get("error")
    assert r["capture_description"]["simulated_cuda_device"]["scaled_dot_product_attention"] == "efficient"
    with pytest.raises(ValueError, match="needs tensors='sim'"):
        run_fake_cuda(sc, work_dir=tmp_path, tensors="fake", sdpa="efficient")


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_the_hybrid_engine_runs_as_deepspeeds_own_on_the_fake_route(tmp_path):
    """The Hybrid Engine on the simulated CUDA device: DeepSpeed's ``DeepSpeedHybridEngine`` with the
    ``transformer_inference`` op standing in without kernels (``standins._install_hybrid_engine``); it injects
    nothing into OPT, and under ZeRO-3 its ``eval()`` flushes before generation (``hybrid_engine.py``). With
    ``hybrid_engine_kernels`` it injects its inference layers as the study's DeepSpeed did
    (``fakecuda/inference_kernels.py``): every decoder layer of every forward of the generation runs DeepSpeed's
    Python with the kernels' stand-ins, no kernel falls back to torch, LoRA is fused and unfused around the
    generation, and every layer is gathered for all of it."""
    settings = {"off": {"hybrid_engine": False}, "native": {"hybrid_engine": True},
                "kernels": {"hybrid_engine": True, "hybrid_engine_kernels": True}}
    sc = {k: Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 4, o) for k, o in settings.items()}
    res = {k: run_fake_cuda(s, work_dir=tmp_path / k, timeout=900, tensors="sim")[s.id] for k, s in sc.items()}
    assert all(r["status"] == "ok" for r in res.values()), [r.get("error") for r in res.values()]
    assert res["native"]["recipe"]["hybrid_engine"] == "DeepSpeedHybridEngine"
    assert any(s.startswith("Hybrid Engine:") for s in res["native"]["standins"])
    he = [f for f in res["native"]["flushes"] if f["name"].startswith("empty_cache@hybrid_engine.py:")]
    assert len(he) == 1 and he[0]["phase"] == "init"
    assert len(res["native"]["flushes"]) == len(res["off"]["flushes"]) + 1
    assert res["native"]["inference_kernel_calls"] == {} and res["native"]["outside_caching_allocator"] == []

    kernels = res["kernels"]
    assert any(s.startswith("Hybrid Engine with its inference kernels") for s in kernels["standins"])
    layers, forwards = 4, 16  # tiny-opt's actor; one forward per generated token (answer_len 16)
    calls = kernels["inference_kernel_calls"]
    per_layer = ("qkv_gemm", "softmax_context", "vector_matmul", "mlp_gemm", "residual_add_bias")
    assert {k: calls[k] for k in per_layer} == dict.fromkeys(per_layer, layers * forwards)
    assert calls["allocate_workspace"] == 1 and "layer_norm" not in calls  # pre-LN OPT: no empty_like
    assert calls["fuse_lora (peft merge)"] == calls["unfuse_lora (peft unmerge)"] == layers * 6  # q k v out fc1 fc2
    # GenWorkSpace for batch 2, 4 layers, hidden 256, 4 heads, 32 tokens: (5120 + 256 + 4096) * 32 * 2 bytes
    assert kernels["outside_caching_allocator"][0]["bytes"] == 606_208
    gen = {k: next(p for p in r["phases"] if p["phase"] == "generate") for k, r in res.items()}
    # the layers' activations and KV cache live in the workspace: a fraction of the native generation's events
    assert gen["kernels"]["events"] * 3 < gen["native"]["events"]
    # ZeRO-3: generate() gathers every layer for the whole generation
    assert gen["kernels"]["peak_allocated"] > gen["native"]["peak_allocated"]


def test_injected_kernels_follow_deepspeeds_workspace_and_token_bookkeeping():
    """``InferenceKernels`` (unit): the workspace size of ``inference_context.h: GenWorkSpace`` for OPT-1.3b
    (132 MiB per sequence at 512 tokens), keys and values as views of its KV cache that grow by one token per
    decode step (``advance_tokens`` after the last layer), a kernel with no stand-in missing as a symbol is."""
    import torch

    from pytest_rlhfmem.fakecuda.inference_kernels import InferenceKernels

    k = InferenceKernels()
    k.allocate_workspace_fp16(2048, 32, 256, 4, 24, 1, False, 0, 512, 512)
    assert k.raw_allocations[0]["bytes"] == 4 * 132 * 2**20
    fp32 = InferenceKernels()
    fp32.allocate_workspace_fp32(2048, 32, 256, 4, 24, 1, False, 0, 512, 512)  # sizeof(float): twice the bytes
    assert fp32.raw_allocations[0]["bytes"] == 4 * 264 * 2**20 and fp32.kv_cache.dtype == torch.float32
    qkv = torch.empty(4, 256, 3 * 2048, dtype=torch.float16, device="meta")
    for layer in range(24):
        ctx, keys, values = k.softmax_context_fp16(qkv, None, 0, False, False, 32, 32, 1.0, True, False, 1, True,
                                                   layer, 24, None, 1e4, True, None, None)
    assert ctx.shape == (4, 256, 2048) and keys.shape == values.shape == (4, 32, 256, 64)
    step = torch.empty(4, 1, 3 * 2048, dtype=torch.float16, device="meta")
    for _ in range(2):
        for layer in range(24):
            _, keys, _ = k.softmax_context_fp16(step, None, 0, False, False, 32, 32, 1.0, True, False, 1, True,
                                                layer, 24, None, 1e4, False, None, None)
    assert keys.shape == (4, 32, 258, 64) and k.calls["softmax_context"] == 72
    with pytest.raises(AttributeError, match="no stand-in for bias_gelu_fp16"):
        k.bias_gelu_fp16  # noqa: B018 - the op_binding wrapper then takes its torch fallback


def test_injected_kernels_are_refused_where_they_cannot_run(tmp_path):
    """``hybrid_engine_kernels``: needs the Hybrid Engine, the simulated device's tensors, and the fake-CUDA
    route: each refusal is one line naming why."""
    from pytest_rlhfmem.rlhf.launch import run_scenario
    from pytest_rlhfmem.rlhf.scenario import ScenarioError

    with pytest.raises(ScenarioError, match="needs hybrid_engine True"):
        Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 4, {"hybrid_engine": False,
                                                                    "hybrid_engine_kernels": True})
    sc = Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 2, {"hybrid_engine": True,
                                                                     "hybrid_engine_kernels": True})
    with pytest.raises(ValueError, match="it needs tensors='sim'"):
        run_fake_cuda(sc, work_dir=tmp_path, tensors="fake")
    without_he = Scenario("deepspeed-chat", "tiny-opt", "zero3", "none", 2, {"hybrid_engine_kernels": True})
    with pytest.raises(ValueError, match="runs without the Hybrid Engine"):  # tiny-opt's default: no Hybrid Engine
        run_fake_cuda(without_he, work_dir=tmp_path, tensors="sim")
    with pytest.raises(ScenarioError, match="fake-CUDA route only .* no injected layer to run on cpu"):
        run_scenario(sc, device="cpu", work_dir=tmp_path)
    assert sc.id.endswith("hybrid_engine=True,hybrid_engine_kernels=True")


def test_record_stream_holds_a_freed_block_until_the_host_waits_for_its_stream():
    """``until-sync`` (simcuda/library.py): CUDACachingAllocator.cpp's ``recordStream`` ignores the block's own
    stream; a block used on another stream is requested free where the program freed it (action 5: the stats
    drop there) and returns to its pool at the host's next wait for that stream (or for all)."""
    from pytest_rlhfmem.simcuda.library import delay_record_stream_frees

    ev = [(1, 0xA, 512, 0, 1), (1, 0xB, 512, 0, 2), (1, 0xC, 512, 7, 3),
          (3, 0xA, 0, 7, 4), (3, 0xB, 0, 0, 5), (3, 0xC, 0, 7, 6),  # A used on 7; B and C on their own stream
          (2, 0xA, 512, 0, 7), (2, 0xB, 512, 0, 8), (2, 0xC, 512, 7, 9),
          (4, 0, 0, 3, 10),  # a wait for another stream: A stays held
          (1, 0xD, 512, 0, 11), (4, 0, 0, 7, 12), (2, 0xD, 512, 0, 13)]
    placed = delay_record_stream_frees(ev)
    assert [(i, e[0], e[1]) for i, e in placed] == [
        (0, 1, 0xA), (1, 1, 0xB), (2, 1, 0xC), (6, 5, 0xA), (7, 2, 0xB), (8, 2, 0xC), (10, 1, 0xD), (11, 2, 0xA),
        (12, 2, 0xD)]
    assert placed[3][1][4] == 7 and placed[7][1][4] == 12  # the request at the free's time, the return at the wait's
    # a block still held at the end is freed after the last event; a wait for every stream releases all
    tail = delay_record_stream_frees([(1, 0xA, 512, 0, 1), (3, 0xA, 0, 5, 2), (2, 0xA, 512, 0, 3)])
    assert tail[1:] == [(2, (5, 0xA, 512, 0, 3)), (3, (2, 0xA, 512, 0, 3))]
    everything = delay_record_stream_frees([(1, 0xA, 512, 0, 1), (3, 0xA, 0, 5, 2), (2, 0xA, 512, 0, 3),
                                            (4, 0, 0, -1, 4)])
    assert everything[-1] == (3, (2, 0xA, 512, 0, 4))


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_record_stream_until_sync_on_the_route(tmp_path, monkeypatch):
    """ZeRO-2 with ``overlap_comm`` records its gradient buckets on the reduction stream
    (``stage_1_and_2.py``): with ``until-sync`` those blocks return to their pool at a host sync, so peak reserved
    cannot fall; their bytes leave ``allocated`` at the program's free either way (PyTorch's ``free`` drops the
    stats before ``insert_events``), so peak allocated is the same. A flush of the policy waits for every stream
    first (``release_cached_blocks`` -> ``synchronize_and_free_events``): no block is held at any FLUSH, and the
    flush-none result derived from the flushed run is the one a run without the policy gives."""
    from pytest_rlhfmem.memory.trace_io import load_trace

    monkeypatch.setenv("RLHFMEM_FAKECUDA_SAVE_TRACE", "1")
    plain = Scenario("deepspeed-chat", "tiny-opt", "zero2", "none", 4)
    flushed = Scenario("deepspeed-chat", "tiny-opt", "zero2", "after-both", 4)
    res = {m: run_fake_cuda(plain, work_dir=tmp_path / m, timeout=900, tensors="sim", record_stream=m)[plain.id]
           for m in ("immediate", "until-sync")}
    both = run_fake_cuda(flushed, work_dir=tmp_path / "flushed", timeout=900, tensors="sim", record_stream="until-sync",
                         without_flush=True)
    assert all(r["status"] == "ok" for r in [*res.values(), *both.values()])
    dev = {m: r["capture_description"]["simulated_cuda_device"] for m, r in res.items()}
    assert dev["immediate"]["record_stream"] == "immediate" and dev["immediate"]["record_stream_delayed_frees"] == 0
    assert dev["until-sync"]["record_stream"] == "until-sync" and dev["until-sync"]["record_stream_delayed_frees"] > 0
    assert res["until-sync"]["total"]["peak_reserved"] >= res["immediate"]["total"]["peak_reserved"]
    assert res["until-sync"]["total"]["peak_allocated"] == res["immediate"]["total"]["peak_allocated"]

    def figures(r: dict) -> list:
        return [(p["phase"], p["peak_reserved"], p["peak_allocated"]) for p in r["phases"]]

    assert figures(both[plain.id]) == figures(res["until-sync"])  # derived flush-none == a run without the policy
    trace = load_trace(tmp_path / "flushed" / (flushed.id.replace("/", "__") + ".rlhftrace"))
    held: set[int] = set()
    returned_by_a_policy_wait = 0
    for k, e in enumerate(trace.events):
        if e.action == "free_requested":
            held.add(e.addr)
        elif e.action == "free" and e.addr in held:
            held.discard(e.addr)
            nxt = next(x for x in trace.events[k:] if x.action != "free")
            returned_by_a_policy_wait += nxt.action == "flush" and nxt.name.startswith("after-")
        elif e.action == "flush":
            assert not held, f"{len(held)} blocks held at {e.name}"
    assert returned_by_a_policy_wait >= 1
    with pytest.raises(ValueError, match="allowed values are immediate, until-sync"):
        run_fake_cuda(plain, work_dir=tmp_path / "bad", tensors="sim", record_stream="later")
