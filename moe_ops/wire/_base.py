"""What every wire format shares: the :class:`WireFormat` protocol, the layer axes, base64, and the
argument and size checks each decoder runs before it allocates anything.

Nothing here knows a client: the formats (one module each beside this one) build on it, and the
package ``__init__`` collects them into the registry.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # SIMD base64, a default dependency; the standard library stands in where it cannot install
    import pybase64 as _b64

    HAS_PYBASE64 = True
except ImportError:
    _b64 = base64
    HAS_PYBASE64 = False

__all__ = [
    "HAS_PYBASE64",
    "LAYER_AXES",
    "WEIGHT_WIRE_DTYPES",
    "WeightsCodec",
    "WireFormat",
    "bfloat16_bits",
    "check_layer_axis",
    "from_bfloat16_bits",
]

# The layer axes a client's arrays use: "moe" - the MoE layers only, in model order
# (RoutingShape.num_layers columns: moe-ops' own arrays, NeMo-RL's); "model" - a column per decoder
# layer, dense layers' columns 0 (RoutingShape.num_model_layers: vLLM's and SGLang's clients).
LAYER_AXES = ("moe", "model")

# The dtypes routing weights travel in (``encode_routing_weights(..., dtype=)``): "float32", 4 bytes an
# entry, exact (vLLM's routed_expert_weights); "bfloat16", 2 bytes an entry, rounded to nearest even
# (moe-ops' own). numpy has no bfloat16: its 16 bits travel as uint16 (bfloat16_bits).
WEIGHT_WIRE_DTYPES = ("float32", "bfloat16")

# numpy refuses arrays whose byte size does not fit a signed pointer-sized int
_MAX_NBYTES = np.iinfo(np.intp).max


@dataclass(frozen=True)
class WeightsCodec:
    """How a format carries routing weights beside its ids: a second text of the same format (vLLM's
    ``routed_expert_weights`` beside ``routed_experts``).

    Called by :func:`~moe_ops.wire.encode_routing_weights` / :func:`~moe_ops.wire.decode_routing_weights`
    with their arguments checked: ``encode(weights, dtype)`` gets a float16 / float32 ndarray and a
    name in ``dtypes``; ``decode(text, *, num_layers, top_k, max_elements)`` returns a new, writable
    float32 array (bfloat16 widened exactly).
    """

    # the names of WEIGHT_WIRE_DTYPES this format writes
    dtypes: tuple[str, ...]
    # (weights, dtype) -> str
    encode: Callable[[np.ndarray, str], str]
    # (text, *, num_layers, top_k, max_elements) -> (n, num_layers, top_k)-checked float32 array
    decode: Callable[..., np.ndarray]

    def __post_init__(self) -> None:
        if (
            not isinstance(self.dtypes, tuple)
            or not self.dtypes
            or any(d not in WEIGHT_WIRE_DTYPES for d in self.dtypes)
        ):
            raise ValueError(
                f"WeightsCodec.dtypes must be a non-empty tuple of {WEIGHT_WIRE_DTYPES}, got {self.dtypes!r}"
            )
        if not callable(self.encode) or not callable(self.decode):
            raise ValueError("WeightsCodec.encode and WeightsCodec.decode must be callable")


@dataclass(frozen=True)
class WireFormat:
    """One client format: how its text is written and read. Each module of ``moe_ops/wire/`` whose
    name does not start with ``_`` defines one, as ``FORMAT``, named after the module.

    ``encode`` and ``decode`` are called by :func:`~moe_ops.encode_routing` /
    :func:`~moe_ops.decode_routing` with their arguments already checked: ``encode`` gets an integer
    ndarray; ``decode`` gets the text as str, bytes, bytearray or a flat byte memoryview, and
    ``num_layers`` / ``top_k`` (None or an int >= 1), ``dtype`` (None or a native-order integer
    np.dtype) and ``max_elements`` (None or an int >= 0) as keywords.
    """

    # the value of encode_routing / decode_routing's format=, and the module's name
    name: str
    # the layer axes (LAYER_AXES) the format's clients read; where there are two the text's own
    # header tells them apart
    layer_axes: tuple[str, ...]
    # the dtypes a text of this format may carry; None: every integer dtype (the text says which)
    dtypes: tuple[np.dtype, ...] | None
    # what every text of this format starts with (moe-ops inspect tells formats apart by it); None
    # when the format has no such prefix (SGLang's bare base64)
    magic: str | None
    # (array) -> str: the text of an integer array; ValueError for one the format cannot carry
    encode: Callable[[np.ndarray], str]
    # (text, *, num_layers, top_k, dtype, max_elements) -> a new, writable, native-order array;
    # ValueError for every malformed text, sizes checked before anything is allocated
    decode: Callable[..., np.ndarray]
    # how the format carries routing weights beside the ids; None: it has no place for them, and
    # no_weights says so (the ValueError encode_routing_weights / decode_routing_weights raise)
    weights: WeightsCodec | None = None
    # with weights None: why the format cannot carry weights and what to use instead
    no_weights: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"WireFormat.name must be an identifier (its module's name), got {self.name!r}")
        axes = self.layer_axes
        if not isinstance(axes, tuple) or not axes or any(a not in LAYER_AXES for a in axes):
            raise ValueError(f"WireFormat.layer_axes must be a non-empty tuple of {LAYER_AXES}, got {axes!r}")
        if self.dtypes is not None and (
            not isinstance(self.dtypes, tuple)
            or not self.dtypes
            or any(not isinstance(d, np.dtype) or d.kind not in "iu" or not d.isnative for d in self.dtypes)
        ):
            raise ValueError(
                f"WireFormat.dtypes must be None or a non-empty tuple of native integer np.dtype, "
                f"got {self.dtypes!r}"
            )
        if self.magic is not None and (
            not isinstance(self.magic, str) or not self.magic.isascii() or not self.magic
        ):
            raise ValueError(f"WireFormat.magic must be None or non-empty ASCII text, got {self.magic!r}")
        if not callable(self.encode) or not callable(self.decode):
            raise ValueError("WireFormat.encode and WireFormat.decode must be callable")
        if self.weights is not None and not isinstance(self.weights, WeightsCodec):
            raise ValueError(f"WireFormat.weights must be None or a WeightsCodec, got {self.weights!r}")
        if (self.weights is None) == (not isinstance(self.no_weights, str) or not self.no_weights):
            raise ValueError(
                "WireFormat.no_weights must say why the format has no place for weights (and what to "
                "use instead) exactly when WireFormat.weights is None"
            )

    def matches(self, s: str | bytes | bytearray | memoryview) -> bool:
        """True when ``s`` starts with this format's ``magic`` (always False without one)."""
        if self.magic is None:
            return False
        head = s[: len(self.magic)]
        if not isinstance(head, str):
            head = bytes(head).decode("latin-1")
        return head == self.magic


def check_layer_axis(layer_axis: Any) -> str:
    """``layer_axis`` when it is one of :data:`LAYER_AXES`, else ValueError naming them."""
    if not isinstance(layer_axis, str) or layer_axis not in LAYER_AXES:
        names = " or ".join(map(repr, LAYER_AXES))
        raise ValueError(f"layer_axis must be {names}, got {layer_axis!r}")
    return layer_axis


def dtype_names(dtypes: tuple[np.dtype, ...], last: str = ", ") -> str:
    """'int32, uint16, uint8' (or with ``last=" or "``: 'int32, uint16 or uint8')."""
    names = [d.name for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + last + names[-1]


# ---------------------------------------------------------------------------------------------------
# Routing weights: bfloat16 as 16 bits
# ---------------------------------------------------------------------------------------------------


def weight_array(weights: Any, what: str = "weights") -> np.ndarray:
    """``weights`` as a float16 / float32 ndarray; a uint16 array is bfloat16 bits (the capture
    channel's host form for a bfloat16 weights buffer) and widens to float32 exactly. ValueError
    naming ``what`` otherwise (float64 is refused rather than rounded twice: routers return float32
    at most)."""
    weights = np.asarray(weights)
    if weights.dtype.newbyteorder("=") == np.dtype(np.uint16):
        return from_bfloat16_bits(weights)
    if weights.dtype.newbyteorder("=") not in (np.dtype(np.float16), np.dtype(np.float32)):
        raise ValueError(
            f"{what} must be a float16 or float32 array (or uint16 bfloat16 bits), got dtype {weights.dtype}"
        )
    return weights


def bfloat16_bits(weights: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest to each float16 / float32 value, as its 16 bits in a new uint16 array.

    Rounding is to nearest, ties to even (what a device's ``float -> bfloat16`` cast does): the
    float32 bits plus ``0x7FFF`` plus the lowest kept bit, shifted right 16. float16 widens to
    float32 exactly first. Finite values past bfloat16's largest round to +-inf, subnormals are kept
    (bfloat16 has float32's exponent range, so none flush to 0), -0.0 stays -0.0, and a NaN stays a
    NaN of the same sign (its payload's top 7 bits kept, the quiet bit set, so that no NaN rounds
    to inf).
    """
    bits = np.ascontiguousarray(weights, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
        np.uint16
    )
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 bits (uint16), exactly: each is the top half of a float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---------------------------------------------------------------------------------------------------
# Arrays in, text out
# ---------------------------------------------------------------------------------------------------


def integer_array(array: Any, what: str) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be an integer array, got dtype {array.dtype}")
    return array


def b64encode(data: np.ndarray) -> str:
    """Base64 text of a contiguous uint8 array, straight to str (no bytes -> str pass)."""
    if HAS_PYBASE64:
        return _b64.b64encode_as_string(data)
    return base64.b64encode(data).decode("ascii")


def engine_layout(shape: Any, routing: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``routing`` on the MoE-only axis widened to a column per model layer, dense columns 0, in
    ``dtype``: the arrays vLLM's and SGLang's capturers return.

    ``shape``: the model's RoutingShape (not imported here: shapes imports the wire formats).
    """
    routing = np.asarray(routing)
    if routing.dtype.kind not in "iu":
        raise ValueError(f"routing must be an integer array, got dtype {routing.dtype}")
    if routing.ndim != 3 or routing.shape[1:] != (shape.num_layers, shape.top_k):
        raise ValueError(
            f"routing must have shape (n, {shape.num_layers}, {shape.top_k}), got {routing.shape}"
        )
    if routing.size and (routing.min() < 0 or routing.max() >= shape.num_experts):
        raise ValueError(
            f"routing has ids in [{routing.min()}, {routing.max()}], outside [0, num_experts="
            f"{shape.num_experts}): not routing of this model (never-written rows?)"
        )
    # zeros + one casting copy into the MoE columns (RoutingShape's column index: a slice where the
    # layers are evenly spaced): shape.to_model_layers(rows.astype(dtype), fill=0) writes the array
    # twice and converts once more, 53 ms against 27 ms for 32768 tokens x 61 layers x 8 int32 ids
    out = np.zeros((routing.shape[0], shape.num_model_layers, shape.top_k), dtype=dtype)
    out[:, shape._moe_columns] = routing
    return out


# ---------------------------------------------------------------------------------------------------
# Text in: argument checks, base64, sizes before allocation
# ---------------------------------------------------------------------------------------------------


def byte_view(b: memoryview) -> memoryview:
    """``b`` as one flat run of bytes; a non-contiguous view (a strided slice) is copied into one
    first (memoryview.cast takes C-contiguous views only)."""
    if not b.c_contiguous or b.nbytes == 0:  # cast refuses a 0 in the shape too
        b = memoryview(b.tobytes())
    return b.cast("B") if b.format != "B" or b.ndim != 1 else b


def as_text(s: Any) -> str | bytes | bytearray | memoryview:
    if isinstance(s, memoryview):
        return byte_view(s)
    if not isinstance(s, (str, bytes, bytearray)):
        raise TypeError(f"s must be str or bytes, got {type(s).__name__}")
    return s


def b64decode(s: str | bytes | bytearray | memoryview) -> bytes:
    if isinstance(s, str) and not s.isascii():
        raise ValueError("malformed base64: the text has non-ASCII characters")
    try:
        # str is decoded as is (ASCII checked above): no 16 MB encode to bytes first
        return _b64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"malformed base64: {e}") from None


def b64_decoded_size(s: str | bytes | bytearray | memoryview, start: int = 0) -> int:
    """Bytes that valid base64 text ``s[start:]`` decodes to, from its length and padding alone
    (``s`` is not sliced: nothing the size of the text is copied)."""
    n = len(s) - start
    if n % 4:
        raise ValueError(f"malformed base64: {n} characters is not a multiple of 4")
    if n == 0:
        return 0
    tail = s[-2:] if isinstance(s, str) else bytes(s[-2:]).decode("latin-1")
    return n // 4 * 3 - tail.count("=")


def check_count(name: str, value: Any, *, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")
    return int(value)


def check_size(shape: tuple[int, ...], itemsize: int, max_elements: int | None) -> int:
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


def check_dtype_arg(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        out = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"dtype must be None or an integer numpy dtype, got {dtype!r} ({e})") from None
    if out.kind not in "iu" or out.fields is not None or out.subdtype is not None:
        raise ValueError(f"dtype must be None or an integer numpy dtype, got {out}")
    return out.newbyteorder("=")


def check_declared(
    what: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    num_layers: int | None,
    top_k: int | None,
    want_dtype: np.dtype | None,
) -> None:
    """The shape and dtype a self-describing text declares against those the caller asked for
    (None: not asked); ValueError naming both. ``what``: 'the .npy data', 'the nrlre1 envelope'."""
    if want_dtype is not None and dtype.newbyteorder("=") != want_dtype:
        raise ValueError(f"{what} has dtype {dtype}, but dtype={want_dtype} was asked for")
    if (num_layers is not None or top_k is not None) and (
        len(shape) != 3
        or (num_layers is not None and shape[1] != num_layers)
        or (top_k is not None and shape[2] != top_k)
    ):
        want = f"(n, {'*' if num_layers is None else num_layers}, {'*' if top_k is None else top_k})"
        raise ValueError(f"{what} has shape {shape}, but {want} was asked for")
