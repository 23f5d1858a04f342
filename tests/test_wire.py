"""Wire formats: base64 .npy interoperability, the raw-bytes form, and hostile input."""

from __future__ import annotations

import base64
import io
import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import routing_rows, routing_shapes

from moe_ops import decode_routing, decode_routing_bytes, encode_routing, encode_routing_bytes, wire

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


def _raw(code=1, ndim=1, version=1, magic=b"MOER", dims=(2,), data=b"\x01\x02"):
    return struct.pack("<4sBBBB", magic, version, code, ndim, 0) + struct.pack(f"<{len(dims)}Q", *dims) + data


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
