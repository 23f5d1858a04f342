"""Raw bytes (``encode_routing_bytes`` / ``decode_routing_bytes``), for clients that skip base64::

    offset  size        field
    0       4           magic b"MOER"
    4       1           version (1)
    5       1           dtype code: 1 uint8, 2 uint16, 3 int32, 4 int16, 5 int64, 6 int8, 7 uint32, 8 uint64
    6       1           ndim (0..8)
    7       1           reserved, must be 0
    8       8 * ndim    shape, uint64 little-endian each
    ...     prod(shape) * itemsize   the elements, C order, little-endian

Not a text format of the registry (``format=`` of ``encode_routing``): bytes, not text. The form is
canonical: whatever decodes re-encodes to the very same bytes.
"""

from __future__ import annotations

import struct

import numpy as np

from ._base import byte_view, check_count, check_size, integer_array

__all__ = ["RAW_MAGIC", "RAW_VERSION", "decode_routing_bytes", "encode_routing_bytes"]

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


def encode_routing_bytes(array: np.ndarray) -> bytes:
    """The raw-bytes form of an integer array (header in the module docstring)."""
    array = integer_array(array, "array")
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
    max_elements = check_count("max_elements", max_elements, minimum=0)
    view = byte_view(memoryview(b))
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
    count = check_size(shape, dtype.itemsize, max_elements)
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
