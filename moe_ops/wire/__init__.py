"""Wire formats for routing arrays: the text each client decodes, and raw bytes.

One module per client format, each defining ``FORMAT``, a :class:`WireFormat` (name, the layer
axes its clients read, its dtypes, the prefix its texts start with, encode, decode); the registry
:data:`FORMATS` collects every module of this package whose name does not start with ``_``, in name
order. :func:`encode_routing` / :func:`decode_routing` (``format=``), ``replay_batch``'s
``layer_axis`` (:data:`LAYER_AXES`) and ``moe-ops inspect`` (:func:`sniff_format`) consult it, so a
new format is one new module (docs/wire.md has the table of formats and clients, and under "Adding
a wire format" the steps). The engine layouts live with their formats (``npy.vllm_layout``,
``sglang.sglang_layout``, ...).

Routing weights ride as a second text of the same format (:func:`encode_routing_weights` /
:func:`decode_routing_weights`): float32 as vLLM returns them, or bfloat16 (2 bytes an entry) in
moe-ops' own; a format's :attr:`WireFormat.weights` says how it carries them, or its
``no_weights`` why it cannot.

Raw bytes (``encode_routing_bytes`` / ``decode_routing_bytes``, the ``MOER`` form, :mod:`._raw`)
are for clients that skip base64. A batch for trainer ranks that each read their own rows is one
framed file (``write_framed`` / ``FramedReader``, the ``MOEF`` form, :mod:`._framed`): rows read by
(request, token range), checked per block, never the whole batch.

``pybase64`` (SIMD) is used when importable, the standard library otherwise; both produce and accept
the same text. Every malformed input raises ValueError, sizes checked before anything is allocated;
only an argument of the wrong type (``s`` not text or bytes) raises TypeError.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from ._base import (
    HAS_PYBASE64,
    LAYER_AXES,
    WEIGHT_WIRE_DTYPES,
    WeightsCodec,
    WireFormat,
    as_text,
    bfloat16_bits,
    check_count,
    check_dtype_arg,
    check_layer_axis,
    from_bfloat16_bits,
    integer_array,
    weight_array,
)
from ._framed import FRAMED_MAGIC, FramedEntry, FramedReader, write_framed
from ._raw import RAW_MAGIC, RAW_VERSION, decode_routing_bytes, encode_routing_bytes
from .sglang import SGLANG_DTYPES

__all__ = [
    "FORMATS",
    "FRAMED_MAGIC",
    "HAS_PYBASE64",
    "LAYER_AXES",
    "RAW_MAGIC",
    "RAW_VERSION",
    "SGLANG_DTYPES",
    "WEIGHT_WIRE_DTYPES",
    "WIRE_FORMATS",
    "FramedEntry",
    "FramedReader",
    "WeightsCodec",
    "WireFormat",
    "bfloat16_bits",
    "check_layer_axis",
    "decode_routing",
    "decode_routing_bytes",
    "decode_routing_weights",
    "encode_routing",
    "encode_routing_bytes",
    "encode_routing_weights",
    "from_bfloat16_bits",
    "sniff_format",
    "wire_format",
    "write_framed",
]


def _discover() -> dict[str, WireFormat]:
    """The ``FORMAT`` of every module of this package not named ``_*``, by name; ImportError for a
    module without one, or whose format is named otherwise than the module."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        fmt = getattr(module, "FORMAT", None)
        if not isinstance(fmt, WireFormat) or fmt.name != info.name:
            raise ImportError(
                f"{module.__name__} must define FORMAT, a WireFormat named {info.name!r} (every module "
                f"of moe_ops.wire not named _* is a wire format), got {fmt!r}"
            )
        found[fmt.name] = fmt
    return found


# the registry: format name -> WireFormat, in name order
FORMATS: Mapping[str, WireFormat] = MappingProxyType(_discover())
WIRE_FORMATS = tuple(FORMATS)


def wire_format(format: Any) -> WireFormat:
    """The registered :class:`WireFormat` named ``format``; ValueError naming the registered ones."""
    fmt = FORMATS.get(format) if isinstance(format, str) else None
    if fmt is None:
        raise ValueError(f"format must be one of {WIRE_FORMATS}, got {format!r}")
    return fmt


def sniff_format(s: str | bytes | bytearray | memoryview) -> WireFormat | None:
    """The registered format whose ``magic`` starts ``s``; None when none does (a format without a
    prefix, SGLang's bare base64, cannot be told from other text)."""
    s = as_text(s)
    return next((fmt for fmt in FORMATS.values() if fmt.matches(s)), None)


def encode_routing(array: np.ndarray, *, format: str = "npy") -> str:
    """Base64 text of an integer routing array, in one of the formats clients decode.

    Args:
        array: integer array; ``(n, num_layers, top_k)`` for every format but ``"npy"`` (any shape).
            Build the array a client expects with :meth:`RoutingShape.vllm_layout` /
            :meth:`RoutingShape.sglang_layout` (their layer axis is every model layer).
        format: a name in :data:`WIRE_FORMATS` - ``"npy"``: base64 of the ``.npy`` bytes (C order),
            read back by ``np.load(io.BytesIO(base64.b64decode(s)))`` and :func:`decode_routing`;
            ``"sglang"``: base64 of the raw little-endian ids, no header; int32, uint16 or uint8
            only (the dtypes SGLang's clients know), and the client must be told which.
            docs/wire.md has every format.

    Raises ValueError for a non-integer array, an unknown format, or an array the format cannot
    carry (``"sglang"``: not 3-D, or a dtype other than int32 / uint16 / uint8).
    """
    fmt = wire_format(format)
    return fmt.encode(integer_array(array, "array"))


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
        s: the text (str or ASCII bytes, bytearray or memoryview; a non-contiguous memoryview is
            copied first).
        format: a name in :data:`WIRE_FORMATS` - ``"npy"`` (vLLM's ``routed_experts``; the header
            gives shape and dtype) or ``"sglang"`` (raw ids with no header: ``num_layers``,
            ``top_k`` and ``dtype`` required); docs/wire.md has every format.
        num_layers: ids per token are ``(num_layers, top_k)``. A format whose text says the shape:
            optional, the shape must then be ``(n, num_layers, top_k)``; ``"sglang"``: required.
        top_k: see ``num_layers``.
        dtype: a format whose text says the dtype: optional, it must then be it (any byte order);
            ``"sglang"``: required, one of int32 (SGLang's default), uint16, uint8.
        max_elements: refuse arrays with more elements than this (checked from the header or the
            text's length, before the array is allocated). None: no limit.

    Returns a new, writable array in native byte order; ``"sglang"`` gives ``(n, num_layers, top_k)``.

    Raises ValueError for malformed base64, a malformed or truncated payload, trailing bytes, an
    object or other non-integer dtype, too many elements, a shape or dtype other than the one asked
    for, a ``"sglang"`` byte count that is not a whole number of rows, or a bad argument value;
    TypeError when ``s`` is not str or bytes. Never unpickles.
    """
    fmt = wire_format(format)
    num_layers = check_count("num_layers", num_layers, minimum=1)
    top_k = check_count("top_k", top_k, minimum=1)
    dtype = check_dtype_arg(dtype)
    max_elements = check_count("max_elements", max_elements, minimum=0)
    return fmt.decode(as_text(s), num_layers=num_layers, top_k=top_k, dtype=dtype, max_elements=max_elements)


def _weights_codec(format: Any) -> tuple[WireFormat, WeightsCodec]:
    fmt = wire_format(format)
    if fmt.weights is None:
        raise ValueError(fmt.no_weights)
    return fmt, fmt.weights


def encode_routing_weights(weights: np.ndarray, *, format: str = "npy", dtype: str = "bfloat16") -> str:
    """Base64 text of a routing-weights array, the second text beside :func:`encode_routing`'s ids.

    Args:
        weights: float16 / float32 array (any shape; ``(n, num_layers, top_k)`` beside the ids), NaN
            where no weight was recorded (a layer not captured, a dropped step: the channel's fill);
            or uint16 - bfloat16 bits, what a ``RoutingCapturer(weights_dtype=torch.bfloat16)``
            snapshot's ``"weights"`` channel holds (widened exactly; 0xFFFF, its fill, is NaN).
        format: a name in :data:`WIRE_FORMATS` whose :attr:`WireFormat.weights` is set: ``"npy"``.
        dtype: one of :data:`WEIGHT_WIRE_DTYPES` - ``"bfloat16"`` (default, moe-ops' own, 2 bytes an
            entry: each value rounded to the nearest bfloat16, ties to even, NaN kept NaN
            (:func:`bfloat16_bits`); a ``.npy`` of uint16, the bfloat16's bits) or ``"float32"``
            (vLLM's ``routed_expert_weights``: a float32 ``.npy``, exact; build its layer axis with
            :func:`moe_ops.wire.npy.vllm_weights_layout`).

    Raises ValueError for a dtype other than float16 / float32 / uint16, an unknown ``format`` or
    ``dtype``, or a format with no place for weights (``"sglang"``, ``"nemo_rl"``: the message
    names the format and what to use instead).
    """
    fmt, codec = _weights_codec(format)
    if not isinstance(dtype, str) or dtype not in codec.dtypes:
        raise ValueError(f"dtype must be one of {codec.dtypes} for format={fmt.name!r}, got {dtype!r}")
    return codec.encode(weight_array(weights), dtype)


def decode_routing_weights(
    s: str | bytes,
    *,
    format: str = "npy",
    num_layers: int | None = None,
    top_k: int | None = None,
    max_elements: int | None = None,
) -> np.ndarray:
    """The float32 weights of a text from :func:`encode_routing_weights` (or vLLM's
    ``routed_expert_weights``).

    Args:
        s: the text (str or ASCII bytes, bytearray or memoryview).
        format: as for :func:`encode_routing_weights`.
        num_layers: optional; the shape must then be ``(n, num_layers, top_k)``.
        top_k: see ``num_layers``.
        max_elements: refuse arrays with more elements than this (from the header, before the
            array is allocated). None: no limit.

    Returns a new, writable, C-order float32 array: float32 texts as sent, float16 widened, uint16
    texts read as bfloat16 bits and widened exactly (NaN stays NaN).

    Raises ValueError for every malformed text, a dtype other than float32, float16 or uint16 in the
    header, a shape other than the one asked for, too many elements, or a format with no place for
    weights; TypeError when ``s`` is not str or bytes. Never unpickles.
    """
    _, codec = _weights_codec(format)
    num_layers = check_count("num_layers", num_layers, minimum=1)
    top_k = check_count("top_k", top_k, minimum=1)
    max_elements = check_count("max_elements", max_elements, minimum=0)
    return codec.decode(as_text(s), num_layers=num_layers, top_k=top_k, max_elements=max_elements)
