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
