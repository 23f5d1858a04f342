"""Request lifecycle: pre-free capture, preemption/resume under both policies, abort, block reuse,
prefix hits, steps in flight, dropped steps, rejected draft tokens, start offsets.

The state machine simulates an engine scheduler (paged KV allocator with a prefix cache and LRU-less
eviction, chunked prefill whose last chunk samples, decode with speculative draft tokens that a
verify outcome rejects, preemption by recompute that keeps the sampled tokens, abort, finish) and
drives the REAL data path for every step: ``RoutingCapturer.set_step`` / ``capture`` (the capture
op, LOCAL layout with padding rows) / ``snapshot`` through the transfer ring (1..4 steps in flight,
landing in any order, some dropped) into ``RoutingLedger`` and ``SlotStore``. Its invariant: every
finished request's routing equals what its tokens were routed to under the ledger's policy, row for
row, with exactly the rows of dropped steps marked missing; under ``"sampling"`` an attempt that
never sampled contributes no row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from strategies import routing_rows

from moe_ops import RoutingCapturer, RoutingLedger, RoutingShape, SlotStore

# model layers 0..3, layer 2 dense; ids need uint16 (300 experts)
SHAPE = RoutingShape(num_layers=3, num_experts=300, top_k=2, moe_layers=(0, 1, 3), num_model_layers=4)
PAD_ID = 299  # ids in padding rows of the step's topk_ids: must never reach a request


def _rows(seed: int, n: int) -> np.ndarray:
    return routing_rows(np.random.default_rng(seed), n, SHAPE)


# ---------------------------------------------------------------------------------- scenario tests


def test_abort_with_a_step_in_flight_and_the_block_reused_out_of_order():
    store = SlotStore(4 * 2, SHAPE)
    ledger = RoutingLedger(store, block_size=2)
    ledger.add_request("a")
    ledger.append_blocks("a", [1])
    s0 = ledger.schedule([("a", 2)])
    a_rows = _rows(0, 2)
    ledger.abort("a")  # a's rows are still in flight
    ledger.add_request("b")
    ledger.append_blocks("b", [1])  # the engine reuses a's block at once
    s1 = ledger.schedule([("b", 1)])
    b_rows = _rows(1, 1)
    ledger.land(s1.seq, b_rows)  # b's step lands first
    ledger.land(s0.seq, a_rows)  # then a's late rows
    ledger.finish("b")
    done = {r.req_id: r for r in ledger.collect()}
    assert np.array_equal(done["b"].routing, b_rows), "a's late rows leaked into b's reused block"
    assert np.array_equal(done["a"].routing, a_rows) and done["a"].aborted
    assert np.array_equal(store.read([1], 1, 2), b_rows)


def test_late_rows_never_land_in_a_reallocated_block():
    """Even in slots the new owner has not written yet, the old owner's late rows stay out."""
    store = SlotStore(4 * 2, SHAPE)
    ledger = RoutingLedger(store, block_size=2)
    ledger.add_request("a")
    ledger.append_blocks("a", [1])
    s0 = ledger.schedule([("a", 2)])  # slots 2, 3
    ledger.abort("a")
    ledger.add_request("b")
    ledger.append_blocks("b", [1])
    s1 = ledger.schedule([("b", 1)])  # slot 2 only
    ledger.land(s0.seq, _rows(6, 2))  # a's rows land first this time
    assert (store.read_slots([2, 3]) == store.fill).all(), "a's late rows were written into b's block"
    b_rows = _rows(7, 1)
    ledger.land(s1.seq, b_rows)
    assert np.array_equal(store.read_slots([2]), b_rows) and (store.read_slots([3]) == store.fill).all()


@pytest.mark.parametrize("policy", ["sampling", "latest"])
def test_preempt_and_resume_return_the_most_complete_copy_in_order(policy):
    """A shorter later attempt adds nothing: both policies return the first attempt's rows."""
    store = SlotStore(8 * 2, SHAPE)
    ledger = RoutingLedger(store, block_size=2, policy=policy)
    ledger.add_request("r")
    ledger.append_blocks("r", [0, 1, 2])
    s = ledger.schedule([("r", 5)])
    first = _rows(2, 5)
    ledger.land(s.seq, first)
    ledger.preempt("r")
    assert ledger.block_refs(0) == 0
    # resume on a prefix hit of its own first block, recompute 2 tokens, then abort: 4 < 5 rows,
    # so the first attempt's copy is the most complete
    ledger.resume("r", cached_blocks=[0], num_cached_tokens=2)
    ledger.append_blocks("r", [5])
    s = ledger.schedule([("r", 2)])
    ledger.land(s.seq, _rows(3, 2))
    ledger.abort("r")
    (done,) = ledger.collect()
    assert np.array_equal(done.routing, first)


def test_prefix_hit_on_a_block_whose_step_is_in_flight():
    store = SlotStore(8 * 2, SHAPE)
    ledger = RoutingLedger(store, block_size=2)
    ledger.add_request("a")
    ledger.append_blocks("a", [3])
    s_a = ledger.schedule([("a", 2)])
    a_rows = _rows(4, 2)
    ledger.add_request("b", cached_blocks=[3], num_cached_tokens=2)  # a's block is cached already
    ledger.append_blocks("b", [4])
    s_b = ledger.schedule([("b", 1)])
    b_rows = _rows(5, 1)
    ledger.land(s_b.seq, b_rows)
    ledger.finish("b")
    assert ledger.collect() == [], "b must wait for a's in-flight step"
    ledger.land(s_a.seq, a_rows)
    (done,) = ledger.collect()
    assert np.array_equal(done.routing, np.concatenate([a_rows, b_rows]))


# --------------------------------------------------------------- preemption policies (sampling, latest)

SMALL = RoutingShape(num_layers=1, num_experts=64, top_k=1)  # uint8 rows, fill 255


def _const(value: int, n: int) -> np.ndarray:
    return np.full((n, 1, 1), value, np.uint8)


def _ids(values) -> np.ndarray:
    return np.asarray(values, np.uint8).reshape(-1, 1, 1)


@pytest.mark.parametrize("policy, expected", [("sampling", [0, 0, 0, 0, 0, 1]), ("latest", [1] * 6)])
def test_policy_of_the_issue_example(policy, expected):
    """Sampling-time routes survive a re-prefill: the positions the first attempt computed keep its
    rows; the re-prefill only adds the new token (``policy="latest"`` keeps the old behaviour)."""
    lg = RoutingLedger(SlotStore(64, RoutingShape(num_layers=1, num_experts=8, top_k=1)), 16, policy)
    lg.add_request("r")
    lg.append_blocks("r", [0])
    s = lg.schedule([("r", 5)])
    lg.land(s.seq, np.zeros((5, 1, 1), np.uint8))  # sampling-time routes
    lg.preempt("r")
    lg.resume("r")
    lg.append_blocks("r", [1])
    s = lg.schedule([("r", 6)])
    lg.land(s.seq, np.ones((6, 1, 1), np.uint8))  # re-prefill + 1 new token
    lg.finish("r")
    (done,) = lg.collect()
    assert done.routing[:, 0, 0].tolist() == expected
    assert not done.missing.any() and done.missing.shape == (6,)


# Twins of SGLang's CPU test test/registered/unit/managers/test_retract_routed_experts.py
# (sgl-project/sglang): its request has a 4-token prompt and 2 sampled tokens, and each prefill there
# computes every token but the last (rows = tokens - 1). Not ported: test_stop_before_saved_prefix_
# end_trims_routes (the ledger returns every computed position; cutting at a stop token is the
# engine's slice), test_discarded_input_embeds_output_discards_its_routes (SGLang drops the outputs
# and restarts: to the ledger that is a new request), and the opt-in / no-capturer plumbing tests.
SGLANG_PROMPT = 4


def _attempts(ledger, lengths, blocks_of_attempt, abort_last=False, prompt_len=None):
    """Runs one request through attempts computing ``lengths[a]`` tokens in one step each (rows
    10 * a + position), preempting between them; returns the rows each attempt computed."""
    computed = []
    for a, n in enumerate(lengths):
        if a == 0:
            ledger.add_request("r", prompt_len=prompt_len)
        else:
            ledger.resume("r")
        ledger.append_blocks("r", blocks_of_attempt[a])
        rows = _ids([10 * a + p for p in range(n)])
        step = ledger.schedule([("r", n)])
        ledger.land(step.seq, rows)
        computed.append(rows)
        if a + 1 < len(lengths):
            ledger.preempt("r")
    if abort_last:
        ledger.abort("r")
    else:
        ledger.finish("r")
    return computed


@pytest.mark.parametrize("first_chunks", [[2], [1, 1]])
@pytest.mark.parametrize("reprefill_chunks", [[4], [3, 1]])
def test_an_attempt_preempted_before_its_first_sample_contributes_no_rows(first_chunks, reprefill_chunks):
    """SGLang's test_initial_chunked_prefill_has_no_sampling_routes_to_preserve: the chunked prefill
    of a 4-token prompt computes 2 tokens and is preempted before anything was sampled; the
    re-prefill samples the first token, attending to its own KV: every row is the re-prefill's
    (versions [1, 1, 1, 1]; the per-position rule gave [0, 0, 1, 1])."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r", prompt_len=SGLANG_PROMPT)
    ledger.append_blocks("r", [0])
    for n in first_chunks:
        ledger.land(ledger.schedule([("r", n)]).seq, _const(0, n))
    ledger.preempt("r")
    ledger.resume("r")
    ledger.append_blocks("r", [1])
    for n in reprefill_chunks:
        ledger.land(ledger.schedule([("r", n)]).seq, _const(1, n))
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.routing[:, 0, 0].tolist() == [1, 1, 1, 1]
    assert done.missing.tolist() == [False] * 4


def test_repeated_preemptions_before_the_first_sample_contribute_no_rows():
    """Three attempts cut off in the prefill of a 6-token prompt (3, 5, then 2 tokens), the fourth
    samples: every row is the fourth's."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    *_, last = _attempts(ledger, [3, 5, 2, 7], [[0], [1, 2], [3], [4, 5]], prompt_len=6)
    (done,) = ledger.collect()
    assert np.array_equal(done.routing, last)


@pytest.mark.parametrize("policy", ["sampling", "latest"])
@pytest.mark.parametrize("while_preempted", [False, True])
def test_a_request_that_never_sampled(policy, while_preempted):
    """Aborted before its first sample (5 tokens of a 6-token prompt, preempted; aborted then, or
    after a second attempt computed 3): no forward's outputs were used, so ``sampling`` returns no
    row; ``latest`` keeps its meaning, the most complete attempt (the first, 5 rows)."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4, policy)
    ledger.add_request("r", prompt_len=6)
    ledger.append_blocks("r", [0, 1])
    first = _ids(range(5))
    ledger.land(ledger.schedule([("r", 5)]).seq, first)
    ledger.preempt("r")
    if not while_preempted:
        ledger.resume("r")
        ledger.append_blocks("r", [2])
        ledger.land(ledger.schedule([("r", 3)]).seq, _ids([20, 21, 22]))
    ledger.abort("r")
    (done,) = ledger.collect()
    assert done.aborted
    if policy == "sampling":
        assert done.routing.shape == (0, 1, 1) and done.missing.shape == (0,)
    else:
        assert np.array_equal(done.routing, first) and not done.missing.any()


@pytest.mark.parametrize("fate", ["land", "drop"])
def test_steps_of_an_attempt_that_never_sampled_never_reach_the_request(fate):
    """The unsampled attempt's step is still in flight at preemption: the request does not wait for
    it, and whether it lands or is dropped, none of its rows (nor missing flags) reach the request."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r", prompt_len=SGLANG_PROMPT)
    ledger.append_blocks("r", [0])
    s0 = ledger.schedule([("r", 2)])
    ledger.preempt("r")
    ledger.resume("r")
    ledger.append_blocks("r", [1])
    ledger.land(ledger.schedule([("r", 4)]).seq, _const(1, 4))
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.routing[:, 0, 0].tolist() == [1, 1, 1, 1] and not done.missing.any()
    if fate == "land":
        ledger.land(s0.seq, _const(0, 2))
    else:
        ledger.drop(s0.seq)
    assert ledger.collect() == [] and ledger.in_flight == [] and ledger.held_requests() == []


def test_a_prefix_hit_on_the_unsampled_attempts_block_returns_its_rows():
    """The first attempt computed 5 of 6 prompt tokens and was preempted before sampling; the engine
    cached its first block and the re-prefill starts on it. The sample attended to the first
    attempt's KV in that block, so tokens 0..3 are the first attempt's rows, 4 and 5 the
    re-prefill's (the first attempt's row of token 4 was never used)."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r", prompt_len=6)
    ledger.append_blocks("r", [2, 5])
    ledger.land(ledger.schedule([("r", 5)]).seq, _ids(range(5)))
    ledger.preempt("r")
    ledger.resume("r", cached_blocks=[2], num_cached_tokens=4)
    ledger.append_blocks("r", [7])
    ledger.land(ledger.schedule([("r", 2)]).seq, _ids([24, 25]))
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.routing[:, 0, 0].tolist() == [0, 1, 2, 3, 24, 25]


@pytest.mark.parametrize("prompt_len", [None, SGLANG_PROMPT])
@pytest.mark.parametrize("policy", ["sampling", "latest"])
def test_repeated_preemptions_keep_each_positions_first_version(policy, prompt_len):
    """SGLang's test_repeated_retracts_keep_each_sampling_version: 5, then 7, then 8 tokens, each
    attempt sampled."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4, policy)
    a0, a1, a2 = _attempts(ledger, [5, 7, 8], [[0, 1], [5, 3], [2, 7]], prompt_len=prompt_len)
    (done,) = ledger.collect()
    expected = np.concatenate([a0, a1[5:], a2[7:]]) if policy == "sampling" else a2
    assert np.array_equal(done.routing, expected)


@pytest.mark.parametrize("prompt_len", [None, SGLANG_PROMPT])
@pytest.mark.parametrize("policy", ["sampling", "latest"])
@pytest.mark.parametrize("abort_during_partial", [False, True])
def test_preemption_during_a_partial_reprefill_reads_no_uncomputed_row(
    policy, abort_during_partial, prompt_len
):
    """SGLang's test_retract_during_reprefill_does_not_read_uncomputed_rows: 5 tokens, a re-prefill
    cut off after 2 (its blocks hold another request's old rows past them; none may come back),
    then 6 tokens."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4, policy)
    ledger.add_request("old")
    ledger.append_blocks("old", [2, 3])
    step = ledger.schedule([("old", 8)])
    ledger.land(step.seq, _const(63, 8))  # poison left in blocks 2, 3
    ledger.finish("old")
    ledger.collect()
    lengths = [5, 2] if abort_during_partial else [5, 2, 6]
    computed = _attempts(
        ledger, lengths, [[0, 1], [2, 3], [3, 2]], abort_last=abort_during_partial, prompt_len=prompt_len
    )
    (done,) = ledger.collect()
    assert not (done.routing == 63).any(), "rows the partial attempt never computed came back"
    a0 = computed[0]
    if abort_during_partial:  # the 2-token attempt is shorter: both policies keep the first
        expected = a0
    else:
        expected = np.concatenate([a0, computed[2][5:]]) if policy == "sampling" else computed[2]
    assert np.array_equal(done.routing, expected)


def test_a_step_in_flight_at_preemption_counts_for_the_attempt():
    """SGLang's test_pause_retract_preserves_the_drained_overlap_result: the decode step of token 5
    is in flight when the request is preempted (the engine keeps its sampled token); it lands after
    the re-prefill: the original's 6 rows, then the re-prefill's row of token 6."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r", prompt_len=SGLANG_PROMPT)
    ledger.append_blocks("r", [0, 1])
    s0 = ledger.schedule([("r", 5)])
    s1 = ledger.schedule([("r", 1)])
    ledger.land(s0.seq, _ids(range(5)))
    ledger.preempt("r")
    ledger.resume("r")
    ledger.append_blocks("r", [3, 2])
    ledger.land(ledger.schedule([("r", 7)]).seq, _ids(range(20, 27)))
    ledger.finish("r")
    assert ledger.collect() == [], "the request must wait for its step in flight"
    ledger.land(s1.seq, _ids([5]))
    (done,) = ledger.collect()
    assert done.routing[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 26]


def test_non_retracted_request_is_unchanged():
    """SGLang's test_non_retracted_request_is_unchanged: one prefill, start 3."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r", start=3, prompt_len=SGLANG_PROMPT)
    ledger.append_blocks("r", [1, 0])
    ledger.land(ledger.schedule([("r", 5)]).seq, _ids(range(5)))
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.routing[:, 0, 0].tolist() == [3, 4] and done.start == 3


def test_without_prompt_len_every_attempt_counts_from_its_first_token():
    """The documented default (``prompt_len=None``): the ledger cannot tell when the request first
    samples, so a first attempt cut off during its chunked prefill keeps its 2 rows."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    a0, a1 = _attempts(ledger, [2, 6], [[0], [1, 2]])
    (done,) = ledger.collect()
    assert np.array_equal(done.routing, np.concatenate([a0, a1[2:]]))


def test_policy_must_be_known():
    with pytest.raises(ValueError, match=r"policy must be one of \('sampling', 'latest'\), got 'first'"):
        RoutingLedger(SlotStore(16, SMALL), 4, policy="first")


# ------------------------------------------------------------------------------------- start offsets


@pytest.mark.parametrize("prompt_len", [None, SGLANG_PROMPT])
@pytest.mark.parametrize("start", [0, 3, 4, 5, 10])
def test_start_cuts_the_sampling_rows(start, prompt_len):
    """SGLang's test_sampling_routes_survive_reprefill: cat(original, recomputed[len(original):])[start:]."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r", start=start, prompt_len=prompt_len)
    ledger.append_blocks("r", [0, 1])
    s = ledger.schedule([("r", 5)])
    original = _ids(range(5))
    ledger.land(s.seq, original)
    ledger.preempt("r")
    ledger.resume("r")
    ledger.append_blocks("r", [4, 2])
    s = ledger.schedule([("r", 6)])
    recomputed = _ids(range(20, 26))
    ledger.land(s.seq, recomputed)
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.start == start
    assert np.array_equal(done.routing, np.concatenate([original, recomputed[5:]])[start:])
    assert done.missing.shape == (done.routing.shape[0],)


@pytest.mark.parametrize("start", [0, 5, 8, 9, 11, 30])
def test_start_copies_no_row_before_it(start):
    """A second turn on a prefix hit of the first turn's 8 tokens: the rows from ``start`` on are
    returned in an array of exactly that many rows (not a slice of a longer copy)."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("turn1")
    ledger.append_blocks("turn1", [6, 2])
    s = ledger.schedule([("turn1", 8)])
    first = _ids(range(30, 38))
    ledger.land(s.seq, first)
    ledger.add_request("turn2", cached_blocks=[6, 2], num_cached_tokens=8, start=start)
    ledger.append_blocks("turn2", [5])
    s = ledger.schedule([("turn2", 3)])
    new = _ids([1, 2, 3])
    ledger.land(s.seq, new)
    ledger.finish("turn2")
    (done,) = ledger.collect()
    expected = np.concatenate([first, new])[start:]
    assert np.array_equal(done.routing, expected) and done.start == start
    assert done.routing.base is None and done.missing.base is None, "a view of a longer private copy"


def test_start_cuts_missing_like_the_rows():
    """A dropped step covering tokens 0..5 of a request with start 3: missing covers [3, 8) only."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r", start=3)
    ledger.append_blocks("r", [0, 1])
    s0 = ledger.schedule([("r", 6)])
    s1 = ledger.schedule([("r", 2)])
    ledger.land(s1.seq, _ids([40, 41]))
    ledger.drop(s0.seq)
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.missing.tolist() == [True, True, True, False, False]
    assert done.routing[:, 0, 0].tolist() == [255, 255, 255, 40, 41]


# ----------------------------------------------------------------------------- dropped steps (drop)


@pytest.mark.parametrize("drop_first", [False, True])
def test_a_prefix_hit_on_a_dropped_step_reads_fill_not_old_rows(drop_first):
    """The block held another request's rows before; the step that recomputed it never arrived:
    the prefix-hit request gets fill rows marked missing (the step in flight, or dropped already)."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("old")
    ledger.append_blocks("old", [2])
    s = ledger.schedule([("old", 4)])
    ledger.land(s.seq, _const(63, 4))
    ledger.finish("old")
    ledger.collect()
    ledger.add_request("a")
    ledger.append_blocks("a", [2])
    s_a = ledger.schedule([("a", 4)])
    if drop_first:
        ledger.drop(s_a.seq)
    ledger.add_request("b", cached_blocks=[2], num_cached_tokens=4)
    ledger.append_blocks("b", [3])
    s_b = ledger.schedule([("b", 1)])
    ledger.land(s_b.seq, _ids([7]))
    ledger.finish("b")
    if not drop_first:
        assert ledger.collect() == [], "b must wait for a's step"
        ledger.drop(s_a.seq)
    (done,) = ledger.collect()
    assert done.req_id == "b"
    assert done.routing[:, 0, 0].tolist() == [255, 255, 255, 255, 7]
    assert done.missing.tolist() == [True] * 4 + [False]


# ------------------------------------------------------------------------------- smaller contracts


def test_slot_mapping_is_read_only():
    """An engine that reverses the slot mapping in place must not corrupt the ledger's routing."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r")
    ledger.append_blocks("r", [3, 1])
    step = ledger.schedule([("r", 6)])
    with pytest.raises(ValueError, match="read-only"):
        step.slot_mapping[:] = step.slot_mapping[::-1]
    with pytest.raises(ValueError, match="WRITEABLE"):
        step.slot_mapping.flags.writeable = True
    ledger.land(step.seq, _ids(range(6)))
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.routing[:, 0, 0].tolist() == list(range(6))
    assert ledger.store.read([3, 1], 6, 4)[:, 0, 0].tolist() == list(range(6))


def test_slot_mapping_of_long_and_short_entries_in_one_step():
    """Entries up to 32 tokens and longer ones take different paths; the mapping is one sequence."""
    rng = np.random.default_rng(5)
    ledger = RoutingLedger(SlotStore(64 * 4, SMALL), 4)
    lengths = [1, 40, 3, 33, 32, 0, 2, 70]
    free = rng.permutation(64).tolist()
    tables = {}
    for rid, n in enumerate(lengths):
        ledger.add_request(rid)
        tables[rid] = [free.pop() for _ in range(-(-(n + 5) // 4))]
        ledger.append_blocks(rid, tables[rid])
    ledger.schedule([(rid, 5) for rid in range(len(lengths))])  # every entry starts mid-block
    step = ledger.schedule(list(enumerate(lengths)))
    expected = [tables[rid][p // 4] * 4 + p % 4 for rid, n in enumerate(lengths) for p in range(5, 5 + n)]
    assert step.slot_mapping.tolist() == expected and step.slot_mapping.dtype == np.int64


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.array([300, 7.9]).reshape(2, 1, 1), "must hold integers, got dtype float64"),
        (np.array([300, 7]).reshape(2, 1, 1), r"hold values in \[7, 300\] that the store's dtype uint8"),
        (np.array([-1, 7]).reshape(2, 1, 1), r"hold values in \[-1, 7\]"),
    ],
)
def test_land_checks_rows_that_only_go_to_a_private_copy(bad, match):
    """The aborted request's block is reused before its step lands, so its rows go to its private
    copy only: they are checked like the store's rows, and a refused landing changes nothing."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("a")
    ledger.append_blocks("a", [1])
    s0 = ledger.schedule([("a", 2)])
    ledger.abort("a")
    ledger.add_request("b")
    ledger.append_blocks("b", [1])
    with pytest.raises(ValueError, match=f"rows of step {s0.seq} {match}"):
        ledger.land(s0.seq, bad)
    assert ledger.in_flight == [s0.seq] and ledger.collect() == []
    ledger.land(s0.seq, _ids([5, 6]))
    (done,) = ledger.collect()
    assert done.aborted and done.routing[:, 0, 0].tolist() == [5, 6]


# ------------------------------------------------------------------ speculative decoding (reject)


@pytest.mark.parametrize("policy", ["sampling", "latest"])
@pytest.mark.parametrize("order", ["reject, land", "land, reject", "reject, recompute lands, land"])
def test_reject_takes_back_draft_rows(policy, order):
    """Decode step: the sampled token at position 4 and drafts at 5, 6; the verify rejects both
    drafts. Their rows never reach the request, whenever their step lands; the recompute's do."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4, policy)
    ledger.add_request("r")
    ledger.append_blocks("r", [2, 0])
    s0 = ledger.schedule([("r", 4)])
    ledger.land(s0.seq, _ids([0, 1, 2, 3]))
    s1 = ledger.schedule([("r", 3)])
    if order == "land, reject":
        ledger.land(s1.seq, _ids([4, 50, 51]))
    ledger.reject("r", 2)
    if order == "reject, land":
        ledger.land(s1.seq, _ids([4, 50, 51]))
    s2 = ledger.schedule([("r", 2)])  # positions 5, 6 again (the next sampled token and a draft)
    assert s2.slot_mapping.tolist() == [1, 2]
    ledger.land(s2.seq, _ids([5, 6]))
    if order == "reject, recompute lands, land":
        ledger.land(s1.seq, _ids([4, 50, 51]))
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.routing[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert not done.missing.any()


def test_reject_keeps_a_late_step_out_of_the_store():
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r")
    ledger.append_blocks("r", [1])
    s = ledger.schedule([("r", 3)])
    assert ledger.pending_slots() == 3
    ledger.reject("r", 2)
    assert ledger.pending_slots() == 1
    ledger.land(s.seq, _ids([0, 50, 51]))
    assert ledger.store.read_slots([4, 5, 6])[:, 0, 0].tolist() == [0, 255, 255]


@pytest.mark.parametrize("policy", ["sampling", "latest"])
def test_rejected_positions_are_filled_by_the_attempt_that_computes_them(policy):
    """Attempt 0 computes 5 tokens and 2 drafts, rejects both, is preempted; attempt 1 recomputes
    7 tokens: under either policy positions 5, 6 come from attempt 1 (attempt 0 never kept them)."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4, policy)
    ledger.add_request("r")
    ledger.append_blocks("r", [0, 1])
    s = ledger.schedule([("r", 7)])
    ledger.reject("r", 2)
    ledger.preempt("r")
    ledger.resume("r")
    ledger.append_blocks("r", [3, 2])
    s1 = ledger.schedule([("r", 7)])
    ledger.land(s1.seq, _ids(range(20, 27)))
    ledger.land(s.seq, _ids(range(7)))  # attempt 0's step lands last
    ledger.finish("r")
    (done,) = ledger.collect()
    expected = [0, 1, 2, 3, 4, 25, 26] if policy == "sampling" else list(range(20, 27))
    assert done.routing[:, 0, 0].tolist() == expected


def test_reject_cannot_take_back_prefix_hit_tokens():
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("a")
    ledger.append_blocks("a", [0])
    ledger.schedule([("a", 4)])
    ledger.add_request("b", cached_blocks=[0], num_cached_tokens=4)
    ledger.append_blocks("b", [1])
    ledger.schedule([("b", 2)])
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 2\] \(positions of request 'b'"):
        ledger.reject("b", 3)
    ledger.reject("b", 2)
    assert ledger.schedule([("b", 1)]).slot_mapping.tolist() == [4]


# ----------------------------------------------------------------------------------- engine mistakes


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda led: led.append_blocks("a", [0]), ValueError, r"blocks \[0\] are held"),
        (lambda led: led.append_blocks("a", [9]), IndexError, r"block_ids must be in \[0, 8\)"),
        (lambda led: led.schedule([("a", 5)]), IndexError, "append blocks first"),
        (lambda led: led.schedule([("a", 1), ("a", 1)]), ValueError, "appears twice"),
        (lambda led: led.schedule([("zz", 1)]), KeyError, "unknown request"),
        (lambda led: led.land(7, np.zeros((0, 3, 2), np.uint16)), KeyError, "not in flight"),
        (lambda led: led.land(0, np.zeros((3, 3, 2), np.uint16)), ValueError, r"shape \(2, 3, 2\)"),
        (lambda led: led.add_request("a"), ValueError, "already exists"),
        (lambda led: led.add_request("c", [1], 3), ValueError, "num_cached_tokens must be"),
        (lambda led: led.resume("a"), ValueError, "only a preempted request can resume"),
        (lambda led: led.land(0, np.full((2, 3, 2), 1.0)), ValueError, "rows of step 0 must hold integers"),
        (lambda led: led.drop(7), KeyError, "step 7 is not in flight"),
        (lambda led: led.reject("a", 3), ValueError, r"num_tokens must be in \[0, 2\]"),
        (lambda led: led.reject("a", -1), ValueError, r"num_tokens must be in \[0, 2\]"),
        (lambda led: led.reject("a", True), ValueError, "num_tokens must be an int, got True"),
        (lambda led: led.reject("zz", 1), KeyError, "unknown request"),
        (lambda led: led.add_request("c", start=-1), ValueError, "start must be an int >= 0, got -1"),
        (lambda led: led.add_request("c", start=2.0), ValueError, "start must be an int >= 0, got 2.0"),
        (
            lambda led: led.add_request("c", prompt_len=0),
            ValueError,
            "prompt_len must be an int >= 1 or None, got 0",
        ),
        (
            lambda led: led.add_request("c", prompt_len=3.0),
            ValueError,
            "prompt_len must be an int >= 1 or None, got 3.0",
        ),
        (
            lambda led: led.add_request("c", prompt_len=True),
            ValueError,
            "prompt_len must be an int >= 1 or None, got True",
        ),
        (
            lambda led: led.add_request("c", [1], 2, prompt_len=2),
            ValueError,
            r"num_cached_tokens=2 must be < 2",
        ),
    ],
)
def test_engine_mistakes_raise_and_change_nothing(call, exc, match):
    ledger = RoutingLedger(SlotStore(16, SHAPE), block_size=2)
    ledger.add_request("a")
    ledger.append_blocks("a", [0, 1])
    ledger.schedule([("a", 2)])
    with pytest.raises(exc, match=match):
        call(ledger)
    # the ledger goes on as if the call never happened
    assert ledger.held_requests() == ["a"] and ledger.in_flight == [0] and ledger.pending_slots() == 2
    assert [ledger.block_refs(b) for b in range(8)] == [1, 1, 0, 0, 0, 0, 0, 0]
    rows = _rows(8, 3)
    ledger.land(0, rows[:2])
    ledger.land(ledger.schedule([("a", 1)]).seq, rows[2:])
    ledger.finish("a")
    (done,) = ledger.collect()
    assert np.array_equal(done.routing, rows) and not done.missing.any()


def test_a_prefix_hit_must_leave_the_token_that_samples_to_compute():
    """After an attempt that computed 4 tokens of a 4-token prompt and sampled, the request knows 5:
    a resumed attempt's hit may cover 4 (the re-prefill computes token 4 and samples), never 8."""
    ledger = RoutingLedger(SlotStore(16 * 4, SMALL), 4)
    ledger.add_request("r", prompt_len=4)
    ledger.append_blocks("r", [0, 1])
    ledger.land(ledger.schedule([("r", 4)]).seq, _ids(range(4)))
    ledger.preempt("r")
    with pytest.raises(ValueError, match=r"num_cached_tokens=8 must be < 5 \(the tokens request 'r' knows"):
        ledger.resume("r", cached_blocks=[0, 1], num_cached_tokens=8)
    assert ledger.state("r") == "preempted" and ledger.block_refs(0) == ledger.block_refs(1) == 0
    ledger.resume("r", cached_blocks=[0], num_cached_tokens=4)
    ledger.append_blocks("r", [3])
    ledger.land(ledger.schedule([("r", 1)]).seq, _ids([24]))
    ledger.finish("r")
    (done,) = ledger.collect()
    assert done.routing[:, 0, 0].tolist() == [0, 1, 2, 3, 24]


def test_reject_needs_a_running_request():
    ledger = RoutingLedger(SlotStore(16, SHAPE), block_size=2)
    ledger.add_request("a")
    ledger.append_blocks("a", [0])
    ledger.schedule([("a", 2)])
    ledger.preempt("a")
    with pytest.raises(ValueError, match="request 'a' is preempted; expected running"):
        ledger.reject("a", 1)


# ----------------------------------------------------------------------------------- state machine


# a request's arrival: which common prefix, its own tokens, start, whether the engine tells prompt_len
_ARRIVAL = dict(
    prefix=st.integers(0, 1),
    length=st.integers(1, 8),
    start=st.sampled_from([0, 0, 1, 3, 6, 20]),
    tell_prompt=st.sampled_from([True, True, True, False]),
)


class EngineMachine(RuleBasedStateMachine):
    """A small paged-KV engine with async scheduling and speculative decoding, driving the real
    capture -> store path; some steps' rows never arrive (dropped).

    Sampling is modelled as an engine does it: a request's tokens are its prompt and the tokens it
    sampled. A (re-)prefill computes known tokens in chunks; the chunk that computes the last one
    samples the next token. A decode computes the token sampled last plus draft tokens; the verify
    outcome takes back the rejected drafts and appends the token sampled after the accepted ones.
    Preemption keeps the tokens; the next attempt re-prefills all of them. Each attempt records
    whether it sampled; the oracle reads only that record.

    The routes follow the KV too: a disaggregated request is prefilled on another instance (its
    own ledger, a step of it maybe dropped), which samples its first token, and only the KV of its
    first p positions arrives (the handoff record; the rest is recomputed here); cached prefix
    blocks move to a lower tier with their rows (offload), are evicted from the GPU, come back into
    other blocks on a later hit (load), or are dropped by the tier (recomputed). EPLB maps change
    between steps: the router picks physical replicas, the capture maps them back."""

    DEVICE = "cpu"
    POLICY = "sampling"
    BLOCK_SIZE = 2
    NUM_BLOCKS = 6  # few blocks: freed blocks are reallocated (and cached ones evicted) soon
    MAX_STEP_TOKENS = 8
    MAX_DRAFT = 2  # draft tokens per decode step of a request
    MAX_RUNNING = 3  # arrivals wait while this many run (resumes do not)
    VOCAB = 3  # few token values: prompts share prefixes, so the prefix cache hits

    @initialize(depth=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
    def setup(self, depth, seed):
        self.depth = depth
        self.rng = np.random.default_rng(seed)
        max_rows = self.MAX_STEP_TOKENS + 3
        self.capturer = RoutingCapturer(SHAPE, max_rows, self.DEVICE, ring_depth=depth)
        self.store = SlotStore(self.NUM_BLOCKS * self.BLOCK_SIZE, SHAPE)
        self.ledger = RoutingLedger(self.store, self.BLOCK_SIZE, policy=self.POLICY)
        # engine side
        self.refs = [0] * self.NUM_BLOCKS  # running requests holding each block
        self.block_key = [None] * self.NUM_BLOCKS  # prefix key of a cached full block
        self.cached: dict[tuple, int] = {}  # prefix key -> block
        # slot -> (seq, row) of the last forward that wrote it (synchronous truth)
        self.world: dict[int, tuple[int, np.ndarray]] = {}
        self.reqs: dict[int, dict] = {}  # request id -> engine state and truth per attempt
        self.in_flight: list[tuple[int, object]] = []  # (ledger seq, snapshot handle)
        self.dropped: set = set()  # seqs whose rows never arrived (("P", seq): the prefill instance's)
        self.ended: set[int] = set()  # finished/aborted, not collected yet
        # a lower KV tier: prefix key -> (blocks record, the (seq, row) truth of the block's slots)
        self.tier: dict[tuple, tuple[bytes, list]] = {}
        # the prefill instance of disaggregated requests (PD handoff), its own store and blocks
        self.prefill = RoutingLedger(SlotStore(64 * self.BLOCK_SIZE, SHAPE), self.BLOCK_SIZE)
        # EPLB: per MoE layer, (physical -> logical map, first replica, second replica) or None
        self.eplb = None

    # -- engine helpers ------------------------------------------------------------------------

    def _ids(self, *states):
        return sorted(i for i, r in self.reqs.items() if r["state"] in states)

    def _release(self, req):
        for b in req["table"]:
            self.refs[b] -= 1
        req["table"] = []

    def _close_attempt(self, req):
        """Records the attempt's truth: position -> (seq, row) of tokens [0, computed), and whether
        it sampled."""
        assert sorted(req["truth"]) == list(range(req["computed"]))
        req["attempts"].append((dict(req["truth"]), req["sampled"]))
        req["computed"] = 0
        req["truth"] = {}
        req["sampled"] = False

    def _expected(self, req):
        """(rows, missing) the ledger must return, from the attempts' truth and the dropped steps."""
        if self.POLICY == "sampling":
            # each position from the first attempt that computed it and sampled; without prompt_len
            # the ledger cannot tell, and every attempt counts
            merged = {}
            for truth, sampled in req["attempts"]:
                if sampled or req["prompt_len"] is None:
                    for p, entry in truth.items():
                        merged.setdefault(p, entry)
        else:  # the attempt with the most positions; the later one on a tie, sampled or not
            merged = {}
            for truth, _ in req["attempts"]:
                if len(truth) >= len(merged):
                    merged = truth
        positions = range(req["start"], len(merged))
        rows = np.empty((len(positions), SHAPE.num_layers, SHAPE.top_k), SHAPE.id_dtype)
        missing = np.zeros(len(positions), dtype=bool)
        for i, p in enumerate(positions):
            seq, row = merged[p]
            missing[i] = seq in self.dropped
            rows[i] = self.store.fill if missing[i] else row
        return rows, missing

    def _start(self, rid):
        """Schedules a request (new, or preempted: resume) on the longest cached prefix."""
        req = self.reqs[rid]
        tokens, bs = req["tokens"], self.BLOCK_SIZE
        hit = []
        while (len(hit) + 1) * bs <= len(tokens) - 1:  # at least one token is always computed
            key = tuple(tokens[: (len(hit) + 1) * bs])
            block = self.cached.get(key)
            if block is None and key in self.tier:
                block = self._load(key, hit)  # the KV (and its rows) come back from the lower tier
            if block is None:
                break
            hit.append(block)
        for b in hit:
            self.refs[b] += 1
        req["table"] = list(hit)
        req["computed"] = len(hit) * bs
        for p in range(req["computed"]):  # prefix-hit rows: what the computing forward routed
            req["truth"][p] = self.world[hit[p // bs] * bs + p % bs]
        if req["state"] == "preempted":
            self.ledger.resume(rid, hit, len(hit) * bs)
        else:
            self.ledger.add_request(rid, hit, len(hit) * bs, start=req["start"], prompt_len=req["prompt_len"])
        req["state"] = "running"

    def _load(self, key, taken):
        """Loads a prefix block from the lower tier into a free block (one not cached, if any) not in
        ``taken`` (the hit so far); None when every block is held."""
        free = [b for b in range(self.NUM_BLOCKS) if self.refs[b] == 0 and b not in taken]
        if not free:
            return None
        uncached = [b for b in free if self.block_key[b] is None]
        b = (uncached or free)[0]
        if self.block_key[b] is not None:
            del self.cached[self.block_key[b]]
        record, truth = self.tier[key]
        self.ledger.load_blocks([b], record)
        event("load a block from the lower tier")
        bs = self.BLOCK_SIZE
        for i, entry in enumerate(truth):
            self.world[b * bs + i] = entry
        self.cached[key] = b
        self.block_key[b] = key
        return b

    def _verify(self, rid, k):
        """The verify step's outcome: the last ``k`` of the request's draft tokens are rejected, and
        the token after the accepted ones is sampled."""
        req = self.reqs[rid]
        if k:
            event("reject")
        self.ledger.reject(rid, k)
        for p in range(req["computed"] - k, req["computed"]):
            del req["truth"][p]
        req["computed"] -= k
        del req["tokens"][len(req["tokens"]) - k :]
        req["tokens"].append(int(self.rng.integers(0, self.VOCAB)))
        req["draft"] = 0

    def _settle(self, rid, data):
        """The engine learns a request's verify outcome before it schedules, preempts or ends it."""
        if self.reqs[rid]["draft"]:
            self._verify(rid, data.draw(st.integers(0, self.reqs[rid]["draft"]), label="rejected"))

    def _collect(self):
        for done in self.ledger.collect():
            req = self.reqs[done.req_id]
            expected, missing = self._expected(req)
            assert done.aborted == (req["state"] == "aborted")
            assert done.start == req["start"]
            assert done.routing.shape == expected.shape, (
                f"request {done.req_id}: {done.routing.shape[0]} rows, expected {expected.shape[0]}"
            )
            assert np.array_equal(done.missing, missing), f"request {done.req_id}: missing flags"
            bad = np.flatnonzero((done.routing != expected).any(axis=(1, 2)))
            assert bad.size == 0, f"request {done.req_id}: rows {bad.tolist()} differ from its routing"
            self.ended.remove(done.req_id)
            req["state"] = "collected"

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self._ids("running")) < self.MAX_RUNNING)
    @rule(**_ARRIVAL)
    def arrive(self, prefix, length, start, tell_prompt):
        """A new request arrives and is scheduled at once (prefix hit included); most engines tell
        the ledger its prompt length, some (old callers) do not."""
        self._arrive(prefix, length, start, tell_prompt)

    @precondition(lambda self: len(self._ids("running")) < self.MAX_RUNNING)
    @rule(**_ARRIVAL, data=st.data())
    def arrive_from_prefill(self, prefix, length, start, tell_prompt, data):
        """A disaggregated request: another instance prefills its prompt (in one or two steps, one
        maybe dropped) and samples its first token; the KV of its first p positions arrives here
        (all, or part: the rest is recomputed here) with the handoff record."""
        rid = self._arrive(prefix, length, start, tell_prompt, schedule=False)
        req = self.reqs[rid]
        tokens, bs = req["tokens"], self.BLOCK_SIZE
        n = len(tokens)
        p = data.draw(st.integers(0, n), label="positions whose KV arrives")
        free = [b for b in range(self.NUM_BLOCKS) if self.refs[b] == 0]
        need = -(-p // bs)
        if need > len(free):
            event("handoff: no KV space here, the request is prefilled here instead")
            self._start(rid)
            return
        self.prefill.add_request(rid, prompt_len=req["prompt_len"])
        self.prefill.append_blocks(rid, list(range(-(-n // bs))))
        truth = {}
        cut = data.draw(st.integers(1, n), label="first prefill chunk")
        for lo, hi in ((0, cut), (cut, n)):
            if hi == lo:
                continue
            step = self.prefill.schedule([(rid, hi - lo)])
            rows = routing_rows(self.rng, hi - lo, SHAPE)
            for i in range(hi - lo):
                truth[lo + i] = (("P", step.seq), rows[i])
            if data.draw(st.integers(0, 5), label="drop if 0") == 0:
                self.dropped.add(("P", step.seq))
                self.prefill.drop(step.seq)
            else:
                self.prefill.land(step.seq, rows)
        record = self.prefill.export_handoff(rid)
        self.prefill.finish(rid)
        self.prefill.collect()
        tokens.append(int(self.rng.integers(0, self.VOCAB)))  # the prefill instance sampled it
        fresh = data.draw(st.permutations(free))[:need]
        for b in fresh:
            if self.block_key[b] is not None:
                del self.cached[self.block_key[b]]
                self.block_key[b] = None
            self.refs[b] = 1
        self.ledger.import_handoff(rid, record, fresh, num_tokens=p, start=req["start"])
        event("handoff, all the KV" if p == n else "handoff, part of the KV: recompute the rest")
        req["table"] = list(fresh)
        req["computed"] = p
        req["sampled"] = True
        for pos in range(p):
            req["truth"][pos] = self.world[fresh[pos // bs] * bs + pos % bs] = truth[pos]
        req["state"] = "running"

    def _arrive(self, prefix, length, start, tell_prompt, schedule=True):
        common = [[0, 1, 2, 0, 1, 2], [2, 2, 1, 1, 0, 0]][prefix]
        tokens = common[: max(length, 3)] + self.rng.integers(0, self.VOCAB, size=length).tolist()
        rid = len(self.reqs)
        self.reqs[rid] = dict(
            tokens=tokens,
            prompt_len=len(tokens) if tell_prompt else None,
            state="waiting",
            table=[],
            computed=0,
            draft=0,
            sampled=False,  # the current attempt has sampled
            truth={},
            attempts=[],
            start=start,
        )
        if schedule:
            self._start(rid)
        return rid

    @precondition(lambda self: self._ids("preempted"))
    @rule(data=st.data())
    def resume(self, data):
        self._start(data.draw(st.sampled_from(self._ids("preempted"))))

    @precondition(lambda self: any(self.reqs[r]["draft"] for r in self._ids("running")))
    @rule(data=st.data())
    def verify(self, data):
        """The verify outcome of a request's draft tokens arrives (before or after its step lands)."""
        rid = data.draw(st.sampled_from([r for r in self._ids("running") if self.reqs[r]["draft"]]))
        self._settle(rid, data)

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data())
    def step(self, data):
        """Schedules a step of some running requests and runs it through the capture path."""
        if len(self.in_flight) >= self.depth:
            self.land(data)  # the ring is full: the engine consumes a step first
        running = self._ids("running")
        chosen = data.draw(st.permutations(running))  # every running request, budget permitting
        bs, budget, entries, rows = self.BLOCK_SIZE, self.MAX_STEP_TOKENS, [], []
        for rid in chosen:
            req = self.reqs[rid]
            if budget == 0:
                break
            self._settle(rid, data)
            recompute = req["sampled"] and req["computed"] < len(req["tokens"]) - 1
            if recompute:  # a handed-off request whose KV arrived in part: recompute, no sample
                draft = 0
                n = data.draw(st.integers(1, min(len(req["tokens"]) - 1 - req["computed"], budget)))
            elif req["sampled"]:  # decode: the token sampled last and drafts after it
                assert req["computed"] == len(req["tokens"]) - 1
                draft = data.draw(st.integers(0, min(self.MAX_DRAFT, budget - 1)))
                n = 1 + draft
            else:  # (chunked, re-)prefill of known tokens; the chunk that reaches the last samples
                draft = 0
                cap = min(len(req["tokens"]) - req["computed"], budget)
                n = data.draw(st.one_of(st.just(cap), st.integers(1, cap)))  # often all the step can take
            need = -(-(req["computed"] + n) // bs) - len(req["table"])
            free = [b for b in range(self.NUM_BLOCKS) if self.refs[b] == 0]
            if need > len(free):
                continue  # no KV space for this request this step
            if recompute:
                pass
            elif req["sampled"]:  # the drafts; without any, the sampled token comes with the step
                req["tokens"] += self.rng.integers(0, self.VOCAB, size=draft or 1).tolist()
            elif req["computed"] + n == len(req["tokens"]):  # the prefill's last chunk samples
                req["tokens"].append(int(self.rng.integers(0, self.VOCAB)))
                req["sampled"] = True
            fresh = data.draw(st.permutations(free))[:need]  # any free block, cached ones evicted
            for b in fresh:
                if self.block_key[b] is not None:
                    del self.cached[self.block_key[b]]
                    self.block_key[b] = None
                self.refs[b] = 1
            req["table"] += fresh
            self.ledger.append_blocks(rid, fresh)
            req["computed"] += n
            req["draft"] = draft
            verified = req["computed"] - draft
            for j, b in enumerate(req["table"]):  # full verified blocks join the prefix cache
                key = tuple(req["tokens"][: (j + 1) * bs])
                if (j + 1) * bs <= verified and self.block_key[b] is None and key not in self.cached:
                    self.cached[key] = b
                    self.block_key[b] = key
            entries.append((rid, n))
            rows.append(routing_rows(self.rng, n, SHAPE))
            budget -= n
        if not entries:
            return
        step = self.ledger.schedule(entries)
        expected_slots = []
        for (rid, n), step_rows in zip(entries, rows):
            req = self.reqs[rid]
            for i in range(n):
                p = req["computed"] - n + i
                slot = req["table"][p // bs] * bs + p % bs
                req["truth"][p] = self.world[slot] = (step.seq, step_rows[i])
                expected_slots.append(slot)
        assert np.array_equal(step.slot_mapping, expected_slots)
        # the forward: every MoE layer's topk_ids, LOCAL layout with CUDA-graph-style padding rows
        batch = np.concatenate(rows)
        n_total, pad = batch.shape[0], data.draw(st.integers(0, 3))
        self.capturer.set_step([n_total])
        for i, layer in enumerate(SHAPE.moe_layers):
            ids = np.full((n_total + pad, SHAPE.top_k), PAD_ID, dtype=np.int64)
            ids[:n_total] = batch[:, i]
            if self.eplb is None:
                self.capturer.capture(layer, torch.from_numpy(ids).to(self.DEVICE))
                continue
            # the router picked physical replicas; the capture maps them back to logical ids
            phys_map, first, second = self.eplb[i]
            phys = np.where(self.rng.random(ids.shape) < 0.5, first[ids], second[ids])
            self.capturer.capture(
                layer,
                torch.from_numpy(phys).to(self.DEVICE),
                expert_map=torch.from_numpy(phys_map).to(self.DEVICE),
                num_logical_experts=SHAPE.num_experts,
            )
        self.in_flight.append((step.seq, self.capturer.snapshot()))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def land(self, data):
        """The oldest or any later step's rows reach the host (any order), or never arrive (its
        snapshot is lost: dropped); then finished requests are collected and checked."""
        idx = data.draw(st.integers(0, len(self.in_flight) - 1))
        seq, handle = self.in_flight.pop(idx)
        if data.draw(st.integers(0, 5), label="drop if 0") == 0:
            event("drop")
            self.dropped.add(seq)
            self.ledger.drop(seq)
        else:
            self.ledger.land(seq, handle.result(copy=False))
        handle.release()
        self._collect()

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def offload(self, data):
        """A cached prefix block's KV moves to the lower tier with its rows; the GPU block is freed
        (or, while a request holds it, stays where it is as well)."""
        key = data.draw(st.sampled_from(sorted(self.cached)))
        b = self.cached[key]
        try:
            record = self.ledger.offload_blocks([b])
        except ValueError as exc:  # a step that writes it is in flight: the engine waits
            assert "in flight" in str(exc)
            event("offload waits for a step in flight")
            return
        bs = self.BLOCK_SIZE
        self.tier[key] = (record, [self.world[b * bs + i] for i in range(bs)])
        event("offload a block to the lower tier")
        if self.refs[b] == 0 and data.draw(st.booleans(), label="evict from the GPU"):
            del self.cached[key]
            self.block_key[b] = None

    @rule(redundant=st.sampled_from([None, 0, 7, 40]))
    def rebalance(self, redundant):
        """EPLB moves experts between steps: a new physical -> logical map per MoE layer (a
        permutation of the logical experts and ``redundant`` replicas), or none (None). Steps in
        flight were captured under the map of their own step."""
        if not hasattr(self, "ledger"):
            return
        if redundant is None:
            self.eplb = None
            return
        event("EPLB map change")
        layers = []
        for _ in SHAPE.moe_layers:
            n = SHAPE.num_experts
            phys_map = np.concatenate([np.arange(n), self.rng.integers(0, n, size=redundant)])
            phys_map = phys_map[self.rng.permutation(phys_map.size)].astype(np.int32)
            first = np.full(n, -1, np.int64)
            second = np.full(n, -1, np.int64)
            for p, logical in enumerate(phys_map.tolist()):
                if first[logical] < 0:
                    first[logical] = p
                second[logical] = p  # the last replica (the first when there is one)
            layers.append((phys_map, first, second))
        self.eplb = layers

    @precondition(lambda self: self.tier)
    @rule(data=st.data())
    def tier_drop(self, data):
        """The lower tier drops a block: a later hit on its prefix recomputes it."""
        del self.tier[data.draw(st.sampled_from(sorted(self.tier)))]
        event("the lower tier drops a block")

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(self._ids("running")))
        self._settle(rid, data)
        req = self.reqs[rid]
        if req["sampled"]:
            event("preempt after the attempt sampled")
        elif not req["attempts"]:
            event("preempt during the first prefill, before the first sample")
        elif any(sampled for _, sampled in req["attempts"]):
            event("preempt during a re-prefill, after an earlier attempt sampled")
        else:
            event("preempt during a re-prefill, no attempt sampled yet")
        if len(req["attempts"]) >= 2:
            event("preempt a third or later attempt")
        self.ledger.preempt(rid)
        self._release(req)
        self._close_attempt(req)
        req["state"] = "preempted"

    @precondition(lambda self: self._ids("running", "preempted"))
    @rule(data=st.data(), aborted=st.booleans())
    def end(self, data, aborted):
        """Finish a running request whose attempt has sampled (a request finishes on a sampled
        token), or abort a running or preempted one."""
        finishable = [r for r in self._ids("running") if self.reqs[r]["sampled"]]
        rid = data.draw(
            st.sampled_from(self._ids("running", "preempted") if aborted else finishable or [None])
        )
        if rid is not None:
            if self.reqs[rid]["state"] == "running":
                self._settle(rid, data)
            self._end(rid, aborted)

    def _end(self, rid, aborted):
        req = self.reqs[rid]
        if not req["sampled"] and not any(sampled for _, sampled in req["attempts"]):
            event("abort a request that never sampled")
        if aborted:
            self.ledger.abort(rid)
        else:
            self.ledger.finish(rid)
        if req["state"] == "running":
            self._release(req)
            self._close_attempt(req)
        req["state"] = "aborted" if aborted else "finished"
        self.ended.add(rid)
        self._collect()

    @invariant()
    def bookkeeping_agrees(self):
        if hasattr(self, "ledger"):
            for b in range(self.NUM_BLOCKS):
                assert self.ledger.block_refs(b) == self.refs[b], f"block {b} refcount"
            assert self.capturer.pipeline.in_flight == len(self.in_flight)
            assert self.ledger.in_flight == sorted(seq for seq, _ in self.in_flight)

    def teardown(self):
        if not hasattr(self, "ledger"):
            return
        for rid in self._ids("running", "preempted"):  # every request ends: all rows are checked
            req = self.reqs[rid]
            self._end(rid, aborted=req["state"] == "preempted" or not req["sampled"])
        while self.in_flight:  # drain the pipeline, then every finished request must be returned
            seq, handle = self.in_flight.pop()
            self.ledger.land(seq, handle.result(copy=False))
            handle.release()
        self._collect()
        assert not self.ended, f"finished requests never returned: {sorted(self.ended)}"
        assert self.ledger.held_requests() == [] and self.ledger.pending_slots() == 0


EngineMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEngineCPU = EngineMachine.TestCase


class EngineMachineLatest(EngineMachine):
    POLICY = "latest"


EngineMachineLatest.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEngineLatestCPU = EngineMachineLatest.TestCase


class EngineMachineGPU(EngineMachine):
    DEVICE = "cuda"


EngineMachineGPU.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEngineGPU = pytest.mark.gpu(EngineMachineGPU.TestCase)
