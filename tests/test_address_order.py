"""memory/address_order.py: the same allocation sequence, new segments placed in different address orders."""

import pytest

from pytest_rlhfmem.memory.address_order import address_order_spread
from pytest_rlhfmem.memory.events import ALLOC, FREE, POOL_ENTER, SEGMENT_ALLOC, SEGMENT_FREE, Event, Trace
from pytest_rlhfmem.memory.replay import FREE_RUNNING, replay

MiB = 2**20


def two_equal_free_blocks_then_a_large_request() -> Trace:
    """Segment S1 (20 MiB) keeps a 4 MiB block and frees a 16 MiB one; segment S2 (16 MiB) is wholly free.
    A 16 MiB request then has two equal candidates, and best fit takes the lower address: taking S1's block
    leaves no room for the final 20 MiB request once the 4 MiB block goes (a third cudaMalloc: 56 MiB
    reserved); taking S2 lets S1 merge back to 20 MiB free (36 MiB reserved)."""
    seq = [(ALLOC, 1, 4 * MiB), (ALLOC, 2, 16 * MiB), (ALLOC, 3, 16 * MiB), (FREE, 2, 16 * MiB),
           (FREE, 3, 16 * MiB), (ALLOC, 4, 16 * MiB), (FREE, 1, 4 * MiB), (ALLOC, 5, 20 * MiB)]
    return Trace(events=[Event(action, addr, size) for action, addr, size in seq], source="hand-built")


def test_the_peak_reserved_of_one_sequence_depends_on_where_new_segments_land():
    spread = address_order_spread(two_equal_free_blocks_then_a_large_request(), orders=16, seed=0)
    assert spread["model_order"] == {"peak_reserved": 56 * MiB, "peak_allocated": 36 * MiB}
    counts = spread["peak_reserved"]["counts"]
    assert set(counts) == {36 * MiB, 56 * MiB} and sum(counts.values()) == 16
    assert (spread["peak_reserved"]["min"], spread["peak_reserved"]["max"]) == (36 * MiB, 56 * MiB)
    assert spread["model_order_share"] == counts[56 * MiB] / 16
    assert address_order_spread(two_equal_free_blocks_then_a_large_request(), orders=16, seed=0) == spread


def test_the_model_order_is_the_free_running_replay_recorded_empty_cache_included():
    """Each order is ``python_engine.replay_python``'s free-running replay: a recorded ``segment_free`` batch
    no cudaMalloc follows is a user's ``empty_cache()`` and is replayed, so the 16 MiB segment is gone when
    the 32 MiB one is made (peak reserved 2 + 32 MiB, not 16 + 2 + 32)."""
    seq = [(SEGMENT_ALLOC, 1 << 40, 16 * MiB), (ALLOC, 1 << 40, 16 * MiB), (SEGMENT_ALLOC, 2 << 40, 2 * MiB),
           (ALLOC, 2 << 40, 512), (FREE, 1 << 40, 16 * MiB), (SEGMENT_FREE, 1 << 40, 16 * MiB),
           (FREE, 2 << 40, 512), (SEGMENT_ALLOC, 3 << 40, 32 * MiB), (ALLOC, 3 << 40, 32 * MiB)]
    trace = Trace(events=[Event(action, addr, size) for action, addr, size in seq], source="hand-built")
    spread = address_order_spread(trace, orders=4, seed=0)
    assert spread["model_order"]["peak_reserved"] == replay(trace, mode=FREE_RUNNING).total.peak_reserved \
        == 34 * MiB
    assert spread["peak_reserved"]["counts"] == {34 * MiB: 4}


def test_orders_below_one_and_pools_are_refused_naming_them():
    with pytest.raises(ValueError, match="allowed values are 1 or more"):
        address_order_spread(two_equal_free_blocks_then_a_large_request(), orders=0)
    trace = Trace(events=[Event(POOL_ENTER, 1, 1), Event(ALLOC, 1, 512)], source="pooled.pickle")
    with pytest.raises(ValueError, match="pooled.pickle: holds pool_enter events"):
        address_order_spread(trace)


def test_rlhfmem_replay_prints_the_spread_and_puts_it_in_its_json(tmp_path, capsys):
    import json

    from pytest_rlhfmem.cli import main
    from pytest_rlhfmem.memory.trace_io import save_trace

    path = save_trace(tmp_path / "hand.rlhftrace", two_equal_free_blocks_then_a_large_request())
    assert main(["replay", str(path), "--address-orders", "16"]) == 0
    assert "peak reserved under 16 random cudaMalloc address orders (seed 0): 36.00 MiB to 56.00 MiB; " \
           "the model's order (56.00 MiB)" in capsys.readouterr().out
    assert main(["replay", str(path), "--address-orders", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["address_order_spread"]["peak_reserved"]["max"] == 56 * MiB
    assert out["simulated"]["peak_reserved"] == 56 * MiB
