"""Routing weights on the wire: vLLM's ``routed_expert_weights`` (float32 ``.npy``), moe-ops' own
bfloat16 (2 bytes an entry, rounded to nearest even, checked against a reference written here from
exact arithmetic and against torch's cast), formats without a place for weights refused by name, and
the whole host path - snapshot ring, slot store, ledger, wire - with a weights channel beside the
ids."""

from __future__ import annotations

import base64
import io
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import BF16_EDGE_BITS, weight_arrays

from moe_ops import (
    RoutingLedger,
    RoutingShape,
    SlotStore,
    TransferPipeline,
    decode_routing,
    decode_routing_weights,
    encode_routing,
    encode_routing_weights,
    wire,
)
from moe_ops.channels import Channel
from moe_ops.wire import WEIGHT_WIRE_DTYPES, bfloat16_bits, from_bfloat16_bits
from moe_ops.wire.npy import vllm_weights_layout

# ------------------------------------------------------------------------------ reference rounding


def _ref_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 of the bfloat16 nearest each value, ties to even, worked out with exact fractions:
    the two bfloat16 neighbours of ``x`` (toward zero: the float32 with its low 16 bits cleared;
    away from zero: the next bfloat16, or 2**128 past the largest finite one, which rounds to inf),
    whichever is nearer, the one whose last kept bit is 0 on a tie. NaN stays NaN (sign kept)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape, np.float32)
    for i, x in enumerate(flat):
        if np.isnan(x) or np.isinf(x):
            out[i] = x
            continue
        bits = int(np.float32(x).view(np.uint32))
        sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
        lo_mag = mag & 0xFFFF0000
        lo = Fraction(float(np.uint32(lo_mag).view(np.float32)))
        hi_mag = lo_mag + 0x10000
        hi = (
            Fraction(2) ** 128
            if hi_mag >= 0x7F800000
            else Fraction(float(np.uint32(hi_mag).view(np.float32)))
        )
        v = Fraction(float(np.uint32(mag).view(np.float32)))
        below, above = v - lo, hi - v
        take_hi = above < below or (above == below and (lo_mag >> 16) & 1)
        out[i] = np.uint32(sign | (hi_mag if take_hi else lo_mag)).view(np.float32)
    return out.reshape(np.shape(values))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, NaN where the other is NaN (same sign), -0.0 told from 0.0."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    if not np.array_equal(nan, np.isnan(b)) or not np.array_equal(np.signbit(a), np.signbit(b)):
        return False
    return np.array_equal(a[~nan], b[~nan])


def test_the_reference_rounds_the_edges_as_worked_out_by_hand():
    as_f32 = lambda *bits: np.array(bits, np.uint32).view(np.float32)
    got = _ref_bfloat16(as_f32(0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0x7F7F7FFF, 0x00008000))
    # 1 + 2**-8 ties down to 1.0 (even); 1 + 3 * 2**-8 ties up to 1 + 2**-6; a hair above a tie rounds
    # up; float32's largest rounds to inf; just under the last tie stays finite; a subnormal tie
    # rounds to even (0)
    want = as_f32(0x3F800000, 0x3F820000, 0x3F810000, 0x7F800000, 0x7F7F0000, 0x00000000)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@settings(max_examples=200)
@given(weights=weight_arrays())
def test_bfloat16_rounding_is_nearest_even_with_nan_kept(weights):
    bits = bfloat16_bits(weights)
    assert bits.dtype == np.uint16 and bits.shape == weights.shape
    got = from_bfloat16_bits(bits)
    assert got.dtype == np.float32
    assert _same(got, _ref_bfloat16(weights))
    # a second oracle: torch's cast (round to nearest even) for every value but NaN, whose payload
    # torch may canonicalise
    finite = ~np.isnan(weights)
    torch_bf16 = torch.from_numpy(np.ascontiguousarray(weights, np.float32)).to(torch.bfloat16).float()
    assert _same(got[finite], torch_bf16.numpy()[finite])


def test_bfloat16_edges_torch_agrees():
    x = np.array(BF16_EDGE_BITS, np.uint32).view(np.float32)
    ours = from_bfloat16_bits(bfloat16_bits(x))
    theirs = torch.from_numpy(x.copy()).to(torch.bfloat16).float().numpy()
    assert _same(ours, _ref_bfloat16(x))
    finite = ~np.isnan(x)
    assert _same(ours[finite], theirs[finite]) and np.isnan(ours[~finite]).all()


# ----------------------------------------------------------------------------------------- formats


@settings(max_examples=150)
@given(weights=weight_arrays(), dtype=st.sampled_from(WEIGHT_WIRE_DTYPES))
def test_weights_round_trip_through_npy(weights, dtype):
    text = encode_routing_weights(weights, dtype=dtype)
    assert isinstance(text, str) and text.isascii() and wire.sniff_format(text) is wire.FORMATS["npy"]
    raw = np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)  # a client's own reading
    _, num_layers, top_k = weights.shape
    assert raw.shape == weights.shape
    want = np.asarray(weights, np.float32)
    if dtype == "float32":  # vLLM's field: float32, every bit as sent (float16 widened exactly)
        assert raw.dtype == np.float32
        assert np.array_equal(raw.view(np.uint32), want.view(np.uint32))
    else:  # 2 bytes an entry: bfloat16's bits
        assert raw.dtype == np.uint16 and raw.nbytes == 2 * weights.size
        assert _same((raw.astype(np.uint32) << 16).view(np.float32), _ref_bfloat16(weights))
        want = _ref_bfloat16(weights)
    text_bytes = text.encode()
    for s in (text, text_bytes, bytearray(text_bytes), memoryview(text_bytes)):
        out = decode_routing_weights(s, num_layers=num_layers, top_k=top_k, max_elements=weights.size)
        assert out.dtype == np.float32 and out.flags.writeable and out.flags.c_contiguous
        assert _same(out, want)


def test_vllm_clients_read_the_weights_beside_the_ids():
    shape = RoutingShape(num_layers=3, num_experts=64, top_k=2, moe_layers=(1, 2, 3), num_model_layers=4)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 64, size=(5, 3, 2)).astype(shape.id_dtype)
    weights = rng.random((5, 3, 2), dtype=np.float32)
    weights[1, 2] = np.nan  # a layer not captured: the channel's fill
    choice = {
        "routed_experts": encode_routing(shape.vllm_layout(rows)),
        "routed_expert_weights": encode_routing_weights(vllm_weights_layout(shape, weights), dtype="float32"),
    }
    # client side (what vLLM's clients do: np.load of both fields, same shape)
    ids = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
    w = np.load(io.BytesIO(base64.b64decode(choice["routed_expert_weights"])), allow_pickle=False)
    assert w.dtype == np.float32 and w.shape == ids.shape == (5, 4, 2)
    assert np.isnan(w[:, 0]).all()  # the dense layer's column: no weight
    assert _same(w[:, 1:], weights) and np.array_equal(ids[:, 1:], rows)
    with pytest.raises(ValueError, match=r"weights must have shape \(n, 3, 2\)"):
        vllm_weights_layout(shape, weights[:, :2])
    with pytest.raises(ValueError, match="float16 or float32"):
        vllm_weights_layout(shape, weights.astype(np.float64))


@pytest.mark.parametrize("name", sorted(wire.FORMATS))
def test_every_format_carries_weights_or_says_what_to_use_instead(name):
    fmt = wire.FORMATS[name]
    w = np.full((2, 3, 1), 0.5, np.float32)
    if fmt.weights is not None:
        for dtype in fmt.weights.dtypes:
            out = decode_routing_weights(encode_routing_weights(w, format=name, dtype=dtype), format=name)
            assert np.array_equal(out, w)
        return
    for call in (
        lambda: encode_routing_weights(w, format=name),
        lambda: decode_routing_weights("AAAA", format=name, num_layers=3, top_k=1),
    ):
        with pytest.raises(
            ValueError, match=rf"format='{name}' has no place for routing weights.*format='npy'"
        ):
            call()


def test_a_wire_format_declares_its_weights_in_one_place():
    with pytest.raises(ValueError, match="no_weights must say why"):
        wire.WireFormat("x", ("moe",), None, None, str, str)  # neither weights nor a reason
    codec = wire.FORMATS["npy"].weights
    with pytest.raises(ValueError, match="no_weights must say why"):
        wire.WireFormat("x", ("moe",), None, None, str, str, weights=codec, no_weights="both")
    with pytest.raises(ValueError, match=r"WeightsCodec\.dtypes"):
        wire.WeightsCodec(("float16",), str, str)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: encode_routing_weights(np.ones((1, 2, 2), np.int32)),
            r"float16 or float32 array \(or uint16 bfloat16 bits\), got dtype int32",
        ),
        (lambda: encode_routing_weights(np.ones((1, 2, 2))), r"bfloat16 bits\), got dtype float64"),
        (
            lambda: encode_routing_weights(np.ones((1, 2, 2), np.float32), dtype="float16"),
            "dtype must be one of",
        ),
        (
            lambda: encode_routing_weights(np.ones((1, 2, 2), np.float32), format="json"),
            "format must be one of",
        ),
        # an ids text is not a weights text
        (
            lambda: decode_routing_weights(encode_routing(np.ones((1, 2, 2), np.uint8))),
            "routing weights must be",
        ),
        (
            lambda: decode_routing_weights(encode_routing(np.ones((1, 2, 2), np.int32))),
            "routing weights must be",
        ),
        (
            lambda: decode_routing_weights(
                encode_routing_weights(np.ones((1, 2, 2), np.float32)), num_layers=3
            ),
            r"has shape \(1, 2, 2\), but \(n, 3, \*\) was asked for",
        ),
        (
            lambda: decode_routing_weights(
                encode_routing_weights(np.ones((3, 2, 2), np.float32)), max_elements=11
            ),
            "more than max_elements=11",
        ),
        (lambda: decode_routing_weights("k05VTVBZ!!!!"), "malformed base64"),
        (lambda: decode_routing_weights("AAAA", top_k=0), "top_k must be None or an int >= 1"),
    ],
)
def test_hostile_weights_input_is_refused_naming_what_is_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_weights_text_that_declares_more_than_it_holds_is_refused():
    text = encode_routing_weights(np.ones((4, 2, 2), np.float32), dtype="float32")
    raw = base64.b64decode(text)
    with pytest.raises(ValueError, match="needs 64 bytes after the header, got 60"):
        decode_routing_weights(base64.b64encode(raw[:-4]).decode())


# ------------------------------------------------------------------------ the host path end to end

SHAPE = RoutingShape(num_layers=3, num_experts=200, top_k=2)  # uint8 ids
POISON = -7
ID_FILL = np.iinfo(SHAPE.id_dtype).max  # a row or layer without data: the unsigned maximum (255)


@settings(max_examples=25, deadline=None)
@given(
    w_dtype=st.sampled_from([np.float16, np.float32]),
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    stale=st.integers(0, 2),
    drop=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_ids_and_weights_from_the_ring_to_the_wire_and_back(w_dtype, counts, stale, drop, seed):
    """Real objects only: a CPU snapshot ring with a weights channel (one layer's stamp stale),
    a slot store and a ledger with the same channel, each step's ``results()`` landed, the last
    step dropped when ``drop``; each finished request's ids and weights encoded (ids as ``.npy``,
    weights as bfloat16 and as float32) and decoded: ids exact, weights equal to the reference
    rounding of what the source held, NaN where the layer was stale or the step dropped."""
    rng = np.random.default_rng(seed)
    w_dtype = np.dtype(w_dtype)
    max_rows = 8
    ids_src = torch.full((max_rows, 3, 2), POISON, dtype=torch.int32)
    w_src = torch.full((max_rows, 3, 2), POISON, dtype=torch.float32)
    stamps, step = torch.tensor([1, 1, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    stamps[stale] = 0  # this layer was not captured: ids and weights read their fill
    weights_channel = Channel("weights", w_dtype)
    pipe = TransferPipeline(
        ids_src,
        SHAPE.id_dtype,
        layer_stamps=stamps,
        step_tensor=step,
        extra_channels=[(weights_channel, w_src)],
    )
    block = 8
    ledger = RoutingLedger(SlotStore(len(counts) * block, SHAPE, extra_channels=[weights_channel]), block)
    want_ids, want_w, dropped = {}, {}, {}
    for r in range(len(counts)):
        ledger.add_request(r)
        ledger.append_blocks(r, [r])
        want_ids[r], want_w[r], dropped[r] = [], [], []
    tokens = max(counts)
    for t in range(tokens):
        live = [r for r, n in enumerate(counts) if t < n]
        if not live:
            break
        scheduled = ledger.schedule([(r, 1) for r in live])
        k = len(live)
        ids = rng.integers(0, 200, size=(k, 3, 2))
        w = rng.random((k, 3, 2)).astype(np.float32)
        w[rng.random((k, 3, 2)) < 0.2] = np.float32(1 + 2**-8)  # a bfloat16 tie
        pipe.guard_source()
        ids_src[:k] = torch.from_numpy(ids).to(torch.int32)
        w_src[:k] = torch.from_numpy(w)
        ids_src[k:], w_src[k:] = POISON, POISON
        with pipe.snapshot(k) as handle:
            rows = handle.results()
        last = t == tokens - 1
        if drop and last:
            ledger.drop(scheduled.seq)
        else:
            ledger.land(scheduled.seq, rows)
        for i, r in enumerate(live):
            row_ids = ids[i].astype(SHAPE.id_dtype)
            row_w = w[i].astype(w_dtype).astype(np.float32)  # the channel's dtype, then the wire's
            row_ids[stale], row_w[stale] = ID_FILL, np.nan
            if drop and last:
                row_ids[:], row_w[:] = ID_FILL, np.nan
            want_ids[r].append(row_ids)
            want_w[r].append(row_w)
            dropped[r].append(drop and last)
    for r in range(len(counts)):
        ledger.finish(r)
    done = {f.req_id: f for f in ledger.collect()}
    assert sorted(done) == list(range(len(counts)))
    for r, n in enumerate(counts):
        f = done[r]
        assert list(f.channels) == ["weights"] and f.channels["weights"].dtype == w_dtype
        assert np.array_equal(f.missing, np.array(dropped[r], bool).reshape(n))
        ids_want = np.array(want_ids[r], SHAPE.id_dtype).reshape(n, 3, 2)
        w_want = np.array(want_w[r], np.float32).reshape(n, 3, 2)
        ids_text = encode_routing(f.routing)
        ids_back = decode_routing(ids_text, num_layers=3, top_k=2, dtype=SHAPE.id_dtype)
        assert np.array_equal(ids_back, ids_want)
        bf16 = decode_routing_weights(encode_routing_weights(f.channels["weights"]), num_layers=3, top_k=2)
        assert _same(bf16, _ref_bfloat16(w_want))
        assert np.isnan(bf16[:, stale]).all() and np.isnan(bf16[f.missing]).all()
        f32 = decode_routing_weights(encode_routing_weights(f.channels["weights"], dtype="float32"))
        assert _same(f32, w_want)


@pytest.mark.parametrize("dtype", WEIGHT_WIRE_DTYPES)
def test_bfloat16_bits_from_a_capture_channel_encode_as_their_values(dtype):
    """A RoutingCapturer with a bfloat16 weights buffer snapshots uint16 bits (0xFFFF where a layer
    was not captured): they encode as the bfloat16 values they are, NaN kept."""
    rng = np.random.default_rng(5)
    values = rng.random((4, 3, 2)).astype(np.float32)
    bits = bfloat16_bits(values)
    bits[1, 2] = 0xFFFF  # the channel's fill: a stale layer
    got = decode_routing_weights(encode_routing_weights(bits, dtype=dtype))
    want = from_bfloat16_bits(bits)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)  # exact, NaN where NaN
    assert np.isnan(got[1, 2]).all() and not np.isnan(np.delete(got.reshape(12, 2), 5, axis=0)).any()
