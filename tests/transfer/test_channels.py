"""Rows as named channels: a second payload (float routing weights) beside the ids rides the slot
store, the snapshot ring and the ledger bit for bit, in its own dtype; hostile channel input is
refused before anything changes. The ids-only case keeps every old name and result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    WEIGHT_DTYPES,
    WeightsCase,
    bucket_row_counts,
    routing_rows,
    routing_shapes,
    weight_rows,
    weights_cases,
)

from moe_ops import RoutingLedger, RoutingShape, SlotStore, TransferPipeline
from moe_ops.channels import IDS, Channel

SHAPE = RoutingShape(num_layers=3, num_experts=200, top_k=2)  # uint8 ids
F16 = np.dtype(np.float16)
POISON = -7


def _bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a float array, so that -0.0, NaN payloads and subnormals compare exactly."""
    return a.view(f"u{a.dtype.itemsize}")


def _torch_cast(src: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """The host rows a channel of ``dtype`` must hold for ``src``: torch's cast (the oracle)."""
    target = torch.from_numpy(np.empty(0, dtype)).dtype
    return src.cpu().to(target).numpy()


# ------------------------------------------------------------------------------------------ Channel


def test_a_channel_normalises_its_dtype_and_refuses_what_no_row_can_hold():
    w = Channel("weights", "float16")
    assert w.dtype == F16 and w.row_shape is None and np.isnan(w.fill)
    assert Channel("ids", np.uint8).fill == 255 and Channel("ids", np.int32).fill == -1
    assert Channel("w", np.float32, [3, 2]).row_shape == (3, 2)
    assert w.resolved((4, 8)) == Channel("weights", F16, (4, 8))
    for bad, match in [
        (lambda: Channel("two words", F16), "Python identifier"),
        (lambda: Channel(7, F16), "Python identifier"),
        (lambda: Channel("w", np.complex64), "integer or float dtype"),
        (lambda: Channel("w", np.bool_), "integer or float dtype"),
        (lambda: Channel("w", ">f4"), "native"),
        (lambda: Channel("w", "no such dtype"), "integer or float dtype"),
        (lambda: Channel("w", F16, (3, 0)), "row_shape must be None or a tuple of ints >= 1"),
        (lambda: Channel("w", F16, 3), "row_shape must be None"),
        (lambda: Channel("w", F16, (True, 2)), "row_shape must be None"),
    ]:
        with pytest.raises(ValueError, match=match):
            bad()


# ---------------------------------------------------------------------------------------- SlotStore


@settings(max_examples=100)
@given(
    shape=routing_shapes(max_layers=4, max_top_k=4),
    dtype=st.sampled_from(WEIGHT_DTYPES),
    num_slots=st.integers(1, 40),
    block_size=st.sampled_from([1, 2, 4]),
    data=st.data(),
)
def test_a_weights_channel_rides_the_store_bit_for_bit(shape, dtype, num_slots, block_size, data):
    num_slots = num_slots * block_size
    store = SlotStore(num_slots, shape, extra_channels=[Channel("weights", dtype)])
    assert [c.name for c in store.channels] == [IDS, "weights"]
    assert store.channels[1].row_shape == store.row_shape
    assert store.arrays["weights"].dtype == dtype and store.data is store.arrays[IDS]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ids_model = np.full((num_slots, *store.row_shape), store.fill, store.dtype)
    w_model = np.full((num_slots, *store.row_shape), np.nan, dtype)
    for _ in range(data.draw(st.integers(1, 3))):
        n = data.draw(st.integers(0, num_slots))
        slots = rng.permutation(num_slots)[:n]
        ids = routing_rows(rng, n, shape)
        weights = weight_rows(rng, (n, *store.row_shape), dtype, nan=True)
        store.write(slots, {"weights": weights, IDS: ids})  # any key order
        ids_model[slots], w_model[slots] = ids, weights
    assert np.array_equal(store.data, ids_model)
    assert np.array_equal(_bits(store.arrays["weights"]), _bits(w_model))
    table = rng.integers(0, num_slots // block_size, size=data.draw(st.integers(1, 4)))
    n = data.draw(st.integers(0, table.size * block_size))
    slots = (table[:, None] * block_size + np.arange(block_size)).reshape(-1)[:n]
    got = store.read(table, n, block_size, channel="weights")
    assert got.dtype == dtype and np.array_equal(_bits(got), _bits(w_model[slots]))
    assert np.array_equal(store.read(table, n, block_size), ids_model[slots])
    assert np.array_equal(_bits(store.read_slots(slots, channel="weights")), _bits(w_model[slots]))
    assert store.nbytes == store.data.nbytes + store.arrays["weights"].nbytes


def test_a_float16_batch_widens_exactly_into_a_float32_channel():
    store = SlotStore(4, SHAPE, extra_channels=[Channel("weights", np.float32)])
    w = weight_rows(np.random.default_rng(0), (2, 3, 2), np.float16)
    store.write([1, 3], {IDS: np.ones((2, 3, 2), np.uint8), "weights": w})
    assert np.array_equal(store.read_slots([1, 3], channel="weights"), w.astype(np.float32))


def _two_channel_store() -> SlotStore:
    store = SlotStore(8, SHAPE, extra_channels=[Channel("weights", F16)])
    rng = np.random.default_rng(3)
    store.write(np.arange(8), {IDS: routing_rows(rng, 8, SHAPE), "weights": weight_rows(rng, (8, 3, 2), F16)})
    return store


def _rows(n=2, ids_dtype=np.uint8, w_dtype=F16, w_shape=(3, 2)):
    return {IDS: np.ones((n, 3, 2), ids_dtype), "weights": np.full((n, *w_shape), 0.5, w_dtype)}


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda s: s.write([0, 1], np.ones((2, 3, 2), np.uint8)),
            r"mapping of every channel \['ids', 'weights'\]",
        ),
        (lambda s: s.write([0, 1], {IDS: np.ones((2, 3, 2), np.uint8)}), "lacks channel 'weights'"),
        (lambda s: s.write([0, 1], {**_rows(), "bias": np.zeros((2, 3, 2))}), r"'bias' is not a configured"),
        (
            lambda s: s.write([0, 1], _rows(w_dtype=np.float32)),
            r"rows\['weights'\] must hold floats that cast",
        ),
        (lambda s: s.write([0, 1], _rows(w_dtype=np.int8)), r"rows\['weights'\] must hold floats"),
        (lambda s: s.write([0, 1], _rows(w_shape=(2, 3))), r"rows\['weights'\] must have shape \(2, 3, 2\)"),
        (lambda s: s.write([0, 1], _rows(ids_dtype=np.float32)), r"rows\['ids'\] must hold integers"),
        (lambda s: s.write([0, 9], _rows()), "slots must be in"),  # IndexError, checked last
        (lambda s: s.read([0], 1, 4, channel="bias"), r"channel='bias' is not a configured channel"),
        (lambda s: s.read_slots([0], channel="Weights"), r"expected one of \['ids', 'weights'\]"),
    ],
)
def test_the_store_refuses_hostile_channel_input_and_stays_unchanged(call, match):
    store = _two_channel_store()
    before = {k: v.copy() for k, v in store.arrays.items()}
    with pytest.raises((ValueError, IndexError), match=match):
        call(store)
    assert np.array_equal(store.data, before[IDS])
    assert np.array_equal(_bits(store.arrays["weights"]), _bits(before["weights"]))


def test_store_channel_sets_are_checked():
    with pytest.raises(ValueError, match="'ids' is the expert ids' channel"):
        SlotStore(4, SHAPE, extra_channels=[Channel("ids", F16)])
    with pytest.raises(ValueError, match="'w' is taken"):
        SlotStore(4, SHAPE, extra_channels=[Channel("w", F16), Channel("w", np.float32)])
    with pytest.raises(TypeError, match="must hold Channel objects"):
        SlotStore(4, SHAPE, extra_channels=[("w", F16)])
    with pytest.raises(TypeError, match="sequence of Channel"):
        SlotStore(4, SHAPE, extra_channels=Channel("w", F16))
    plain = SlotStore(4, SHAPE)  # the ids alone: a bare array, as always
    plain.write([2], np.full((1, 3, 2), 7, np.int64))
    assert plain.channels == (Channel(IDS, np.uint8, (3, 2)),) and plain.read_slots([2])[0, 0, 0] == 7
    plain.write([1], {IDS: np.full((1, 3, 2), 5, np.uint8)})  # or a mapping of its one channel
    assert (plain.read_slots([1]) == 5).all()


# ------------------------------------------------------------------------------------------ pipeline


def _weights_pipe(case: WeightsCase, device, **kw) -> tuple[TransferPipeline, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(0, 200, (case.max_rows, case.num_layers, case.top_k), generator=g, dtype=torch.int32)
    ids, weights = ids.to(device), case.weights(device)
    pipe = TransferPipeline(ids, np.uint8, extra_channels=[(Channel("weights", case.dtype), weights)], **kw)
    return pipe, ids, weights


@settings(max_examples=80)
@given(case=weights_cases(), depth=st.integers(1, 3))
def test_a_weights_channel_rides_the_ring_to_the_host_bit_for_bit_cpu(case, depth):
    pipe, ids, weights = _weights_pipe(case, "cpu", depth=depth)
    assert [c.name for c in pipe.channels] == [IDS, "weights"]
    assert pipe.channels[1].row_shape == (case.num_layers, case.top_k)
    n = case.num_rows
    with pipe.snapshot(n) as handle:
        got = handle.results(copy=False)
        assert list(got) == [IDS, "weights"] and got["weights"].dtype == case.dtype
        assert got["weights"].shape == (n, case.num_layers, case.top_k)
        want = _torch_cast(weights[:n], case.dtype)
        assert np.array_equal(_bits(got["weights"]), _bits(want))
        assert np.array_equal(got[IDS], ids[:n].numpy().astype(np.uint8))
        assert np.array_equal(handle.result(), got[IDS])  # the ids, as before channels
        alone = handle.result(channel="weights")
        assert np.array_equal(_bits(alone), _bits(want)) and alone.flags.owndata


def test_a_same_dtype_channel_keeps_every_bit_pattern_cpu():
    """float16 in, float16 out: the copy is a copy (NaN payloads, -0.0, subnormals kept)."""
    rng = np.random.default_rng(5)
    w = weight_rows(rng, (16, 4, 8), F16, nan=True)
    pipe = TransferPipeline(
        torch.zeros(16, 4, 8, dtype=torch.int32),
        np.int32,
        extra_channels={Channel("weights", F16): torch.from_numpy(w)},
    )
    with pipe.snapshot(16) as handle:
        assert np.array_equal(_bits(handle.result(channel="weights")), _bits(w))


def test_stale_layers_read_each_channels_fill_cpu():
    source = torch.arange(4 * 3 * 2, dtype=torch.int32).view(4, 3, 2)
    weights = torch.linspace(0, 1, 24, dtype=torch.float32).view(4, 3, 2)
    stamps, step = torch.tensor([5, 4, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    pipe = TransferPipeline(
        source,
        np.uint8,
        layer_stamps=stamps,
        step_tensor=step,
        extra_channels=[(Channel("weights", np.float32), weights)],
    )
    with pipe.snapshot(3) as handle:
        rows = handle.results()
    assert (rows[IDS][:, 1] == 255).all() and np.isnan(rows["weights"][:, 1]).all()
    for layer in (0, 2):
        assert np.array_equal(rows[IDS][:, layer], source[:3, layer].numpy())
        assert np.array_equal(rows["weights"][:, layer], weights[:3, layer].numpy())


@pytest.mark.parametrize(
    "extra, exc, match",
    [
        ([(Channel("ids", F16), torch.zeros(8, 2, 2))], ValueError, "'ids' is the expert ids' channel"),
        ([(Channel("w", F16), torch.zeros(7, 2, 2))], ValueError, r"extra_channels\['w'\].*max_rows=8"),
        ([(Channel("w", F16), torch.zeros(8))], ValueError, r"\(max_rows=8, \*row_shape\)"),
        (
            [(Channel("w", F16, (2, 3)), torch.zeros(8, 2, 2))],
            ValueError,
            r"row_shape \(2, 3\), got \(2, 2\)",
        ),
        ([(Channel("w", F16), torch.zeros(8, 2, 2, dtype=torch.int32))], ValueError, "floating point dtype"),
        ([(Channel("w", np.int16), torch.zeros(8, 2, 2))], ValueError, "integer dtype for a int16 channel"),
        ([(Channel("w", np.int16), torch.zeros(8, 2, 2, dtype=torch.bool))], ValueError, "integer dtype"),
        (
            [(Channel("w", np.uint32), torch.zeros(8, 2, 2, dtype=torch.int32))],
            ValueError,
            "dtype must be one of",
        ),
        ([(Channel("w", F16), torch.zeros(8, 2, 2).transpose(1, 2))], ValueError, "contiguous"),
        ([(Channel("w", F16), torch.zeros(8, 3, 2))], ValueError, "num_layers=2"),  # stamps below
        ([(Channel("w", F16), torch.zeros(8, 4))], ValueError, "num_layers=2"),
        (
            [(Channel("w", F16), torch.zeros(8, 2, 2)), (Channel("w", F16), torch.zeros(8, 2, 2))],
            ValueError,
            "taken",
        ),
        ([("w", torch.zeros(8, 2, 2))], TypeError, "must hold Channel objects"),
        ([(Channel("w", F16), np.zeros((8, 2, 2)))], TypeError, "must be a torch.Tensor"),
        ([Channel("w", F16)], TypeError, r"\(Channel, source tensor\) pairs"),
        ("weights", TypeError, r"\(Channel, source tensor\) pairs or a mapping"),
    ],
)
def test_the_pipeline_refuses_hostile_channels_before_allocating(extra, exc, match):
    source = torch.zeros(8, 2, 2, dtype=torch.int32)
    stamps, step = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(exc, match=match):
        TransferPipeline(source, np.uint8, layer_stamps=stamps, step_tensor=step, extra_channels=extra)


def test_a_handle_refuses_a_channel_it_does_not_carry():
    pipe = TransferPipeline(torch.zeros(4, 2, 2, dtype=torch.int32), np.uint8)
    assert pipe.channels == (Channel(IDS, np.uint8, (2, 2)),)
    with pipe.snapshot(2) as handle:
        with pytest.raises(
            ValueError, match=r"channel='weights' is not a configured channel; expected one of \['ids'\]"
        ):
            handle.result(channel="weights")
        assert list(handle.results()) == [IDS]  # the handle still works
        assert handle.result(channel=IDS).shape == (2, 2, 2)


def _run_weights_schedule(device, depth, row_counts, dtype, **kw):
    """Steps write fresh ids and weights and snapshot them; up to ``depth`` in flight, consumed out
    of order; every channel's rows come back as written."""
    rng = np.random.default_rng(len(row_counts) * 7 + depth)
    ids = torch.full((32, 3, 2), POISON, dtype=torch.int32, device=device)
    weights = torch.full((32, 3, 2), POISON, dtype=torch.float32, device=device)
    pipe = TransferPipeline(
        ids, np.uint16, depth=depth, extra_channels=[(Channel("weights", dtype), weights)], **kw
    )
    pending = []
    for n in row_counts:
        if len(pending) == depth:
            handle, want_ids, want_w = pending.pop(int(rng.integers(0, depth)))
            got = handle.results(copy=bool(rng.integers(0, 2)))
            assert np.array_equal(got[IDS].astype(np.int64), want_ids)
            assert np.array_equal(_bits(got["weights"]), _bits(want_w)), f"snapshot {handle.seq}"
            handle.release()
        rows = rng.integers(0, 300, size=(n, 3, 2))
        w = weight_rows(rng, (n, 3, 2), np.float32)
        pipe.guard_source()  # the next writes wait until queued snapshots read the sources
        ids[:n] = torch.from_numpy(rows).to(device, torch.int32)
        weights[:n] = torch.from_numpy(w).to(device)
        ids[n:], weights[n:] = POISON, POISON
        pending.append((pipe.snapshot(n), rows, _torch_cast(torch.from_numpy(w), np.dtype(dtype))))
    for handle, want_ids, want_w in pending:
        got = handle.results()
        assert np.array_equal(got[IDS].astype(np.int64), want_ids)
        assert np.array_equal(_bits(got["weights"]), _bits(want_w))
        handle.release()
    assert pipe.in_flight == 0
    return pipe


@settings(max_examples=30)
@given(depth=st.integers(1, 4), row_counts=st.lists(bucket_row_counts(32), max_size=12))
def test_two_channels_in_flight_consumed_out_of_order_cpu(depth, row_counts):
    _run_weights_schedule("cpu", depth, row_counts, np.float16)


# ------------------------------------------------------------------------------------------- ledger


def test_the_ledger_carries_every_channel_through_landing_redirects_and_drops():
    """Request a lands while running; b finishes with its step in flight (pre-free capture
    redirects the late rows into its private rows); c's step is dropped (NaN weights, missing)."""
    store = SlotStore(12, SHAPE, extra_channels=[Channel("weights", F16)])
    ledger = RoutingLedger(store, 4)
    rng = np.random.default_rng(11)
    for req, block in (("a", 0), ("b", 1), ("c", 2)):
        ledger.add_request(req)
        ledger.append_blocks(req, [block])
    step = ledger.schedule([("a", 3), ("b", 2), ("c", 1)])
    rows = {IDS: routing_rows(rng, 6, SHAPE), "weights": weight_rows(rng, (6, 3, 2), F16, nan=True)}
    ledger.finish("b")  # b's rows are in flight: delivered to its private rows when they land
    before = {k: v.copy() for k, v in store.arrays.items()}
    with pytest.raises(ValueError, match="must be a mapping of every channel"):
        ledger.land(step.seq, rows[IDS])
    with pytest.raises(ValueError, match=r"rows of step 0\['weights'\] must hold floats that cast"):
        ledger.land(step.seq, {**rows, "weights": rows["weights"].astype(np.float32)})
    assert ledger.in_flight == [step.seq] and ledger.collect() == []  # nothing changed
    assert all(np.array_equal(_bits(v), _bits(before[k])) for k, v in store.arrays.items())
    ledger.land(step.seq, rows)
    (b,) = ledger.collect()
    assert b.req_id == "b" and list(b.channels) == ["weights"]
    assert np.array_equal(b.routing, rows[IDS][3:5])
    assert np.array_equal(_bits(b.channels["weights"]), _bits(rows["weights"][3:5]))
    drop = ledger.schedule([("c", 1)])
    ledger.drop(drop.seq)
    ledger.finish("a")
    ledger.finish("c")
    done = {f.req_id: f for f in ledger.collect()}
    assert np.array_equal(_bits(done["a"].channels["weights"]), _bits(rows["weights"][:3]))
    assert np.array_equal(done["c"].missing, [False, True])
    assert np.array_equal(_bits(done["c"].channels["weights"][:1]), _bits(rows["weights"][5:6]))
    assert np.isnan(done["c"].channels["weights"][1]).all() and (done["c"].routing[1] == 255).all()
    assert ledger.held_requests() == [] and ledger.pending_slots() == 0


def test_an_ids_only_ledger_takes_a_bare_array_and_returns_no_other_channel():
    ledger = RoutingLedger(SlotStore(8, SHAPE), 4)
    ledger.add_request("r")
    ledger.append_blocks("r", [1])
    step = ledger.schedule([("r", 2)])
    ids = routing_rows(np.random.default_rng(2), 2, SHAPE)
    ledger.land(step.seq, ids)
    ledger.finish("r")
    (r,) = ledger.collect()
    assert np.array_equal(r.routing, ids) and dict(r.channels) == {}


# ---------------------------------------------------------------------------------------------- GPU

# (graphs, cudart) -> narrow_path: every way a CUDA snapshot narrows and copies
CUDA_PATHS = [
    pytest.param(None, None, id="graph_launch"),
    pytest.param(None, False, id="graph_replay"),
    pytest.param(False, None, id="kernel-cudart"),
    pytest.param(False, False, id="kernel-copy_"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs, cudart", CUDA_PATHS)
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_two_channels_in_flight_through_every_cuda_path_gpu(cuda_device, graphs, cudart, dtype):
    rng = np.random.default_rng(0)
    counts = [int(c) for c in rng.integers(0, 33, size=24)] + [0, 1, 32, 31, 16, 17]
    pipe = _run_weights_schedule(cuda_device, 3, counts, dtype, graphs=graphs, cudart=cudart)
    assert pipe.graphed == (graphs is None)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(case=weights_cases(max_rows=64))
def test_a_weights_channel_rides_the_cuda_ring_bit_for_bit_gpu(case):
    pipe, ids, weights = _weights_pipe(case, "cuda")
    n = case.num_rows
    with pipe.snapshot(n) as handle:
        got = handle.results()
    assert np.array_equal(_bits(got["weights"]), _bits(_torch_cast(weights[:n], case.dtype)))
    assert np.array_equal(got[IDS], ids[:n].cpu().numpy().astype(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("graphs, cudart", CUDA_PATHS)
def test_stale_layers_read_each_channels_fill_gpu(cuda_device, graphs, cudart):
    source = torch.arange(8 * 3 * 2, dtype=torch.int32, device=cuda_device).view(8, 3, 2)
    weights = torch.linspace(0, 1, 48, device=cuda_device).view(8, 3, 2).to(torch.bfloat16)
    stamps = torch.tensor([5, 4, 5], dtype=torch.int32, device=cuda_device)
    step = torch.tensor([5], dtype=torch.int32, device=cuda_device)
    pipe = TransferPipeline(
        source,
        np.uint8,
        layer_stamps=stamps,
        step_tensor=step,
        graphs=graphs,
        cudart=cudart,
        extra_channels=[(Channel("weights", np.float32), weights)],
    )
    for n in (3, 8, 1):
        with pipe.snapshot(n) as handle:
            rows = handle.results()
        assert (rows[IDS][:, 1] == 255).all() and np.isnan(rows["weights"][:, 1]).all()
        for layer in (0, 2):
            assert np.array_equal(rows[IDS][:, layer], source[:n, layer].cpu().numpy())
            assert np.array_equal(rows["weights"][:, layer], weights[:n, layer].float().cpu().numpy())
