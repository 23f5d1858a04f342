"""Multi-turn sessions: each turn delivers only the rows its client does not hold, and the client's
splice of the deltas equals a full re-send of every turn, row for row, whether the next turn hits
the prefix cache, misses it, reads blocks another request rewrote, or follows a dropped row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ops import RoutingLedger, RoutingShape, SlotStore
from moe_ops.store.session import row_digests, splice_turn

SHAPE = RoutingShape(num_layers=2, num_experts=32, top_k=2)
BS = 4


def _rows(rng, n):
    return rng.integers(0, SHAPE.num_experts, size=(n, SHAPE.num_layers, SHAPE.top_k)).astype(np.uint8)


class _Engine:
    """Two ledgers fed the same steps: one with the session view, one without (start 0, the naive
    full re-send). Blocks are handed out from a free list; finished turns leave theirs cached."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.with_session = RoutingLedger(SlotStore(4096 * BS, SHAPE), BS)
        self.naive = RoutingLedger(SlotStore(4096 * BS, SHAPE), BS)
        self.next_block = 0

    def blocks(self, n):
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def both(self, method, *args, **kwargs):
        session = kwargs.pop("session", None)
        a = getattr(self.with_session, method)(*args, **kwargs, **({"session": session} if session else {}))
        b = getattr(self.naive, method)(*args, **kwargs)
        return a, b

    def land(self, entries, rows, drop=False):
        (a, b) = self.both("schedule", entries)
        for ledger, step in ((self.with_session, a), (self.naive, b)):
            if drop:
                ledger.drop(step.seq)
            else:
                ledger.land(step.seq, rows)

    def turn(self, req, prompt_len, decode, cached_blocks=(), hit=0, drop_at=None):
        """One turn: prompt_len tokens known (hit of them cached), decode steps of one token."""
        need = -(-(prompt_len + decode) // BS) - len(cached_blocks)
        self.both("add_request", req, list(cached_blocks), hit, prompt_len=prompt_len, session="s")
        fresh = self.blocks(need)
        self.both("append_blocks", req, fresh)
        todo = prompt_len - hit
        self.land([(req, todo)], _rows(self.rng, todo), drop=drop_at == "prompt")
        for _ in range(decode):
            self.land([(req, 1)], _rows(self.rng, 1))
        self.both("finish", req)
        (a,) = self.with_session.collect()
        (b,) = self.naive.collect()
        return a, b, list(cached_blocks) + fresh


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    turns=st.lists(
        st.tuples(st.integers(1, 9), st.integers(0, 6), st.sampled_from(["hit", "miss", "partial"])),
        min_size=1,
        max_size=4,
    ),
    first_prompt=st.integers(1, 12),
)
def test_spliced_deltas_equal_the_full_resend_every_turn(seed, turns, first_prompt):
    eng = _Engine(seed)
    held = None
    known, blocks = first_prompt, []  # tokens the session knows; blocks of its last turn
    sent = naive_sent = 0
    for i, (user, decode, cache) in enumerate(turns):
        computed_before = known - 1 if i else 0  # the last turn's last sampled token was never run
        whole = (computed_before // BS) * BS
        hit = {"hit": whole, "miss": 0, "partial": max(0, whole - BS)}[cache]
        hit = min(hit, ((known + user - 1) // BS) * BS) if i else 0
        prompt = known + user if i else first_prompt
        got, full, blocks = eng.turn(f"t{i}", prompt, decode, blocks[: hit // BS], hit)
        assert np.array_equal(got.routing, full.routing[got.start :])
        held = full.routing if held is None else splice_turn(held, got.routing, got.start)
        assert np.array_equal(held, full.routing), i
        assert got.start <= min(hit, computed_before) or i == 0
        sent += got.routing.shape[0]
        naive_sent += full.routing.shape[0]
        known = prompt + decode + 1  # the prompt, the computed decode tokens and the last sample
    assert eng.with_session.session_delivered("s") == held.shape[0]
    assert sent <= naive_sent


def test_a_cached_block_rewritten_by_another_request_is_resent():
    """Turn 2 hits blocks whose rows another request rewrote (the same prefix, another forward): the
    digests differ from the delivered rows, so those rows are sent again."""
    eng = _Engine(1)
    first, _, blocks = eng.turn("t0", 8, 3)
    # another request computes the first block again into the same block (prefix recompute)
    eng.both("add_request", "other", prompt_len=4)
    eng.both("append_blocks", "other", [blocks[0]])
    eng.land([("other", 4)], _rows(eng.rng, 4))
    eng.both("abort", "other")
    eng.with_session.collect(), eng.naive.collect()
    got, full, _ = eng.turn("t1", 13, 2, blocks[:2], 8)
    assert got.start == 0  # block 0 changed: everything from position 0
    assert np.array_equal(splice_turn(first.routing, got.routing, got.start), full.routing)


def test_a_dropped_row_is_resent_next_turn():
    eng = _Engine(2)
    first, _, blocks = eng.turn("t0", 8, 2, drop_at="prompt")
    assert first.missing[:8].all() and eng.with_session.session_delivered("s") == 0
    got, _, _ = eng.turn("t1", 12, 1, blocks[:2], 8)
    assert got.start == 0


def test_a_hit_on_the_last_turn_sends_only_the_new_rows():
    """4 turns of 512 new tokens on a 2K prompt, all hits: each turn sends its new rows and the
    prompt's tail past the last whole cached block, not the whole history."""
    eng = _Engine(3)
    known, blocks, held = 2048, [], None
    for i in range(4):
        computed = known - 1 if i else 0
        hit = (computed // BS) * BS if i else 0
        prompt = known + 64 if i else known
        got, full, blocks = eng.turn(f"t{i}", prompt, 512, blocks[: hit // BS], hit)
        held = full.routing if held is None else splice_turn(held, got.routing, got.start)
        assert np.array_equal(held, full.routing)
        if i:
            assert got.routing.shape[0] <= 64 + 512 + BS  # the new rows (and a partial block)
            assert got.routing.shape[0] <= 0.25 * full.routing.shape[0]
        known = prompt + 512 + 1


def test_splice_and_session_arguments():
    held = np.zeros((5, 2, 2), np.uint8)
    with pytest.raises(ValueError, match="a gap"):
        splice_turn(held, np.zeros((2, 2, 2), np.uint8), 6)
    with pytest.raises(ValueError, match="differ"):
        splice_turn(held, np.zeros((2, 2, 3), np.uint8), 5)
    assert splice_turn(held, np.ones((2, 2, 2), np.uint8), 3).shape == (5, 2, 2)
    ledger = RoutingLedger(SlotStore(64, SHAPE), BS)
    with pytest.raises(KeyError):
        ledger.end_session("nope")
    ledger.add_request("a", session="s", start=3)  # an explicit start is the client's word
    ledger.end_session("s")
    assert ledger.session_delivered("s") == 0
    a = row_digests([np.zeros((3, 2, 2), np.uint8)])
    b = row_digests([np.zeros((3, 2, 2), np.uint8) + np.array([0, 0, 1], np.uint8)[:, None, None]])
    assert (a[:2] == b[:2]).all() and (a[2] != b[2]).all()
