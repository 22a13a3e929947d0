"""The driver's segment placement (memory/driver_va.py): first-fit address ranges, the CUDA context's range given
back at the first cuBLAS handle, and how a replay and a trace carry the setting. The end-to-end check against
two GPU recordings is in tests/test_sim_cuda.py (the CS336 workload's 495 segments in the GPU's address order)."""

import pytest

from pytest_rlhfmem.memory.allocator import SEGMENT_PLACEMENT_KEY, AllocatorConfig, AllocatorConfigError
from pytest_rlhfmem.memory.driver_va import BASE, FirstFitAddressSpace, SegmentPlacement
from pytest_rlhfmem.memory.events import ALLOC, CUBLAS_WORKSPACE, FREE, SEGMENT_ALLOC, Event, Trace
from pytest_rlhfmem.memory.replay import FREE_RUNNING, replay
from pytest_rlhfmem.memory.replay_engine import engine_for

MiB = 2**20


def test_first_fit_reuses_the_lowest_free_range_that_fits_and_merges_neighbours():
    va = FirstFitAddressSpace()
    a, b, c = va.map(20 * MiB), va.map(16 * MiB), va.map(1)  # 1 B takes one 2 MiB granule
    assert (a, b, c) == (BASE, BASE + 20 * MiB, BASE + 36 * MiB) and va.top == BASE + 38 * MiB
    va.unmap(a)
    assert va.map(40 * MiB) == BASE + 38 * MiB  # the 20 MiB hole is too small: mapped on top
    assert va.map(16 * MiB) == BASE  # fits the hole: its low end
    assert va.holes[0] == (BASE + 16 * MiB, 4 * MiB)
    va.unmap(b)  # merges with the 4 MiB hole below it
    assert list(va.holes) == [(BASE + 16 * MiB, 20 * MiB)]
    va.unmap(BASE + 38 * MiB)  # the top mapping: top comes down
    assert va.top == BASE + 38 * MiB
    va.unmap(12345)  # not mapped here (a recorded segment): nothing changes
    assert list(va.holes) == [(BASE + 16 * MiB, 20 * MiB)]


def test_the_contexts_range_is_given_back_once_at_the_first_cublas_handle():
    va = FirstFitAddressSpace(188 * MiB)
    first = va.map(40 * MiB)
    assert first == BASE + 188 * MiB  # the program's first segment sits above the context's range
    va.cublas_handle_created()
    assert va.map(20 * MiB) == BASE and va.map(16 * MiB) == BASE + 20 * MiB  # fills the range from its bottom
    va.cublas_handle_created()  # a second handle gives nothing back
    assert va.map(160 * MiB) == BASE + 228 * MiB  # 152 MiB left below: does not fit, goes on top


@pytest.mark.parametrize(("spec", "kind", "reserve"), [
    (None, "above-last", 0), ("", "above-last", 0), ("above-last", "above-last", 0), ("first-fit", "first-fit", 0),
    ("first-fit:188MiB", "first-fit", 188 * MiB), ("first-fit:197132288", "first-fit", 188 * MiB),
    ("first-fit:1", "first-fit", 2 * MiB),  # rounded up to the 2 MiB granule
])
def test_placement_specs(spec, kind, reserve):
    p = SegmentPlacement.parse(spec)
    assert (p.kind, p.context_reserve) == (kind, reserve)
    assert SegmentPlacement.parse(p.spec()) == p


@pytest.mark.parametrize("spec", ["lowest", "above-last:2MiB", "first-fit:lots", "first-fit:-2MiB", "first-fit:2TiB"])
def test_a_bad_placement_names_where_it_came_from_and_the_allowed_forms(spec):
    with pytest.raises(ValueError, match=r"--segment-placement .*allowed values are above-last, first-fit, or "
                                         r"first-fit:SIZE"):
        SegmentPlacement.parse(spec, "--segment-placement")


def test_a_trace_carries_its_placement_in_allocator_settings():
    config = AllocatorConfig.from_snapshot_settings({SEGMENT_PLACEMENT_KEY: "first-fit:4194304"})
    assert config.segment_placement == SegmentPlacement("first-fit", 4 * MiB)
    assert AllocatorConfig.from_snapshot_settings({}).segment_placement == SegmentPlacement()
    with pytest.raises(AllocatorConfigError, match="allocator_settings\\['rlhfmem_segment_placement'\\] 'nearest'"):
        AllocatorConfig.from_snapshot_settings({SEGMENT_PLACEMENT_KEY: "nearest"})


def _program() -> Trace:
    """30 MiB, then a cuBLAS handle's workspace (small pool), then another 30 MiB: creation order A, W, B."""
    ev = [Event(ALLOC, 1, 30 * MiB), Event(ALLOC, 2, 8192, name=CUBLAS_WORKSPACE), Event(ALLOC, 3, 30 * MiB),
          Event(FREE, 1, 30 * MiB), Event(FREE, 3, 30 * MiB), Event(ALLOC, 4, 10 * MiB)]
    return Trace(events=ev, capture="synthetic")


def _segments(result) -> list[tuple[int, int]]:
    return [(e.addr, e.size) for e in result.events if e.action == SEGMENT_ALLOC]


def test_under_first_fit_a_segment_made_after_the_first_cublas_handle_lies_below_the_earlier_ones():
    above = replay(_program(), mode=FREE_RUNNING, record_series=False, record_events=True)
    config = AllocatorConfig(segment_placement=SegmentPlacement("first-fit", 40 * MiB))
    first_fit = replay(_program(), config, mode=FREE_RUNNING, record_series=False, record_events=True)
    a, w, b = _segments(first_fit)
    assert a[0] == BASE + 40 * MiB and w[0] == BASE and b[0] == BASE + 2 * MiB  # W and B fill the context's range
    assert [s for _a, s in _segments(above)] == [s for _a, s in (a, w, b)]
    # best fit takes the lowest of the two free 30 MiB blocks: A's above-last, B's under first-fit
    lowest = {r: next(e.addr for e in res.events if e.action == ALLOC and e.size == 10 * MiB)
              for r, res in (("above", above), ("first-fit", first_fit))}
    assert lowest["above"] == _segments(above)[0][0] and lowest["first-fit"] == b[0]
    # the same program with no named workspace never gets the context's range back
    plain = Trace(events=[e._replace(name="") for e in _program().events], capture="synthetic")
    assert min(a for a, _s in _segments(replay(plain, config, mode=FREE_RUNNING, record_series=False,
                                               record_events=True))) == BASE + 40 * MiB


def test_first_fit_replays_in_the_python_model():
    config = AllocatorConfig(segment_placement=SegmentPlacement("first-fit"))
    engine, why = engine_for(None, config, FREE_RUNNING)
    assert engine == "python" and "segment placement first-fit" in why
    assert replay(_program(), config, mode=FREE_RUNNING, record_series=False, engine="auto").engine == "python"


def test_capture_refuses_a_placement_without_the_simulated_device(capsys):
    from pytest_rlhfmem.cli import main

    assert main(["capture", "--device", "cpu", "--segment-placement", "first-fit", "--", "python", "-c", "pass"]) == 2
    assert "--segment-placement places the simulated CUDA device's segments: it needs --device cuda-sim" \
        in capsys.readouterr().err
    assert main(["capture", "--device", "cuda-sim", "--segment-placement", "lowest", "--", "python", "-c", "pass"]) == 2
    assert "--segment-placement 'lowest': allowed values are above-last, first-fit" in capsys.readouterr().err


@pytest.mark.parametrize("placement", [SegmentPlacement(), SegmentPlacement("first-fit", 40 * MiB)])
def test_a_new_segment_never_lands_on_one_the_trace_began_with(placement):
    """A simulated snapshot's segments lie where the model maps new ones (from BASE up): a replay of it must map
    its new segments elsewhere (before, the first new segment took the first imported one's address)."""
    from pytest_rlhfmem.memory.events import SegmentState

    first = SegmentState(BASE + 40 * MiB, 20 * MiB, 0, False, [(BASE + 40 * MiB, 20 * MiB, 20 * MiB)])
    in_context = SegmentState(BASE, 20 * MiB, 0, False, [])  # made after the context gave its range back
    trace = Trace(events=[Event(ALLOC, 1, 30 * MiB), Event(ALLOC, 2, 16 * MiB)], initial_segments=[first, in_context],
                  capture="synthetic")
    result = replay(trace, AllocatorConfig(segment_placement=placement), mode=FREE_RUNNING, record_series=False,
                    record_events=True)
    new = _segments(result)
    taken = [(BASE + 40 * MiB, BASE + 60 * MiB), (BASE, BASE + 20 * MiB)]
    assert len(new) == 1 and new[0][1] == 30 * MiB  # the 16 MiB request reuses the free imported segment
    assert all(new[0][0] + new[0][1] <= lo or new[0][0] >= hi for lo, hi in taken)
    assert result.final_reserved == 70 * MiB and len(result.model.segments) == 3


def test_occupy_carves_a_free_range_and_refuses_a_mapped_one():
    va = FirstFitAddressSpace()
    a = va.map(20 * MiB)
    va.map(20 * MiB)
    va.unmap(a)
    va.occupy(BASE + 4 * MiB, 8 * MiB)  # inside the hole: splits it
    assert list(va.holes) == [(BASE, 4 * MiB), (BASE + 12 * MiB, 8 * MiB)]
    va.occupy(BASE + 60 * MiB, 2 * MiB)  # above the top: the gap becomes a hole
    assert va.top == BASE + 62 * MiB and (BASE + 40 * MiB, 20 * MiB) in va.holes
    with pytest.raises(ValueError, match="overlaps an address range already mapped"):
        va.occupy(BASE + 20 * MiB, 2 * MiB)
    va.occupy(0x704400000, 20 * MiB)  # a real GPU address: outside this space
    assert 0x704400000 not in va.mapped


def test_the_compiled_core_also_maps_new_segments_above_the_ones_the_trace_began_with():
    from pytest_rlhfmem.memory.events import SegmentState
    from pytest_rlhfmem.memory.replay_engine import compiled_available

    ok, why = compiled_available()
    if not ok:
        pytest.fail(f"the compiled replay core does not build here: {why}")
    seg = SegmentState(BASE, 20 * MiB, 0, False, [(BASE, 20 * MiB, 20 * MiB)])
    trace = Trace(events=[Event(ALLOC, 1, 30 * MiB)], initial_segments=[seg], capture="synthetic")
    result = replay(trace, mode=FREE_RUNNING, record_series=False, engine="compiled")
    assert result.engine == "compiled"
    assert [a for a, _s in result.segment_allocs][0] >= BASE + 20 * MiB


def test_capture_checks_the_placement_variable_before_any_rank_starts(capsys, monkeypatch):
    from pytest_rlhfmem.cli import main

    monkeypatch.setenv("RLHFMEM_SEGMENT_PLACEMENT", "bogus")
    assert main(["capture", "--device", "cuda-sim", "--", "python", "-c", "pass"]) == 2
    assert "$RLHFMEM_SEGMENT_PLACEMENT 'bogus': allowed values are above-last" in capsys.readouterr().err


def test_replay_with_another_alloc_conf_keeps_the_traces_segment_placement(tmp_path, capsys):
    """``rlhfmem replay --alloc-conf`` replaces the allocator's settings, not the driver's placement that the trace
    carries (``allocator_settings['rlhfmem_segment_placement']``); ``--segment-placement`` still replaces it."""
    import json

    from pytest_rlhfmem.cli import main
    from pytest_rlhfmem.memory.allocator import SEGMENT_PLACEMENT_KEY
    from pytest_rlhfmem.memory.trace_io import save_trace

    path = save_trace(tmp_path / "t.rlhftrace", Trace(events=_program().events, capture="synthetic",
                                                      allocator_settings={SEGMENT_PLACEMENT_KEY: "first-fit:40MiB"}))
    runs = {"alloc-conf": ["--alloc-conf", "max_split_size_mb:64"],
            "both": ["--alloc-conf", "max_split_size_mb:64", "--segment-placement", "above-last"]}
    out = {}
    for name, flags in runs.items():
        assert main(["replay", str(path), "--free-running", "--json", *flags]) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert out["alloc-conf"]["segment_placement"] == SegmentPlacement("first-fit", 40 * MiB).spec()
    assert out["both"]["segment_placement"] == "above-last"
