"""rlhfmem advise (issue 13): trace files, flush placement, the sweep's JSON, bad input, and the premise on
real recipe runs (a flush-none trace predicts each flush policy's measured figures)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DATA, shared_snapshot
from pytest_rlhfmem.advise import (
    SCHEMA, AdviseInputError, advise, find_boundaries, policy_boundaries, program_events,
)
from pytest_rlhfmem.memory.allocator import MiB
from pytest_rlhfmem.memory.replay import with_flushes
from pytest_rlhfmem.memory.trace import (
    ALLOC, CAPTURE_CPU_SIMULATED, FLUSH, FREE, PHASE, PHASE_END, Event, SegmentState, Trace,
)
from pytest_rlhfmem.memory.trace_io import SUFFIX, TraceFileError, load_trace, save_trace

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest_rlhfmem.cli", "advise", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def phased(flush_after: tuple[str, ...] = ()) -> Trace:
    """Inference caches a 30 MiB and a 2 MiB (small) segment; training then needs 40 MiB: only a flush in
    between lowers the peak (72 MiB -> 42 MiB), and costs one small segment re-acquired between the phases
    (allocations between a phase's end and the next phase follow the flush, as in the recipes)."""
    ev, t = [], 0

    def add(action, addr=0, size=0, name=""):
        nonlocal t
        t += 10
        ev.append(Event(action, addr, size, 0, t, name))

    add(PHASE, name="generate")
    add(ALLOC, 0x1000, 30 * MiB)
    add(ALLOC, 0x5000, 1024)
    add(FREE, 0x1000, 30 * MiB)
    add(FREE, 0x5000, 1024)
    add(PHASE_END, name="generate")
    if "generate" in flush_after:
        add(FLUSH, name="after-generate")
    add(ALLOC, 0x2000, 4096)  # between phases: after the flush
    add(PHASE, name="train_actor")
    add(ALLOC, 0x3000, 40 * MiB)
    add(FREE, 0x3000, 40 * MiB)
    add(FREE, 0x2000, 4096)
    add(PHASE_END, name="train_actor")
    if "train_actor" in flush_after:
        add(FLUSH, name="after-train_actor")
    return Trace(events=ev, capture=CAPTURE_CPU_SIMULATED)


def result_json(tmp_path: Path, traces: list[Trace], flush: str = "none", name: str = "r.json") -> Path:
    ranks = []
    for i, tr in enumerate(traces):
        f = save_trace(tmp_path / f"trace-rank{i}{SUFFIX}", tr)
        ranks.append({"rank": i, "trace_file": str(f)})
    p = tmp_path / name
    p.write_text(json.dumps({"scenario_id": f"synthetic/flush-{flush}/x{len(traces)}", "capture": CAPTURE_CPU_SIMULATED,
                             "scenario": {"flush": flush}, "ranks": ranks}))
    return p


# -- trace files ------------------------------------------------------------------------------------


def test_trace_file_round_trip_keeps_every_field(tmp_path):
    tr = phased(("generate",))
    tr.events.append(Event("segment_alloc", 1 << 40, 2 * MiB, 7, 10**12, ""))
    tr.initial_segments = [SegmentState(1 << 30, 2 * MiB, 0, True, [(1 << 30, 512, 100)])]
    tr.allocator_settings = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    back = load_trace(save_trace(tmp_path / "t.rlhftrace", tr))
    assert back.events == tr.events
    assert back.initial_segments == tr.initial_segments
    assert back.allocator_settings == tr.allocator_settings and back.capture == tr.capture


@pytest.mark.parametrize("damage, fragment", [
    (lambda b: b"garbage" + b, "not an rlhfmem trace file"),
    (lambda b: b[:14] + b"\x09\x00" + b[16:], "version 9"),
    (lambda b: b[:-5], "truncated"),
    (lambda b: b[:20] + b"X" + b[21:], "corrupt trace header"),
    (lambda b: b[:16], "truncated trace file \\(no header\\)"),
])
def test_a_bad_trace_file_is_one_clear_error(tmp_path, damage, fragment):
    p = save_trace(tmp_path / "t.rlhftrace", phased())
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(TraceFileError, match=fragment) as e:
        load_trace(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


# -- placements -------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["after-inference", "after-training", "after-both"])
def test_inserting_a_policy_into_the_flushless_trace_gives_the_policy_runs_trace(policy):
    """Positions are exact: the FLUSH lands right after the phase's end mark, before the allocations
    between phases, where the recipes' phase step (PhaseSteps) calls empty_cache."""
    flush_after = {"after-inference": ("generate",), "after-training": ("train_actor",),
                   "after-both": ("generate", "train_actor")}[policy]
    program, _ = program_events(phased())
    b = find_boundaries(program)
    assert b.kind == "phase-end" and list(b.positions) == ["generate", "train_actor"]
    names = policy_boundaries(policy, list(b.positions))
    got = with_flushes(program, [b.positions[n] for n in names], names)
    want = phased(flush_after).events
    assert [(e.action, e.addr, e.size, e.name) for e in got] == [(e.action, e.addr, e.size, e.name) for e in want]


def test_boundaries_without_phase_ends_or_without_phases():
    events = [e for e in phased().events if e.action != PHASE_END]
    b = find_boundaries(events)
    assert b.kind == "phase-start" and b.positions["generate"] == 6  # at train_actor's start
    bare = [e for e in events if e.action in (ALLOC, FREE)] * 10
    w = find_boundaries(bare)
    assert w.kind == "window" and 1 <= len(w.positions) <= 8
    assert policy_boundaries("after-inference", list(w.positions)) is None  # not a recipe trace


# -- the sweep ---------------------------------------------------------------------------------------


def test_advise_finds_the_flush_that_cuts_the_peak_and_documents_its_cost(tmp_path):
    doc = advise(result_json(tmp_path, [phased(), phased()]), processes=1)
    assert doc["schema"] == SCHEMA
    s = doc["scenarios"][0]
    assert s["baseline"]["peak_reserved"] == 72 * MiB
    # expandable segments reach the same peak with no flush and one mapping fewer: ranked first by cost
    best = s["candidates"][0]
    assert best["id"] == "setting:expandable_segments:True" and best["peak_reserved"] == 42 * MiB
    assert s["recommendation"]["text"].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: -41.7%")
    flush = next(c for c in s["candidates"] if c["id"] == "flush:generate")
    assert flush["flushes_at"] == ["generate"] and flush["peak_reserved"] == 42 * MiB
    assert flush["delta_peak_pct"] == pytest.approx(-100 * 30 / 72)
    assert (flush["extra_cuda_malloc"], flush["extra_cuda_free"]) == (1, 2)  # the 2 MiB small segment again
    assert flush["bytes_reacquired"] == 2 * MiB and flush["time_estimate"] is None  # CPU: no time invented
    assert s["candidates"].index(flush) < min(i for i, c in enumerate(s["candidates"]) if c["peak_reserved"] > 42 * MiB)
    assert s["policies"]["after-inference"] and s["policies"]["none"] == "none"
    pol = next(c for c in s["candidates"] if c["id"] == s["policies"]["after-training"])
    assert pol["peak_reserved"] == 72 * MiB  # a flush after the peak cannot lower it
    assert not any(n["setting"] == "expandable_segments:True" for n in s["not_evaluated"])  # modelled now
    for c in s["candidates"]:
        for k in ("id", "kind", "description", "peak_reserved", "fragmentation_at_peak", "peak_phase", "peak_rank",
                  "extra_cuda_malloc", "extra_cuda_free", "bytes_reacquired", "time_estimate", "rank", "per_rank"):
            assert k in c, k
        assert len(c["per_rank"]) == 2


def test_two_processes_give_the_same_answer_as_one(tmp_path):
    p = result_json(tmp_path, [phased(), phased(("generate",))], flush="mixed")
    one, two = advise(p, processes=1), advise(p, processes=2)
    for s in (one, two):
        for s_ in s["scenarios"]:
            s_.pop("seconds")
    assert one == two


def test_budget_names_the_cheapest_change_that_fits(tmp_path):
    doc = advise(result_json(tmp_path, [phased()]), budget=50 * MiB, processes=1)
    s = doc["scenarios"][0]
    b = s["budget"]
    rows = {c["id"]: c for c in s["candidates"]}
    fits = [c for c in s["candidates"] if c["peak_reserved"] <= 50 * MiB]
    assert "flush:generate" in {c["id"] for c in fits} and "fits 50.00 MiB" in b["text"]
    chosen = rows[b["candidate"]]
    calls = min(c["extra_cuda_malloc"] + c["extra_cuda_free"] for c in fits)
    assert chosen["peak_reserved"] <= 50 * MiB and chosen["extra_cuda_malloc"] + chosen["extra_cuda_free"] == calls
    # garbage_collection_threshold assumed the budget as the device's capacity
    assert s["assumptions"]["gc_capacity"] == 50 * MiB
    none_fits = advise(result_json(tmp_path, [phased()]), budget=10 * MiB, processes=1)["scenarios"][0]["budget"]
    assert none_fits["candidate"] is None and "no evaluated change fits" in none_fits["text"]


def test_cli_writes_json_and_markdown(tmp_path):
    p = result_json(tmp_path, [phased()])
    r = cli(str(p), "--json", str(tmp_path / "a.json"), "--md", str(tmp_path / "a.md"), "--processes", "1")
    assert r.returncode == 0, r.stderr
    # expandable segments and the flush after generate both reach 42 MiB; the setting costs no extra call
    assert "recommendation: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: -41.7% peak reserved" in r.stdout
    assert "flush after generate" in r.stdout
    assert json.loads((tmp_path / "a.json").read_text())["schema"] == SCHEMA
    assert "**Recommendation:** PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in (tmp_path / "a.md").read_text()


@pytest.mark.parametrize("make, fragment", [
    (lambda d: d / "nope.json", "no such file"),
    (lambda d: (d / "r.json").write_text(json.dumps({"scenario_id": "x", "ranks": [{"rank": 0}]})) and d / "r.json",
     "names no trace file"),
    (lambda d: (d / "s.json").write_text("{\"a\": 1}") and d / "s.json", "no scenario_id"),
    (lambda d: (d / "t.pickle").write_bytes(__import__("pickle").dumps({"segments": [], "device_traces": [[]]}))
     and d / "t.pickle", "holds no trace events"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, make, fragment):
    r = cli(str(make(tmp_path)))
    assert r.returncode == 2
    assert r.stderr.startswith("rlhfmem: error:") and fragment in r.stderr and r.stderr.count("\n") == 1


def test_unknown_setting_is_one_line_exit_2(tmp_path):
    r = cli(str(result_json(tmp_path, [phased()])), "--setting", "max_spilt_size_mb:64")
    assert r.returncode == 2 and "unknown alloc-conf key 'max_spilt_size_mb'" in r.stderr


def test_missing_trace_file_is_named(tmp_path):
    p = result_json(tmp_path, [phased()])
    (tmp_path / f"trace-rank0{SUFFIX}").unlink()
    with pytest.raises(AdviseInputError, match="cannot read the trace file"):
        advise(p, processes=1)


# The advice on each real snapshot, pinned (replays are deterministic; bytes): the recommended candidate, its
# peak reserved, and the baseline's (no flush, the recorded settings). A change of ranking, of a candidate's
# replay or of the baseline's shows here.
ADVICE = {
    "eor_nn": ("setting:expandable_segments:True", 113_246_208, 134_217_728),
    "select_n_a": ("setting:garbage_collection_threshold:0.5", 2_424_307_712, 2_776_629_248),
    "cs336_ctx256_fwd": ("combination:event 2410|max_split_size_mb:32", 26_491_224_064, 28_619_833_344),
    "slime_init_b": ("setting:expandable_segments:True", 26_321_354_752, 27_525_120_000),
    "wedson_medium_256_training": ("none", 9_265_217_536, 9_265_217_536),
    "codeloc_expandable_dev0_dev2": ("none", 21_883_781_120, 21_883_781_120),  # recorded with expandable segments
}


@pytest.mark.parametrize("name", sorted(ADVICE))
def test_advice_on_real_snapshots(name, tmp_path):
    r = cli(str(shared_snapshot(name)), "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "a.json").read_text())["scenarios"][0]
    assert s["boundary_kind"] == "window" and s["policies"]["after-inference"] is None
    best, best_peak, baseline_peak = ADVICE[name]
    assert s["baseline"]["peak_reserved"] == baseline_peak
    assert (s["candidates"][0]["id"], s["candidates"][0]["peak_reserved"]) == (best, best_peak)
    assert s["recommendation"]["candidate"] == best
    if best == "none":  # nothing beats the program as it is: the advice says keep it
        assert "keep the program as it is" in s["recommendation"]["text"]
    else:
        if best.startswith("setting:"):  # a snapshot records no torch version: the alias every version reads
            assert s["recommendation"]["env"] == {
                "variable": "PYTORCH_CUDA_ALLOC_CONF", "value": best.removeprefix("setting:"),
                "why": "PyTorch version unknown: the alias every version reads (2.9 and later warn it is deprecated)"}
        pct = 100 * (best_peak - baseline_peak) / baseline_peak
        assert f"{pct:+.1f}% peak reserved" in s["recommendation"]["text"]
    assert not any(n["setting"] == "expandable_segments:True" for n in s["not_evaluated"])


# --rlhfmem-advise in a real session (the advice in an over-budget failure and in the report):
# tests/test_plugin_budgets.py::test_users_own_test_update_check_and_lowered_budget, step 4.


def test_greedy_search_finds_a_two_flush_set_no_single_flush_reaches(tmp_path):
    """generate caches 30 MiB, infer_actor 36 MiB, train_actor needs 40 MiB: one flush gets the peak to
    66 MiB at best, the pair to 40 MiB. The search adds the second flush before the new peak."""
    ev = []
    for k, (name, mib) in enumerate((("generate", 30), ("infer_actor", 36), ("train_actor", 40))):
        ev += [Event(PHASE, name=name), Event(ALLOC, 0x1000 * (k + 1), mib * MiB),
               Event(FREE, 0x1000 * (k + 1), mib * MiB), Event(PHASE_END, name=name)]
    s = advise(result_json(tmp_path, [Trace(events=ev, capture=CAPTURE_CPU_SIMULATED)]), processes=1)["scenarios"][0]
    assert s["baseline"]["peak_reserved"] == 106 * MiB
    assert [st["set"] for st in s["search"]["steps"]] == [["infer_actor"], ["generate", "infer_actor"]]
    pair = [c for c in s["candidates"] if c["kind"] != "combination"
            and set(c.get("flushes_at") or ()) == {"generate", "infer_actor"}]
    assert pair and pair[0]["peak_reserved"] == 40 * MiB
    assert pair[0]["description"].startswith("flush after generate and infer_actor")
    singles = [c for c in s["candidates"] if len(c.get("flushes_at") or ()) == 1 and c["kind"] != "combination"]
    assert min(c["peak_reserved"] for c in singles) == 66 * MiB  # no single flush reaches the pair's peak


def test_an_unmarked_script_gets_no_flush_after_run_and_is_told_to_mark_its_phases(tmp_path):
    """Issue 20 item 4: a captured script without rlhfmem.phase marks is one window, `run`; a flush after it
    is after the last event and cannot change anything, so it is no candidate; the report says what marks
    would enable flush-placement advice."""
    out = tmp_path / "plain.json"
    cli = [sys.executable, "-m", "pytest_rlhfmem.cli"]
    r = subprocess.run([*cli, "capture", "--id", "plain", "--device", "cpu", "--json", str(out), "--",
                        str(DATA / "commands" / "plain_train.py")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    a = subprocess.run([*cli, "advise", str(out)], capture_output=True, text=True, timeout=600)
    assert a.returncode == 0, a.stderr
    assert "flush after run" not in a.stdout and "0 flush boundaries" in a.stdout, a.stdout
    assert "no phase marks" in a.stdout and 'rlhfmem.phase("generate")' in a.stdout, a.stdout
    subprocess.run([*cli, "advise", str(out), "--json", str(tmp_path / "a.json")], check=True, timeout=600,
                   capture_output=True)
    s = json.loads((tmp_path / "a.json").read_text())["scenarios"][0]
    assert s["hint"] and not any(c["id"].startswith("flush:") for c in s["candidates"])


def test_a_setting_is_recommended_under_the_variable_the_runs_pytorch_reads(tmp_path):
    """A snapshot records no torch version: the advice names PYTORCH_CUDA_ALLOC_CONF, which every version reads.
    A result records its torch: 2.13 reads PYTORCH_ALLOC_CONF first (the alias is deprecated), so the same
    trace as a result is advised under that name, in the text and the markdown report."""
    from pytest_rlhfmem.advise.rendering import markdown, text_lines
    from pytest_rlhfmem.memory.trace import load_snapshot, trace_from_snapshot

    snap_doc = advise(shared_snapshot("eor_nn"), processes=1)
    assert "  set it as: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  (PyTorch version unknown: the alias " \
           "every version reads (2.9 and later warn it is deprecated))" in text_lines(snap_doc)
    f = save_trace(tmp_path / f"trace-rank0{SUFFIX}", trace_from_snapshot(load_snapshot(shared_snapshot("eor_nn"))))
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"scenario_id": "eor", "capture": "cuda-memory-history", "scenario": {},
                             "versions": {"torch": "2.13.0+cpu"}, "ranks": [{"rank": 0, "trace_file": str(f)}]}))
    doc = advise(p, processes=1)
    env = doc["scenarios"][0]["recommendation"]["env"]
    assert env == {"variable": "PYTORCH_ALLOC_CONF", "value": "expandable_segments:True",
                   "why": "torch 2.13 reads PYTORCH_ALLOC_CONF first; PYTORCH_CUDA_ALLOC_CONF is its deprecated alias"}
    assert "Set it as `PYTORCH_ALLOC_CONF=expandable_segments:True`" in markdown(doc)
