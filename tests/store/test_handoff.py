"""Prefill/decode handoff: a request served by two ledgers (prefill rows exported with its KV,
imported by the decode instance) returns what one ledger serving it alone returns, row for row;
partial KV gives the decode forward's rows where it recomputed; bad records change nothing."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threads import run_threads

from moe_ops import RoutingLedger, RoutingShape, SlotStore
from moe_ops.channels import IDS, Channel
from moe_ops.store.handoff import decode_handoff, encode_handoff

SHAPE = RoutingShape(num_layers=3, num_experts=64, top_k=2)
WEIGHTS = Channel("weights", np.float16)


def _rows(seed: int, n: int, channels: bool) -> dict | np.ndarray:
    """Rows of one forward of n tokens: distinct per seed (the forward that computed them)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, SHAPE.num_experts, size=(n, SHAPE.num_layers, SHAPE.top_k)).astype(np.uint8)
    if not channels:
        return ids
    return {IDS: ids, "weights": rng.random((n, SHAPE.num_layers, SHAPE.top_k)).astype(np.float16)}


def _ledger(channels: bool, block_size: int = 4, num_blocks: int = 32) -> RoutingLedger:
    extra = [WEIGHTS] if channels else []
    return RoutingLedger(SlotStore(num_blocks * block_size, SHAPE, extra_channels=extra), block_size)


def _take(rows, lo: int, hi: int):
    return {k: v[lo:hi] for k, v in rows.items()} if isinstance(rows, dict) else rows[lo:hi]


def _serve(ledger, req, blocks, prompt, decode_rows, *, first=0, chunks=None, dropped=()):
    """Schedules and lands (or drops) the prompt in ``chunks`` from position ``first``, then one
    decode token per row of ``decode_rows``."""
    pos = first
    for i, size in enumerate(chunks or [prompt - first]):
        step = ledger.schedule([(req, size)])
        if i in dropped:
            ledger.drop(step.seq)
        else:
            ledger.land(step.seq, _take(decode_rows["prompt"], pos, pos + size))
        pos += size
    for t in range(decode_rows["n"]):
        step = ledger.schedule([(req, 1)])
        ledger.land(step.seq, _take(decode_rows["decode"], t, t + 1))
    return pos


def _collect_one(ledger):
    (done,) = ledger.collect()
    return done


def _equal(a, b) -> bool:
    return (
        np.array_equal(a.routing, b.routing)
        and np.array_equal(a.missing, b.missing)
        and a.start == b.start
        and a.channels.keys() == b.channels.keys()
        and all(np.array_equal(a.channels[k], b.channels[k], equal_nan=True) for k in a.channels)
    )


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(1, 23),
    new=st.integers(0, 9),
    block_size=st.sampled_from([1, 2, 4, 16]),
    channels=st.booleans(),
    start=st.integers(0, 5),
    chunks=st.integers(1, 3),
    drop_first=st.booleans(),
    req_id=st.sampled_from(["req-7", 7]),
)
def test_a_handed_off_request_returns_what_one_instance_returns(
    prompt, new, block_size, channels, start, chunks, drop_first, req_id
):
    """Prefill (chunked, a chunk possibly dropped) on one ledger, export, import on another ledger's
    blocks, decode there: the collected routing equals one ledger serving the same forwards."""
    sizes = [len(c) for c in np.array_split(np.arange(prompt), min(chunks, prompt))]
    dropped = (0,) if drop_first else ()
    forwards = {"prompt": _rows(1, prompt, channels), "decode": _rows(2, new, channels), "n": new}
    need = -(-(prompt + new) // block_size)
    start = min(start, prompt)

    alone = _ledger(channels, block_size, 64)
    alone.add_request(req_id, start=start, prompt_len=prompt)
    alone.append_blocks(req_id, list(range(need)))
    _serve(alone, req_id, None, prompt, forwards, chunks=sizes, dropped=dropped)
    alone.finish(req_id)
    want = _collect_one(alone)

    prefill = _ledger(channels, block_size, 64)
    prefill.add_request(req_id, prompt_len=prompt)
    prefill.append_blocks(req_id, [5 + b for b in range(-(-prompt // block_size))])
    _serve(prefill, req_id, None, prompt, {**forwards, "n": 0}, chunks=sizes, dropped=dropped)
    record = prefill.export_handoff(req_id)
    prefill.finish(req_id)
    prefill.collect()

    decode = _ledger(channels, block_size, 64)
    kv_blocks = [40 + b for b in range(-(-prompt // block_size))]  # other blocks than prefill's
    decode.import_handoff(req_id, record, kv_blocks, start=start)
    extra = need - len(kv_blocks)
    if extra:
        decode.append_blocks(req_id, [10 + b for b in range(extra)])
    for t in range(new):
        step = decode.schedule([(req_id, 1)])
        decode.land(step.seq, _take(forwards["decode"], t, t + 1))
    decode.finish(req_id)
    assert _equal(_collect_one(decode), want)


def test_partial_kv_returns_the_decode_forwards_rows_where_it_recomputed():
    """KV of positions [0, 6) arrived of the record's 10: the decode instance recomputes [6, 10)
    (another forward: other rows) and those are the rows returned; [0, 6) are the prefill's."""
    prompt, kv = 10, 6
    prefill = _ledger(True)
    prefill.add_request("r", prompt_len=prompt)
    prefill.append_blocks("r", [0, 1, 2])
    pre = _rows(11, prompt, True)
    prefill.land(prefill.schedule([("r", prompt)]).seq, pre)
    record = prefill.export_handoff("r")

    decode = _ledger(True)
    decode.import_handoff("r", record, [7, 3], num_tokens=kv)  # two blocks of 4: 8 slots >= 6
    decode.append_blocks("r", [9])
    again = _rows(12, prompt - kv, True)
    decode.land(decode.schedule([("r", prompt - kv)]).seq, again)
    last = _rows(13, 1, True)
    decode.land(decode.schedule([("r", 1)]).seq, last)
    decode.finish("r")
    done = _collect_one(decode)
    for name in (IDS, "weights"):
        assert np.array_equal(done.channels.get(name, done.routing)[:kv], pre[name][:kv])
        assert np.array_equal(done.channels.get(name, done.routing)[kv:prompt], again[name])
        assert np.array_equal(done.channels.get(name, done.routing)[prompt:], last[name])
    assert not done.missing.any()


def test_the_record_round_trips_and_carries_the_request():
    prefill = _ledger(True)
    prefill.add_request("r", prompt_len=5)
    prefill.append_blocks("r", [3, 4])
    rows = _rows(3, 5, True)
    prefill.land(prefill.schedule([("r", 5)]).seq, rows)
    data = prefill.export_handoff("r")
    rec = decode_handoff(data)
    assert rec.req_id == "r" and rec.prompt_len == 5 and rec.sampled and rec.num_tokens == 5
    assert np.array_equal(rec.rows[IDS], rows[IDS]) and np.array_equal(rec.rows["weights"], rows["weights"])
    assert encode_handoff(rec) == data  # the same record, the same bytes
    assert decode_handoff(prefill.export_handoff("r", num_tokens=2)).num_tokens == 2
    assert decode_handoff(prefill.export_handoff("r")).handoff_id != rec.handoff_id


def _state(ledger):
    return (
        ledger.held_requests,
        [ledger.block_refs(b) for b in range(ledger.num_blocks)],
        ledger.pending_slots,
        {k: v.copy() for k, v in ledger.store.arrays.items()},
    )


def _same(a, b) -> bool:
    return a[:3] == b[:3] and all(np.array_equal(a[3][k], b[3][k], equal_nan=True) for k in a[3])


def test_bad_records_are_refused_by_name_and_nothing_lands():
    prefill = _ledger(True)
    prefill.add_request("r", prompt_len=6)
    prefill.append_blocks("r", [0, 1])
    prefill.land(prefill.schedule([("r", 6)]).seq, _rows(4, 6, True))
    data = prefill.export_handoff("r")

    decode = _ledger(True)
    decode.add_request("busy")
    decode.append_blocks("busy", [5])
    before = _state(decode)
    cases = [
        (data[:-1], "truncated|CRC"),
        (data[:20], "truncated"),
        (b"MOEX" + data[4:], "not a handoff record"),
        (bytes([data[0] ^ 1]) + data[1:], "not a handoff record"),
        (data[:30] + bytes([data[30] ^ 0x10]) + data[31:], "CRC-32"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            decode.import_handoff("r", bad, [2, 3])
        assert _same(_state(decode), before)
    for cut in range(len(data)):  # every truncation
        with pytest.raises(ValueError):
            decode.import_handoff("r", data[:cut], [2, 3])
    with pytest.raises(ValueError, match="is for request 'r', not 'q'"):
        decode.import_handoff("q", data, [2, 3])
    other = RoutingLedger(SlotStore(128, RoutingShape(num_layers=3, num_experts=64, top_k=4)), 4)
    with pytest.raises(ValueError, match="another model shape"):
        other.import_handoff("r", data, [2, 3])
    ids_only = _ledger(False)
    with pytest.raises(ValueError, match="another model shape"):
        ids_only.import_handoff("r", data, [2, 3])
    more_experts = RoutingLedger(
        SlotStore(128, RoutingShape(num_layers=3, num_experts=128, top_k=2), extra_channels=[WEIGHTS]), 4
    )
    with pytest.raises(ValueError, match="another model shape"):
        more_experts.import_handoff("r", data, [2, 3])
    with pytest.raises(ValueError, match="held by running requests"):
        decode.import_handoff("r", data, [5, 3])
    with pytest.raises(ValueError, match="needs 2 blocks"):
        decode.import_handoff("r", data, [2])
    with pytest.raises(ValueError, match="holds 6 rows"):
        decode.import_handoff("r", data, [2, 3], num_tokens=7)
    assert _same(_state(decode), before)
    decode.import_handoff("r", data, [2, 3])
    decode.finish("r")
    decode.collect()
    with pytest.raises(ValueError, match="imported already"):  # replayed after its request left
        decode.import_handoff("r", data, [2, 3])


def test_crafted_records_with_a_valid_crc_raise_value_error():
    """A byte changed and the CRC recomputed: ValueError or a record that checks out (never another
    exception)."""
    prefill = _ledger(True)
    prefill.add_request(9, prompt_len=3)
    prefill.append_blocks(9, [0])
    prefill.land(prefill.schedule([(9, 3)]).seq, _rows(5, 3, True))
    data = prefill.export_handoff(9)
    body = data[:-4]
    accepted = 0
    for i in range(len(body)):
        for value in (0, 0xFF, body[i] ^ 0x80):
            crafted = body[:i] + bytes([value]) + body[i + 1 :]
            crafted += struct.pack("<I", zlib.crc32(crafted))
            try:
                rec = decode_handoff(crafted, max_rows=1 << 16)
            except ValueError:
                continue
            accepted += 1  # e.g. a row's byte or the handoff id: a record that checks out
            assert rec.missing.shape == (rec.num_tokens,)
            for channel in rec.channels:
                assert rec.rows[channel.name].shape == (rec.num_tokens, *channel.row_shape)
    assert accepted > 0


def test_export_waits_for_rows_in_flight_and_checks_its_arguments():
    prefill = _ledger(False)
    prefill.add_request("r", prompt_len=4)
    prefill.append_blocks("r", [0])
    step = prefill.schedule([("r", 4)])
    with pytest.raises(ValueError, match="in flight"):
        prefill.export_handoff("r")
    prefill.land(step.seq, _rows(6, 4, False))
    with pytest.raises(ValueError, match="has computed 4 tokens"):
        prefill.export_handoff("r", num_tokens=5)
    prefill.add_request(("tuple", 1), prompt_len=1)
    prefill.append_blocks(("tuple", 1), [1])
    prefill.land(prefill.schedule([(("tuple", 1), 1)]).seq, _rows(6, 1, False))
    with pytest.raises(ValueError, match="str or int request id"):
        prefill.export_handoff(("tuple", 1))


def test_rows_dropped_on_prefill_arrive_missing():
    prefill = _ledger(False)
    prefill.add_request("r", prompt_len=8)
    prefill.append_blocks("r", [0, 1])
    prefill.drop(prefill.schedule([("r", 4)]).seq)
    prefill.land(prefill.schedule([("r", 4)]).seq, _rows(7, 4, False))
    decode = _ledger(False)
    decode.import_handoff("r", prefill.export_handoff("r"), [6, 2])
    decode.finish("r")
    done = _collect_one(decode)
    assert done.missing.tolist() == [True] * 4 + [False] * 4
    assert (done.routing[:4] == decode.store.fill).all()


def test_an_old_step_in_flight_never_lands_in_imported_blocks():
    """The decode ledger's block 2 was freed by an aborted request whose step is still in flight:
    the imported rows stay, the late rows land nowhere there."""
    decode = _ledger(False)
    decode.add_request("old")
    decode.append_blocks("old", [2])
    late = decode.schedule([("old", 4)])
    decode.abort("old")
    prefill = _ledger(False)
    prefill.add_request("r", prompt_len=4)
    prefill.append_blocks("r", [0])
    rows = _rows(8, 4, False)
    prefill.land(prefill.schedule([("r", 4)]).seq, rows)
    decode.import_handoff("r", prefill.export_handoff("r"), [2])
    decode.land(late.seq, _rows(9, 4, False))
    decode.finish("r")
    got = {d.req_id: d for d in decode.collect()}
    assert np.array_equal(got["r"].routing, rows) and not got["r"].missing.any()


def test_threads_import_and_serve_at_once():
    """Eight threads each import a request's record and decode it on one ledger (its lock): every
    request returns its own rows."""
    records, forwards = {}, {}
    prefill = _ledger(False, 4, 64)
    for i in range(8):
        prefill.add_request(i, prompt_len=4)
        prefill.append_blocks(i, [i])
        forwards[i] = (_rows(100 + i, 4, False), _rows(200 + i, 3, False))
        prefill.land(prefill.schedule([(i, 4)]).seq, forwards[i][0])
        records[i] = prefill.export_handoff(i)
    decode = _ledger(False, 4, 64)
    errors = []

    def work(i):
        try:
            decode.import_handoff(i, records[i], [8 + 2 * i])
            decode.append_blocks(i, [9 + 2 * i])
            for t in range(3):
                decode.land(decode.schedule([(i, 1)]).seq, forwards[i][1][t : t + 1])
            decode.finish(i)
        except Exception as exc:  # reported below with the thread's index
            errors.append((i, exc))

    run_threads(work, 8, timeout=120.0)
    assert not errors, errors
    got = {d.req_id: d.routing for d in decode.collect()}
    assert sorted(got) == list(range(8))
    for i, (pre, dec) in forwards.items():
        assert np.array_equal(got[i], np.concatenate([pre, dec]))
