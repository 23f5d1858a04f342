"""RoutingLedger under load: thousands of requests with dropped steps, and two threads at once.

``Engine`` is an independent model of a paged-KV serving engine (chunked prefill whose last chunk
samples, decode with draft tokens and rejection, preemption by recompute that keeps the sampled
tokens, when blocks run out or at random, aborts, immediate reuse of freed blocks) with its own
oracle: for every attempt of every request, which step computed each position and with which row,
and whether the attempt sampled. What a request must get back follows from that record and the
policy rule alone (never from the ledger's code): sampling keeps each position from the first
attempt that computed it and sampled (every attempt, for the requests added without
``prompt_len``), latest the most complete attempt; rows of dropped steps are the store's fill value
and marked missing.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import sys
import threading

import numpy as np
import pytest

from moe_ops import RoutingLedger, RoutingShape, SlotStore

SHAPE = RoutingShape(num_layers=2, num_experts=250, top_k=2)  # uint8 rows, fill 255
BLOCK_SIZE = 4
ROW = (SHAPE.num_layers, SHAPE.top_k)


class Engine:
    """A scheduler driving a ledger, and the oracle of what each request must get back.

    A request's ``tokens`` are its prompt and the tokens it sampled. A (re-)prefill computes known
    tokens in chunks; the chunk that computes the last one samples the next token. A decode computes
    the token sampled last plus drafts; the verify outcome takes back the rejected drafts and
    appends the token sampled after the accepted ones. Preemption keeps the tokens.

    Only :meth:`step` and the request-lifecycle helpers touch the engine's state (the scheduler
    thread); ``dropped`` is written by whoever gives steps up, before the ledger hears of it.
    ``events`` counts the cases the run went through.
    """

    def __init__(self, ledger: RoutingLedger, seed: int, num_blocks: int, max_running: int, budget: int):
        self.ledger = ledger
        self.rng = np.random.default_rng(seed)
        self.free = list(range(num_blocks))  # LIFO: a freed block is the next one handed out
        self.max_running = max_running
        self.budget = budget
        self.reqs: dict[int, dict] = {}
        self.running: list[int] = []
        self.preempted: list[int] = []
        self.step_rows: dict[int, np.ndarray] = {}  # seq -> the rows the step computed
        self.dropped: set[int] = set()
        self.ended: list[int] = []  # finished or aborted, in that order
        self.next_id = 0
        self.events: collections.Counter = collections.Counter()

    # -- lifecycle ---------------------------------------------------------------------------

    def _arrive(self) -> None:
        rid, rng = self.next_id, self.rng
        self.next_id += 1
        prompt = int(rng.integers(1, 24))
        start = int(rng.choice([0, 0, rng.integers(0, prompt + 4)]))
        tell_prompt = rng.random() < 0.9  # some callers do not pass prompt_len
        self.reqs[rid] = dict(
            prompt=prompt,
            tell_prompt=tell_prompt,
            max_new=int(rng.integers(1, 12)),
            tokens=prompt,
            computed=0,
            draft=0,
            sampled=False,  # the current attempt has sampled
            table=[],
            truth={},
            attempts=[],
            start=start,
            state="running",
        )
        self.ledger.add_request(rid, start=start, prompt_len=prompt if tell_prompt else None)
        self.running.append(rid)

    def _free_blocks(self, req: dict) -> None:
        self.free.extend(reversed(req["table"]))
        req["table"] = []

    def _close(self, req: dict) -> None:
        assert sorted(req["truth"]) == list(range(req["computed"]))
        req["attempts"].append((req["truth"], req["sampled"]))
        req["truth"], req["computed"], req["sampled"] = {}, 0, False

    def _ever_sampled(self, req: dict) -> bool:
        return req["sampled"] or any(sampled for _, sampled in req["attempts"])

    def _preempt(self, rid: int) -> None:
        req = self.reqs[rid]
        self._verify(rid)
        if req["sampled"]:
            self.events["preempt after the attempt sampled"] += 1
        elif not req["attempts"]:
            self.events["preempt during the first prefill"] += 1
        elif self._ever_sampled(req):
            self.events["preempt during a re-prefill after a sample"] += 1
        else:
            self.events["preempt during a re-prefill, never sampled"] += 1
        if len(req["attempts"]) >= 2:
            self.events["preempt a third or later attempt"] += 1
        self.ledger.preempt(rid)
        self._free_blocks(req)
        self._close(req)
        req["state"] = "preempted"
        self.running.remove(rid)
        self.preempted.append(rid)

    def _resume(self, rid: int) -> None:
        self.ledger.resume(rid)
        self.reqs[rid]["state"] = "running"
        self.preempted.remove(rid)
        self.running.append(rid)

    def _end(self, rid: int, aborted: bool) -> None:
        req = self.reqs[rid]
        if req["state"] == "running":
            self._verify(rid)
        if not self._ever_sampled(req):
            self.events["end a request that never sampled"] += 1
        (self.ledger.abort if aborted else self.ledger.finish)(rid)
        if req["state"] == "running":
            self._free_blocks(req)
            self._close(req)
            self.running.remove(rid)
        else:
            self.preempted.remove(rid)
        req["state"] = "aborted" if aborted else "finished"
        self.ended.append(rid)

    def _verify(self, rid: int) -> None:
        """The verify outcome: the last k of the request's drafts are rejected (k may be 0), and
        the token after the accepted ones is sampled."""
        req = self.reqs[rid]
        if not req["draft"]:
            return
        k = int(self.rng.integers(0, req["draft"] + 1))
        self.events["reject"] += k > 0
        self.ledger.reject(rid, k)
        for p in range(req["computed"] - k, req["computed"]):
            del req["truth"][p]
        req["computed"] -= k
        req["tokens"] += 1 - k
        req["draft"] = 0

    # -- one scheduler iteration -------------------------------------------------------------

    def step(self) -> tuple[int, np.ndarray] | None:
        """Lifecycle events, then one scheduled step: (seq, rows), or None when nothing ran."""
        rng = self.rng
        while len(self.running) < self.max_running and (self.preempted or rng.random() < 0.7):
            if self.preempted and rng.random() < 0.5:
                self._resume(self.preempted[0])
            else:
                self._arrive()
        for rid in list(self.running):
            req = self.reqs[rid]
            if rng.random() < 0.5:
                self._verify(rid)
            if req["tokens"] >= req["prompt"] + req["max_new"] and req["sampled"] and not req["draft"]:
                self._end(rid, aborted=False)
            elif rng.random() < 0.02:
                self._end(rid, aborted=True)
            elif rng.random() < 0.02:
                self._preempt(rid)
        for rid in list(self.preempted):
            if rng.random() < 0.01:
                self._end(rid, aborted=True)
        entries, parts, budget = [], [], self.budget
        for rid in list(self.running):
            req = self.reqs[rid]
            # drafts in flight: verified before scheduling again; a victim preempted for space: skip
            if budget == 0 or req["draft"] or req["state"] != "running":
                continue
            if req["sampled"]:  # decode: the token sampled last, then drafts
                assert req["computed"] == req["tokens"] - 1
                draft = int(rng.integers(0, min(3, budget - 1) + 1))
                n = 1 + draft
            else:  # (re-)prefill of known tokens; the chunk that computes the last one samples
                draft, n = 0, int(rng.integers(1, min(req["tokens"] - req["computed"], budget) + 1))
            need = -(-(req["computed"] + n) // BLOCK_SIZE) - len(req["table"])
            while need > len(self.free):  # out of KV blocks: preempt the newest other request
                victims = [r for r in self.running if r != rid and r not in dict(entries)]
                if not victims:
                    break
                self._preempt(victims[-1])
            if need > len(self.free):
                continue
            fresh = [self.free.pop() for _ in range(need)]
            req["table"] += fresh
            self.ledger.append_blocks(rid, fresh)
            if req["sampled"]:  # the drafts; without any, the sampled token comes with the step
                req["tokens"] += draft or 1
            elif req["computed"] + n == req["tokens"]:
                req["tokens"] += 1
                req["sampled"] = True
            req["draft"] = draft
            entries.append((rid, n))
            parts.append(n)
            budget -= n
        if not entries:
            return None
        step = self.ledger.schedule(entries)
        rows = rng.integers(0, SHAPE.num_experts, size=(sum(parts), *ROW), dtype=np.uint8)
        self.step_rows[step.seq] = rows
        row = 0
        for rid, n in entries:
            req = self.reqs[rid]
            for _ in range(n):
                req["truth"][req["computed"]] = (step.seq, row)
                req["computed"] += 1
                row += 1
        return step.seq, rows

    def end_all(self) -> None:
        for rid in list(self.running):
            self._end(rid, aborted=not self.reqs[rid]["sampled"])
        for rid in list(self.preempted):
            self._end(rid, aborted=True)

    # -- oracle ------------------------------------------------------------------------------

    def expected(self, rid: int, policy: str) -> tuple[np.ndarray, np.ndarray]:
        """(rows, missing) of tokens [start, n) of the request, by the policy's rule."""
        req = self.reqs[rid]
        merged: dict[int, tuple[int, int]] = {}
        for truth, sampled in req["attempts"]:
            if policy == "sampling":
                if sampled or not req["tell_prompt"]:
                    for p, entry in truth.items():
                        merged.setdefault(p, entry)
            elif len(truth) >= len(merged):
                merged = truth
        positions = range(req["start"], len(merged))
        rows = np.full((len(positions), *ROW), 255, np.uint8)
        missing = np.ones(len(positions), dtype=bool)
        for i, p in enumerate(positions):
            seq, row = merged[p]
            if seq not in self.dropped:
                rows[i], missing[i] = self.step_rows[seq][row], False
        return rows, missing

    def check(self, delivered: list, policy: str) -> None:
        """Every ended request delivered exactly once, with its rows and missing flags."""
        ids = [d.req_id for d in delivered]
        assert len(ids) == len(set(ids)), "a request was delivered twice"
        assert sorted(ids) == sorted(self.ended), "requests lost or delivered without ending"
        wrong = []
        for done in delivered:
            rows, missing = self.expected(done.req_id, policy)
            assert done.aborted == (self.reqs[done.req_id]["state"] == "aborted")
            if done.routing.shape != rows.shape or not (
                np.array_equal(done.routing, rows) and np.array_equal(done.missing, missing)
            ):
                wrong.append(done.req_id)
        assert not wrong, f"{len(wrong)} of {len(delivered)} requests have wrong rows: {wrong[:10]}"


# every case of the sampling rule a run must go through (Engine.events)
CASES = (
    "preempt during the first prefill",
    "preempt during a re-prefill, never sampled",
    "preempt during a re-prefill after a sample",
    "preempt after the attempt sampled",
    "preempt a third or later attempt",
    "end a request that never sampled",
    "reject",
)


def _assert_exercised(engine: Engine) -> None:
    missed = [case for case in CASES if not engine.events[case]]
    assert not missed, f"the run never went through: {missed} ({dict(engine.events)})"


def _assert_drained(ledger: RoutingLedger, num_blocks: int) -> None:
    assert ledger.held_requests() == [] and ledger.in_flight == [] and ledger.pending_slots() == 0
    assert all(ledger.block_refs(b) == 0 for b in range(num_blocks))


# --------------------------------------------------------------------------------- dropped steps


def test_a_lost_step_holds_only_its_own_request():
    """The lost-step stall: a step whose rows never come held every later request (1,000 finished
    requests, collect() returned []). Now only its own request waits, until the step is dropped."""
    ledger = RoutingLedger(SlotStore(64 * BLOCK_SIZE, SHAPE), BLOCK_SIZE)
    rows = np.random.default_rng(0).integers(0, 250, size=(1001, *ROW), dtype=np.uint8)
    ledger.add_request("lost")
    ledger.append_blocks("lost", [0])
    lost = ledger.schedule([("lost", 3)])
    ledger.finish("lost")
    delivered = {}
    for i in range(1000):
        ledger.add_request(i)
        ledger.append_blocks(i, [1 + i % 63])
        ledger.land(ledger.schedule([(i, 1)]).seq, rows[i : i + 1])
        ledger.finish(i)
        delivered.update((d.req_id, d) for d in ledger.collect())
    assert sorted(delivered) == list(range(1000)) and ledger.held_requests() == ["lost"]
    assert all(np.array_equal(delivered[i].routing, rows[i : i + 1]) for i in range(1000))
    ledger.drop(lost.seq)
    (done,) = ledger.collect()
    assert done.req_id == "lost" and done.missing.tolist() == [True] * 3
    assert (done.routing == ledger.store.fill).all()
    _assert_drained(ledger, 64)


@pytest.mark.parametrize("policy, seed", [("sampling", 0), ("latest", 1)])
def test_thousands_of_requests_with_dropped_steps(policy, seed):
    """Steps land out of order (up to 6 in flight) and 5% are dropped; after draining, every
    request came back once with its rows, and the ledger holds nothing."""
    num_blocks = 48
    ledger = RoutingLedger(SlotStore(num_blocks * BLOCK_SIZE, SHAPE), BLOCK_SIZE, policy)
    engine = Engine(ledger, seed, num_blocks, max_running=12, budget=24)
    rng = np.random.default_rng(seed + 100)
    in_flight, delivered = [], []
    while engine.next_id < 3000:
        out = engine.step()
        if out is not None:
            in_flight.append(out)
        while in_flight and (len(in_flight) > 6 or rng.random() < 0.4):
            seq, rows = in_flight.pop(int(rng.integers(0, len(in_flight))))
            if rng.random() < 0.05:
                engine.dropped.add(seq)
                ledger.drop(seq)
            else:
                ledger.land(seq, rows)
        delivered += ledger.collect()
    engine.end_all()
    for seq, rows in in_flight:
        ledger.land(seq, rows)
    delivered += ledger.collect()
    assert engine.dropped and any(d.missing.any() for d in delivered), "the run dropped nothing"
    _assert_exercised(engine)
    engine.check(delivered, policy)
    _assert_drained(ledger, num_blocks)


# ------------------------------------------------------------------------------------ two threads


@pytest.fixture
def fast_thread_switches():
    """Switch threads every few microseconds (CPython's default is 5 ms): races show up in a short
    run instead of hiding between long time slices."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


@pytest.mark.usefixtures("fast_thread_switches")
def test_scheduler_and_output_threads_against_the_oracle():
    """A scheduler thread (add, append, schedule, reject, preempt, resume, finish, abort, collect)
    and an output thread (land out of order, drop 5%, collect) share one ledger: 0 wrong rows,
    0 errors, nothing held after draining."""
    num_blocks = 48
    ledger = RoutingLedger(SlotStore(num_blocks * BLOCK_SIZE, SHAPE), BLOCK_SIZE)
    engine = Engine(ledger, seed=7, num_blocks=num_blocks, max_running=12, budget=24)
    steps: queue.Queue = queue.Queue(maxsize=8)
    delivered, errors = [], []
    done_scheduling = threading.Event()

    def scheduler():
        try:
            while engine.next_id < 2500:
                out = engine.step()
                if out is not None:
                    steps.put(out)
                delivered.extend(ledger.collect())
            engine.end_all()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            done_scheduling.set()

    def output():
        rng = np.random.default_rng(8)
        held = []
        try:
            while not (done_scheduling.is_set() and steps.empty() and not held):
                with contextlib.suppress(queue.Empty):
                    held.append(steps.get(timeout=0.001))
                while held and (len(held) > 3 or rng.random() < 0.5 or done_scheduling.is_set()):
                    seq, rows = held.pop(int(rng.integers(0, len(held))))
                    if rng.random() < 0.05:
                        engine.dropped.add(seq)  # recorded before the ledger can deliver it
                        ledger.drop(seq)
                    else:
                        ledger.land(seq, rows)
                if rng.random() < 0.2:
                    delivered.extend(ledger.collect())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=scheduler), threading.Thread(target=output)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, f"{len(errors)} errors, first: {errors[0]!r}"
    delivered.extend(ledger.collect())
    assert engine.dropped
    _assert_exercised(engine)
    engine.check(delivered, "sampling")
    _assert_drained(ledger, num_blocks)


# ------------------------------------------------------------------------------------------ the soak


def test_the_soak_at_ci_size():
    """``tests/store/soak_ledger.py`` (the 10**7-event fault-injection soak, docs/performance.md) at
    a budget CI affords: every delivered request checked against the oracle, none wrong."""
    from soak_ledger import events, soak

    counts = soak(20_000, seed=7)
    assert events(counts) >= 20_000 and counts["silent-wrong requests"] == 0
    assert counts["drops"] and counts["reject"] and counts["preempt after the attempt sampled"]
    assert counts["delivered requests"] == counts["arrivals"]
