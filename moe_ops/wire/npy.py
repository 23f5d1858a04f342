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

from ._base import (
    WeightsCodec,
    WireFormat,
    b64decode,
    b64encode,
    bfloat16_bits,
    check_declared,
    check_size,
    engine_layout,
    from_bfloat16_bits,
    weight_array,
)

__all__ = ["FORMAT", "vllm_dtype", "vllm_layout", "vllm_weights_layout"]

# .npy headers that numpy itself writes are well under this; larger ones are refused unread
_MAX_NPY_HEADER = 10_000
# numpy 1.x's NPY_MAXDIMS: an array with more dims than this cannot be read by every client
_NPY_MAX_NDIM = 32
_NPY_MAGIC = b"\x93NUMPY"
# what np.save writes for integer arrays: byte order, kind, width ('|u1', '<i4', '>u2', ...)
_INT_DESCR = re.compile(r"[<>|=]?[iu][1248]")
# what a weights text may hold: float32 (vLLM's routed_expert_weights), float16, and uint16: the
# bits of bfloat16 (moe-ops' own, 2 bytes an entry; numpy has no bfloat16 dtype)
_WEIGHT_DESCR = re.compile(r"[<>=]?(f4|f2|u2)")
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


def vllm_weights_layout(shape: Any, weights: np.ndarray) -> np.ndarray:
    """The array vLLM returns as a choice's ``routed_expert_weights`` (before ``.npy`` + base64),
    beside :func:`vllm_layout`'s ids.

    vLLM's capturer keeps the weights in float32 beside the ids (``topk_weights.float()``), on the
    same ``num_hidden_layers`` axis; a dense layer's column is NaN here (no weight is NaN; vLLM's
    capturer never writes it: a client must not read it, as it must not read the ids' 0 there).

    Args:
        shape: the model's RoutingShape.
        weights: (n, num_layers, top_k) float16 / float32 - weights on the shape's (MoE-only) layer
            axis; NaN where a layer was not captured (the channel's fill), kept.

    Returns a new (n, num_model_layers, top_k) float32 array (float16 widened exactly).

    Raises ValueError for a wrong shape or a dtype other than float16 / float32.
    """
    weights = weight_array(weights)
    if weights.ndim != 3 or weights.shape[1:] != (shape.num_layers, shape.top_k):
        raise ValueError(
            f"weights must have shape (n, {shape.num_layers}, {shape.top_k}), got {weights.shape}"
        )
    out = np.full((weights.shape[0], shape.num_model_layers, shape.top_k), np.nan, dtype=np.float32)
    out[:, shape._moe_columns] = weights
    return out


def _npy_text(array: np.ndarray) -> str:
    """Base64 of ``array``'s ``.npy`` bytes (C order)."""
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


def encode(array: np.ndarray) -> str:
    if array.ndim > _NPY_MAX_NDIM:
        raise ValueError(f"array must have at most {_NPY_MAX_NDIM} dims, got {array.ndim}")
    return _npy_text(array)


def _read_npy(s, max_elements, descr: re.Pattern):
    """(raw bytes, shape, fortran, dtype, count, offset) of a base64 ``.npy`` text whose dtype
    matches ``descr``."""
    if len(s) > _HEADER_B64_CHARS:
        # Decode just the head first, so the header (shape, dtype) is checked before the whole
        # payload is decoded and allocated.
        _parse_npy_header(b64decode(s[:_HEADER_B64_CHARS]), max_elements, complete=False, descr=descr)
    raw = b64decode(s)
    return (raw, *_parse_npy_header(raw, max_elements, complete=True, descr=descr))


def decode(s, *, num_layers, top_k, dtype, max_elements) -> np.ndarray:
    raw, shape, fortran, file_dtype, count, offset = _read_npy(s, max_elements, _INT_DESCR)
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


def _npy_dtype(descr: Any, allowed: re.Pattern = _INT_DESCR) -> np.dtype:
    if isinstance(descr, str) and "O" in descr:
        raise ValueError(f"object dtypes are refused (they would need unpickling), got {descr!r}")
    if not isinstance(descr, str) or not allowed.fullmatch(descr):
        if allowed is _WEIGHT_DESCR:
            raise ValueError(
                "routing weights must be float32, float16 or uint16 (bfloat16 bits), got descr " + repr(descr)
            )
        raise ValueError(f"routing arrays must have an integer dtype, got descr {descr!r}")
    return np.dtype(descr)


def _parse_npy_header(
    raw: bytes, max_elements: int | None, *, complete: bool, descr: re.Pattern = _INT_DESCR
):
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
    dtype = _npy_dtype(header["descr"], descr)
    count = check_size(shape, dtype.itemsize, max_elements)
    size = count * dtype.itemsize
    if complete and len(raw) - offset != size:
        raise ValueError(
            f".npy data of shape {shape} and dtype {dtype} needs {size} bytes after the header, "
            f"got {len(raw) - offset}"
        )
    return shape, fortran, dtype, count, offset


def encode_weights(weights: np.ndarray, dtype: str) -> str:
    if weights.ndim > _NPY_MAX_NDIM:
        raise ValueError(f"weights must have at most {_NPY_MAX_NDIM} dims, got {weights.ndim}")
    if dtype == "float32":  # vLLM's routed_expert_weights: '<f4', float16 widened exactly
        return _npy_text(np.asarray(weights, dtype=np.dtype("<f4")))
    return _npy_text(bfloat16_bits(weights).astype("<u2", copy=False))


def decode_weights(s, *, num_layers, top_k, max_elements) -> np.ndarray:
    raw, shape, fortran, file_dtype, count, offset = _read_npy(s, max_elements, _WEIGHT_DESCR)
    check_declared("the .npy weights", shape, file_dtype, num_layers, top_k, None)
    flat = np.frombuffer(raw, dtype=file_dtype, count=count, offset=offset)
    array = flat.reshape(shape, order="F" if fortran else "C")
    if file_dtype.kind == "u":  # bfloat16 bits: each the top half of a float32
        return np.ascontiguousarray(from_bfloat16_bits(array.astype(np.uint16)))
    return array.astype(np.float32, order="C", copy=True)


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
    # vLLM's routed_expert_weights (float32 .npy) and moe-ops' own (bfloat16 bits as uint16 .npy)
    weights=WeightsCodec(dtypes=("float32", "bfloat16"), encode=encode_weights, decode=decode_weights),
)
