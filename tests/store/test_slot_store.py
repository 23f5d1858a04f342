"""SlotStore: paged writes and reads against a per-slot dict model, bounds, prefix-cache hits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import routing_rows, routing_shapes

from moe_ops import RoutingShape, SlotStore
from moe_ops.store import slots_for

SHAPE = RoutingShape(num_layers=4, num_experts=255, top_k=2)  # the largest uint8 store (fill 255)


@settings(max_examples=200)
@given(
    shape=routing_shapes(max_layers=4, max_top_k=4),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(1, 12),
    data=st.data(),
)
def test_writes_and_paged_reads_match_a_slot_model(shape, block_size, num_blocks, data):
    store = SlotStore(num_blocks * block_size, shape)
    assert store.dtype == shape.id_dtype
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    model: dict[int, np.ndarray] = {}
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(0, store.num_slots))
        slots = rng.permutation(store.num_slots)[:n]
        rows = routing_rows(rng, n, shape)
        store.write(slots, rows)
        for s, r in zip(slots.tolist(), rows):
            model[s] = r
    # a request: any blocks (repeats allowed: a read never checks ownership), any token window
    table = rng.integers(0, num_blocks, size=data.draw(st.integers(1, 2 * num_blocks)))
    start = data.draw(st.integers(0, table.size * block_size))
    n = data.draw(st.integers(0, table.size * block_size - start))
    out = store.read(table, n, block_size, start=start)
    assert out.shape == (n, shape.num_layers, shape.top_k) and out.dtype == store.dtype
    for i in range(n):
        t = start + i
        slot = int(table[t // block_size]) * block_size + t % block_size
        expected = model.get(slot, np.full(out.shape[1:], store.fill, store.dtype))
        assert np.array_equal(out[i], expected), f"token {t} (slot {slot})"
    out[...] = 0  # a copy: the store is unchanged
    if n:
        assert np.array_equal(
            store.read(table, n, block_size, start=start)[:1],
            store.read_slots(slots_for(table, block_size, start, 1)),
        )


def test_prefix_cache_hit_returns_the_original_routing():
    """Request B hits A's first two cached blocks: B's prefix rows are A's, without any copy."""
    block_size = 4
    store = SlotStore(16 * block_size, SHAPE)
    rng = np.random.default_rng(0)
    a_blocks = [5, 9, 2]
    a_rows = routing_rows(rng, 10, SHAPE)  # 10 tokens over 3 blocks
    store.write(slots_for(a_blocks, block_size, 0, 10), a_rows)
    b_blocks = [5, 9, 11]  # shared prefix (8 tokens), then B's own block
    b_own = routing_rows(rng, 3, SHAPE)
    store.write(slots_for(b_blocks, block_size, 8, 3), b_own)
    b = store.read(b_blocks, 11, block_size)
    assert np.array_equal(b[:8], a_rows[:8]), "the prefix hit must return A's routing"
    assert np.array_equal(b[8:], b_own)
    assert np.array_equal(store.read(a_blocks, 10, block_size), a_rows), "A's rows are untouched"
    assert np.array_equal(store.read(b_blocks, 3, block_size, start=8), b_own)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda s: s.write([-1], np.zeros((1, 4, 2), np.uint8)), IndexError, r"slots must be in \[0, 32\)"),
        (lambda s: s.write([32], np.zeros((1, 4, 2), np.uint8)), IndexError, r"got \[32\]"),
        (lambda s: s.write([0, 1], np.zeros((1, 4, 2), np.uint8)), ValueError, "rows must have shape"),
        (lambda s: s.write([0], np.zeros((1, 4, 2), np.float32)), ValueError, "rows must hold integers"),
        (lambda s: s.write([0], np.full((1, 4, 2), 256, np.int32)), ValueError, "cannot hold"),
        (lambda s: s.write([0], np.full((1, 4, 2), -1, np.int32)), ValueError, "cannot hold"),
        (lambda s: s.write([[0]], np.zeros((1, 4, 2), np.uint8)), ValueError, "slot_mapping must be 1-D"),
        (
            lambda s: s.write([0.5], np.zeros((1, 4, 2), np.uint8)),
            ValueError,
            "slot_mapping must hold integers",
        ),
        (lambda s: s.read([-1], 1, 4), IndexError, r"block ids must be in \[0, 8\)"),
        (lambda s: s.read([8], 1, 4), IndexError, r"got \[8\]"),
        (lambda s: s.read([0, 1], 9, 4), IndexError, r"tokens \[0, 9\) need 3 blocks"),
        (lambda s: s.read([0, 1], 2, 4, start=7), IndexError, r"tokens \[7, 9\)"),
        (lambda s: s.read_slots([40]), IndexError, "slots must be in"),
        (lambda s: s.read([0], -1, 4), ValueError, "num_tokens must be an int >= 0"),
        (lambda s: s.read([0], 1, 0), ValueError, "block_size must be an int >= 1"),
    ],
)
def test_out_of_range_never_wraps_and_leaves_the_store_unchanged(call, exc, match):
    store = SlotStore(32, SHAPE)
    store.write(np.arange(32), routing_rows(np.random.default_rng(1), 32, SHAPE))
    before = store.data.copy()
    with pytest.raises(exc, match=match):
        call(store)
    assert np.array_equal(store.data, before)


def test_dtypes():
    assert SlotStore(4, RoutingShape(1, 257, 1)).dtype == np.uint16
    # 256 experts: 255 is an id, so the store widens to keep a fill that is none
    wide = SlotStore(4, RoutingShape(1, 256, 1))
    assert wide.dtype == np.uint16 and wide.fill == 65535
    assert SlotStore(4, RoutingShape(1, 70000, 1)).dtype == np.int32
    store = SlotStore(4, SHAPE, dtype=np.int32)
    assert store.fill == -1 and (store.data == -1).all()
    store.write([3], np.full((1, 4, 2), 200, np.int64))  # values fit: the cast is exact
    assert (store.read_slots([3]) == 200).all()
    with pytest.raises(ValueError, match="cannot hold expert ids up to 299"):
        SlotStore(4, RoutingShape(1, 300, 1), dtype=np.uint8)
    with pytest.raises(ValueError, match="integer dtype"):
        SlotStore(4, SHAPE, dtype=np.float32)
    assert SlotStore(4, SHAPE).fill == 255  # unsigned: never-written slots read as the max value
