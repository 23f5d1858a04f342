"""Wire formats: base64 .npy and SGLang's raw text, interoperability with the clients' own decoding,
the raw-bytes form, and hostile input (fuzzed: every malformed input raises ValueError)."""

from __future__ import annotations

import base64
import gc
import io
import math
import pickle
import struct
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import (
    mutated,
    npy_payloads,
    raw_routing_payloads,
    routing_arrays,
    routing_rows,
    routing_shapes,
)

from moe_ops import (
    RoutingShape,
    decode_routing,
    decode_routing_bytes,
    encode_routing,
    encode_routing_bytes,
    wire,
)
from moe_ops.wire import _base as wire_base  # the base64 backend every format encodes with

INT_DTYPES = [np.uint8, np.uint16, np.int32, np.int16, np.int64, np.int8, np.uint32, np.uint64]


def _npy(array: np.ndarray, **kwargs) -> bytes:
    f = io.BytesIO()
    np.save(f, array, **kwargs)
    return f.getvalue()


@settings(max_examples=200)
@given(shape=routing_shapes(), n=st.integers(0, 20), seed=st.integers(0, 2**32 - 1))
def test_roundtrip_and_np_load_interop(shape, n, seed):
    rows = routing_rows(np.random.default_rng(seed), n, shape)
    s = encode_routing(rows)
    assert isinstance(s, str)
    theirs = np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)  # how clients read it
    assert theirs.dtype == rows.dtype and np.array_equal(theirs, rows)
    ours = decode_routing(s)
    assert ours.dtype == rows.dtype and np.array_equal(ours, rows) and ours.flags.writeable
    raw = encode_routing_bytes(rows)
    back = decode_routing_bytes(raw)
    assert back.dtype == rows.dtype and np.array_equal(back, rows) and back.flags.writeable


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_integer_dtype_and_engine_written_npy(dtype):
    info = np.iinfo(dtype)
    arr = np.array([[[info.min, info.max], [0, 1]]], dtype=dtype)
    # what an engine writes: np.save of its array, base64 of the bytes
    s = base64.b64encode(_npy(arr)).decode()
    assert np.array_equal(decode_routing(s), arr)
    assert np.array_equal(decode_routing(s.encode()), arr)  # bytes input too
    assert np.array_equal(decode_routing_bytes(encode_routing_bytes(arr)), arr)


def test_big_endian_fortran_and_non_contiguous_inputs():
    arr = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    s = base64.b64encode(_npy(arr.astype(">i4"))).decode()
    out = decode_routing(s)
    assert out.dtype == np.int32 and out.dtype.isnative and np.array_equal(out, arr)
    s = base64.b64encode(_npy(np.asfortranarray(arr))).decode()
    assert np.array_equal(decode_routing(s), arr)
    strided = arr[:, ::2]
    assert np.array_equal(decode_routing(encode_routing(strided)), strided)
    assert np.array_equal(decode_routing_bytes(encode_routing_bytes(strided)), strided)
    assert np.array_equal(decode_routing_bytes(encode_routing_bytes(arr.astype(">i4"))), arr)


def test_uses_pybase64_when_present_and_the_text_is_standard_base64():
    arr = np.arange(10, dtype=np.uint8)
    assert encode_routing(arr) == base64.b64encode(_npy(arr)).decode()
    try:
        import pybase64  # noqa: F401

        assert wire.HAS_PYBASE64
    except ImportError:
        assert not wire.HAS_PYBASE64


@pytest.mark.parametrize(
    "text, match",
    [
        ("not base64!!", "malformed base64"),
        ("QUJ", "malformed base64"),  # missing padding
        ("ÄÖÜ", "non-ASCII"),
        (base64.b64encode(b"hello world").decode(), r"malformed \.npy"),
        (base64.b64encode(_npy(np.arange(4, dtype=np.int32))[:-3]).decode(), "needs 16 bytes"),
        (base64.b64encode(_npy(np.arange(4, dtype=np.int32)) + b"\0").decode(), "needs 16 bytes"),
        (base64.b64encode(_npy(np.arange(4, dtype=np.float32))).decode(), "integer dtype"),
        (base64.b64encode(_npy(np.array([True]))).decode(), "integer dtype"),
        (base64.b64encode(_npy(np.zeros(2, dtype=[("a", "<i4")]))).decode(), "integer dtype"),
        (
            base64.b64encode(_npy(np.array([1, "x"], dtype=object), allow_pickle=True)).decode(),
            "object dtypes",
        ),
    ],
)
def test_decode_rejects_bad_input(text, match):
    with pytest.raises(ValueError, match=match):
        decode_routing(text)


class _Boom:
    def __reduce__(self):
        return (pytest.fail, ("decode_routing unpickled the payload",))


def test_never_unpickles():
    payload = np.array([_Boom()], dtype=object)
    s = base64.b64encode(_npy(payload, allow_pickle=True)).decode()
    with pytest.raises(ValueError, match="object dtypes"):
        decode_routing(s)
    # a raw pickle stream (no .npy header) is not .npy data at all
    with pytest.raises(ValueError, match=r"malformed \.npy"):
        decode_routing(base64.b64encode(pickle.dumps(np.arange(3))).decode())


def _huge_header(shape: tuple[int, ...]) -> str:
    """A valid .npy header announcing ``shape`` with no data after it."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<i4", "fortran_order": False, "shape": shape})
    return base64.b64encode(f.getvalue()).decode()


def test_max_elements_is_checked_from_the_header_before_allocating():
    # 2**40 int32 elements (4 TiB): only a header check can refuse this without allocating
    s = _huge_header((1 << 20, 1 << 12, 1 << 8))
    with pytest.raises(ValueError, match="more than max_elements=1000"):
        decode_routing(s, max_elements=1000)
    with pytest.raises(ValueError, match="needs 4398046511104 bytes"):
        decode_routing(s)  # no limit: still refused, the bytes are not there
    arr = np.zeros((10, 3, 2), np.uint8)
    assert decode_routing(encode_routing(arr), max_elements=60).shape == (10, 3, 2)
    with pytest.raises(ValueError, match="60 elements, more than max_elements=59"):
        decode_routing(encode_routing(arr), max_elements=59)
    with pytest.raises(ValueError, match="more than max_elements=59"):
        decode_routing_bytes(encode_routing_bytes(arr), max_elements=59)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_value_error_only(data):
    for s in (base64.b64encode(data).decode(), base64.b64encode(b"\x93NUMPY\x01\x00" + data).decode()):
        try:
            out = decode_routing(s, max_elements=10_000)
        except ValueError:
            continue
        assert out.dtype.kind in "iu" and out.size <= 10_000
    try:
        out = decode_routing_bytes(b"MOER\x01" + data, max_elements=10_000)
    except ValueError:
        return
    assert out.dtype.kind in "iu"


def _raw(code=1, ndim=1, version=1, magic=b"MOER", dims=(2,), data=b"\x01\x02", reserved=0):
    head = struct.pack("<4sBBBB", magic, version, code, ndim, reserved)
    return head + struct.pack(f"<{len(dims)}Q", *dims) + data


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"MOE", "shorter"),
        (_raw(magic=b"NOPE"), "must start with b'MOER'"),
        (_raw(version=2), "unsupported raw routing version 2"),
        (_raw(code=99), "unknown dtype code 99"),
        (_raw(ndim=9, dims=(1,) * 9, data=b"\x00"), "ndim 9 exceeds 8"),
        (_raw(ndim=2, dims=(2,)), "end inside the shape"),
        (_raw(data=b"\x01"), "needs 2 bytes, got 1"),
        (_raw(data=b"\x01\x02\x03"), "needs 2 bytes, got 3"),
        (_raw(dims=(1 << 62,), data=b""), "more than max_elements"),
        (_raw(reserved=1), "byte 7 is reserved and must be 0, got 1"),
        (_raw(reserved=0xFF), "byte 7 is reserved and must be 0, got 255"),
        (_raw(code=3, ndim=2, dims=(0, 1 << 63), data=b""), "larger than numpy can hold"),
        (_raw(code=5, ndim=2, dims=(1 << 61, 0), data=b""), "larger than numpy can hold"),
    ],
)
def test_raw_bytes_rejects_bad_input(raw, match):
    with pytest.raises(ValueError, match=match):
        decode_routing_bytes(raw, max_elements=1 << 40)


def test_raw_bytes_layout_is_as_documented():
    arr = np.array([[1, 2, 3]], dtype=np.uint16)
    raw = encode_routing_bytes(arr)
    assert raw[:8] == b"MOER\x01\x02\x02\x00"  # magic, version 1, uint16 (code 2), ndim 2
    assert struct.unpack_from("<2Q", raw, 8) == (1, 3)
    assert raw[24:] == arr.astype("<u2").tobytes()


@pytest.mark.parametrize("bad", [np.zeros(3, np.float32), np.array([True]), np.array(["a"])])
def test_encode_rejects_non_integer_arrays(bad):
    with pytest.raises(ValueError, match="integer array"):
        encode_routing(bad)
    with pytest.raises(ValueError, match="integer array"):
        encode_routing_bytes(bad)


def test_negative_dimensions_are_refused():
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<i4", "fortran_order": False, "shape": (-2, -2)})
    s = base64.b64encode(f.getvalue() + bytes(16)).decode()
    with pytest.raises(ValueError, match="negative dimension"):
        decode_routing(s)


# ----------------------------------------------------------------------------- hostile .npy headers


def _npy_with_header(text: str, data: bytes = b"") -> str:
    """Base64 .npy text with a hand-written header (padded as numpy pads it: before the newline)."""
    text = text.removesuffix("\n")
    text = text + " " * (-(len(text) + 11) % 64) + "\n"
    return base64.b64encode(
        b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin-1") + data
    ).decode()


@pytest.mark.parametrize(
    "header, data, match",
    [
        # numpy's reader retried this through Python 2 token filtering: tokenize.TokenError
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (1,), } (\n", b"\x01", "not a Python literal"),
        # True is an int to numpy's reader; the array came out with shape (True, 2)
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (True, 2), }\n", b"\x01\x02", "tuple of ints"),
        # Python 2 longs, invalid escapes, "1if": the tokenizer would print warnings, so refused first
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (3L,), }\n", b"\x01\x02\x03", "no .npy header"),
        ("{'descr': '<u\\x31', 'fortran_order': False, 'shape': (1,), }\n", b"\x01", "no .npy header has"),
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (1if 1 else 2,), }\n", b"\x01", "no .npy header"),
        ("{'descr': '<u1', 'fortran_order': 0, 'shape': (1,), }\n", b"\x01", "fortran_order must be"),
        ("{'descr': '<u1', 'fortran_order': False, 'shape': [1], }\n", b"\x01", "tuple of ints"),
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (1.0,), }\n", b"\x01", "tuple of ints"),
        ("{'descr': '<u1', 'fortran_order': False}\n", b"\x01", r"dict of \['descr'"),
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (1,), 'x': 0}\n", b"\x01", "dict of"),
        ("[1, 2]\n", b"", "dict of"),
        ("{'descr': '<u3', 'fortran_order': False, 'shape': (1,), }\n", b"\x01", "integer dtype"),
        ("{'descr': 5, 'fortran_order': False, 'shape': (1,), }\n", b"\x01", "integer dtype"),
        ("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }\n", b"\x01", "object dtypes"),
        ("{'descr': '<i4', 'fortran_order': False, 'shape': (0, 2**63), }\n", b"", "Python literal"),
        (
            "{'descr': '<i4', 'fortran_order': False, 'shape': (0, 9223372036854775807), }\n",
            b"",
            "numpy can hold",
        ),
        (
            "{'descr': '<u1', 'fortran_order': False, 'shape': " + "(" * 300 + ")" * 300 + "}\n",
            b"",
            "literal",
        ),
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (" + "1, " * 33 + "), }\n", b"\x01", "33 dims"),
        ("{'descr': '<u1', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",), }\n", b"", "literal"),
    ],
)
def test_hostile_npy_headers_raise_value_error(header, data, match):
    with pytest.raises(ValueError, match=match):
        decode_routing(_npy_with_header(header, data))


def test_a_header_numpy_accepts_with_any_byte_order_descr_decodes():
    s = _npy_with_header("{'descr': '<u1', 'fortran_order': False, 'shape': (2, 1, 1), }\n", b"\x07\x09")
    out = decode_routing(s)
    assert out.dtype == np.uint8 and out.reshape(-1).tolist() == [7, 9]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_elements=-1), "max_elements must be None or an int >= 0, got -1"),
        (dict(max_elements="9"), "max_elements must be None or an int >= 0"),
        (dict(max_elements=True), "max_elements must be None or an int >= 0"),
        (dict(num_layers=0), "num_layers must be None or an int >= 1, got 0"),
        (dict(top_k=2.0), "top_k must be None or an int >= 1"),
        (dict(dtype="float32"), "dtype must be None or an integer numpy dtype, got float32"),
        (dict(dtype="nope"), "dtype must be None or an integer numpy dtype, got 'nope'"),
        # every registered format is named (npy and sglang at least; each format module adds one)
        (dict(format="json"), r"format must be one of \((?=.*'npy')(?=.*'sglang').*\), got 'json'"),
        (dict(format=None), "format must be one of"),
    ],
)
def test_decode_argument_values_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decode_routing(encode_routing(np.zeros((1, 1, 1), np.uint8)), **kwargs)


def test_decode_rejects_non_text_with_type_error():
    for bad in (None, 5, ["AAAA"], np.zeros(4, np.uint8)):
        with pytest.raises(TypeError, match="s must be str or bytes"):
            decode_routing(bad)
    with pytest.raises(TypeError, match="b must be bytes"):
        decode_routing_bytes("MOER")
    with pytest.raises(ValueError, match="max_elements must be None"):
        decode_routing_bytes(encode_routing_bytes(np.zeros(2, np.uint8)), max_elements=-5)


def test_a_0d_array_keeps_its_shape():
    for encode, decode in ((encode_routing, decode_routing), (encode_routing_bytes, decode_routing_bytes)):
        out = decode(encode(np.array(95, np.uint8)))
        assert out.shape == () and out == 95


def _strided_view(payload: bytes, step: int, offset: int, rows: int) -> memoryview:
    """``payload`` as a memoryview that is not contiguous: its bytes every ``step``-th of a larger
    buffer (poisoned with 0xAA between them), as ``rows`` rows when ``rows`` divides its length."""
    buf = np.full(offset + len(payload) * step, 0xAA, dtype=np.uint8)
    buf[offset::step] = np.frombuffer(payload, dtype=np.uint8)
    view = buf[offset::step]
    if rows > 1 and len(payload) % rows == 0:
        # 2-D and non-contiguous; a column slice of a wider array when step is 1
        wide = np.full((rows, 2 * len(payload) // rows), 0xAA, dtype=np.uint8)
        wide[:, ::2] = np.frombuffer(payload, dtype=np.uint8).reshape(rows, -1)
        view = wide[:, ::2] if step == 1 else view.reshape(rows, -1)
    return memoryview(view)


@settings(max_examples=100)
@given(
    array=routing_arrays(),
    step=st.integers(1, 5),
    offset=st.integers(0, 7),
    rows=st.integers(1, 4),
    form=st.sampled_from(["npy", "sglang", "raw"]),
)
def test_non_contiguous_memoryviews_decode_like_their_bytes(array, step, offset, rows, form):
    """A strided or 2-D memoryview of a payload decodes to what its bytes decode to (copied first)."""
    if form == "raw":
        payload, decode, kwargs = encode_routing_bytes(array), decode_routing_bytes, {}
    elif form == "sglang":
        assume(array.ndim == 3 and array.shape[1] >= 1 and array.shape[2] >= 1)
        array = array.astype(np.int32)
        payload = encode_routing(array, format="sglang").encode()
        decode = decode_routing
        kwargs = dict(format="sglang", num_layers=array.shape[1], top_k=array.shape[2], dtype=np.int32)
    else:
        payload, decode, kwargs = encode_routing(array).encode(), decode_routing, {}
    view = _strided_view(payload, step, offset, rows)
    out = decode(view, **kwargs)
    assert out.dtype == array.dtype.newbyteorder("=") and np.array_equal(out, array)
    assert np.array_equal(out, decode(payload, **kwargs))


def test_npy_shape_and_dtype_can_be_asserted():
    rows = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
    s = encode_routing(rows)
    assert np.array_equal(decode_routing(s, num_layers=3, top_k=4, dtype=np.uint16), rows)
    assert np.array_equal(decode_routing(s, top_k=4, dtype=">u2"), rows)  # byte order is the file's
    with pytest.raises(ValueError, match=r"has shape \(2, 3, 4\), but \(n, 61, \*\) was asked for"):
        decode_routing(s, num_layers=61)
    with pytest.raises(ValueError, match="has dtype uint16, but dtype=uint8 was asked for"):
        decode_routing(s, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"has shape \(24,\)"):
        decode_routing(encode_routing(rows.reshape(-1)), num_layers=3, top_k=4)


# -------------------------------------------------------------------------------- format="sglang"


def _sglang_client_decode(s: str, num_layers: int, top_k: int, dtype=np.int32) -> np.ndarray:
    """What SGLang-based clients do with meta_info["routed_experts"] (little-endian hosts)."""
    return np.frombuffer(base64.b64decode(s), dtype=dtype).reshape(-1, num_layers, top_k)


@settings(max_examples=150)
@given(shape=routing_shapes(), n=st.integers(0, 9), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_sglang_text_is_what_sglang_clients_decode(shape, n, seed, data):
    dtype = data.draw(
        st.sampled_from([d for d in wire.SGLANG_DTYPES if np.iinfo(d).max >= shape.num_experts - 1])
    )
    rows = routing_rows(np.random.default_rng(seed), n, shape)
    array = shape.sglang_layout(rows, dtype=dtype)
    s = encode_routing(array, format="sglang")
    theirs = _sglang_client_decode(s, shape.num_model_layers, shape.top_k, dtype)
    assert np.array_equal(theirs, array)
    assert np.array_equal(theirs[:, list(shape.moe_layers)], rows)
    ours = decode_routing(
        s, format="sglang", num_layers=shape.num_model_layers, top_k=shape.top_k, dtype=dtype
    )
    assert ours.dtype == dtype and ours.flags.writeable and np.array_equal(ours, array)


def test_sglang_encode_writes_little_endian_and_refuses_what_clients_cannot_read():
    rows = np.array([[[1, 258]]], dtype=">i4")
    assert base64.b64decode(encode_routing(rows, format="sglang")) == b"\x01\x00\x00\x00\x02\x01\x00\x00"
    with pytest.raises(ValueError, match=r"format='sglang' writes int32, uint16, uint8 ids.*int64"):
        encode_routing(rows.astype(np.int64), format="sglang")
    with pytest.raises(ValueError, match=r"3-D \(n, num_layers, top_k\) array.*shape \(2,\)"):
        encode_routing(np.zeros(2, np.int32), format="sglang")
    with pytest.raises(ValueError, match="integer array"):
        encode_routing(np.zeros((1, 1, 1), np.float32), format="sglang")
    with pytest.raises(ValueError, match="format must be one of"):
        encode_routing(rows, format="SGLANG")


def test_sglang_decode_needs_the_shape_and_dtype_and_whole_rows():
    s = encode_routing(np.arange(12, dtype=np.int32).reshape(2, 3, 2), format="sglang")
    with pytest.raises(ValueError, match="carries no header: pass num_layers, top_k, dtype"):
        decode_routing(s, format="sglang")
    with pytest.raises(ValueError, match="pass dtype"):
        decode_routing(s, format="sglang", num_layers=3, top_k=2)
    with pytest.raises(ValueError, match=r"dtype must be one of int32, uint16, uint8.*got int64"):
        decode_routing(s, format="sglang", num_layers=3, top_k=2, dtype=np.int64)
    # 48 bytes: 2 rows of 3 x 2 int32, 4 of uint16 - but not a whole number of 5 x 2 int32 rows
    with pytest.raises(ValueError, match="holds 48 bytes, not a whole number of 40-byte rows"):
        decode_routing(s, format="sglang", num_layers=5, top_k=2, dtype=np.int32)
    assert decode_routing(s, format="sglang", num_layers=3, top_k=2, dtype=np.uint16).shape == (4, 3, 2)
    with pytest.raises(ValueError, match="12 elements, more than max_elements=11"):
        decode_routing(s, format="sglang", num_layers=3, top_k=2, dtype=np.int32, max_elements=11)
    assert decode_routing("", format="sglang", num_layers=3, top_k=2, dtype=np.int32).shape == (0, 3, 2)
    for bad, match in [("AAA", "not a multiple of 4"), ("AA=A", "malformed base64"), ("ÄÄÄÄ", "non-ASCII")]:
        with pytest.raises(ValueError, match=match):
            decode_routing(bad, format="sglang", num_layers=1, top_k=1, dtype=np.uint8)


def test_sglang_size_is_checked_before_decoding():
    """78 MB of base64 announcing 30,000 rows of 61 x 8 int32 ids: refused from the length alone,
    before a byte of it is decoded or allocated."""
    huge = "A" * (30_000 * 61 * 8 * 4 * 4 // 3)
    assert len(huge) * 3 // 4 == 30_000 * 61 * 8 * 4
    with pytest.raises(ValueError, match="more than max_elements=1000000"):
        decode_routing(huge, format="sglang", num_layers=61, top_k=8, dtype=np.int32, max_elements=10**6)
    with pytest.raises(ValueError, match="not a whole number of"):
        decode_routing(huge, format="sglang", num_layers=61, top_k=7, dtype=np.int32)


# ---------------------------------------------------------------------------- fuzz: both decoders
#
# Thousands of cases, each decode held to 10 ms of CPU time: every malformed input raises
# ValueError, and whatever decodes agrees with an independent reader (np.load, SGLang's
# np.frombuffer, a re-encode).

FUZZ = settings(max_examples=1000)


def _quietly(decode, *args, **kwargs):
    """``decode(*args, **kwargs)``, or None for a ValueError; it must not emit a warning and must
    take under 10 ms of this thread's CPU time.

    CPU time, not wall time: other processes on a shared 2-core machine stretched 0.2 ms cases to
    16 ms of wall time. The collector is off while it is timed (a full collection of this process's
    heap takes ~190 ms here), and a case over 10 ms is timed twice more, the best of three counting:
    once in a full-suite run one 0.2 ms case still read 40 ms; a slow input is slow every time."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        best = math.inf
        for _ in range(3):
            gc.disable()
            start = time.thread_time()
            try:
                out = decode(*args, **kwargs)
            except ValueError:
                out = None
            finally:
                best = min(best, time.thread_time() - start)
                gc.enable()
            if best < 0.010:
                break
    assert not caught, f"decoding warned: {caught[0].message}"
    assert best < 0.010, f"one decode took {best * 1e3:.1f} ms of CPU time (best of 3)"
    return out


def _agrees_with_np_load(payload: bytes) -> None:
    ours = _quietly(decode_routing, base64.b64encode(payload), max_elements=1 << 16)
    if ours is None:
        return
    theirs = np.load(io.BytesIO(payload), allow_pickle=False)
    assert ours.dtype.kind in "iu" and ours.dtype.isnative and ours.flags.writeable
    assert ours.dtype == theirs.dtype.newbyteorder("=") and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


@FUZZ
@given(payload=npy_payloads())
def test_fuzz_npy_generated_headers(payload):
    _agrees_with_np_load(payload)


@FUZZ
@given(data=st.data(), array=routing_arrays())
def test_fuzz_npy_mutated_payloads(data, array):
    f = io.BytesIO()
    np.save(f, array, allow_pickle=False)
    _agrees_with_np_load(data.draw(mutated(f.getvalue(), keep=10)))


@FUZZ
@given(
    payload=st.one_of(
        raw_routing_payloads(),
        routing_arrays().map(encode_routing_bytes).flatmap(lambda raw: mutated(raw, keep=4)),
    )
)
def test_fuzz_raw_bytes(payload):
    out = _quietly(decode_routing_bytes, payload, max_elements=1 << 16)
    if out is None:
        return
    # the format is canonical: whatever decodes re-encodes to the very same bytes
    assert encode_routing_bytes(out) == payload and out.flags.writeable


@FUZZ
@given(
    data=st.data(),
    num_layers=st.integers(1, 5),
    top_k=st.integers(1, 4),
    dtype=st.sampled_from(wire.SGLANG_DTYPES),
)
def test_fuzz_sglang_text(data, num_layers, top_k, dtype):
    raw = data.draw(st.binary(max_size=160))
    text = data.draw(
        st.one_of(
            st.just(base64.b64encode(raw).decode()),
            st.just(base64.b64encode(raw).decode()).flatmap(lambda t: mutated(t.encode())),
            st.text(alphabet="ABCDEFGHabcdef0123456789+/=\n -_Ä", max_size=40),
        )
    )
    out = _quietly(decode_routing, text, format="sglang", num_layers=num_layers, top_k=top_k, dtype=dtype)
    if out is None:
        return
    theirs = _sglang_client_decode(text, num_layers, top_k, dtype.newbyteorder("<"))
    assert out.dtype == dtype and np.array_equal(out, theirs)


@FUZZ
@given(text=st.one_of(st.text(max_size=64), st.binary(max_size=64)))
def test_fuzz_any_text_npy(text):
    out = _quietly(decode_routing, text)
    assert out is None or out.dtype.kind in "iu"


def test_both_base64_backends_give_the_same_text_and_arrays(monkeypatch):
    """pybase64 where installed (a default dependency), the standard library where it cannot be;
    the text and the decoded arrays are the same."""
    rows = np.random.default_rng(7).integers(0, 300, size=(33, 5, 3)).astype(np.uint16)
    texts = {}
    for backend in ("installed", "stdlib"):
        if backend == "stdlib":
            monkeypatch.setattr(wire_base, "_b64", base64)
            monkeypatch.setattr(wire_base, "HAS_PYBASE64", False)
        texts[backend] = (encode_routing(rows), encode_routing(rows, format="sglang"))
        assert np.array_equal(decode_routing(texts[backend][0]), rows)
        back = decode_routing(texts[backend][1], format="sglang", num_layers=5, top_k=3, dtype=np.uint16)
        assert np.array_equal(back, rows)
        with pytest.raises(ValueError, match="malformed base64"):
            decode_routing(texts[backend][0][:-4] + "A=A=")
    assert texts["installed"] == texts["stdlib"]


def test_pybase64_is_a_default_dependency():
    tomllib = pytest.importorskip("tomllib")  # the standard library from Python 3.11
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "pybase64" for dep in project["dependencies"])


def test_vllm_text_is_what_vllm_clients_decode():
    """vLLM's routed_experts: base64 .npy, every model layer (dense ones 0), uint8 up to 256 experts."""
    shape = RoutingShape(3, 256, 2, moe_layers=(1, 3, 4), num_model_layers=5)
    rows = routing_rows(np.random.default_rng(3), 6, shape)
    s = encode_routing(shape.vllm_layout(rows))
    theirs = np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)
    assert theirs.shape == (6, 5, 2) and theirs.dtype == np.uint8
    assert (theirs[:, [0, 2]] == 0).all() and np.array_equal(theirs[:, [1, 3, 4]], rows)
    assert math.prod(theirs.shape) == theirs.size


# ------------------------------------------------------------------ the registry: every format
#
# Each test below runs for every registered format, so a new format module gets them without a
# line here: its round trip, its self-description, and hostile text refused with ValueError only.

FORMAT_NAMES = sorted(wire.FORMATS)


def _format_arrays(fmt):
    """3-D arrays a format carries: its dtypes (every integer dtype when the text says which), any
    byte order and memory order, values over the dtype's whole range."""
    dtypes = fmt.dtypes if fmt.dtypes is not None else INT_DTYPES
    return routing_arrays(dtypes=dtypes).filter(lambda a: a.ndim == 3 and a.shape[1] >= 1 and a.shape[2] >= 1)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@settings(max_examples=100)
@given(data=st.data())
def test_every_format_round_trips_each_of_its_dtypes(name, data):
    fmt = wire.FORMATS[name]
    array = data.draw(_format_arrays(fmt))
    text = encode_routing(array, format=name)
    assert isinstance(text, str) and text.isascii()
    native = array.dtype.newbyteorder("=")
    _, num_layers, top_k = array.shape
    for s in (text, text.encode(), bytearray(text.encode()), memoryview(text.encode())):
        out = decode_routing(s, format=name, num_layers=num_layers, top_k=top_k, dtype=native)
        assert out.dtype == native and out.flags.writeable and out.flags.c_contiguous
        assert np.array_equal(out, array)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format_describes_itself(name):
    fmt = wire.FORMATS[name]
    assert fmt.name == name and name in wire.WIRE_FORMATS
    assert wire.wire_format(name) is fmt
    assert fmt.layer_axes and set(fmt.layer_axes) <= {"moe", "model"}
    dtype = (fmt.dtypes or (np.dtype(np.uint8),))[0]
    text = encode_routing(np.zeros((2, 3, 1), dtype), format=name)
    if fmt.magic is None:
        assert wire.sniff_format(text) is not fmt
    else:
        assert text.startswith(fmt.magic) and wire.sniff_format(text) is fmt
        assert wire.sniff_format(text.encode()) is fmt
    if fmt.dtypes is not None:  # a dtype the format does not carry is refused, naming the format
        other = next(d for d in map(np.dtype, INT_DTYPES) if d not in fmt.dtypes)
        with pytest.raises(ValueError, match=f"format='{name}'"):
            encode_routing(np.zeros((1, 1, 1), other), format=name)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@settings(max_examples=300)
@given(data=st.data())
def test_every_format_refuses_hostile_text_with_value_error_only(name, data):
    """Any text, and the format's own texts mutated: a ValueError or an integer array no larger
    than max_elements, never a warning, under 10 ms of CPU time (test_wire's _quietly)."""
    fmt = wire.FORMATS[name]
    dtype = (fmt.dtypes or (np.dtype(np.uint8),))[0]
    own = data.draw(_format_arrays(fmt)).astype(dtype)
    text = data.draw(
        st.one_of(
            st.text(max_size=64),
            st.binary(max_size=64),
            st.just(encode_routing(own, format=name).encode()).flatmap(lambda t: mutated(t, keep=8)),
            st.text(max_size=40).map(lambda t: (fmt.magic or "") + t),
        )
    )
    kwargs = dict(format=name, num_layers=own.shape[1], top_k=own.shape[2], dtype=dtype)
    out = _quietly(decode_routing, text, max_elements=1 << 12, **kwargs)
    assert out is None or (out.dtype == dtype and out.size <= 1 << 12 and out.shape[1:] == own.shape[1:])


def test_the_registry_takes_every_public_module_and_refuses_one_without_its_format(tmp_path, monkeypatch):
    """Every module of moe_ops/wire/ not named _* is a format: one without a FORMAT, or with a
    FORMAT named otherwise than the module, stops the import instead of being skipped."""
    import sys

    assert tuple(wire.FORMATS) == wire.WIRE_FORMATS == tuple(sorted(wire.FORMATS))
    monkeypatch.setattr(wire, "__path__", [*wire.__path__, str(tmp_path)])
    for module, body, match in [
        ("zz_none", "X = 1\n", "must define FORMAT, a WireFormat named 'zz_none'"),
        ("zz_named", "from moe_ops.wire import npy\nFORMAT = npy.FORMAT\n", "named 'zz_named'"),
    ]:
        (tmp_path / f"{module}.py").write_text(body)
        try:
            with pytest.raises(ImportError, match=match):
                wire._discover()
        finally:
            (tmp_path / f"{module}.py").unlink()
            sys.modules.pop(f"moe_ops.wire.{module}", None)
    assert set(wire._discover()) == set(wire.FORMATS)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(name="two-words"), "name must be an identifier"),
        (dict(layer_axes=("decoder",)), "layer_axes must be a non-empty tuple of"),
        (dict(layer_axes=()), "layer_axes must be a non-empty tuple of"),
        (dict(dtypes=(np.dtype(np.float32),)), "native integer np.dtype"),
        (dict(dtypes=(np.dtype(">i4"),)), "native integer np.dtype"),
        (dict(magic=""), "magic must be None or non-empty ASCII"),
        (dict(magic="Ä:"), "magic must be None or non-empty ASCII"),
        (dict(decode=None), "must be callable"),
    ],
)
def test_a_wire_format_is_checked_where_it_is_defined(fields, match):
    good = dict(
        name="x", layer_axes=("moe",), dtypes=None, magic="x:", encode=lambda a: "", decode=lambda s, **kw: s
    )
    with pytest.raises(ValueError, match=match):
        wire.WireFormat(**{**good, **fields})
