"""Indexer records on the wire: SGLang's layout for its clients, and moe-ops' compact format.

``format="sglang"``: what SGLang puts in ``meta_info["indexer_topk"]`` - the base64 of the raw
little-endian int32 positions, shape ``(seqlen, num_indexer_layers, index_topk)``, no header, the
indexer's order and its -1 padding kept (the same bytes as its ``routed_experts``, so
:mod:`moe_ops.wire.sglang` does the work; the decoder is told ``num_layers`` and ``k``).

``format="compact"`` (``MOEI``): a top-k set per (token, indexer layer), stored as a SET - the
sparse attention sums over the chosen keys, so the order the indexer listed them in changes nothing
but the float summation order, and the decoder returns each row sorted ascending with its -1 padding
last. Adjacent decode steps of a request share most of their top-k (the keys that scored high for
one query score high for the next), so each row is coded against the previous row of the same
layer when that is shorter:

* FULL: the row's m positions, sorted, as gaps (``p[0]``, then ``p[i] - p[i-1] - 1``), each in
  ``w1`` bits (``w1`` the widest gap's bit length);
* DELTA: the positions the previous row had and this one drops (``r``, as gaps, ``w1`` bits each),
  then those it adds (``a``, as gaps, ``w2`` bits each).

Layout (little-endian)::

    0   4  magic b"MOEI"
    4   1  version (1)
    5   1  flags: bit 0 - counts are uint32 (k > 65535), else uint16; other bits 0
    6   2  reserved, 0
    8   4  n: tokens (rows)
    12  4  L: indexer layers
    16  4  k: positions per row (the top-k), at most 65535
    20  4  context: every position is in [0, context)
    24  ...  R = L * n record headers, layer-major (layer 0's rows 0..n-1, then layer 1's):
            uint8 mode_w1[R] (bit 7: DELTA; bits 0-5: w1), uint8 w2[R], uint16 c1[R], uint16 c2[R]
            (FULL: c1 = m, c2 = 0; DELTA: c1 = r, c2 = a; row 0 of a layer is always FULL)
       ...  the payload: every record's gaps, in record order, packed LSB-first without alignment
            (record i starts where record i-1 ended), zero bits to a whole byte
    end-4 4  CRC-32 (zlib) of everything before it

The text form is the base64 of those bytes. Decoding is exact (the set of every row, ``-1`` padding
after it). Before the output is allocated it checks the CRC and the sizes against the bytes present
and ``max_elements``; then each width (at most 31 bits), that a DELTA drops only positions the
previous row had and adds only ones it lacked, rows of at most k positions, every position below
``context``, the payload's length. Anything else is a ValueError naming the problem. Memory: the output
(``max_elements`` int32 at most, 2**28 by default) and temporaries of a few dozen bytes a value for
spans of about 2**18 values (a dense row codes in 0 bits, so a short text may describe a large
output; the output bound is what limits it).
"""

from __future__ import annotations

import base64
import ctypes
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._runtime import native
from ..wire import sglang as _sglang
from ..wire._base import as_text, b64_decoded_size, b64decode, check_size

__all__ = [
    "COMPACT_MAGIC",
    "COMPACT_VERSION",
    "INDEXER_FORMATS",
    "canonical_positions",
    "codec",
    "decode_positions",
    "decode_positions_bytes",
    "encode_positions",
    "encode_positions_bytes",
    "set_bound_bits",
]

INDEXER_FORMATS = ("compact", "sglang")
COMPACT_MAGIC = b"MOEI"
COMPACT_VERSION = 1
_HEADER = struct.Struct("<4sBBHIIII")
_DELTA = 0x80
_WIDTH_MASK = 0x3F
_MAX_WIDTH = 31  # gaps of positions below 2**31
# positions per row the format carries (its counts are uint16): DSA's k is 512 - 2048; a bound here
# also bounds one row's decoding work, which no text can otherwise limit (a dense row codes in 0 bits)
MAX_K = 0xFFFF
# decoded elements a text may describe unless the caller says otherwise: 2**28 int32 (1 GiB)
DEFAULT_MAX_ELEMENTS = 1 << 28


def _positions_array(positions: Any) -> np.ndarray:
    try:
        import torch

        if isinstance(positions, torch.Tensor):
            positions = positions.detach().cpu().numpy()  # HOST SYNC for a device tensor
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    array = np.asarray(positions)
    if array.dtype.kind not in "iu":
        raise ValueError(f"positions must be an integer array, got dtype {array.dtype}")
    if array.ndim != 3:
        raise ValueError(f"positions must be 3-D (n, num_indexer_layers, k), got shape {array.shape}")
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        # cast to int64 below, such a value would wrap to a negative one (2**64 - 1 to -1, "none")
        raise ValueError(f"positions must fit int64, got {array.max()}")
    return array


def _check_context(context: Any) -> int:
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or not 1 <= context <= 2**31:
        raise ValueError(
            f"context must be an int in [1, 2**31] (positions lie in [0, context)), got {context!r}"
        )
    return int(context)


def canonical_positions(positions: Any) -> np.ndarray:
    """``positions`` (n, L, k) as the compact format decodes them: each row's positions sorted
    ascending, its -1 padding last, int32 (what a round trip compares against)."""
    array = _positions_array(positions).astype(np.int64)
    key = np.where(array >= 0, array, np.iinfo(np.int64).max)
    out = np.sort(key, axis=2)
    return np.where(out == np.iinfo(np.int64).max, -1, out).astype(np.int32)


# the C encoder tests membership in the previous row through bitmaps up to this context (codec.c)
_BITMAP_CONTEXT = 1 << 22
_CODEC_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "codec.c")


def _native() -> ctypes.CDLL | None:
    lib = native.load(_CODEC_SOURCE)
    if lib is not None and not getattr(lib, "_moei_typed", False):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.moei_encode.restype = i64
        lib.moei_encode.argtypes = [
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            i64,
            ptr,
        ]
        lib.moei_decode.restype = i64
        lib.moei_decode.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
        lib._moei_typed = True
    return lib


def codec() -> str:
    """Which codec the compact format runs: "native" (codec.c, built at the first call with the
    system C compiler) or why the numpy twin runs instead (no compiler, ``MOE_OPS_NATIVE=0``, a
    failed build). Builds the C codec if it is not built yet."""
    _native()
    return native.status(_CODEC_SOURCE)


def set_bound_bits(k: int, context: int) -> float:
    """log2 C(context, k): the bits a k-subset of ``context`` positions needs at the least (the
    floor a coder of random sets is measured against)."""
    from math import lgamma, log

    return (lgamma(context + 1) - lgamma(k + 1) - lgamma(context - k + 1)) / log(2)


# --------------------------------------------------------------------------------------------------
# bit packing: values with per-value widths, back to back, LSB first, in uint64 words
# --------------------------------------------------------------------------------------------------


def _pack(values: np.ndarray, widths: np.ndarray) -> tuple[bytes, int]:
    """(bytes, bits) of ``values`` (uint64, each below 2**width) packed at their ``widths``."""
    ends = np.cumsum(widths, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    words = np.zeros(total // 64 + 2, dtype=np.uint64)
    live = widths > 0
    if live.any():
        v = values[live].astype(np.uint64)
        offset = (ends - widths)[live]
        word = offset >> 6
        shift = (offset & 63).astype(np.uint64)
        lo = v << shift  # bits shifted past 64 drop (they go to the next word below)
        hi = np.where(shift == 0, np.uint64(0), v >> ((np.uint64(64) - shift) & np.uint64(63)))
        # values are in offset order, so word indices do not decrease: one reduceat per half, and
        # the bits of different values never overlap (a sum is an OR)
        starts = np.flatnonzero(np.diff(word, prepend=-1))
        words[word[starts]] |= np.add.reduceat(lo, starts)
        spill = hi != 0
        if spill.any():
            w2 = word[spill] + 1
            h = hi[spill]
            s2 = np.flatnonzero(np.diff(w2, prepend=-1))
            words[w2[s2]] |= np.add.reduceat(h, s2)
    data = words.view("<u8").tobytes() if words.dtype.byteorder != ">" else words.astype("<u8").tobytes()
    return data[: (total + 7) // 8], total


def _unpack(data: np.ndarray, widths: np.ndarray, base: int = 0) -> np.ndarray:
    """Inverse of :func:`_pack`: int64 values of ``widths`` read back to back from ``data``
    (uint8, padded by the caller to whole words plus one), the first at bit ``base``."""
    words = data.view("<u8")
    ends = np.cumsum(widths, dtype=np.int64) + base
    offset = ends - widths
    word = offset >> 6
    shift = (offset & 63).astype(np.uint64)
    lo = words[word] >> shift
    hi = np.where(shift == 0, np.uint64(0), words[word + 1] << ((np.uint64(64) - shift) & np.uint64(63)))
    mask = (np.uint64(1) << widths.astype(np.uint64)) - np.uint64(1)
    return ((lo | hi) & mask).astype(np.int64)


def _bit_length(x: np.ndarray) -> np.ndarray:
    """Bit length of non-negative int64 values below 2**31 (0 for 0)."""
    out = np.zeros(x.shape, dtype=np.int64)
    x = x.copy()
    for shift in (16, 8, 4, 2, 1):
        big = x >= (1 << shift)
        out += big * shift
        x = np.where(big, x >> shift, x)
    return out + (x > 0)


def _segment_max(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Max of each consecutive segment of ``values`` (``counts`` long each; 0 for an empty one)."""
    out = np.zeros(counts.shape, dtype=np.int64)
    nonempty = counts > 0
    if values.size:
        starts = (np.cumsum(counts) - counts)[nonempty]
        out[nonempty] = np.maximum.reduceat(values, starts)
    return out


def _gaps(sorted_values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Gaps of consecutive sorted segments: ``v[0]``, then ``v[i] - v[i-1] - 1``."""
    gaps = np.empty_like(sorted_values)
    if sorted_values.size:
        gaps[0] = sorted_values[0]
        gaps[1:] = sorted_values[1:] - sorted_values[:-1] - 1
        starts = (np.cumsum(counts) - counts)[counts > 0]
        gaps[starts] = sorted_values[starts]
    return gaps


def _from_gaps(gaps: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_gaps` (int64)."""
    if not gaps.size:
        return gaps.astype(np.int64)
    steps = gaps + 1
    total = np.cumsum(steps)
    starts = (np.cumsum(counts) - counts)[counts > 0]
    base = np.repeat(total[starts] - steps[starts], counts[counts > 0])
    return total - base - 1


# --------------------------------------------------------------------------------------------------
# compact encode
# --------------------------------------------------------------------------------------------------


def encode_positions_bytes(positions: Any, *, context: int) -> bytes:
    """The compact (``MOEI``) bytes of ``positions``: (n, num_indexer_layers, k) integer, each row
    distinct positions in ``[0, context)`` padded with -1 anywhere (the order is not kept: see the
    module docstring). A torch tensor is copied to the host (HOST SYNC for a device tensor).

    Raises ValueError for a wrong shape or dtype, a position outside ``[-1, context)`` or repeated
    within its row (the capture stored those as -1; a row handed here with one is not a record).
    The rows are coded in C where a compiler is at hand (:func:`codec`), else by the numpy twin:
    the same bytes. Thread-safe; the C loop runs without the GIL.
    """
    context = _check_context(context)
    array = _checked_shape(positions)
    lib = _native()
    if lib is not None:
        data = _encode_native(lib, array, context)
        if data is not None:
            return data
    # no C codec, or bad input: the numpy twin codes the rows or names the problem
    return _encode_numpy(array, context)


def _checked_shape(positions: Any) -> np.ndarray:
    array = _positions_array(positions)
    n, n_layers, k = array.shape
    for name, v in (("n", n), ("num_indexer_layers", n_layers)):
        if v >= 2**32:
            raise ValueError(f"{name}={v} does not fit the format's uint32 header field")
    if k > MAX_K:
        raise ValueError(f"k={k} positions per row: the compact format carries at most {MAX_K}")
    return array


def _encode_native(lib: ctypes.CDLL, array: np.ndarray, context: int) -> bytes | None:
    """The C codec's bytes of a shape-checked array, or None where it found bad input (the numpy
    twin then says what)."""
    n, n_layers, k = array.shape
    if array.dtype != np.int32:
        if array.size and (array.min() < -1 or array.max() >= context):
            return None
        array = array.astype(np.int32)
    if any(st % 4 for st in array.strides):  # a view whose strides are not whole int32 elements
        array = np.ascontiguousarray(array)
    n_records = n * n_layers
    mode_w1 = np.empty(n_records, np.uint8)
    w2 = np.empty(n_records, np.uint8)
    c1 = np.empty(n_records, "<u2")
    c2 = np.empty(n_records, "<u2")
    payload = np.empty(n_records * k * 4 + 8, np.uint8)
    scratch = np.empty(5 * max(k, 1), np.uint32)
    # membership of a row's positions in the previous row through bitmaps of the context while
    # they stay in cache (2 x 64 KiB at 4M positions), else a merge of the sorted rows
    n_words = -(-context // 64) if context <= _BITMAP_CONTEXT else 0
    bitmaps = np.zeros(2 * max(n_words, 1), np.uint64)
    bad = ctypes.c_int64(0)
    size = lib.moei_encode(
        array.ctypes.data, n, n_layers, k, *(st // 4 for st in array.strides), context,
        mode_w1.ctypes.data, w2.ctypes.data, c1.ctypes.data, c2.ctypes.data, payload.ctypes.data,
        scratch.ctypes.data, bitmaps.ctypes.data, n_words, ctypes.byref(bad),
    )  # fmt: skip
    if size < 0:
        return None
    head = _HEADER.pack(COMPACT_MAGIC, COMPACT_VERSION, 0, 0, n, n_layers, k, context)
    body = b"".join(
        (head, mode_w1.tobytes(), w2.tobytes(), c1.tobytes(), c2.tobytes(), payload[:size].tobytes())
    )
    return body + struct.pack("<I", zlib.crc32(body))


def _encode_numpy(array: np.ndarray, context: int) -> bytes:
    """The numpy twin of the C codec's encoder (the format's definition)."""
    n, n_layers, k = array.shape
    pos = array.astype(np.int64)
    if pos.size and (pos.min() < -1 or pos.max() >= context):
        bad = pos[(pos < -1) | (pos >= context)][0]
        raise ValueError(f"positions must lie in [0, context={context}) or be -1 (none), got {bad}")
    # layer-major rows, each sorted with its -1 padding last
    rows = np.ascontiguousarray(pos.transpose(1, 0, 2)).reshape(n_layers * n, k)
    rows = np.sort(np.where(rows >= 0, rows, context), axis=1)
    valid = rows < context
    if k > 1 and ((rows[:, 1:] == rows[:, :-1]) & valid[:, 1:]).any():
        raise ValueError("positions repeat within a row: a top-k set holds each key position once")
    n_records = n_layers * n
    m = valid.sum(axis=1)
    record = np.repeat(np.arange(n_records, dtype=np.int64), m)
    values = rows[valid]
    # keys (record, position) in one sorted array: row t's element p is in row t-1 iff the key one
    # record earlier is present (within a layer: a layer's row 0 has no previous row)
    key = record * context + values
    t_of = record % n if n else record
    in_prev = np.zeros(values.shape, dtype=bool)
    in_next = np.zeros(values.shape, dtype=bool)
    if key.size:
        j = np.searchsorted(key, key - context)
        in_prev = (t_of > 0) & (key[np.minimum(j, key.size - 1)] == key - context)
        j = np.searchsorted(key, key + context)
        in_next = (t_of < n - 1) & (key[np.minimum(j, key.size - 1)] == key + context)
    # FULL costs of every record
    full_gaps = _gaps(values, m)
    w_full = _bit_length(_segment_max(full_gaps, m))
    full_bits = m * w_full
    # DELTA: dropped = elements of record i-1 not in record i; added = elements of record i not in i-1
    added = ~in_prev
    dropped = ~in_next & (t_of < n - 1)
    a_count = np.bincount(record[added], minlength=n_records)
    d_record = record[dropped] + 1
    r_count = np.bincount(d_record, minlength=n_records) if n_records else np.zeros(0, np.int64)
    add_values = values[added]
    drop_values = values[dropped]
    add_gaps = _gaps(add_values, a_count)
    drop_gaps = _gaps(drop_values, r_count)
    w_add = _bit_length(_segment_max(add_gaps, a_count))
    w_drop = _bit_length(_segment_max(drop_gaps, r_count))
    delta_bits = r_count * w_drop + a_count * w_add
    first = (np.arange(n_records) % n == 0) if n else np.zeros(0, bool)
    use_delta = ~first & (delta_bits < full_bits)
    # the record headers
    count_dtype = np.dtype("<u2")
    mode_w1 = np.where(use_delta, _DELTA | w_drop, w_full).astype(np.uint8)
    w2 = np.where(use_delta, w_add, 0).astype(np.uint8)
    c1 = np.where(use_delta, r_count, m).astype(count_dtype)
    c2 = np.where(use_delta, a_count, 0).astype(count_dtype)
    # the payload: each record's values in record order (DELTA: dropped gaps, then added gaps)
    per_value_record = np.concatenate([record, d_record, record[added]])
    part = np.concatenate(
        [
            np.zeros(record.size, np.int64),
            np.ones(d_record.size, np.int64),
            np.full(add_values.size, 2, np.int64),
        ]
    )
    gaps = np.concatenate([full_gaps, drop_gaps, add_gaps])
    keep = (
        np.where(part == 0, ~use_delta[per_value_record], use_delta[per_value_record])
        if gaps.size
        else part == 0
    )
    order = np.lexsort((part[keep], per_value_record[keep]))  # stable: gaps stay in order within a part
    sel_record = per_value_record[keep][order]
    sel_part = part[keep][order]
    widths = (
        np.select([sel_part == 0, sel_part == 1], [w_full[sel_record], w_drop[sel_record]], w_add[sel_record])
        if sel_record.size
        else np.zeros(0, np.int64)
    )
    payload, _ = _pack(gaps[keep][order].astype(np.uint64), widths.astype(np.int64))
    head = _HEADER.pack(COMPACT_MAGIC, COMPACT_VERSION, 0, 0, n, n_layers, k, context)
    body = b"".join((head, mode_w1.tobytes(), w2.tobytes(), c1.tobytes(), c2.tobytes(), payload))
    return body + struct.pack("<I", zlib.crc32(body))


def encode_positions(positions: Any, *, format: str = "compact", context: int | None = None) -> str:
    """The text of an indexer record ``positions`` (n, num_indexer_layers, k) in ``format``:
    ``"compact"`` (needs ``context``; see :func:`encode_positions_bytes`) or ``"sglang"`` (int32,
    the indexer's order and -1 padding kept). Raises ValueError for a format not in
    :data:`INDEXER_FORMATS` or input the format cannot carry."""
    if format == "compact":
        if context is None:
            raise ValueError("format='compact' needs context: positions lie in [0, context)")
        return base64.b64encode(encode_positions_bytes(positions, context=context)).decode("ascii")
    if format == "sglang":
        array = _positions_array(positions)
        if array.size and (array.min() < -1 or array.max() > np.iinfo(np.int32).max):
            raise ValueError("format='sglang' carries int32 positions (-1 for none): a value is out of range")
        return _sglang.encode(array.astype(np.int32))
    raise ValueError(f"format must be one of {INDEXER_FORMATS}, got {format!r}")


# --------------------------------------------------------------------------------------------------
# compact decode
# --------------------------------------------------------------------------------------------------


def decode_positions_bytes(data: Any, *, max_elements: int | None = DEFAULT_MAX_ELEMENTS) -> np.ndarray:
    """The (n, num_indexer_layers, k) int32 positions of compact bytes: each row's set sorted
    ascending, -1 after it. ValueError for anything malformed (see the module docstring); sizes
    over ``max_elements`` are refused before the output is allocated (None: numpy's limit).
    The rows are decoded in C where a compiler is at hand (:func:`codec`), else by the numpy twin;
    a payload the C loop refuses is decoded again by the twin, which names the problem."""
    return _decode(data, max_elements, native_ok=True)


def _decode(data: Any, max_elements: int | None, *, native_ok: bool) -> np.ndarray:
    """decode_positions_bytes; ``native_ok`` False: the numpy twin alone."""
    if isinstance(data, memoryview):
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    size = len(data)
    if size < _HEADER.size + 4:
        raise ValueError(
            f"compact indexer record truncated: {size} bytes, the header alone is {_HEADER.size + 4}"
        )
    magic, version, flags, reserved, n, n_layers, k, context = _HEADER.unpack_from(data, 0)
    if magic != COMPACT_MAGIC:
        raise ValueError(f"not a compact indexer record: magic {magic!r}, expected {COMPACT_MAGIC!r}")
    if version != COMPACT_VERSION:
        raise ValueError(f"compact indexer record version {version}, this decoder reads {COMPACT_VERSION}")
    if flags or reserved:
        raise ValueError(f"compact indexer record has unknown flags {flags:#x} / reserved {reserved:#x}")
    (crc,) = struct.unpack_from("<I", data, size - 4)
    if zlib.crc32(memoryview(data)[: size - 4]) != crc:
        raise ValueError("compact indexer record corrupt or truncated: CRC-32 mismatch")
    if not 1 <= context <= 2**31:
        raise ValueError(f"compact indexer record context {context} outside [1, 2**31]")
    if k > MAX_K:
        raise ValueError(f"compact indexer record has k={k}, the format carries at most {MAX_K}")
    check_size((n, n_layers, k), 4, max_elements)
    count_size = 2
    n_records = n * n_layers
    head_end = _HEADER.size + n_records * (2 + 2 * count_size)
    if head_end > size - 4:
        raise ValueError(
            f"compact indexer record truncated: {n_records} record headers need {head_end - _HEADER.size} "
            f"bytes, {size - 4 - _HEADER.size} present"
        )
    raw = np.frombuffer(data, dtype=np.uint8, count=size - 4)
    lib = _native() if native_ok else None
    if lib is not None:
        # the C loop checks the record headers and the payload as the twin below does
        at = head_end
        payload_bytes = size - 4 - at
        padded = np.zeros(payload_bytes + 8, dtype=np.uint8)  # 8 spare bytes: a field is read as a word
        padded[:payload_bytes] = raw[at:]
        counts = np.frombuffer(data, dtype="<u2", count=2 * n_records, offset=_HEADER.size + 2 * n_records)
        if counts.dtype.byteorder not in "=<|" or not counts.flags.aligned:
            counts = counts.astype(np.uint16)  # native order, aligned
        rows = np.empty((n, n_layers, k), dtype=np.int32)
        scratch = np.empty(4 * max(k, 1), np.uint32)
        code = lib.moei_decode(
            padded.ctypes.data, 8 * payload_bytes, n, n_layers, k, context,
            raw[_HEADER.size :].ctypes.data, raw[_HEADER.size + n_records :].ctypes.data,
            counts.ctypes.data, counts[n_records:].ctypes.data, rows.ctypes.data, scratch.ctypes.data,
        )  # fmt: skip
        if code == 0:
            return rows
        # something the C loop refuses: the numpy twin below names it
    at = _HEADER.size
    mode_w1 = raw[at : at + n_records].astype(np.int64)
    at += n_records
    w2 = raw[at : at + n_records].astype(np.int64)
    at += n_records
    count_dtype = np.dtype("<u2")
    c1 = np.frombuffer(data, dtype=count_dtype, count=n_records, offset=at).astype(np.int64)
    at += n_records * count_size
    c2 = np.frombuffer(data, dtype=count_dtype, count=n_records, offset=at).astype(np.int64)
    at += n_records * count_size
    delta = (mode_w1 & _DELTA) != 0
    if (mode_w1 & 0x40).any():
        raise ValueError("compact indexer record header has an unknown mode bit (0x40)")
    w1 = mode_w1 & _WIDTH_MASK
    if (w1 > _MAX_WIDTH).any() or (w2 > _MAX_WIDTH).any():
        raise ValueError(f"compact indexer record has a gap width above {_MAX_WIDTH} bits")
    t_of = np.arange(n_records) % n if n else np.zeros(0, np.int64)
    if (delta & (t_of == 0)).any():
        raise ValueError("compact indexer record: a layer's first row is a DELTA (it has no previous row)")
    if ((~delta) & ((c2 != 0) | (w2 != 0))).any():
        raise ValueError("compact indexer record: a FULL row with an added count or width")
    # row sizes, before any payload is read: FULL m = c1; DELTA m = m_prev - r + a, every m <= k
    step = np.where(delta, c2 - c1, c1)
    segment = np.cumsum(~delta) - 1  # FULL rows start segments
    seg_start = np.flatnonzero(~delta)
    run = np.cumsum(step)
    if n_records:
        m = run - (run[seg_start] - step[seg_start])[segment]
        m_prev = np.concatenate([[0], m[:-1]])
        if (delta & (c1 > m_prev)).any():
            raise ValueError("compact indexer record: a DELTA drops more positions than its previous row has")
        if (m < 0).any() or (m > min(k, context)).any():
            raise ValueError(
                f"compact indexer record: a row holds more than k={k} positions (or fewer than 0)"
            )
    widths_per_record = np.where(delta, c1 * w1 + c2 * w2, c1 * w1)
    total_bits = int(widths_per_record.sum())
    payload_bytes = size - 4 - at
    if (total_bits + 7) // 8 != payload_bytes:
        raise ValueError(
            f"compact indexer record payload is {payload_bytes} bytes, its headers describe {total_bits} bits"
        )
    padded = np.zeros((payload_bytes // 8 + 2) * 8, dtype=np.uint8)  # whole words, one spare
    padded[:payload_bytes] = raw[at:]
    out = np.full((n_records, k), -1, dtype=np.int32)
    if n_records:
        book = _Records(delta, c1, np.where(delta, c2, 0), w1, w2, segment, seg_start, m, widths_per_record)
        # spans of consecutive records of about _SPAN values each (at least one record): the
        # temporaries stay within a few dozen bytes a value of one span, whatever the text claims
        work = book.values + m
        ends = np.cumsum(work)
        lo = 0
        while lo < n_records:
            hi = max(lo + 1, int(np.searchsorted(ends, ends[lo] - work[lo] + _SPAN, side="right")))
            lead = out[lo - 1, : m[lo - 1]].astype(np.int64) if delta[lo] else None
            _decode_span(book, lo, hi, lead, padded, context, out)
            lo = hi
    return out.reshape(n_layers, n, k).transpose(1, 0, 2).copy()


# values (gaps and positions) one decoding step handles at most, beyond one record's own
_SPAN = 1 << 18


@dataclass(frozen=True)
class _Records:
    """The record headers of one text, checked (see decode_positions_bytes), as int64 arrays."""

    # (R,) bool: the record is a DELTA
    delta: np.ndarray
    # (R,): FULL m / DELTA dropped count; DELTA added count (0 for FULL)
    n1: np.ndarray
    n2: np.ndarray
    # (R,): gap widths of the two parts
    w1: np.ndarray
    w2: np.ndarray
    # (R,): each record's segment (a FULL record starts one), and each segment's first record
    segment: np.ndarray
    seg_start: np.ndarray
    # (R,): positions in each record's row
    m: np.ndarray
    # (R,): payload bits of each record
    bits: np.ndarray

    @property
    def values(self) -> np.ndarray:
        return self.n1 + self.n2

    @property
    def bit_start(self) -> np.ndarray:
        return np.cumsum(self.bits) - self.bits


def _decode_span(
    book: _Records,
    lo: int,
    hi: int,
    lead: np.ndarray | None,
    padded: np.ndarray,
    context: int,
    out: np.ndarray,
) -> None:
    """Decodes records ``[lo, hi)`` into ``out``'s rows; ``lead``: the decoded row ``lo - 1`` when
    record ``lo`` is a DELTA against it (treated as a FULL row there, its output discarded)."""
    delta, n1, n2 = book.delta, book.n1[lo:hi], book.n2[lo:hi]
    per_record = n1 + n2
    value_record = np.repeat(np.arange(lo, hi), per_record)
    index_in_record = np.arange(value_record.size) - np.repeat(np.cumsum(per_record) - per_record, per_record)
    is_second = index_in_record >= book.n1[value_record]
    widths = np.where(is_second, book.w2[value_record], book.w1[value_record])
    gaps = _unpack(padded, widths, int(book.bit_start[lo]))
    first_part = ~is_second
    values_1 = _from_gaps(gaps[first_part], n1)
    values_2 = _from_gaps(gaps[is_second], n2)
    if (values_1 >= context).any() or (values_2 >= context).any():
        raise ValueError(f"compact indexer record holds a position at or beyond context={context}")
    # events per (segment, position): FULL values and DELTA additions open an interval at their
    # row, DELTA drops close it; a segment's end (or the span's) closes what is open
    rec_1 = value_record[first_part]
    rec_2 = value_record[is_second]
    parts_record = [rec_1, rec_2]
    parts_value = [values_1, values_2]
    parts_kind = [np.where(delta[rec_1], -1, 1), np.ones(rec_2.size, np.int64)]
    if lead is not None:  # row lo - 1, already decoded: its positions open there
        parts_record.append(np.full(lead.size, lo - 1, np.int64))
        parts_value.append(lead)
        parts_kind.append(np.ones(lead.size, np.int64))
    ev_record = np.concatenate(parts_record)
    ev_value = np.concatenate(parts_value)
    ev_kind = np.concatenate(parts_kind)
    ev_segment = book.segment[ev_record]
    order = np.lexsort((ev_record, ev_value, ev_segment))
    ev_record, ev_value, ev_kind, ev_segment = (x[order] for x in (ev_record, ev_value, ev_kind, ev_segment))
    same = np.zeros(ev_record.size, dtype=bool)
    if ev_record.size:
        same[1:] = (ev_segment[1:] == ev_segment[:-1]) & (ev_value[1:] == ev_value[:-1])
    # within a (segment, position): opens and closes alternate, an open first, at rising rows
    if (ev_kind[~same] != 1).any():
        raise ValueError("compact indexer record drops a position its previous row did not have")
    if same.any():
        prev_kind = np.roll(ev_kind, 1)
        if (ev_kind[same] == prev_kind[same]).any():
            raise ValueError(
                "compact indexer record adds a position its previous row already had (or drops one twice)"
            )
        if (ev_record[same] <= np.roll(ev_record, 1)[same]).any():
            raise ValueError("compact indexer record: a position opened and closed in the same row")
    # intervals [open row, close row): the close is the next event's row, or the segment's end
    # within the span (a segment spans one layer only: FULL starts every layer's row 0)
    seg_end = np.append(book.seg_start[1:], book.delta.size)
    opens = ev_kind == 1
    nxt_same = np.append(same[1:], False)
    end = np.minimum(seg_end[ev_segment], hi) if ev_record.size else ev_record
    close = np.where(nxt_same, np.roll(ev_record, -1), end)
    start_rows = ev_record[opens]
    lengths = (close[opens] - start_rows).astype(np.int64)
    if lengths.size and (lengths <= 0).any():  # pragma: no cover - excluded by the checks above
        raise ValueError("compact indexer record has an empty interval")
    out_record = np.repeat(start_rows, lengths) + (
        np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    )
    out_value = np.repeat(ev_value[opens], lengths)
    keep = out_record >= lo
    out_record, out_value = out_record[keep], out_value[keep]
    order = np.lexsort((out_value, out_record))
    out_record, out_value = out_record[order], out_value[order]
    counts = np.bincount(out_record - lo, minlength=hi - lo)
    if not np.array_equal(counts, book.m[lo:hi]):  # pragma: no cover - implied by the event checks
        raise ValueError("compact indexer record rows disagree with their counts")
    col = np.arange(out_record.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out[out_record, col] = out_value


def decode_positions(
    s: Any,
    *,
    format: str = "compact",
    num_layers: int | None = None,
    k: int | None = None,
    max_elements: int | None = DEFAULT_MAX_ELEMENTS,
) -> np.ndarray:
    """The (n, num_indexer_layers, k) int32 positions of a text in ``format``: ``"compact"``
    (self-describing) or ``"sglang"`` (needs ``num_layers`` and ``k``: SGLang's num_indexer_layers
    and index_topk). ValueError for malformed text, sizes checked before anything is allocated."""
    s = as_text(s)
    if format == "compact":
        size = b64_decoded_size(s)
        if max_elements is not None and size > 64 + 16 * max_elements:
            raise ValueError(f"compact indexer text of {size} bytes is larger than max_elements allows")
        return decode_positions_bytes(b64decode(s), max_elements=max_elements)
    if format == "sglang":
        return _sglang.decode(
            s, num_layers=num_layers, top_k=k, dtype=np.dtype(np.int32), max_elements=max_elements
        )
    raise ValueError(f"format must be one of {INDEXER_FORMATS}, got {format!r}")
