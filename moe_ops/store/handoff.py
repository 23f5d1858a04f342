"""Prefill/decode handoff: a request's routing rows travel with its KV from one instance to another.

In a disaggregated deployment the prefill instance computes a request's prompt (its KV and its
routing), a connector moves the KV blocks to a decode instance, and decode continues the request.
The routing must follow: the finished request returns prefill rows + decode rows, exactly as one
instance would. :meth:`RoutingLedger.export_handoff` (prefill side) writes a request's landed rows
as one record; the connector carries its bytes beside the KV blocks (or the decode side fetches
them); :meth:`RoutingLedger.import_handoff` (decode side) starts the request on the blocks the KV
went into, with the record's rows at their slots. Plain bytes in, plain bytes out: no engine import.

Partially transferred KV (the decode side recomputes positions ``[p, n)``, e.g. blocks that did not
arrive): ``import_handoff(..., num_tokens=p)`` takes the record's rows of ``[0, p)`` only; the
decode instance's own forwards compute the rest, and their rows are the ones returned for those
positions - the rows of the forward whose KV the decode uses, per position.

Record layout (little-endian), version 1::

    0    4  magic b"MOEH"
    4    1  version (1)
    5    1  flags: bit 0 - the prefill attempt sampled (its first token was drawn from these rows'
            forwards); other bits 0
    6    2  C: channels (ids first)
    8    8  handoff id: 64 random bits; a ledger imports each id once
    16   8  n: rows, positions [0, n) of the request
    24   8  prompt_len (0: not known)
    32   4  num_experts of the routing shape
    36   2  R: bytes of the request id
    38   1  request id type: 0 str (utf-8), 1 int (int64)
    39   1  reserved, 0
    40   R  the request id
    ...     per channel: uint16 name length, the name (utf-8), uint8 dtype length, numpy's dtype
            string ("|u1", "<f2", ...), uint8 ndim, uint32 dims
    ...     missing: ceil(n / 8) bytes, bit i (LSB first) set where row i never arrived on prefill
    ...     per channel: its n rows, C order, the channel's dtype
    end-4 4 CRC-32 (zlib) of everything before it

Decoding checks everything before it returns: the CRC, the magic and version, every size against
the bytes present (and a bound on the rows: ``max_rows``), the channel table. Malformed bytes are a
ValueError naming the problem.
"""

from __future__ import annotations

import math
import secrets
import struct
import zlib
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from ..channels import Channel

__all__ = [
    "HANDOFF_MAGIC",
    "HANDOFF_VERSION",
    "HandoffRecord",
    "decode_handoff",
    "encode_handoff",
    "new_handoff_id",
]

HANDOFF_MAGIC = b"MOEH"
HANDOFF_VERSION = 1
_HEAD = struct.Struct("<4sBBHQQQIHBB")
_SAMPLED = 0x01
# rows a record may hold unless the caller says otherwise: a 2**24-token prompt is beyond any served
_MAX_ROWS = 1 << 24


@dataclass(frozen=True)
class HandoffRecord:
    """One request's rows of positions ``[0, num_tokens)`` handed from prefill to decode."""

    # the request's id on both instances (str or int)
    req_id: Hashable
    # random 64-bit id of this record: a ledger imports each once
    handoff_id: int
    # the prefill attempt sampled its first token from these rows' forwards
    sampled: bool
    # tokens of the prompt, or None when the prefill side did not know it
    prompt_len: int | None
    # experts of the routing shape the rows index (another model's record is refused by it)
    num_experts: int
    # (ids, *extra) channels, row shapes resolved
    channels: tuple[Channel, ...]
    # channel name -> (num_tokens, *row_shape) rows, ids first
    rows: dict[str, np.ndarray]
    # (num_tokens,) bool: True where the row never arrived on the prefill side (its step dropped)
    missing: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.missing.shape[0])


def new_handoff_id() -> int:
    """64 random bits (``secrets``): two exports never share an id in practice (2**-64 a pair)."""
    return secrets.randbits(64)


def encode_handoff(record: HandoffRecord) -> bytes:
    """The bytes of ``record`` (see the module docstring). ValueError for a request id that is not
    a str or an int, or rows that disagree with the channels."""
    rid = record.req_id
    if isinstance(rid, str):
        rid_type, rid_bytes = 0, rid.encode("utf-8")
    elif isinstance(rid, (int, np.integer)) and not isinstance(rid, bool):
        rid_type, rid_bytes = 1, struct.pack("<q", int(rid))
    else:
        raise ValueError(f"a handoff carries a str or int request id, got {type(rid).__name__} {rid!r}")
    if len(rid_bytes) > 0xFFFF:
        raise ValueError(f"request id of {len(rid_bytes)} bytes: a handoff carries at most 65535")
    n = record.num_tokens
    flags = _SAMPLED if record.sampled else 0
    head = _HEAD.pack(
        HANDOFF_MAGIC, HANDOFF_VERSION, flags, len(record.channels), record.handoff_id, n,
        record.prompt_len or 0, record.num_experts, len(rid_bytes), rid_type, 0,
    )  # fmt: skip
    parts = [head, rid_bytes]
    for channel in record.channels:
        name = channel.name.encode("utf-8")
        dtype = np.dtype(channel.dtype).str.encode("ascii")
        shape = tuple(channel.row_shape)
        parts += [struct.pack("<H", len(name)), name, struct.pack("<B", len(dtype)), dtype]
        parts += [struct.pack("<B", len(shape)), struct.pack(f"<{len(shape)}I", *shape)]
    parts.append(np.packbits(record.missing.astype(bool), bitorder="little").tobytes())
    for channel in record.channels:
        rows = record.rows[channel.name]
        if rows.shape != (n, *channel.row_shape) or rows.dtype != np.dtype(channel.dtype):
            raise ValueError(
                f"rows of channel {channel.name!r} must be {(n, *channel.row_shape)} "
                f"{np.dtype(channel.dtype)}, got {rows.shape} {rows.dtype}"
            )
        parts.append(np.ascontiguousarray(rows).astype(rows.dtype.newbyteorder("<"), copy=False).tobytes())
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


class _Reader:
    def __init__(self, data: bytes, end: int):
        self.data, self.at, self.end = data, 0, end

    def take(self, size: int, what: str) -> memoryview:
        if size < 0 or self.at + size > self.end:
            raise ValueError(
                f"handoff record truncated: {what} needs {size} bytes at {self.at}, {self.end - self.at} left"
            )
        view = memoryview(self.data)[self.at : self.at + size]
        self.at += size
        return view

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))


def decode_handoff(data: bytes, *, max_rows: int = _MAX_ROWS) -> HandoffRecord:
    """The :class:`HandoffRecord` of ``data``. ValueError naming the problem for bytes that are not
    a whole, intact version-1 record (every size is checked before anything is allocated;
    ``max_rows`` bounds the rows)."""
    if isinstance(data, memoryview):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"a handoff record is bytes, got {type(data).__name__}")
    size = len(data)
    if size < _HEAD.size + 4:
        raise ValueError(f"handoff record truncated: {size} bytes, the header alone is {_HEAD.size + 4}")
    if data[:4] != HANDOFF_MAGIC:
        raise ValueError(f"not a handoff record: magic {bytes(data[:4])!r}, expected {HANDOFF_MAGIC!r}")
    (crc,) = struct.unpack_from("<I", data, size - 4)
    if zlib.crc32(memoryview(data)[: size - 4]) != crc:
        raise ValueError("handoff record corrupt or truncated: CRC-32 mismatch")
    r = _Reader(bytes(data), size - 4)
    _, version, flags, n_channels, hid, n, prompt_len, num_experts, rid_len, rid_type, reserved = r.unpack(
        _HEAD.format, "the header"
    )
    if version != HANDOFF_VERSION:
        raise ValueError(f"handoff record version {version}, this reader reads {HANDOFF_VERSION}")
    if flags & ~_SAMPLED or reserved:
        raise ValueError(f"handoff record has unknown flags {flags:#x} / reserved {reserved:#x}")
    if n > max_rows:
        raise ValueError(f"handoff record of {n} rows: more than max_rows={max_rows}")
    if n_channels < 1:
        raise ValueError("handoff record has no channel (the ids come first)")
    rid = bytes(r.take(rid_len, "the request id"))
    if rid_type == 0:
        try:
            req_id: Hashable = rid.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("handoff record's request id is not utf-8") from None
    elif rid_type == 1 and rid_len == 8:
        (req_id,) = struct.unpack("<q", rid)
    else:
        raise ValueError(f"handoff record's request id has type {rid_type} and {rid_len} bytes")
    channels = []
    for i in range(n_channels):
        (name_len,) = r.unpack("<H", f"channel {i}'s name length")
        name = bytes(r.take(name_len, f"channel {i}'s name"))
        (dtype_len,) = r.unpack("<B", f"channel {i}'s dtype length")
        dtype_text = bytes(r.take(dtype_len, f"channel {i}'s dtype")).decode("ascii", "replace")
        (ndim,) = r.unpack("<B", f"channel {i}'s ndim")
        dims = r.unpack(f"<{ndim}I", f"channel {i}'s dims")
        try:
            dtype = np.dtype(dtype_text)
            channel = Channel(name.decode("utf-8"), dtype, tuple(int(d) for d in dims))
        except (TypeError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"handoff record's channel {i} is not a channel: {exc}") from None
        if dtype.kind not in "iuf" or dtype.hasobject:
            raise ValueError(f"handoff record's channel {i} has dtype {dtype}, not an integer or float")
        channels.append(channel)
    names = [c.name for c in channels]
    if len(set(names)) != len(names):
        raise ValueError(f"handoff record names a channel twice: {names}")
    missing = np.unpackbits(
        np.frombuffer(r.take((n + 7) // 8, "the missing-row bits"), np.uint8), count=n, bitorder="little"
    ).astype(bool)
    rows = {}
    for channel in channels:
        per_row = math.prod(channel.row_shape) * channel.dtype.itemsize  # Python ints: no wrap
        view = r.take(n * per_row, f"channel {channel.name!r}'s rows")
        little = np.frombuffer(view, dtype=channel.dtype.newbyteorder("<"))
        rows[channel.name] = little.astype(channel.dtype).reshape(n, *channel.row_shape)
    if r.at != r.end:
        raise ValueError(f"handoff record has {r.end - r.at} bytes after its rows")
    return HandoffRecord(
        req_id, hid, bool(flags & _SAMPLED), prompt_len or None, num_experts, tuple(channels), rows, missing
    )
