"""``format="sglang"``: the base64 of the raw little-endian ids with no header, what SGLang puts in
``meta_info["routed_experts"]`` (and what slime, Miles and other clients built on it read with
``np.frombuffer(...).reshape(-1, num_layers, top_k)``).

The text carries neither shape nor dtype, so the decoder must be told both; int32 is SGLang's
default, uint16 / uint8 when the server sets ``SGLANG_ROUTED_EXPERTS_DTYPE``. The element count
comes from the length of the text and is checked against ``max_elements`` and whole rows before
the text is decoded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._base import WireFormat, b64_decoded_size, b64decode, b64encode, check_size, dtype_names, engine_layout

__all__ = ["FORMAT", "SGLANG_DTYPES", "sglang_layout"]

# The values of SGLang's SGLANG_ROUTED_EXPERTS_DTYPE (python/sglang/srt/state_capturer/
# routed_experts_wire.py); int32 is its default and what a payload without routed_experts_dtype holds.
SGLANG_DTYPES = (np.dtype(np.int32), np.dtype(np.uint16), np.dtype(np.uint8))


def sglang_layout(shape: Any, routing: np.ndarray, dtype: Any = np.int32) -> np.ndarray:
    """The array SGLang returns in ``meta_info["routed_experts"]`` (before raw bytes + base64); what
    ``RoutingShape.sglang_layout`` returns.

    SGLang's capturer sizes its layer axis by ``num_hidden_layers`` (``hf_text_config``) and its
    buffers start at 0, which dense layers' columns keep.

    Args:
        shape: the model's RoutingShape.
        routing: (n, num_layers, top_k) integer - ids on the shape's layer axis, each in
            ``[0, num_experts)``.
        dtype: one of SGLANG_DTYPES - int32 (SGLang's default), uint16 or uint8: what the client
            decodes with.

    Returns a new (n, num_model_layers, top_k) array of ``dtype``.

    Raises ValueError for a wrong shape, a non-integer dtype, ids outside ``[0, num_experts)``, a
    ``dtype`` SGLang does not send, or ids that ``dtype`` cannot hold (SGLang itself falls back to
    int32 then and says so in ``routed_experts_dtype``; here the caller picks).
    """
    names = dtype_names(SGLANG_DTYPES, last=" or ")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be {names}, got {dtype!r}") from None
    if dtype not in SGLANG_DTYPES:
        raise ValueError(f"dtype must be {names} (SGLang's wire dtypes), got {dtype}")
    if shape.num_experts - 1 > np.iinfo(dtype).max:
        raise ValueError(
            f"dtype {dtype} holds ids up to {np.iinfo(dtype).max}, but this model has "
            f"num_experts={shape.num_experts}; use a wider dtype (int32 is SGLang's default)"
        )
    return engine_layout(shape, routing, dtype)


def encode(array: np.ndarray) -> str:
    if array.dtype.newbyteorder("=") not in SGLANG_DTYPES:
        raise ValueError(
            f"format='sglang' writes {dtype_names(SGLANG_DTYPES)} ids (SGLang's wire dtypes), got array "
            f"dtype {array.dtype}; convert with RoutingShape.sglang_layout(rows, dtype=...)"
        )
    if array.ndim != 3:
        raise ValueError(
            f"format='sglang' needs a 3-D (n, num_layers, top_k) array (the text has no shape), "
            f"got shape {array.shape}"
        )
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return b64encode(data.reshape(-1).view(np.uint8))


def decode(s, *, num_layers, top_k, dtype, max_elements) -> np.ndarray:
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
        raise ValueError(
            f"format='sglang' dtype must be one of {dtype_names(SGLANG_DTYPES)} (SGLang's wire dtypes), "
            f"got {dtype}"
        )
    row_bytes = num_layers * top_k * dtype.itemsize
    size = b64_decoded_size(s)
    if size % row_bytes:
        raise ValueError(
            f"format='sglang' text holds {size} bytes, not a whole number of {row_bytes}-byte rows "
            f"(num_layers={num_layers} x top_k={top_k} x {dtype.itemsize}-byte {dtype})"
        )
    rows = size // row_bytes
    check_size((rows, num_layers, top_k), dtype.itemsize, max_elements)
    raw = b64decode(s)
    if len(raw) != size:  # the padding count above is only right for valid base64
        raise ValueError(f"malformed base64: decoded {len(raw)} bytes, the length says {size}")
    wire = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(rows, num_layers, top_k)
    return wire.astype(dtype, copy=True)


FORMAT = WireFormat(
    name="sglang",
    # SGLang's clients reshape by num_hidden_layers: a column per model layer
    layer_axes=("model",),
    dtypes=SGLANG_DTYPES,
    magic=None,
    encode=encode,
    decode=decode,
    no_weights=(
        "format='sglang' has no place for routing weights: SGLang's meta_info['routed_experts'] is bare "
        "ids with no header, and SGLang returns no weights field; send them as format='npy' (dtype="
        "'bfloat16', 2 bytes an entry) in a field of your own"
    ),
)
