"""Wire formats for routing arrays: base64 text in the two layouts clients decode, and raw bytes.

Text (``encode_routing`` / ``decode_routing``), two formats (docs/wire.md has the table of clients):

- ``format="npy"``: the base64 of the array's ``.npy`` bytes, what vLLM puts in a choice's
  ``routed_experts``; any client reads it with ``np.load(io.BytesIO(base64.b64decode(s)))``. The
  header carries the shape and dtype.
- ``format="sglang"``: the base64 of the raw little-endian ids with no header, what SGLang puts in
  ``meta_info["routed_experts"]`` (and what slime, Miles and other clients built on it read with
  ``np.frombuffer(...).reshape(-1, num_layers, top_k)``). The text carries neither shape nor dtype,
  so the decoder must be told both; int32 is SGLang's default, uint16 / uint8 when the server sets
  ``SGLANG_ROUTED_EXPERTS_DTYPE``.

``pybase64`` (SIMD) is used when importable, the standard library otherwise; both produce and accept
the same text.

Raw bytes (``encode_routing_bytes`` / ``decode_routing_bytes``), for clients that skip base64::

    offset  size        field
    0       4           magic b"MOER"
    4       1           version (1)
    5       1           dtype code: 1 uint8, 2 uint16, 3 int32, 4 int16, 5 int64, 6 int8, 7 uint32, 8 uint64
    6       1           ndim (0..8)
    7       1           reserved, must be 0
    8       8 * ndim    shape, uint64 little-endian each
    ...     prod(shape) * itemsize   the elements, C order, little-endian

Decoding never unpickles, never evaluates more than a Python literal, and never trusts a size
before checking it: the element count comes from the header (or, for ``"sglang"``, from the length
of the text) and is checked against ``max_elements`` and against the bytes actually present before
any array is allocated. Every malformed input raises ValueError; only an argument of the wrong type
(``s`` not text or bytes) raises TypeError.
"""

from __future__ import annotations

import ast
import base64
import binascii
import io
import math
import re
import struct
from typing import Any

import numpy as np
import numpy.lib.format as npy_format

try:  # SIMD base64, a default dependency; the standard library stands in where it cannot install
    import pybase64 as _b64

    HAS_PYBASE64 = True
except ImportError:
    _b64 = base64
    HAS_PYBASE64 = False

__all__ = [
    "HAS_PYBASE64",
    "SGLANG_DTYPES",
    "WIRE_FORMATS",
    "decode_routing",
    "decode_routing_bytes",
    "encode_routing",
    "encode_routing_bytes",
]

WIRE_FORMATS = ("npy", "sglang")
# The values of SGLang's SGLANG_ROUTED_EXPERTS_DTYPE (python/sglang/srt/state_capturer/
# routed_experts_wire.py); int32 is its default and what a payload without routed_experts_dtype holds.
SGLANG_DTYPES = (np.dtype(np.int32), np.dtype(np.uint16), np.dtype(np.uint8))

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
# numpy 1.x's NPY_MAXDIMS: an array with more dims than this cannot be read by every client
_NPY_MAX_NDIM = 32
_NPY_MAGIC = b"\x93NUMPY"
# what np.save writes for integer arrays: byte order, kind, width ('|u1', '<i4', '>u2', ...)
_INT_DESCR = re.compile(r"[<>|=]?[iu][1248]")
_NPY_KEYS = {"descr", "fortran_order", "shape"}
# Text Python's tokenizer warns about (invalid escape sequences; a number run into a letter, "1if"),
# refused before ast.literal_eval sees it: decoding must not print warnings. No header numpy writes
# has a backslash or a digit followed by a letter.
_NPY_HEADER_WARNS = re.compile(r"\\|[0-9][A-Za-z_]")
# numpy refuses arrays whose byte size does not fit a signed pointer-sized int
_MAX_NBYTES = np.iinfo(np.intp).max
# base64 characters that cover the magic, the header length field and the longest header we read
_HEADER_B64_CHARS = 4 * -(-(_MAX_NPY_HEADER + 12) // 3)


def _integer_array(array: np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be an integer array, got dtype {array.dtype}")
    return array


def _check_format(format: Any) -> str:
    if not isinstance(format, str) or format not in WIRE_FORMATS:
        raise ValueError(f"format must be one of {WIRE_FORMATS}, got {format!r}")
    return format


def _b64encode(data: np.ndarray) -> str:
    """Base64 text of a contiguous uint8 array, straight to str (no bytes -> str pass)."""
    if HAS_PYBASE64:
        return _b64.b64encode_as_string(data)
    return base64.b64encode(data).decode("ascii")


def encode_routing(array: np.ndarray, *, format: str = "npy") -> str:
    """Base64 text of an integer routing array, in one of the two formats clients decode.

    Args:
        array: integer array; ``(n, num_layers, top_k)`` for ``"sglang"``, any shape for ``"npy"``.
            Build the array a client expects with :meth:`RoutingShape.vllm_layout` /
            :meth:`RoutingShape.sglang_layout` (their layer axis is every model layer).
        format: ``"npy"`` - base64 of the ``.npy`` bytes (C order), read back by
            ``np.load(io.BytesIO(base64.b64decode(s)))`` and :func:`decode_routing`; ``"sglang"`` -
            base64 of the raw little-endian ids, no header; int32, uint16 or uint8 only (the dtypes
            SGLang's clients know), and the client must be told which.

    Raises ValueError for a non-integer array, an unknown format, or (``"sglang"``) an array that is
    not 3-D or whose dtype is not int32 / uint16 / uint8.
    """
    fmt = _check_format(format)
    array = _integer_array(array, "array")
    if fmt == "sglang":
        if array.dtype.newbyteorder("=") not in SGLANG_DTYPES:
            names = ", ".join(d.name for d in SGLANG_DTYPES)
            raise ValueError(
                f"format='sglang' writes {names} ids (SGLang's wire dtypes), got array dtype "
                f"{array.dtype}; convert with RoutingShape.sglang_layout(rows, dtype=...)"
            )
        if array.ndim != 3:
            raise ValueError(
                f"format='sglang' needs a 3-D (n, num_layers, top_k) array (the text has no shape), "
                f"got shape {array.shape}"
            )
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        return _b64encode(data.reshape(-1).view(np.uint8))
    if array.ndim > _NPY_MAX_NDIM:
        raise ValueError(f"array must have at most {_NPY_MAX_NDIM} dims, got {array.ndim}")
    # ascontiguousarray makes a 0-d array 1-d: the header would record shape (1,)
    array = np.ascontiguousarray(array).reshape(array.shape)
    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, npy_format.header_data_from_array_1_0(array))
    head = header.getvalue()
    # One buffer (header + data, a single copy) encoded straight to str: encoding the parts,
    # concatenating and decoding the bytes to str cost 3 extra passes (33 ms for a 16 MB request
    # here, against 3.5 ms for pybase64's encode alone).
    buf = np.empty(len(head) + array.nbytes, dtype=np.uint8)
    buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    buf[len(head) :] = array.reshape(-1).view(np.uint8)
    return _b64encode(buf)


def _byte_view(b: memoryview) -> memoryview:
    """``b`` as one flat run of bytes; a non-contiguous view (a strided slice) is copied into one
    first (memoryview.cast takes C-contiguous views only)."""
    if not b.c_contiguous or b.nbytes == 0:  # cast refuses a 0 in the shape too
        b = memoryview(b.tobytes())
    return b.cast("B") if b.format != "B" or b.ndim != 1 else b


def _as_text(s: Any) -> str | bytes | bytearray | memoryview:
    if isinstance(s, memoryview):
        return _byte_view(s)
    if not isinstance(s, (str, bytes, bytearray)):
        raise TypeError(f"s must be str or bytes, got {type(s).__name__}")
    return s


def _b64decode(s: str | bytes | bytearray | memoryview) -> bytes:
    if isinstance(s, str) and not s.isascii():
        raise ValueError("malformed base64: the text has non-ASCII characters")
    try:
        # str is decoded as is (ASCII checked above): no 16 MB encode to bytes first
        return _b64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"malformed base64: {e}") from None


def _b64_decoded_size(s: str | bytes | bytearray | memoryview) -> int:
    """Bytes that valid base64 text ``s`` decodes to, from its length and padding alone."""
    n = len(s)
    if n % 4:
        raise ValueError(f"malformed base64: {n} characters is not a multiple of 4")
    if n == 0:
        return 0
    tail = s[-2:] if isinstance(s, str) else bytes(s[-2:]).decode("latin-1")
    return n // 4 * 3 - tail.count("=")


def _check_count(name: str, value: Any, *, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")
    return int(value)


def _check_size(shape: tuple[int, ...], itemsize: int, max_elements: int | None) -> int:
    """Element count of ``shape``, refused when it exceeds ``max_elements`` or numpy's size limit."""
    if any(d < 0 for d in shape):
        raise ValueError(f"array shape {shape} has a negative dimension")
    count = math.prod(shape)
    if max_elements is not None and count > max_elements:
        raise ValueError(
            f"array of shape {shape} has {count} elements, more than max_elements={max_elements}"
        )
    nonzero = math.prod(d for d in shape if d)
    if any(d > _MAX_NBYTES for d in shape) or nonzero * itemsize > _MAX_NBYTES:
        raise ValueError(f"array shape {shape} is larger than numpy can hold ({_MAX_NBYTES} bytes)")
    return count


def _check_dtype_arg(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        out = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"dtype must be None or an integer numpy dtype, got {dtype!r} ({e})") from None
    if out.kind not in "iu" or out.fields is not None or out.subdtype is not None:
        raise ValueError(f"dtype must be None or an integer numpy dtype, got {out}")
    return out.newbyteorder("=")


def decode_routing(
    s: str | bytes,
    *,
    format: str = "npy",
    num_layers: int | None = None,
    top_k: int | None = None,
    dtype: Any = None,
    max_elements: int | None = None,
) -> np.ndarray:
    """The array of a base64 routing text (from :func:`encode_routing` or a serving engine).

    Args:
        s: base64 text (str or ASCII bytes, bytearray or memoryview; a non-contiguous memoryview
            is copied first).
        format: ``"npy"`` (vLLM's ``routed_experts``; the header gives shape and dtype) or
            ``"sglang"`` (raw ids with no header: ``num_layers``, ``top_k`` and ``dtype`` required).
        num_layers: ids per token are ``(num_layers, top_k)``. ``"npy"``: optional, the header's
            shape must then be ``(n, num_layers, top_k)``; ``"sglang"``: required.
        top_k: see ``num_layers``.
        dtype: ``"npy"``: optional, the header's dtype must then be it (any byte order);
            ``"sglang"``: required, one of int32 (SGLang's default), uint16, uint8.
        max_elements: refuse arrays with more elements than this (checked from the header or the
            text's length, before the array is allocated). None: no limit.

    Returns a new, writable array in native byte order; ``"sglang"`` gives ``(n, num_layers, top_k)``.

    Raises ValueError for malformed base64, a malformed or truncated ``.npy``, trailing bytes, an
    object or other non-integer dtype, too many elements, a shape or dtype other than the one asked
    for, a ``"sglang"`` byte count that is not a whole number of rows, or a bad argument value;
    TypeError when ``s`` is not str or bytes. Never unpickles.
    """
    fmt = _check_format(format)
    num_layers = _check_count("num_layers", num_layers, minimum=1)
    top_k = _check_count("top_k", top_k, minimum=1)
    want_dtype = _check_dtype_arg(dtype)
    max_elements = _check_count("max_elements", max_elements, minimum=0)
    s = _as_text(s)
    if fmt == "sglang":
        return _decode_sglang(s, num_layers, top_k, want_dtype, max_elements)
    if len(s) > _HEADER_B64_CHARS:
        # Decode just the head first, so the header (shape, dtype) is checked before the whole
        # payload is decoded and allocated.
        _parse_npy_header(_b64decode(s[:_HEADER_B64_CHARS]), max_elements, complete=False)
    raw = _b64decode(s)
    shape, fortran, file_dtype, count, offset = _parse_npy_header(raw, max_elements, complete=True)
    if want_dtype is not None and file_dtype.newbyteorder("=") != want_dtype:
        raise ValueError(f"the .npy data has dtype {file_dtype}, but dtype={want_dtype} was asked for")
    if (num_layers is not None or top_k is not None) and (
        len(shape) != 3
        or (num_layers is not None and shape[1] != num_layers)
        or (top_k is not None and shape[2] != top_k)
    ):
        want = f"(n, {'*' if num_layers is None else num_layers}, {'*' if top_k is None else top_k})"
        raise ValueError(f"the .npy data has shape {shape}, but {want} was asked for")
    flat = np.frombuffer(raw, dtype=file_dtype, count=count, offset=offset)
    native = file_dtype.newbyteorder("=")
    return flat.reshape(shape, order="F" if fortran else "C").astype(native, order="C", copy=True)


def _decode_sglang(s, num_layers, top_k, dtype, max_elements) -> np.ndarray:
    missing = [
        name for name, v in (("num_layers", num_layers), ("top_k", top_k), ("dtype", dtype)) if v is None
    ]
    if missing:
        raise ValueError(
            f"format='sglang' text carries no header: pass {', '.join(missing)} (SGLang's num_layers is "
            "the model's num_hidden_layers, top_k its num_experts_per_tok, dtype int32 unless the "
            "server set SGLANG_ROUTED_EXPERTS_DTYPE)"
        )
    if dtype not in SGLANG_DTYPES:
        names = ", ".join(d.name for d in SGLANG_DTYPES)
        raise ValueError(f"format='sglang' dtype must be one of {names} (SGLang's wire dtypes), got {dtype}")
    row_bytes = num_layers * top_k * dtype.itemsize
    size = _b64_decoded_size(s)
    if size % row_bytes:
        raise ValueError(
            f"format='sglang' text holds {size} bytes, not a whole number of {row_bytes}-byte rows "
            f"(num_layers={num_layers} x top_k={top_k} x {dtype.itemsize}-byte {dtype})"
        )
    rows = size // row_bytes
    _check_size((rows, num_layers, top_k), dtype.itemsize, max_elements)
    raw = _b64decode(s)
    if len(raw) != size:  # the padding count above is only right for valid base64
        raise ValueError(f"malformed base64: decoded {len(raw)} bytes, the length says {size}")
    wire = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(rows, num_layers, top_k)
    return wire.astype(dtype, copy=True)


def _npy_literal(text: str) -> Any:
    if _NPY_HEADER_WARNS.search(text):
        raise ValueError("malformed .npy data: the header holds text no .npy header has")
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(
            f"malformed .npy data: the header is not a Python literal ({type(e).__name__})"
        ) from None


def _npy_dtype(descr: Any) -> np.dtype:
    if isinstance(descr, str) and "O" in descr:
        raise ValueError(f"object dtypes are refused (they would need unpickling), got {descr!r}")
    if not isinstance(descr, str) or not _INT_DESCR.fullmatch(descr):
        raise ValueError(f"routing arrays must have an integer dtype, got descr {descr!r}")
    return np.dtype(descr)


def _parse_npy_header(raw: bytes, max_elements: int | None, *, complete: bool):
    """(shape, fortran, dtype, count, data offset) of ``.npy`` bytes; ``complete``: ``raw`` is the
    whole file, so its length must match the header.

    The header is parsed here rather than by ``numpy.lib.format``: numpy's reader retries a header
    that fails to parse through Python 2 token filtering, which raises ``tokenize.TokenError`` on
    some text, and it accepts ``True`` as a dimension.
    """
    if len(raw) < 10 or raw[:6] != _NPY_MAGIC:
        raise ValueError("malformed .npy data: it does not start with the .npy magic b'\\x93NUMPY'")
    version = (raw[6], raw[7])
    if version == (1, 0):
        (header_len,), start = struct.unpack_from("<H", raw, 8), 10
    elif version == (2, 0):
        if len(raw) < 12:
            raise ValueError("malformed .npy data: it ends inside the header length")
        (header_len,), start = struct.unpack_from("<I", raw, 8), 12
    else:
        raise ValueError(f"unsupported .npy version {version} (1.0 and 2.0 are read)")
    if header_len > _MAX_NPY_HEADER:
        raise ValueError(
            f"malformed .npy data: a {header_len}-byte header (at most {_MAX_NPY_HEADER} are read)"
        )
    offset = start + header_len
    if len(raw) < offset:
        raise ValueError(f"malformed .npy data: it ends inside the {header_len}-byte header")
    header = _npy_literal(raw[start:offset].decode("latin-1"))
    if not isinstance(header, dict) or set(header) != _NPY_KEYS:
        keys = sorted(map(repr, header)) if isinstance(header, dict) else type(header).__name__
        raise ValueError(f"malformed .npy data: the header must be a dict of {sorted(_NPY_KEYS)}, got {keys}")
    shape, fortran = header["shape"], header["fortran_order"]
    if not isinstance(shape, tuple) or not all(type(d) is int for d in shape):
        raise ValueError(f"malformed .npy data: shape must be a tuple of ints, got {shape!r}")
    if len(shape) > _NPY_MAX_NDIM:
        raise ValueError(f"malformed .npy data: {len(shape)} dims (at most {_NPY_MAX_NDIM} are read)")
    if type(fortran) is not bool:
        raise ValueError(f"malformed .npy data: fortran_order must be True or False, got {fortran!r}")
    dtype = _npy_dtype(header["descr"])
    count = _check_size(shape, dtype.itemsize, max_elements)
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
    """The array of :func:`encode_routing_bytes` output; same checks as :func:`decode_routing`, and
    the reserved header byte must be 0. ``b``: bytes, bytearray or memoryview (a non-contiguous
    memoryview is copied first).

    Returns a new, writable array in native byte order.
    """
    if not isinstance(b, (bytes, bytearray, memoryview)):
        raise TypeError(f"b must be bytes, got {type(b).__name__}")
    max_elements = _check_count("max_elements", max_elements, minimum=0)
    view = _byte_view(memoryview(b))
    if len(view) < _RAW_HEADER.size:
        raise ValueError(
            f"raw routing bytes are shorter ({len(view)}) than the {_RAW_HEADER.size}-byte header"
        )
    magic, version, code, ndim, reserved = _RAW_HEADER.unpack_from(view, 0)
    if magic != RAW_MAGIC:
        raise ValueError(f"raw routing bytes must start with {RAW_MAGIC!r}, got {bytes(magic)!r}")
    if version != RAW_VERSION:
        raise ValueError(f"unsupported raw routing version {version} (this reads {RAW_VERSION})")
    dtype = _RAW_CODES.get(code)
    if dtype is None:
        raise ValueError(f"unknown dtype code {code} (known: {sorted(_RAW_CODES)})")
    if ndim > _RAW_MAX_NDIM:
        raise ValueError(f"ndim {ndim} exceeds {_RAW_MAX_NDIM}")
    if reserved != 0:
        raise ValueError(f"raw routing header byte 7 is reserved and must be 0, got {reserved}")
    dims_end = _RAW_HEADER.size + 8 * ndim
    if len(view) < dims_end:
        raise ValueError(f"raw routing bytes end inside the shape ({len(view)} < {dims_end} bytes)")
    shape = struct.unpack_from(f"<{ndim}Q", view, _RAW_HEADER.size)
    count = _check_size(shape, dtype.itemsize, max_elements)
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
