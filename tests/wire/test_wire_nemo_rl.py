"""format="nemo_rl": NeMo-RL's ``nrlre1:<dtype>:<S>x<L>x<K>:<base64>`` envelope, checked against
texts built by NeMo-RL's rules (tests/strategies/wire.py: nemo_rl_envelope) and its own reader (below),
hostile envelopes (ValueError only, sizes checked before anything is allocated) and the layout."""

from __future__ import annotations

import base64
import re
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    mutated,
    nemo_rl_arrays,
    nemo_rl_envelope,
    nemo_rl_hostile_envelopes,
    routing_rows,
    routing_shapes,
)
from test_wire import _quietly

from moe_ops import RoutingShape, decode_routing, encode_routing, replay_batch
from moe_ops.cli import main
from moe_ops.wire import FORMATS, sniff_format
from moe_ops.wire.nemo_rl import nemo_rl_dtype, nemo_rl_layout


def _nemo_rl_decode(payload: str) -> np.ndarray:
    """What NeMo-RL's ``decode_routed_experts`` does with an envelope (nemo_rl/utils/
    routed_experts_codec.py), in numpy: split on the first three colons, ``int()`` of each size,
    ``np.frombuffer`` of the base64 in the named dtype (little-endian hosts)."""
    parts = payload.split(":", 3)
    if len(parts) != 4 or parts[0] != "nrlre1":
        raise ValueError("not an envelope")
    _, name, sizes, data = parts
    dtype = {"int8": np.int8, "int16": np.int16, "int32": np.int32}[name]
    shape = tuple(int(d) for d in sizes.split("x"))
    if len(shape) != 3:
        raise ValueError("not 3-D")
    arr = np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype).newbyteorder("<"))
    if arr.size != shape[0] * shape[1] * shape[2]:
        raise ValueError("size")
    return arr.reshape(shape).astype(dtype)


# --------------------------------------------------------------------------- the round trip


@settings(max_examples=300)
@given(array=nemo_rl_arrays())
def test_texts_are_what_nemo_rl_writes_and_nemo_rls_texts_decode(array):
    """Both ways, byte for byte: moe-ops' text is the envelope NeMo-RL's rules give, and that
    envelope decodes to the array (str, bytes and memoryview alike), as NeMo-RL reads it."""
    theirs = nemo_rl_envelope(array)
    assert encode_routing(array, format="nemo_rl") == theirs
    native = array.dtype.newbyteorder("=")
    for s in (theirs, theirs.encode(), memoryview(theirs.encode())):
        out = decode_routing(s, format="nemo_rl")
        assert out.dtype == native and out.flags.writeable and out.shape == array.shape
        assert np.array_equal(out, array)
    assert np.array_equal(_nemo_rl_decode(theirs), array)


@pytest.mark.parametrize(
    "text, values, shape, dtype",
    [
        # NeMo-Gym's test of the opaque envelope (TokenIDLogProbMixin): int16 0, 1, 2, 3 little-endian
        ("nrlre1:int16:2x1x2:AAABAAIAAwA=", [0, 1, 2, 3], (2, 1, 2), np.int16),
        # bytes ff ff 03 07: a row with no route captured (-1, -1), then experts 3 and 7
        ("nrlre1:int8:2x1x2://8DBw==", [-1, -1, 3, 7], (2, 1, 2), np.int8),
        # bytes 01 00 00 00 02 01 00 00: 1 and 258 as little-endian int32
        ("nrlre1:int32:1x1x2:AQAAAAIBAAA=", [1, 258], (1, 1, 2), np.int32),
        # no tokens: an empty payload
        ("nrlre1:int16:0x61x8:", [], (0, 61, 8), np.int16),
    ],
)
def test_literal_envelopes_decode_to_the_values_worked_out_by_hand(text, values, shape, dtype):
    out = decode_routing(text, format="nemo_rl")
    assert out.dtype == dtype and out.shape == shape and out.reshape(-1).tolist() == values
    assert encode_routing(out, format="nemo_rl") == text


def test_encode_writes_little_endian_and_refuses_what_nemo_rl_cannot_read():
    assert (
        encode_routing(np.array([[[1, 258]]], ">i4"), format="nemo_rl") == "nrlre1:int32:1x1x2:AQAAAAIBAAA="
    )
    for dtype in (np.uint8, np.uint16, np.int64):
        with pytest.raises(
            ValueError, match=r"format='nemo_rl' writes int8, int16, int32 ids.*nemo_rl_layout"
        ):
            encode_routing(np.zeros((1, 1, 1), dtype), format="nemo_rl")
    with pytest.raises(ValueError, match=r"3-D \(tokens, num_moe_layers, top_k\) array, got shape \(4,\)"):
        encode_routing(np.zeros(4, np.int16), format="nemo_rl")
    with pytest.raises(ValueError, match="integer array"):
        encode_routing(np.zeros((1, 1, 1), np.float32), format="nemo_rl")


def test_the_registry_knows_it():
    fmt = FORMATS["nemo_rl"]
    assert fmt.layer_axes == ("moe",) and fmt.magic == "nrlre1:"
    assert [d.name for d in fmt.dtypes] == ["int8", "int16", "int32"]
    assert sniff_format("nrlre1:int16:2x1x2:AAABAAIAAwA=") is fmt and sniff_format(b"nrlre1:") is fmt
    assert sniff_format("nrlre2:int16:2x1x2:AAABAAIAAwA=") is None
    with pytest.raises(ValueError, match=r"format must be one of \(.*'nemo_rl'.*\), got 'nrlre1'"):
        decode_routing("nrlre1:int16:2x1x2:AAABAAIAAwA=", format="nrlre1")


# --------------------------------------------------------------------------- hostile input

GOOD = "nrlre1:int16:2x1x2:AAABAAIAAwA="


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "not an nrlre1 envelope"),
        ("nrlre2:int16:2x1x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        ("NRLRE1:int16:2x1x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        ("nrlre1:uint16:2x1x1:AAAA", "not an nrlre1 envelope"),  # NeMo-Gym's rejected example
        ("nrlre1:int64:1x1x1:AAAAAAAAAAA=", "not an nrlre1 envelope"),
        ("nrlre1:int16:2x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        ("nrlre1:int16:1x2x1x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        # sizes NeMo-RL's int() takes and its writer never writes
        ("nrlre1:int16:+2x1x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        ("nrlre1:int16: 2x1x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        ("nrlre1:int16:2_0x1x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        ("nrlre1:int16:\u0662x1x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        ("nrlre1:int16:-2x1x2:AAABAAIAAwA=", "not an nrlre1 envelope"),
        ("nrlre1:int16:" + "9" * 20 + "x1x2:", "not an nrlre1 envelope"),
        ("nrlre1:int16:2x1x2", "not an nrlre1 envelope"),
        # the payload against the header
        (
            "nrlre1:int16:2x1x2:AAABAAIAAw==",
            r"declares shape \(2, 1, 2\) of int16 \(8 bytes\), but its base64 holds 7",
        ),
        ("nrlre1:int16:3x1x2:AAABAAIAAwA=", r"\(12 bytes\), but its base64 holds 8"),
        ("nrlre1:int16:2x1x2:AAAB=AIAAwA=", "malformed base64"),  # padding inside
        ("nrlre1:int16:2x1x2:AAABAAIAAwA", "not a multiple of 4"),
        ("nrlre1:int16:2x1x2:AAAB\nAIAAwA=", "malformed base64"),  # NeMo-RL's reader skips it
        ("nrlre1:int16:2x1x2:AAABAAIAAwA=\n", "not a multiple of 4"),
        ("nrlre1:int16:2x1x2:AAAB-AIAAwA=", "malformed base64"),
        ("nrlre1:int16:2x1x2:AAAB:AIAAwA=", "malformed base64"),
        # sizes numpy cannot hold, checked before the payload
        ("nrlre1:int32:9223372036854775807x2x1:", "larger than numpy can hold"),
    ],
)
def test_hostile_envelopes_raise_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        decode_routing(text, format="nemo_rl")
    with pytest.raises(ValueError, match=match):
        decode_routing(text.encode(), format="nemo_rl")


def test_what_the_caller_asks_for_is_checked_from_the_header():
    assert decode_routing(GOOD, format="nemo_rl", num_layers=1, top_k=2, dtype=">i2").shape == (2, 1, 2)
    # the payload is not valid base64: the header's answer comes first, nothing is decoded
    broken = GOOD[:-4] + "!!!="
    with pytest.raises(ValueError, match=r"nrlre1 envelope has shape \(2, 1, 2\), but \(n, 61, \*\)"):
        decode_routing(broken, format="nemo_rl", num_layers=61)
    with pytest.raises(ValueError, match="nrlre1 envelope has dtype int16, but dtype=int32 was asked for"):
        decode_routing(broken, format="nemo_rl", dtype=np.int32)
    with pytest.raises(ValueError, match="4 elements, more than max_elements=3"):
        decode_routing(broken, format="nemo_rl", max_elements=3)
    with pytest.raises(ValueError, match="malformed base64"):
        decode_routing(broken, format="nemo_rl", max_elements=4)
    with pytest.raises(ValueError, match="non-ASCII"):
        decode_routing(GOOD[:-2] + "Ä=", format="nemo_rl")
    with pytest.raises(TypeError, match="s must be str or bytes"):
        decode_routing(["nrlre1"], format="nemo_rl")


@settings(max_examples=1000)
@given(
    text=st.one_of(
        nemo_rl_hostile_envelopes(),
        nemo_rl_arrays().map(nemo_rl_envelope).flatmap(lambda t: mutated(t.encode(), keep=7)),
    )
)
def test_fuzz_envelopes(text):
    """Generated and mutated envelopes: ValueError only, no warning, under 10 ms of CPU time; what
    decodes is what NeMo-RL's own reader makes of the same text."""
    out = _quietly(decode_routing, text, format="nemo_rl", max_elements=1 << 16)
    if out is None:
        return
    if isinstance(text, bytes):
        text = text.decode("ascii")  # it decoded: the header and the base64 are ASCII
    theirs = _nemo_rl_decode(text)
    assert out.dtype == theirs.dtype and out.shape == theirs.shape and np.array_equal(out, theirs)


# --------------------------------------------------------------------------- bounded memory


def _peak(call) -> tuple[int, BaseException | None]:
    """Peak bytes traced (numpy's buffers included) while ``call()`` runs, and what it raised."""
    tracemalloc.start()
    try:
        call()
        error = None
    except Exception as e:
        error = e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, error


def test_declared_sizes_are_refused_before_anything_of_their_size_is_allocated():
    """Envelopes declaring 2**40 elements, or a 32 MB payload under a 1-element header: refused
    from the header and the text's length, with under 64 KiB traced (the text itself is the
    caller's and was allocated before)."""
    huge_payload = "nrlre1:int16:1x1x1:" + "A" * (32 << 20)
    for text, kwargs, match in [
        ("nrlre1:int32:1099511627776x61x8:AAAA", {}, r"declares shape \(1099511627776, 61, 8\)"),
        ("nrlre1:int32:1099511627776x61x8:AAAA", {"max_elements": 10**6}, "more than max_elements=1000000"),
        (huge_payload, {}, r"\(2 bytes\), but its base64 holds 25165824 bytes"),
        (huge_payload.encode(), {}, "but its base64 holds 25165824 bytes"),
    ]:
        peak, error = _peak(lambda text=text, kwargs=kwargs: decode_routing(text, format="nemo_rl", **kwargs))
        assert isinstance(error, ValueError) and re.search(match, str(error)), error
        assert peak < 64 << 10, f"{peak} bytes traced refusing {str(text)[:40]!r}"


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_valid_decode_allocates_a_small_multiple_of_its_array(as_bytes):
    """4,096 tokens x 61 layers x 8 int16 ids (4 MB). A str's payload is copied once (5.3 MB of
    text), then decoded (4 MB) and copied into a writable array (4 MB): measured peak 2.3x the
    array from str, 2.0x from bytes (the payload is a view); bound 3x."""
    array = np.random.default_rng(0).integers(-1, 256, size=(4096, 61, 8)).astype(np.int16)
    text = nemo_rl_envelope(array)
    s = text.encode() if as_bytes else text
    out = []
    peak, error = _peak(lambda: out.append(decode_routing(s, format="nemo_rl")))
    assert error is None and np.array_equal(out[0], array)
    assert peak < 3 * array.nbytes, f"{peak / array.nbytes:.2f}x the array's bytes"


# --------------------------------------------------------------------------- dtype and layout


@pytest.mark.parametrize(
    "num_experts, dtype",
    # NeMo-RL's rule: int8 while num_experts - 1 <= 127, int16 while <= 32767, int32 beyond
    [(1, np.int8), (8, np.int8), (128, np.int8), (129, np.int16), (256, np.int16), (32768, np.int16),
     (32769, np.int32), (10**6, np.int32)],
)  # fmt: skip
def test_nemo_rl_dtype_is_the_narrowest_signed_dtype_for_ids_and_minus_one(num_experts, dtype):
    assert nemo_rl_dtype(num_experts) == dtype


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8", None])
def test_nemo_rl_dtype_refuses_what_is_no_expert_count(bad):
    with pytest.raises(ValueError, match="num_experts must be an int >= 1"):
        nemo_rl_dtype(bad)


def _expected_layout(shape, rows, empty, num_tokens):
    """The layout by its definition: each row's ids in the signed dtype NeMo-RL's rule picks, rows
    without a record all -1, a -1 row appended when there is a row fewer than tokens."""
    dtype = np.int8 if shape.num_experts <= 128 else np.int16 if shape.num_experts <= 32768 else np.int32
    out = []
    for i in range(len(rows)):
        out.append(np.full(rows.shape[1:], -1) if empty[i] else rows[i].astype(np.int64))
    if num_tokens is not None and num_tokens == len(rows) + 1:
        out.append(np.full(rows.shape[1:], -1))
    return np.array(out, dtype=dtype).reshape(-1, shape.num_layers, shape.top_k)


@settings(max_examples=150)
@given(shape=routing_shapes(), n=st.integers(0, 6), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_layout_writes_no_record_rows_as_minus_one(shape, n, seed, data):
    rng = np.random.default_rng(seed)
    rows = routing_rows(rng, n, shape)  # shape.id_dtype, whose fill is no id
    fill = np.iinfo(rows.dtype).max if rows.dtype.kind == "u" else -1
    filled = rng.random(n) < 0.3
    rows[filled] = fill
    missing = data.draw(st.sampled_from([None, rng.random(n) < 0.3]))
    num_tokens = data.draw(st.sampled_from([None, n + 1] + ([n] if n else [])))
    empty = filled | (missing if missing is not None else False)
    out = nemo_rl_layout(shape, rows, num_tokens=num_tokens, missing=missing)
    expected = _expected_layout(shape, rows, empty, num_tokens)
    assert out.dtype == expected.dtype and np.array_equal(out, expected)
    # and through the wire: NeMo-RL reads it back, and so does replay_batch on the format's axis
    text = encode_routing(out, format="nemo_rl")
    assert np.array_equal(_nemo_rl_decode(text), expected)
    if len(out):
        (axis,) = FORMATS["nemo_rl"].layer_axes
        ids = decode_routing(text, format="nemo_rl")
        batch = replay_batch([ids], shape, layer_axis=axis, num_tokens=[len(out)])
        assert np.array_equal(batch, expected.astype(np.int32))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s, r: nemo_rl_layout(s, r[:, :1]), r"shape \(n, 2, 2\), got \(3, 1, 2\)"),
        (lambda s, r: nemo_rl_layout(s, r.astype(np.float32)), "integer array, got dtype float32"),
        (lambda s, r: nemo_rl_layout(s, r + 300), r"ids in \[300, .*outside \[0, num_experts=300\)"),
        (lambda s, r: nemo_rl_layout(s, np.where(r == 5, -1, r)), r"row 1 is only partly without a record"),
        (
            lambda s, r: nemo_rl_layout(s, np.where(r == 5, 65535, r).astype(np.uint16)),
            "row 1 is only partly",
        ),
        (lambda s, r: nemo_rl_layout(s, np.where(r < 4, -2, r)), r"ids in \[-2, 11\], outside"),
        (lambda s, r: nemo_rl_layout(s, r, num_tokens=5), "3 rows for num_tokens=5: expected 4 .* or 5"),
        (lambda s, r: nemo_rl_layout(s, r, num_tokens=True), "num_tokens must be None or an int >= 1"),
        (
            lambda s, r: nemo_rl_layout(s, r, missing=np.zeros(2, bool)),
            r"missing must be None or a \(3,\) bool",
        ),
        (lambda s, r: nemo_rl_layout(s, r, missing=[False] * 3), r"missing must be None or a \(3,\) bool"),
    ],
)
def test_layout_refuses_what_nemo_rl_would_not_take(call, match):
    shape = RoutingShape(2, 300, 2, moe_layers=(0, 2), num_model_layers=3)
    rows = np.arange(12, dtype=np.int32).reshape(3, 2, 2)
    with pytest.raises(ValueError, match=match):
        call(shape, rows)


def test_layout_takes_a_missing_mask_over_whatever_the_rows_hold():
    """At 256 experts a uint8 row of 255 is a valid id (vLLM's dtype): only the ledger's mask says
    the row is missing, and it wins."""
    shape = RoutingShape(1, 256, 2)
    rows = np.array([[[255, 255]], [[1, 2]]], np.uint8)
    out = nemo_rl_layout(shape, rows, missing=np.array([True, False]))
    assert out.dtype == np.int16 and out.tolist() == [[[-1, -1]], [[1, 2]]]
    assert nemo_rl_layout(shape, rows).tolist() == [[[255, 255]], [[1, 2]]]


# --------------------------------------------------------------------------- moe-ops inspect


def test_inspect_reads_an_envelope_file(tmp_path, capsys):
    """moe-ops inspect finds the format by its prefix, through the registry."""
    path = tmp_path / "routed_experts.txt"
    path.write_text("nrlre1:int16:2x1x2://///wMABwA=\n")  # int16 -1, -1, 3, 7 little-endian
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "2 tokens x 1 MoE layers x top-2, dtype int16 (text nemo_rl)" in text
    assert "rows with no routing (marker -1): 1 of 2" in text and "ids in [3, 7]" in text
