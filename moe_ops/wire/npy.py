"""``format="npy"``: the base64 of an array's ``.npy`` bytes, what vLLM puts in a choice's
``routed_experts`` and what moe-ops sends by default.

Any client reads it with ``np.load(io.BytesIO(base64.b64decode(s)))``; the header carries the
shape and dtype, so one text may hold vLLM's array (a column per model layer, uint8 / uint16, built
by :func:`vllm_layout`) or moe-ops' own (the MoE layers only, ``RoutingShape.id_dtype``).

Decoding never unpickles, never evaluates more than a Python literal, and never trusts a size
before checking it: the element count comes from the header and is checked against
``max_elements`` and against the bytes actually present before any array is allocated.
"""

from __future__ import annotations

import ast
import io
import re
import struct
from typing import Any

import numpy as np
import numpy.lib.format as npy_format

from ._base import WireFormat, b64decode, b64encode, check_declared, check_size, engine_layout

__all__ = ["FORMAT", "vllm_dtype", "vllm_layout"]

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
# base64 characters that cover the magic, the header length field and the longest header we read
_HEADER_B64_CHARS = 4 * -(-(_MAX_NPY_HEADER + 12) // 3)


def vllm_dtype(num_experts: int) -> np.dtype:
    """The dtype vLLM returns ``routed_experts`` in: uint8 up to 256 experts, uint16 up to 65536
    (docs/wire.md cites the source). At 256 and 65536 experts it has no value left for a row
    without data: such a row cannot be said in vLLM's format (pass the ledger's ``missing`` mask to
    ``replay_batch`` instead)."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    raise ValueError(
        f"vLLM's routed_experts holds uint8 / uint16 ids; num_experts={num_experts} does not fit"
    )


def vllm_layout(shape: Any, routing: np.ndarray) -> np.ndarray:
    """The array vLLM returns as a choice's ``routed_experts`` (before ``.npy`` + base64); what
    ``RoutingShape.vllm_layout`` returns.

    vLLM's capturer sizes its layer axis by ``num_hidden_layers`` and never writes a dense layer's
    column, so it holds 0 there; ids are uint8 up to 256 experts, uint16 beyond.

    Args:
        shape: the model's RoutingShape.
        routing: (n, num_layers, top_k) integer - ids on the shape's (MoE-only) layer axis, each in
            ``[0, num_experts)``.

    Returns a new (n, num_model_layers, top_k) uint8 / uint16 array.

    Raises ValueError for a wrong shape, a non-integer dtype, ids outside ``[0, num_experts)``, or
    more than 65536 experts (vLLM has no wider id dtype).
    """
    return engine_layout(shape, routing, vllm_dtype(shape.num_experts))


def encode(array: np.ndarray) -> str:
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
    return b64encode(buf)


def decode(s, *, num_layers, top_k, dtype, max_elements) -> np.ndarray:
    if len(s) > _HEADER_B64_CHARS:
        # Decode just the head first, so the header (shape, dtype) is checked before the whole
        # payload is decoded and allocated.
        _parse_npy_header(b64decode(s[:_HEADER_B64_CHARS]), max_elements, complete=False)
    raw = b64decode(s)
    shape, fortran, file_dtype, count, offset = _parse_npy_header(raw, max_elements, complete=True)
    check_declared("the .npy data", shape, file_dtype, num_layers, top_k, dtype)
    flat = np.frombuffer(raw, dtype=file_dtype, count=count, offset=offset)
    native = file_dtype.newbyteorder("=")
    return flat.reshape(shape, order="F" if fortran else "C").astype(native, order="C", copy=True)


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
    count = check_size(shape, dtype.itemsize, max_elements)
    size = count * dtype.itemsize
    if complete and len(raw) - offset != size:
        raise ValueError(
            f".npy data of shape {shape} and dtype {dtype} needs {size} bytes after the header, "
            f"got {len(raw) - offset}"
        )
    return shape, fortran, dtype, count, offset


FORMAT = WireFormat(
    name="npy",
    # moe-ops' own arrays (MoE layers only) and vLLM's (a column per model layer): the header's
    # shape says which
    layer_axes=("moe", "model"),
    dtypes=None,
    # base64 of the .npy magic b"\x93NUMPY": 6 bytes, two whole base64 groups
    magic="k05VTVBZ",
    encode=encode,
    decode=decode,
)
