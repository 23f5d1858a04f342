"""``format="nemo_rl"``: NeMo-RL's routed-experts envelope, ``nrlre1:<dtype>:<S>x<L>x<K>:<base64>``.

What NeMo-RL's ``encode_routed_experts`` writes (``nemo_rl/utils/routed_experts_codec.py``) and its
NeMo-Gym hops carry as one opaque string: ``<dtype>`` is ``int8``, ``int16`` or ``int32``; ``S``,
``L``, ``K`` the decimal sizes of the ``(tokens, num_moe_layers, top_k)`` array; then the standard
base64 (``+/`` alphabet, ``=`` padding) of its C-order bytes. NeMo-RL writes the host's byte order,
little-endian on every host it runs on; this module writes and reads little-endian whatever the host.

The layer axis holds the MoE layers only. The dtype is the narrowest signed one that holds every id
and -1 (:func:`nemo_rl_dtype`), and a row whose every id is -1 had no route captured (NeMo-RL's
replay routes it live; a row only partly -1 it rejects as corrupt). NeMo-RL's vLLM worker sends a
row per token of the sequence, prompt and generated: ``S = T`` (:func:`nemo_rl_layout` appends the
last token's row that moe-ops, like vLLM and SGLang, does not record).

The envelope says its shape and dtype, so decoding needs neither; both are checked, with the
payload's length and ``max_elements``, before the payload is decoded. NeMo-RL's own reader also
takes what its writer never writes (``int()`` of each size: ``+3``, `` 3``, ``3_0``, non-ASCII
digits; base64 with characters outside the alphabet skipped); this one refuses them.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ._base import (
    WireFormat,
    b64_decoded_size,
    b64decode,
    b64encode,
    check_declared,
    check_size,
    dtype_names,
)

__all__ = ["FORMAT", "NEMO_RL_DTYPES", "nemo_rl_dtype", "nemo_rl_layout"]

# the dtype names of the envelope (NeMo-RL's _NP_DTYPES): signed, so that -1 marks a missing row
NEMO_RL_DTYPES = (np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32))
_MAGIC = "nrlre1:"
# Sizes of at most 19 digits: 10**19 > 2**63, so every size numpy can hold is written in fewer, and
# a header is parsed from a bounded prefix (the regex never scans a 16 MB payload).
_HEAD = re.compile(r"nrlre1:(int8|int16|int32):([0-9]{1,19})x([0-9]{1,19})x([0-9]{1,19}):")
_MAX_HEAD = len("nrlre1:int16:") + 3 * 19 + 2 + 1


def nemo_rl_dtype(num_experts: int) -> np.dtype:
    """The dtype NeMo-RL carries routed experts in for a model of ``num_experts`` experts
    (``resolve_routed_experts_dtype`` in ``nemo_rl/models/generation/interfaces.py``): the narrowest
    signed dtype that holds ids ``0 .. num_experts - 1`` and the missing-row value -1 - int8 up to
    128 experts, int16 up to 32768, int32 beyond."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    return next(d for d in NEMO_RL_DTYPES if num_experts - 1 <= np.iinfo(d).max)


def nemo_rl_layout(
    shape: Any,
    routing: np.ndarray,
    *,
    num_tokens: int | None = None,
    missing: np.ndarray | None = None,
) -> np.ndarray:
    """The array NeMo-RL's replay takes, from moe-ops' rows (before ``encode_routing(...,
    format="nemo_rl")``).

    Args:
        shape: the model's RoutingShape.
        routing: (n, num_layers, top_k) integer - ids on the shape's MoE-only layer axis, each in
            ``[0, num_experts)``, or rows with no record: every entry -1, or an unsigned dtype's
            maximum where that is no id (the fill of ``shape.id_dtype``, what the slot store and
            the ledger write). A row only partly without a record is refused (NeMo-RL would refuse
            it as corrupt).
        num_tokens: None: ``n`` rows out. An int ``T``, the request's tokens (prompt + generated):
            ``n`` must be ``T - 1`` (as moe-ops, vLLM and SGLang return it; a -1 row is appended
            for the last token, which never ran through the model) or ``T``; NeMo-RL's vLLM worker
            drops routes of any other length.
        missing: None or an (n,) bool array: rows written as -1 whatever they hold (the ledger's
            ``FinishedRouting.missing``).

    Returns a new (n or T, num_layers, top_k) array of ``nemo_rl_dtype(shape.num_experts)``, rows
    without a record all -1.

    Raises ValueError for a wrong shape, dtype or row count, an id outside ``[0, num_experts)``, a
    row only partly without a record, or a malformed ``missing``.
    """
    routing = np.asarray(routing)
    if routing.dtype.kind not in "iu":
        raise ValueError(f"routing must be an integer array, got dtype {routing.dtype}")
    if routing.ndim != 3 or routing.shape[1:] != (shape.num_layers, shape.top_k):
        want = f"(n, {shape.num_layers}, {shape.top_k})"
        raise ValueError(f"routing must have shape {want}, got {routing.shape}")
    n = routing.shape[0]
    if missing is not None and (
        not isinstance(missing, np.ndarray) or missing.dtype != np.bool_ or missing.shape != (n,)
    ):
        raise ValueError(
            f"missing must be None or a ({n},) bool array, one flag per row, got "
            f"{getattr(missing, 'dtype', type(missing).__name__)} {getattr(missing, 'shape', '')}"
        )
    rows = n
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
            raise ValueError(f"num_tokens must be None or an int >= 1, got {num_tokens!r}")
        if n not in (num_tokens - 1, num_tokens):
            raise ValueError(
                f"routing has {n} rows for num_tokens={num_tokens}: expected {num_tokens - 1} (a row per "
                f"token but the last) or {num_tokens} (one per token)"
            )
        rows = int(num_tokens)
    no_record = routing == -1 if routing.dtype.kind == "i" else None
    if routing.dtype.kind == "u" and np.iinfo(routing.dtype).max >= shape.num_experts:
        no_record = routing == np.iinfo(routing.dtype).max
    empty = np.zeros(n, bool) if no_record is None else no_record.all(axis=(1, 2))
    if missing is not None:
        empty |= missing
    if no_record is not None:
        partial = no_record.any(axis=(1, 2)) & ~empty
        if partial.any():
            row = int(np.argmax(partial))
            raise ValueError(
                f"routing row {row} is only partly without a record ({routing[row].tolist()}): a row "
                "holds ids or is all no-record (-1, or the unsigned fill)"
            )
    ids = routing[~empty]
    if ids.size and (ids.min() < 0 or ids.max() >= shape.num_experts):
        raise ValueError(
            f"routing has ids in [{ids.min()}, {ids.max()}], outside [0, num_experts={shape.num_experts}) "
            "in rows that are not all no-record"
        )
    out = np.full((rows, shape.num_layers, shape.top_k), -1, dtype=nemo_rl_dtype(shape.num_experts))
    out[:n][~empty] = ids
    return out


def encode(array: np.ndarray) -> str:
    if array.dtype.newbyteorder("=") not in NEMO_RL_DTYPES:
        raise ValueError(
            f"format='nemo_rl' writes {dtype_names(NEMO_RL_DTYPES)} ids (NeMo-RL's envelope dtypes), got "
            f"array dtype {array.dtype}; convert with moe_ops.wire.nemo_rl.nemo_rl_layout(shape, rows)"
        )
    if array.ndim != 3:
        raise ValueError(
            f"format='nemo_rl' needs a 3-D (tokens, num_moe_layers, top_k) array, got shape {array.shape}"
        )
    dtype = array.dtype.newbyteorder("=")
    data = np.ascontiguousarray(array, dtype=dtype.newbyteorder("<"))
    tokens, layers, top_k = array.shape
    return f"{_MAGIC}{dtype.name}:{tokens}x{layers}x{top_k}:" + b64encode(data.reshape(-1).view(np.uint8))


def decode(s, *, num_layers, top_k, dtype, max_elements) -> np.ndarray:
    head = s[:_MAX_HEAD]
    if not isinstance(head, str):
        head = bytes(head).decode("latin-1")
    match = _HEAD.match(head)
    if match is None:
        raise ValueError(
            f"not an nrlre1 envelope: it must start 'nrlre1:<int8|int16|int32>:<S>x<L>x<K>:' (decimal "
            f"sizes), got {head[:40]!r}"
        )
    wire_dtype = np.dtype(match[1])
    shape = (int(match[2]), int(match[3]), int(match[4]))
    check_declared("the nrlre1 envelope", shape, wire_dtype, num_layers, top_k, dtype)
    count = check_size(shape, wire_dtype.itemsize, max_elements)
    start = match.end()
    size = b64_decoded_size(s, start)
    if size != count * wire_dtype.itemsize:
        raise ValueError(
            f"the nrlre1 envelope declares shape {shape} of {wire_dtype} ({count * wire_dtype.itemsize} "
            f"bytes), but its base64 holds {size} bytes"
        )
    # the payload is sliced only now, its size checked: a view of bytes, a copy of a str's text
    raw = b64decode(s[start:] if isinstance(s, str) else memoryview(s)[start:])
    if len(raw) != size:  # the padding count above is only right for valid base64
        raise ValueError(f"malformed base64: decoded {len(raw)} bytes, the length says {size}")
    return np.frombuffer(raw, dtype=wire_dtype.newbyteorder("<")).reshape(shape).astype(wire_dtype, copy=True)


FORMAT = WireFormat(
    name="nemo_rl",
    # [tokens, num_moe_layers, topk]: the MoE layers only
    layer_axes=("moe",),
    dtypes=NEMO_RL_DTYPES,
    magic=_MAGIC,
    encode=encode,
    decode=decode,
    no_weights=(
        "format='nemo_rl' has no place for routing weights: the nrlre1 envelope holds int8 / int16 / "
        "int32 ids only; send them as format='npy' (dtype='bfloat16', 2 bytes an entry) in a field of "
        "your own"
    ),
)
