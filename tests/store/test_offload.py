"""KV offload tiers: a block's rows go to a lower tier with its KV and come back with it, into
whatever blocks the KV is loaded into; a request that hits them reads the rows of the forward that
computed the KV, as it would had the blocks never left. Dropped from every tier: recomputed rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ops import RoutingLedger, RoutingShape, SlotStore
from moe_ops.channels import IDS, Channel
from moe_ops.store.handoff import decode_blocks

SHAPE = RoutingShape(num_layers=2, num_experts=32, top_k=2)
BS = 4


def _ledger(channels=False, num_blocks=64):
    extra = [Channel("weights", np.float32)] if channels else []
    return RoutingLedger(SlotStore(num_blocks * BS, SHAPE, extra_channels=extra), BS)


def _rows(seed, n, channels=False):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, SHAPE.num_experts, size=(n, 2, 2)).astype(np.uint8)
    if not channels:
        return ids
    return {IDS: ids, "weights": rng.random((n, 2, 2)).astype(np.float32)}


def _compute(ledger, req, blocks, rows, prompt_len, cached=(), hit=0):
    ledger.add_request(req, list(cached), hit, prompt_len=prompt_len)
    ledger.append_blocks(req, blocks)
    n = prompt_len - hit
    ledger.land(ledger.schedule([(req, n)]).seq, rows)
    ledger.finish(req)
    return {d.req_id: d for d in ledger.collect()}[req]


@settings(max_examples=40, deadline=None)
@given(
    prefix_blocks=st.integers(1, 5),
    tail=st.integers(1, 7),
    channels=st.booleans(),
    reuse=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_follow_the_kv_through_a_lower_tier(prefix_blocks, tail, channels, reuse, seed):
    """A computes a prefix; its blocks are offloaded and (maybe) reused by B; C's prefix is loaded
    from the tier into other blocks and hit: C's routing equals C's on a ledger whose blocks never
    left (C hits A's blocks there directly)."""
    prefix = prefix_blocks * BS
    a_rows = _rows(seed, prefix, channels)
    c_rows = _rows(seed + 1, tail, channels)

    stay = _ledger(channels)
    _compute(stay, "A", list(range(prefix_blocks)), a_rows, prefix)
    c_blocks = list(range(40, 40 + -(-tail // BS) + 1))
    want = _compute(stay, "C", c_blocks, c_rows, prefix + tail, list(range(prefix_blocks)), prefix)

    tiered = _ledger(channels)
    _compute(tiered, "A", list(range(prefix_blocks)), a_rows, prefix)
    record = tiered.offload_blocks(list(range(prefix_blocks)))
    if reuse:  # the GPU blocks go to another request meanwhile
        _compute(tiered, "B", list(range(prefix_blocks)), _rows(seed + 2, prefix, channels), prefix)
    loaded = list(range(20, 20 + prefix_blocks))
    tiered.load_blocks(loaded, record)
    got = _compute(tiered, "C", c_blocks, c_rows, prefix + tail, loaded, prefix)
    assert np.array_equal(got.routing, want.routing) and np.array_equal(got.missing, want.missing)
    for name in want.channels:
        assert np.array_equal(got.channels[name], want.channels[name])


def test_a_block_dropped_from_every_tier_gets_the_recomputing_forwards_rows():
    ledger = _ledger()
    _compute(ledger, "A", [0, 1], _rows(1, 8), 8)
    ledger.offload_blocks([0, 1])  # the tier later drops it: nothing to load
    recomputed = _rows(2, 10)
    got = _compute(ledger, "C", [5, 6, 7], recomputed, 10)
    assert np.array_equal(got.routing, recomputed)


def test_missing_rows_stay_missing_and_an_old_step_never_lands_in_a_loaded_block():
    ledger = _ledger()
    ledger.add_request("A", prompt_len=8)
    ledger.append_blocks("A", [0, 1])
    ledger.drop(ledger.schedule([("A", 4)]).seq)
    ledger.land(ledger.schedule([("A", 4)]).seq, _rows(3, 4))
    ledger.finish("A")
    ledger.collect()
    record = ledger.offload_blocks([0, 1])
    assert decode_blocks(record).missing.tolist() == [True] * 4 + [False] * 4
    ledger.add_request("old")
    ledger.append_blocks("old", [9])
    late = ledger.schedule([("old", 4)])
    ledger.abort("old")
    ledger.load_blocks([9, 3], record)  # block 9's old step is in flight
    ledger.land(late.seq, _rows(4, 4))
    got = _compute(ledger, "C", [10], _rows(5, 1), 9, [9, 3], 8)
    assert got.missing.tolist() == [True] * 4 + [False] * 5
    assert np.array_equal(got.routing[4:8], _rows(3, 4))


def test_out_of_order_moves_are_refused_and_change_nothing():
    ledger = _ledger(channels=True)
    _compute(ledger, "A", [0, 1], _rows(6, 8, True), 8)
    record = ledger.offload_blocks([0, 1])
    ledger.add_request("busy", prompt_len=4)
    ledger.append_blocks("busy", [5])
    step = ledger.schedule([("busy", 4)])
    with pytest.raises(ValueError, match="in flight"):
        ledger.offload_blocks([5])
    ledger.land(step.seq, _rows(7, 4, True))
    before = {k: v.copy() for k, v in ledger.store.arrays.items()}
    refs = [ledger.block_refs(b) for b in range(ledger.num_blocks)]
    cases = [
        (([5, 6], record), "held by running requests"),
        (([6], record), "holds 2 blocks"),
        (([6, 6], record), "duplicates"),
        (([6, 7], record[:-3]), "truncated|CRC"),
        (([6, 7], b"MOEH" + record[4:]), "not a blocks record"),
    ]
    for (blocks, data), match in cases:
        with pytest.raises(ValueError, match=match):
            ledger.load_blocks(blocks, data)
    with pytest.raises(ValueError, match="another model shape"):
        _ledger(channels=False).load_blocks([6, 7], record)
    with pytest.raises(ValueError, match="blocks of 4 tokens, this ledger 8"):
        RoutingLedger(SlotStore(512, SHAPE, extra_channels=[Channel("weights", np.float32)]), 8).load_blocks(
            [6, 7], record
        )
    assert all(np.array_equal(before[k], v, equal_nan=True) for k, v in ledger.store.arrays.items())
    assert refs == [ledger.block_refs(b) for b in range(ledger.num_blocks)]
    for cut in range(len(record)):
        with pytest.raises(ValueError):
            decode_blocks(record[:cut])
