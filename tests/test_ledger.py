"""Request lifecycle: pre-free capture, preemption/resume, abort, block reuse, prefix hits, in flight.

The state machine simulates an engine scheduler (paged KV allocator with a prefix cache and LRU-less
eviction, chunked prefill, decode, preemption by recompute, abort, finish) and drives the REAL data
path for every step: ``RoutingCapturer.set_step`` / ``capture`` (the capture op, LOCAL layout with
padding rows) / ``snapshot`` through the transfer ring (1..4 steps in flight, landing in any order)
into ``RoutingLedger`` and ``SlotStore``. Its invariant: every finished request's routing equals
what its tokens were routed to, row for row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from strategies import routing_rows

from moe_ops import RoutingCapturer, RoutingLedger, RoutingShape, SlotStore
from moe_ops.store import slots_for

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


def test_preempt_and_resume_return_the_most_complete_copy_in_order():
    store = SlotStore(8 * 2, SHAPE)
    ledger = RoutingLedger(store, block_size=2)
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
    ],
)
def test_engine_mistakes_raise(call, exc, match):
    ledger = RoutingLedger(SlotStore(16, SHAPE), block_size=2)
    ledger.add_request("a")
    ledger.append_blocks("a", [0, 1])
    ledger.schedule([("a", 2)])
    with pytest.raises(exc, match=match):
        call(ledger)


# ----------------------------------------------------------------------------------- state machine


class EngineMachine(RuleBasedStateMachine):
    """A small paged-KV engine with async scheduling, driving the real capture -> store path."""

    DEVICE = "cpu"
    BLOCK_SIZE = 2
    NUM_BLOCKS = 6  # few blocks: freed blocks are reallocated (and cached ones evicted) soon
    MAX_STEP_TOKENS = 8
    VOCAB = 3  # few token values: prompts share prefixes, so the prefix cache hits

    @initialize(depth=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
    def setup(self, depth, seed):
        self.depth = depth
        self.rng = np.random.default_rng(seed)
        self.capturer = RoutingCapturer(SHAPE, self.MAX_STEP_TOKENS + 3, self.DEVICE, ring_depth=depth)
        self.store = SlotStore(self.NUM_BLOCKS * self.BLOCK_SIZE, SHAPE)
        self.ledger = RoutingLedger(self.store, self.BLOCK_SIZE)
        # engine side
        self.refs = [0] * self.NUM_BLOCKS  # running requests holding each block
        self.block_key = [None] * self.NUM_BLOCKS  # prefix key of a cached full block
        self.cached: dict[tuple, int] = {}  # prefix key -> block
        self.world = {}  # slot -> row of the last forward that wrote it (synchronous truth)
        self.reqs: dict[int, dict] = {}  # request id -> engine state and truth per attempt
        self.in_flight: list[tuple[int, object]] = []  # (ledger seq, snapshot handle)
        self.expected_done: dict[int, tuple[np.ndarray, bool]] = {}

    # -- engine helpers ------------------------------------------------------------------------

    def _ids(self, *states):
        return sorted(i for i, r in self.reqs.items() if r["state"] in states)

    def _release(self, req):
        for b in req["table"]:
            self.refs[b] -= 1
        req["table"] = []

    def _close_attempt(self, req):
        """Records the attempt's rows: (length, truth rows of tokens [0, length))."""
        truth = req["truth"]
        rows = np.stack([truth[p] for p in range(req["computed"])]) if req["computed"] else None
        req["attempts"].append((req["computed"], rows))
        req["computed"] = 0
        req["truth"] = {}

    def _expected(self, req):
        best_len, best_rows = -1, None
        for length, rows in req["attempts"]:  # the most rows; the later attempt on a tie
            if length >= best_len:
                best_len, best_rows = length, rows
        if best_rows is None:
            return np.empty((0, SHAPE.num_layers, SHAPE.top_k), SHAPE.id_dtype)
        return best_rows

    def _start(self, rid):
        """Schedules a request (new, or preempted: resume) on the longest cached prefix."""
        req = self.reqs[rid]
        tokens, bs = req["tokens"], self.BLOCK_SIZE
        hit = []
        while (len(hit) + 1) * bs <= len(tokens) - 1:  # at least one token is always computed
            block = self.cached.get(tuple(tokens[: (len(hit) + 1) * bs]))
            if block is None:
                break
            hit.append(block)
        for b in hit:
            self.refs[b] += 1
        req["table"] = list(hit)
        req["computed"] = len(hit) * bs
        for p in range(req["computed"]):  # prefix-hit rows: what the computing forward routed
            req["truth"][p] = self.world[hit[p // bs] * bs + p % bs]
        if req["attempts"] or req["state"] == "preempted":
            self.ledger.resume(rid, hit, len(hit) * bs)
        else:
            self.ledger.add_request(rid, hit, len(hit) * bs)
        req["state"] = "running"

    def _collect(self):
        for done in self.ledger.collect():
            expected, aborted = self.expected_done.pop(done.req_id)
            assert done.aborted == aborted
            assert done.routing.shape == expected.shape, (
                f"request {done.req_id}: {done.routing.shape[0]} rows, expected {expected.shape[0]}"
            )
            bad = np.flatnonzero((done.routing != expected).any(axis=(1, 2)))
            assert bad.size == 0, f"request {done.req_id}: rows {bad.tolist()} differ from its routing"
            self.reqs[done.req_id]["state"] = "collected"

    # -- rules ---------------------------------------------------------------------------------

    @rule(prefix=st.integers(0, 1), length=st.integers(1, 8))
    def arrive(self, prefix, length):
        """A new request arrives and is scheduled at once (prefix hit included)."""
        common = [[0, 1, 2, 0, 1, 2], [2, 2, 1, 1, 0, 0]][prefix]
        tokens = common[: max(length, 3)] + self.rng.integers(0, self.VOCAB, size=length).tolist()
        rid = len(self.reqs)
        self.reqs[rid] = dict(tokens=tokens, state="waiting", table=[], computed=0, truth={}, attempts=[])
        self._start(rid)

    @precondition(lambda self: self._ids("preempted"))
    @rule(data=st.data())
    def resume(self, data):
        self._start(data.draw(st.sampled_from(self._ids("preempted"))))

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data())
    def step(self, data):
        """Schedules a step of some running requests and runs it through the capture path."""
        if len(self.in_flight) >= self.depth:
            self.land(data)  # the ring is full: the engine consumes a step first
        running = self._ids("running")
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=len(running), unique=True))
        bs, budget, entries, rows = self.BLOCK_SIZE, self.MAX_STEP_TOKENS, [], []
        for rid in chosen:
            req = self.reqs[rid]
            if budget == 0:
                break
            if req["computed"] == len(req["tokens"]):  # decode: the sampled token joins the sequence
                req["tokens"].append(int(self.rng.integers(0, self.VOCAB)))
            n = data.draw(st.integers(1, min(len(req["tokens"]) - req["computed"], budget)))
            need = -(-(req["computed"] + n) // bs) - len(req["table"])
            free = [b for b in range(self.NUM_BLOCKS) if self.refs[b] == 0]
            if need > len(free):
                continue  # no KV space for this request this step
            fresh = data.draw(st.permutations(free))[:need]  # any free block, cached ones evicted
            for b in fresh:
                if self.block_key[b] is not None:
                    del self.cached[self.block_key[b]]
                    self.block_key[b] = None
                self.refs[b] = 1
            req["table"] += fresh
            self.ledger.append_blocks(rid, fresh)
            step_rows = routing_rows(self.rng, n, SHAPE)
            for i in range(n):
                p = req["computed"] + i
                req["truth"][p] = step_rows[i]
                self.world[req["table"][p // bs] * bs + p % bs] = step_rows[i]
            req["computed"] += n
            for j, b in enumerate(req["table"]):  # full blocks join the prefix cache when scheduled
                key = tuple(req["tokens"][: (j + 1) * bs])
                if (j + 1) * bs <= req["computed"] and self.block_key[b] is None and key not in self.cached:
                    self.cached[key] = b
                    self.block_key[b] = key
            entries.append((rid, n))
            rows.append(step_rows)
            budget -= n
        if not entries:
            return
        step = self.ledger.schedule(entries)
        expected_slots = np.concatenate(
            [slots_for(self.reqs[r]["table"], bs, self.reqs[r]["computed"] - n, n) for r, n in entries]
        )
        assert np.array_equal(step.slot_mapping, expected_slots)
        # the forward: every MoE layer's topk_ids, LOCAL layout with CUDA-graph-style padding rows
        batch = np.concatenate(rows)
        n_total, pad = batch.shape[0], data.draw(st.integers(0, 3))
        self.capturer.set_step([n_total])
        for i, layer in enumerate(SHAPE.moe_layers):
            ids = np.full((n_total + pad, SHAPE.top_k), PAD_ID, dtype=np.int64)
            ids[:n_total] = batch[:, i]
            self.capturer.capture(layer, torch.from_numpy(ids).to(self.DEVICE))
        self.in_flight.append((step.seq, self.capturer.snapshot()))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def land(self, data):
        """The oldest or any later step's rows reach the host (any order), then finished requests
        are collected and checked."""
        idx = data.draw(st.integers(0, len(self.in_flight) - 1))
        seq, handle = self.in_flight.pop(idx)
        self.ledger.land(seq, handle.result(copy=False))
        handle.release()
        self._collect()

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(self._ids("running")))
        req = self.reqs[rid]
        self.ledger.preempt(rid)
        self._release(req)
        self._close_attempt(req)
        req["state"] = "preempted"

    @precondition(lambda self: self._ids("running", "preempted"))
    @rule(data=st.data(), aborted=st.booleans())
    def end(self, data, aborted):
        """Finish a running request, or abort a running or preempted one."""
        rid = data.draw(
            st.sampled_from(self._ids("running", "preempted") if aborted else self._ids("running") or [None])
        )
        if rid is not None:
            self._end(rid, aborted)

    def _end(self, rid, aborted):
        req = self.reqs[rid]
        if aborted:
            self.ledger.abort(rid)
        else:
            self.ledger.finish(rid)
        if req["state"] == "running":
            self._release(req)
            self._close_attempt(req)
        req["state"] = "aborted" if aborted else "finished"
        self.expected_done[rid] = (self._expected(req), aborted)
        self._collect()

    @invariant()
    def bookkeeping_agrees(self):
        if hasattr(self, "ledger"):
            for b in range(self.NUM_BLOCKS):
                assert self.ledger.block_refs(b) == self.refs[b], f"block {b} refcount"
            assert self.capturer.pipeline.in_flight == len(self.in_flight)

    def teardown(self):
        if not hasattr(self, "ledger"):
            return
        for rid in self._ids("running", "preempted"):  # every request ends: all rows are checked
            self._end(rid, aborted=self.reqs[rid]["state"] == "preempted")
        while self.in_flight:  # drain the pipeline, then every finished request must be returned
            seq, handle = self.in_flight.pop()
            self.ledger.land(seq, handle.result(copy=False))
            handle.release()
        self._collect()
        assert not self.expected_done, f"finished requests never returned: {sorted(self.expected_done)}"


EngineMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEngineCPU = EngineMachine.TestCase


class EngineMachineGPU(EngineMachine):
    DEVICE = "cuda"


EngineMachineGPU.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEngineGPU = pytest.mark.gpu(EngineMachineGPU.TestCase)
