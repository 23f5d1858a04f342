"""A long fault-injection soak of the RoutingLedger against the independent engine model of
``test_ledger_stress.py``: rounds of thousands of requests whose steps land out of order, 5% of them
dropped, with chunked prefill, drafts and rejection, preemption and resume, aborts; every delivered
request is compared with the oracle row for row (a wrong row or missing flag fails the run: 0
silent-wrong rows is the only passing result).

    python tests/store/soak_ledger.py --events 10000000 [--seed 0] [--policy sampling]

Events counted (``EVENT_KINDS``): arrivals, scheduled steps, landed and dropped steps, preemptions,
verifies that rejected drafts, and request ends (finish or abort).
``tests/store/test_ledger_stress.py::test_the_soak_at_ci_size`` runs it at a small budget. The
hypothesis state machine (``test_ledger.py::EngineMachine``) covers what this
model does not: the capture path, the prefix cache, prefill/decode handoff and KV offload tiers.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_ledger_stress import BLOCK_SIZE, SHAPE, Engine

from moe_ops import RoutingLedger, SlotStore

REQUESTS_PER_ROUND = 2000
NUM_BLOCKS = 48


def _round(seed: int, policy: str, counts: collections.Counter) -> None:
    """One round: a fresh ledger and engine, REQUESTS_PER_ROUND requests, drained and checked."""
    ledger = RoutingLedger(SlotStore(NUM_BLOCKS * BLOCK_SIZE, SHAPE), BLOCK_SIZE, policy)
    engine = Engine(ledger, seed, NUM_BLOCKS, max_running=12, budget=24)
    rng = np.random.default_rng(seed + 10**9)
    in_flight = []

    def check(delivered) -> None:
        for done in delivered:
            rows, missing = engine.expected(done.req_id, policy)
            ok = done.routing.shape == rows.shape and np.array_equal(done.routing, rows)
            ok = ok and np.array_equal(done.missing, missing)
            ok = ok and done.aborted == (engine.reqs[done.req_id]["state"] == "aborted")
            counts["delivered requests"] += 1
            counts["delivered rows"] += int(rows.shape[0])
            if not ok:
                counts["silent-wrong requests"] += 1
                raise AssertionError(f"seed {seed}: request {done.req_id} came back wrong")

    while engine.next_id < REQUESTS_PER_ROUND:
        out = engine.step()
        if out is not None:
            in_flight.append(out)
            counts["steps"] += 1
        while in_flight and (len(in_flight) > 6 or rng.random() < 0.4):
            seq, rows = in_flight.pop(int(rng.integers(0, len(in_flight))))
            if rng.random() < 0.05:
                engine.dropped.add(seq)
                ledger.drop(seq)
                counts["drops"] += 1
            else:
                ledger.land(seq, rows)
                counts["lands"] += 1
        check(ledger.collect())
    engine.end_all()
    for seq, rows in in_flight:
        ledger.land(seq, rows)
        counts["lands"] += 1
    check(ledger.collect())
    assert ledger.held_requests() == [] and ledger.pending_slots() == 0, f"seed {seed}: not drained"
    counts["arrivals"] += engine.next_id
    for name, n in engine.events.items():
        counts[name] += n


# what counts as one injected event: an arrival, a scheduled step, a landed or dropped step, a
# preemption (its four kinds; "a third or later attempt" and "never sampled" are tags of events
# counted already), a verify that rejected drafts, and a request's end (each delivered request)
EVENT_KINDS = (
    "arrivals",
    "steps",
    "lands",
    "drops",
    "preempt after the attempt sampled",
    "preempt during the first prefill",
    "preempt during a re-prefill after a sample",
    "preempt during a re-prefill, never sampled",
    "reject",
    "delivered requests",
)


def events(counts: collections.Counter) -> int:
    """Injected events (EVENT_KINDS)."""
    return sum(counts[k] for k in EVENT_KINDS)


def soak(target_events: int, seed: int = 0, policy: str = "sampling", progress=None) -> collections.Counter:
    """Runs rounds until ``target_events`` events were injected; returns the counts. AssertionError
    at the first request that comes back wrong."""
    counts: collections.Counter = collections.Counter()
    rounds = 0
    while events(counts) < target_events:
        _round(seed + rounds, policy, counts)
        rounds += 1
        if progress is not None:
            progress(rounds, counts)
    counts["rounds"] = rounds
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", choices=("sampling", "latest"), default="sampling")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()

    def progress(rounds, counts):
        if rounds % 10 == 0:
            print(
                f"  {rounds} rounds, {events(counts):,} events, {time.perf_counter() - t0:.0f} s", flush=True
            )

    counts = soak(args.events, args.seed, args.policy, progress)
    seconds = time.perf_counter() - t0
    print(
        f"soak: {events(counts):,} injected events in {seconds:.0f} s ({events(counts) / seconds:,.0f}/s), "
        f"{counts['rounds']} rounds, {counts['delivered requests']:,} requests and "
        f"{counts['delivered rows']:,} rows delivered and checked, "
        f"{counts['silent-wrong requests']} silent-wrong"
    )
    print("  " + ", ".join(f"{k}: {v:,}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
