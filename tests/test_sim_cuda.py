"""A user's CUDA script, unchanged, under ``rlhfmem capture --device cuda-sim`` on this CPU-only machine
(the simulated CUDA device: ``simcuda/csrc/sim_cuda.cpp``, ``simcuda/library.py``, ``simcuda/torch_cuda.py``).

The scripts in tests/data/commands are plain CUDA scripts (``device="cuda"``, ``.to("cuda")``,
``torch.autocast("cuda")``, ``torch.cuda.*``, no rlhfmem import); the checks read what the scripts themselves
print and dump (``torch.cuda.memory._dump_snapshot``) next to the capture's result, and hold the CS336
workload's dumped snapshots against the GPU recordings of ``../shared/snapshots``."""

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers import DATA, shared_snapshot

from pytest_rlhfmem.command.run import run_command
from pytest_rlhfmem.fidelity.workloads import recorded_figures
from pytest_rlhfmem.memory.driver_va import ENV_SEGMENT_PLACEMENT
from pytest_rlhfmem.memory.trace import load_snapshot

COMMANDS = DATA / "commands"
SEGMENT_40_MIB = 41_943_040


def capture(tmp_path: Path, script: str, *args: str, id: str, env: dict | None = None,  # noqa: A002
            values: str = "off") -> dict:
    """The script on the simulated device; without values unless ``values`` says so (the answers and figures
    these tests name are the value-free device's; tests/test_sim_values.py runs programs that need values)."""
    result = run_command([str(COMMANDS / script), *args], id, device="cuda-sim", work_dir=tmp_path / "work",
                         timeout=900, env=env, sim_values=values)
    assert result["status"] == "ok", result.get("failure") or Path(result["log"]).read_text()[-3000:]
    return result


def printed_figures(result: dict) -> dict:
    line = next(ln for ln in Path(result["log"]).read_text().splitlines() if ln.startswith("FIGURES "))
    return json.loads(line.removeprefix("FIGURES "))


def test_every_torch_cuda_call_of_a_profiling_script_runs_and_answers_from_the_simulated_allocator(tmp_path):
    from torch.cuda import _memory_viz

    snap = tmp_path / "snap.pickle"
    result = capture(tmp_path, "cuda_functions.py", str(snap), id="cuda-functions")
    fig = printed_figures(result)
    assert result["capture"] == "sim-cuda-simulated" and result["simulated"] is True
    # the script's own torch.cuda figures are the simulated allocator's, at that point of the run
    assert fig["max_allocated"] == fig["stats_peak"] == result["metrics"]["peak_allocated"]
    assert fig["max_reserved"] == result["metrics"]["peak_reserved"]
    assert fig["free_total"] == [24 * 2**30 - fig["reserved"], 24 * 2**30]
    assert fig["elapsed_ms"] == 0.0 and fig["item"] == 1.0 and fig["any"] is False  # named answers
    described = result["capture_description"]["simulated_cuda_device"]
    assert described["scalar_answers"] == {"bool": 1, "float": 1}
    sites = result["ranks"][0]["scalar_answers"]  # the lines of the script that took a fixed answer
    line = next(i for i, ln in enumerate((COMMANDS / "cuda_functions.py").read_text().splitlines(), 1)
                if ln.startswith("answers = "))
    where = f"{COMMANDS / 'cuda_functions.py'}:{line}"
    assert sites == {f"{where} item": {"call": "item", "dtype": "float32", "answer": 1.0, "count": 1},
                     f"{where} __bool__": {"call": "__bool__", "dtype": "bool", "answer": False, "count": 1}}
    assert described["cublas_workspaces"] == 2  # the forward on the side stream, autograd's thread
    # the dumped snapshot is PyTorch's format: torch.cuda._memory_viz reads it, and it holds the state the
    # script saw when it dumped (after empty_cache)
    data = load_snapshot(snap)
    summary = _memory_viz.segsum(data)
    assert f"total_reserved: {fig['reserved_after_empty_cache'] / 2**20:.1f}MiB" in summary
    assert "cudaMalloc" in _memory_viz.trace(data)
    assert data["allocator_settings"]["rlhfmem_capture"] == "sim-cuda-simulated"


def test_cuda_autocast_keeps_the_bf16_weight_casts_until_the_block_exits(tmp_path):
    """CPU autocast would free each cast at once (and a CPU build ignores autocast("cuda") entirely);
    the simulated device runs ATen's AutocastCUDA kernels, cast cache included."""
    fig = printed_figures(capture(tmp_path, "cuda_autocast.py", id="cuda-autocast"))
    weights_bf16 = (1024 * 4096 + 4096 * 1024) * 2
    assert fig["dtype"] == "torch.bfloat16"
    assert fig["inside"] - fig["after"] == weights_bf16  # both cached casts live inside, freed at exit
    assert fig["after"] - fig["before"] == 8 * 1024 * 2 + 8_519_680  # y (bf16) and one cuBLAS workspace


def _compare(dumped: Path, recording: str) -> dict:
    rec, cap = recorded_figures(shared_snapshot(recording)), recorded_figures(dumped)
    return {"recorded": rec, "captured": cap,
            "missing": Counter(rec["sizes"]) - Counter(cap["sizes"]),
            "extra": Counter(cap["sizes"]) - Counter(rec["sizes"])}


def _layout(snapshot: Path) -> list:
    """The segments in address order, each as its blocks' (size, state): what a driver placement decides."""
    segments = sorted(load_snapshot(snapshot)["segments"], key=lambda s: s["address"])
    return [[(b["size"], b["state"]) for b in s["blocks"]] for s in segments]


def context_reserve_of_the_recordings_gpu() -> int:
    """The range the CUDA context held below the program's first segment on the GPU of the wedson recordings,
    read off the INFERENCE recording only: its lowest segment's address to the embedding's (the parameter moved
    first: the one block of 40,960,000 B requested, vocab 10,000 x d_model 1,024 fp32, at the lower address)."""
    segments = load_snapshot(shared_snapshot("wedson_medium_128_inference"))["segments"]
    embedding = min(s["address"] for s in segments if any(b.get("requested_size") == 40_960_000 for b in s["blocks"]))
    return embedding - min(s["address"] for s in segments)


@pytest.mark.long  # a minute or more on 2 cores: tox -e long (pyproject.toml's markers)
def test_cs336_inference_script_unchanged_matches_the_gpu_recording_twice(tmp_path):
    """wedson_medium_128_inference: the profiling script as written for a GPU (model built on the host,
    ``.to("cuda")``, no seed), its own ``_dump_snapshot`` of the recorded step: the same 1,280 allocation
    sizes in order, peak reserved and peak allocated equal to the byte, under the model's default placement and
    under the driver's first-fit one; with first-fit the 98 segments lie in the GPU's address order, block for
    block. Without values, as the device ran before values existed; with values: the next test."""
    shared_snapshot("wedson_medium_128_inference")  # skips, naming the path, before any run when it is missing
    reserve = context_reserve_of_the_recordings_gpu()
    assert reserve == 188 * 2**20
    runs = []
    for k, placement in enumerate((None, f"first-fit:{reserve}")):
        snap = tmp_path / f"inference-{k}.pickle"
        capture(tmp_path / str(k), "cs336_memory_profile.py", "--mode", "inference", "--context-length", "128",
                "--out", str(snap), id="cs336-inference",
                env={ENV_SEGMENT_PLACEMENT: placement} if placement else None)
        runs.append(_compare(snap, "wedson_medium_128_inference"))
    for c in runs:
        rec, cap = c["recorded"], c["captured"]
        assert cap["sizes"] == rec["sizes"] and len(cap["sizes"]) == 1280
        assert cap["peak_reserved"] == rec["peak_reserved"] == 1_763_704_832
        assert cap["peak_allocated"] == rec["peak_allocated"] == 1_738_928_128
    assert runs[0]["captured"] == runs[1]["captured"]
    assert _layout(snap) == _layout(shared_snapshot("wedson_medium_128_inference"))


@pytest.mark.full_size_fidelity
def test_cs336_inference_with_values_keeps_the_gpu_recordings_allocations(tmp_path):
    """The simulated device computing values (``--sim-values on``, the capture's default) makes the same
    allocations as without: the inference workload's 1,280 allocation sizes in order and its peak reserved and peak
    allocated equal the GPU recording's to the byte. About a minute here: the host computes the 423M-parameter
    model's forward (``tox -e sim-fidelity``; the default run checks a smaller loop: tests/test_sim_values.py)."""
    shared_snapshot("wedson_medium_128_inference")
    snap = tmp_path / "inference.pickle"
    capture(tmp_path, "cs336_memory_profile.py", "--mode", "inference", "--context-length", "128", "--out", str(snap),
            id="cs336-inference", values="on")
    c = _compare(snap, "wedson_medium_128_inference")
    rec, cap = c["recorded"], c["captured"]
    assert cap["sizes"] == rec["sizes"] and len(cap["sizes"]) == 1280
    assert cap["peak_reserved"] == rec["peak_reserved"] == 1_763_704_832
    assert cap["peak_allocated"] == rec["peak_allocated"] == 1_738_928_128


@pytest.mark.full_size_fidelity  # 63 s of host compute: tox -e sim-fidelity (the default run checks inference above)
def test_cs336_training_script_unchanged_matches_the_gpu_recording_under_the_drivers_placement(tmp_path, capsys):
    """wedson_medium_256_training: forward, loss, backward, AdamW. The recorded step's allocations and frees are
    the GPU's event for event, in order (13,027 of them: the 49 reductions' 8,388,608 B staging buffers and 32 B
    semaphores, the embedding backward's sort buffers and cub's 1-byte temp storage included).

    Peak reserved is what the five warm-up steps left cached, which depends on where the driver mapped each
    cudaMalloc (best fit takes the lowest address among equal-size free blocks). With the driver's first-fit
    placement and the context's range read off the inference recording (``--segment-placement
    first-fit:188MiB``), two runs give the GPU's peak reserved and peak allocated to the byte and its 495
    segments in address order, block for block. Under the model's default placement (each new segment above
    the last) the capture holds one 41,943,040 B segment less (-0.45%), one of the figures 16 seeded random
    placements give (memory/address_order.py)."""
    from pytest_rlhfmem.memory.address_order import address_order_spread
    from pytest_rlhfmem.memory.trace_io import load_trace

    recording = shared_snapshot("wedson_medium_256_training")
    placement = f"first-fit:{context_reserve_of_the_recordings_gpu()}"
    runs, results = [], []
    for k, env in enumerate(({ENV_SEGMENT_PLACEMENT: placement}, {ENV_SEGMENT_PLACEMENT: placement}, None)):
        snap = tmp_path / f"training-{k}.pickle"
        results.append(capture(tmp_path / str(k), "cs336_memory_profile.py", "--mode", "training",
                               "--context-length", "256", "--out", str(snap), id="cs336-training", env=env))
        runs.append(_compare(snap, "wedson_medium_256_training"))
    rec_data = load_snapshot(recording)

    def sequence(data: dict) -> list[tuple[str, int]]:
        return [(e["action"], e["size"]) for e in data["device_traces"][0]
                if e["action"] in ("alloc", "free_completed")]

    first_fit, default = runs[:2], runs[2]
    assert first_fit[0]["captured"] == first_fit[1]["captured"]  # twice in a row: the same figures
    for c in runs:
        assert c["captured"]["peak_allocated"] == c["recorded"]["peak_allocated"] == 9_113_374_720
        assert not c["missing"] and not c["extra"]
    assert sequence(load_snapshot(tmp_path / "training-0.pickle")) == sequence(rec_data)
    assert len(sequence(rec_data)) == 13_027
    for c in first_fit:
        assert c["captured"]["peak_reserved"] == c["recorded"]["peak_reserved"] == 9_265_217_536
    for k in (0, 1):
        assert _layout(tmp_path / f"training-{k}.pickle") == _layout(recording)
    assert results[0]["capture_description"]["segment_placement"] == placement
    assert "segment_placement" not in results[2]["capture_description"]
    assert default["recorded"]["peak_reserved"] - default["captured"]["peak_reserved"] == SEGMENT_40_MIB
    spread = address_order_spread(load_trace(results[2]["ranks"][0]["trace_file"]), orders=16, seed=0)
    assert spread["model_order"]["peak_reserved"] == default["captured"]["peak_reserved"]
    assert spread["peak_reserved"]["counts"].get(default["recorded"]["peak_reserved"], 0) >= 1
    # the default capture's own trace, replayed under the driver's placement: the GPU's figure (a trace does not
    # depend on the placement; its replay does)
    from pytest_rlhfmem.cli import main

    assert main(["replay", results[2]["ranks"][0]["trace_file"], "--free-running", "--segment-placement", placement,
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["segment_placement"] == placement
    assert out["simulated"]["peak_reserved"] == default["recorded"]["peak_reserved"]


def test_memory_efficient_attention_keeps_output_and_logsumexp_not_the_score_matrix(tmp_path):
    """``--sdpa efficient`` (``$RLHFMEM_SIM_CUDA_SDPA``): scaled_dot_product_attention runs the memory-efficient
    kernels (their meta kernels' outputs); the default, math, materialises the (B, H, T, T) scores and keeps
    the softmax for backward. The philox seed and offset are host tensors, as attention.cu makes them."""
    figures = {}
    for backend in ("math", "efficient"):
        result = run_command([str(COMMANDS / "cuda_sdpa.py")], f"sdpa-{backend}", device="cuda-sim",
                             sim_values="off", work_dir=tmp_path / backend, timeout=900,
                             env={"RLHFMEM_SIM_CUDA_SDPA": backend})
        assert result["status"] == "ok", result.get("failure")
        assert result["capture_description"]["simulated_cuda_device"]["scaled_dot_product_attention"] == backend
        figures[backend] = printed_figures(result)
    b, h, t, d = 2, 4, 256, 64
    eff = figures["efficient"]
    assert eff["after"] - eff["before"] == b * h * t * d * 2 + b * h * t * 4  # fp16 output, fp32 logsumexp
    assert figures["math"]["after"] - figures["math"]["before"] > b * h * t * t * 2  # scores (fp16) kept
    # backward (attention_backward.cu, kernel_backward.h): the sum's fp16 result and its root gradient (512 B
    # blocks), grad_out made contiguous (an expanded gradient), grad_q/k/v, delta (B, H, T) fp32 and the 64x64
    # kernel's fp32 grad_q workspace B * H * ceil(T / 64) * 16,400 B
    qkv = b * h * t * d * 2
    assert eff["peak"] - eff["after"] == 2 * 512 + qkv + 3 * qkv + b * h * t * 4 + b * h * (t // 64) * 16_400
    assert all(eff["grads"]) and all(figures["math"]["grads"])


def test_sdpa_choice_needs_the_simulated_device(capsys):
    from pytest_rlhfmem.cli import main

    assert main(["capture", "--device", "cpu", "--sdpa", "efficient", "--", "python", "-c", "pass"]) == 2
    assert "--sdpa chooses the simulated CUDA device's attention kernel: it needs --device cuda-sim or " \
           "cuda-rehearsal, got " \
           "--device cpu" in capsys.readouterr().err


def test_a_host_buffer_filled_from_the_value_free_device_reads_zeros_not_what_it_held(tmp_path):
    """Without values the device computes nothing; a host tensor copied from it reads zeros, so host code reading it
    decides the same on every run (DeepSpeed's overflow check of offloaded gradients skipped ZeRO-3 + offload's
    actor step in some runs when the buffer kept whatever its memory held). With values, the device's own values."""
    for values, expected in (("off", [0.0]), ("on", [1.0])):
        result = capture(tmp_path / values, "cuda_copy_to_host.py", id="copy-to-host", values=values)
        line = next(ln for ln in Path(result["log"]).read_text().splitlines() if ln.startswith("HOST "))
        assert json.loads(line.removeprefix("HOST ")) == {"copy_": expected, "cpu": expected}


def test_memory_stats_from_a_second_thread_feed_each_allocation_once(tmp_path):
    """The simulated allocator answers any thread, as the real one does under its mutex: a thread reading
    ``torch.cuda.memory_stats()`` while the main thread allocates neither fails nor counts an event twice (a rank's
    progress heartbeat did that on the rehearsal device: ``KeyError`` in ``generate``, ZeRO-3 at world size 2)."""
    result = capture(tmp_path, "cuda_stats_from_a_thread.py", id="stats-thread")
    line = next(ln for ln in Path(result["log"]).read_text().splitlines() if ln.startswith("STATS "))
    stats = json.loads(line.removeprefix("STATS "))
    assert stats["errors"] == []
    assert stats["allocated"] == 0 and stats["allocs"] == stats["frees"] == 300 * 40
