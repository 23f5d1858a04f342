"""Wire formats for routing arrays: base64 ``.npy`` text, and a raw-bytes form.

Text (``encode_routing`` / ``decode_routing``): the base64 of the array's ``.npy`` bytes, the format
serving engines put in their ``routed_experts`` field, so any client can read it with
``np.load(io.BytesIO(base64.b64decode(s)))``. ``pybase64`` (SIMD) is used when importable, the
standard library otherwise; both produce and accept the same text.

Raw bytes (``encode_routing_bytes`` / ``decode_routing_bytes``), for clients that skip base64::

    offset  size        field
    0       4           magic b"MOER"
    4       1           version (1)
    5       1           dtype code: 1 uint8, 2 uint16, 3 int32, 4 int16, 5 int64, 6 int8, 7 uint32, 8 uint64
    6       1           ndim (0..8)
    7       1           reserved (0)
    8       8 * ndim    shape, uint64 little-endian each
    ...     prod(shape) * itemsize   the elements, C order, little-endian

Decoding never unpickles and never trusts a size before checking it: the element count comes from
the header and is checked against ``max_elements`` and against the bytes actually present before
any array is allocated. Bad input raises ValueError.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import struct

import numpy as np
import numpy.lib.format as npy_format

try:  # optional: SIMD base64, several times faster on large arrays
    import pybase64 as _b64

    HAS_PYBASE64 = True
except ImportError:
    _b64 = base64
    HAS_PYBASE64 = False

__all__ = [
    "HAS_PYBASE64",
    "decode_routing",
    "decode_routing_bytes",
    "encode_routing",
    "encode_routing_bytes",
]

RAW_MAGIC = b"MOER"
RAW_VERSION = 1
_RAW_HEADER = struct.Struct("<4sBBBB")
_RAW_CODES = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i4"),
    4: np.dtype("<i2"),
    5: np.dtype("<i8"),
    6: np.dtype("<i1"),
    7: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
_RAW_CODE_OF = {(d.kind, d.itemsize): code for code, d in _RAW_CODES.items()}
_RAW_MAX_NDIM = 8
# .npy headers that numpy itself writes are well under this; larger ones are refused unread
_MAX_NPY_HEADER = 10_000
# base64 characters that cover the magic, the header length field and the longest header we read
_HEADER_B64_CHARS = 4 * -(-(_MAX_NPY_HEADER + 12) // 3)


def _integer_array(array: np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be an integer array, got dtype {array.dtype}")
    return array


def encode_routing(array: np.ndarray) -> str:
    """Base64 text of ``array``'s ``.npy`` bytes (C order; integer dtypes only).

    ``np.load(io.BytesIO(base64.b64decode(s)))`` reads it back, as does :func:`decode_routing`.
    """
    array = np.ascontiguousarray(_integer_array(array, "array"))
    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, npy_format.header_data_from_array_1_0(array))
    head = header.getvalue()
    # One buffer (header + data, a single copy) encoded straight to str: encoding the parts,
    # concatenating and decoding the bytes to str cost 3 extra passes (33 ms for a 16 MB request
    # here, against 3.5 ms for pybase64's encode alone).
    buf = np.empty(len(head) + array.nbytes, dtype=np.uint8)
    buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    buf[len(head) :] = array.reshape(-1).view(np.uint8)
    if HAS_PYBASE64:
        return _b64.b64encode_as_string(buf)
    return base64.b64encode(buf).decode("ascii")


def _b64decode(s: str | bytes) -> bytes:
    if isinstance(s, str):
        if not s.isascii():
            raise ValueError("malformed base64: the text has non-ASCII characters")
    elif not isinstance(s, (bytes, bytearray, memoryview)):
        raise TypeError(f"s must be str or bytes, got {type(s).__name__}")
    try:
        # str is decoded as is (ASCII checked above): no 16 MB encode to bytes first
        return _b64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"malformed base64: {e}") from None


def _check_elements(shape: tuple[int, ...], max_elements: int | None) -> int:
    if any(d < 0 for d in shape):
        raise ValueError(f"array shape {shape} has a negative dimension")
    count = math.prod(shape)
    if max_elements is not None and count > max_elements:
        raise ValueError(
            f"array of shape {shape} has {count} elements, more than max_elements={max_elements}"
        )
    return count


def _check_dtype(dtype: np.dtype) -> None:
    if dtype.hasobject:
        raise ValueError(f"object dtypes are refused (they would need unpickling), got {dtype}")
    if dtype.kind not in "iu" or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"routing arrays must have an integer dtype, got {dtype}")


def decode_routing(s: str | bytes, *, max_elements: int | None = None) -> np.ndarray:
    """The array of a base64 ``.npy`` text (from :func:`encode_routing` or a serving engine).

    Args:
        s: base64 text (str or ASCII bytes).
        max_elements: refuse arrays with more elements than this (checked from the header, before
            the array is allocated). None: no limit.

    Returns a new, writable array in native byte order.

    Raises ValueError for malformed base64, a malformed or truncated ``.npy``, trailing bytes, an
    object or other non-integer dtype, or too many elements. Never unpickles.
    """
    if isinstance(s, (str, bytes, bytearray)) and len(s) > _HEADER_B64_CHARS:
        # Decode just the head first, so the header (shape, dtype) is checked before the whole
        # payload is decoded and allocated.
        _parse_npy_header(_b64decode(s[:_HEADER_B64_CHARS]), max_elements, complete=False)
    raw = _b64decode(s)
    shape, fortran, dtype, count, offset = _parse_npy_header(raw, max_elements, complete=True)
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
    native = dtype.newbyteorder("=")
    return flat.reshape(shape, order="F" if fortran else "C").astype(native, order="C", copy=True)


def _parse_npy_header(raw: bytes, max_elements: int | None, *, complete: bool):
    """(shape, fortran, dtype, count, data offset) of ``.npy`` bytes; ``complete``: ``raw`` is the
    whole file, so its length must match the header."""
    f = io.BytesIO(raw)
    try:
        version = npy_format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(f, max_header_size=_MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(f, max_header_size=_MAX_NPY_HEADER)
        else:
            raise ValueError(f"unsupported .npy version {version} (1.0 and 2.0 are read)")
    except ValueError as e:
        raise ValueError(f"malformed .npy data: {e}") from None
    _check_dtype(dtype)
    count = _check_elements(shape, max_elements)
    offset = f.tell()
    size = count * dtype.itemsize
    if complete and len(raw) - offset != size:
        raise ValueError(
            f".npy data of shape {shape} and dtype {dtype} needs {size} bytes after the header, "
            f"got {len(raw) - offset}"
        )
    return shape, fortran, dtype, count, offset


def encode_routing_bytes(array: np.ndarray) -> bytes:
    """The raw-bytes form of an integer array (header in the module docstring)."""
    array = _integer_array(array, "array")
    code = _RAW_CODE_OF.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise ValueError(f"array dtype {array.dtype} has no raw-bytes code")
    if array.ndim > _RAW_MAX_NDIM:
        raise ValueError(f"array must have at most {_RAW_MAX_NDIM} dims, got {array.ndim}")
    data = np.ascontiguousarray(array, dtype=_RAW_CODES[code])
    header = _RAW_HEADER.pack(RAW_MAGIC, RAW_VERSION, code, array.ndim, 0)
    dims = struct.pack(f"<{array.ndim}Q", *array.shape)
    buf = bytearray(header)
    buf += dims
    buf += memoryview(data).cast("B") if data.size else b""
    return bytes(buf)


def decode_routing_bytes(b: bytes | bytearray | memoryview, *, max_elements: int | None = None) -> np.ndarray:
    """The array of :func:`encode_routing_bytes` output; same checks as :func:`decode_routing`.

    Returns a new, writable array in native byte order.
    """
    if not isinstance(b, (bytes, bytearray, memoryview)):
        raise TypeError(f"b must be bytes, got {type(b).__name__}")
    view = memoryview(b).cast("B")
    if len(view) < _RAW_HEADER.size:
        raise ValueError(
            f"raw routing bytes are shorter ({len(view)}) than the {_RAW_HEADER.size}-byte header"
        )
    magic, version, code, ndim, _ = _RAW_HEADER.unpack_from(view, 0)
    if magic != RAW_MAGIC:
        raise ValueError(f"raw routing bytes must start with {RAW_MAGIC!r}, got {bytes(magic)!r}")
    if version != RAW_VERSION:
        raise ValueError(f"unsupported raw routing version {version} (this reads {RAW_VERSION})")
    dtype = _RAW_CODES.get(code)
    if dtype is None:
        raise ValueError(f"unknown dtype code {code} (known: {sorted(_RAW_CODES)})")
    if ndim > _RAW_MAX_NDIM:
        raise ValueError(f"ndim {ndim} exceeds {_RAW_MAX_NDIM}")
    dims_end = _RAW_HEADER.size + 8 * ndim
    if len(view) < dims_end:
        raise ValueError(f"raw routing bytes end inside the shape ({len(view)} < {dims_end} bytes)")
    shape = struct.unpack_from(f"<{ndim}Q", view, _RAW_HEADER.size)
    count = _check_elements(shape, max_elements)
    size = count * dtype.itemsize
    if len(view) - dims_end != size:
        raise ValueError(
            f"raw routing data of shape {shape} and dtype {dtype} needs {size} bytes, "
            f"got {len(view) - dims_end}"
        )
    return (
        np.frombuffer(view, dtype=dtype, count=count, offset=dims_end)
        .reshape(shape)
        .astype(dtype.newbyteorder("="), copy=True)
    )
