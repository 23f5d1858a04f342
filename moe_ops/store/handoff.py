"""Rows that travel with their KV: from a prefill instance to a decode instance (the handoff), and
to a lower KV tier and back (the blocks record, at the end of this module).

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
    32   8  computed: positions the prefill attempt computed (>= n); with the sampled flag, the
            request knows computed + 1 tokens (the decode side's next attempt samples after them)
    40   4  num_experts of the routing shape
    44   2  R: bytes of the request id
    46   1  request id type: 0 str (utf-8), 1 int (int64)
    47   1  reserved, 0
    48   R  the request id
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
    "BLOCKS_MAGIC",
    "HANDOFF_MAGIC",
    "HANDOFF_VERSION",
    "BlocksRecord",
    "HandoffRecord",
    "decode_blocks",
    "decode_handoff",
    "encode_blocks",
    "encode_handoff",
    "new_handoff_id",
]

HANDOFF_MAGIC = b"MOEH"
HANDOFF_VERSION = 1
_HEAD = struct.Struct("<4sBBHQQQQIHBB")
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
    # positions the prefill attempt computed (>= num_tokens; None: num_tokens)
    computed: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.missing.shape[0])


def new_handoff_id() -> int:
    """64 random bits (``secrets``): two exports never share an id in practice (2**-64 a pair)."""
    return secrets.randbits(64)


def _rows_part(channels: tuple[Channel, ...], rows: dict, missing: np.ndarray, n: int, what: str) -> list:
    """The channel table, the missing bits and every channel's rows (the part both records share)."""
    parts = []
    for channel in channels:
        name = channel.name.encode("utf-8")
        dtype = np.dtype(channel.dtype).str.encode("ascii")
        shape = tuple(channel.row_shape)
        parts += [struct.pack("<H", len(name)), name, struct.pack("<B", len(dtype)), dtype]
        parts += [struct.pack("<B", len(shape)), struct.pack(f"<{len(shape)}I", *shape)]
    if missing.shape != (n,):
        raise ValueError(f"{what}: missing must be ({n},), got {missing.shape}")
    parts.append(np.packbits(missing.astype(bool), bitorder="little").tobytes())
    for channel in channels:
        values = rows[channel.name]
        if values.shape != (n, *channel.row_shape) or values.dtype != np.dtype(channel.dtype):
            raise ValueError(
                f"{what}: rows of channel {channel.name!r} must be {(n, *channel.row_shape)} "
                f"{np.dtype(channel.dtype)}, got {values.shape} {values.dtype}"
            )
        parts.append(
            np.ascontiguousarray(values).astype(values.dtype.newbyteorder("<"), copy=False).tobytes()
        )
    return parts


def _sealed(parts: list) -> bytes:
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


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
    computed = n if record.computed is None else int(record.computed)
    if computed < n:
        raise ValueError(f"handoff: computed={computed} is below the record's {n} rows")
    head = _HEAD.pack(
        HANDOFF_MAGIC, HANDOFF_VERSION, flags, len(record.channels), record.handoff_id, n,
        record.prompt_len or 0, computed, record.num_experts, len(rid_bytes), rid_type, 0,
    )  # fmt: skip
    return _sealed([head, rid_bytes, *_rows_part(record.channels, record.rows, record.missing, n, "handoff")])


class _Reader:
    def __init__(self, data: bytes, end: int, what: str):
        self.data, self.at, self.end, self.what = data, 0, end, what

    def take(self, size: int, part: str) -> memoryview:
        if size < 0 or self.at + size > self.end:
            raise ValueError(
                f"{self.what} truncated: {part} needs {size} bytes at {self.at}, {self.end - self.at} left"
            )
        view = memoryview(self.data)[self.at : self.at + size]
        self.at += size
        return view

    def unpack(self, fmt: str, part: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), part))


def _opened(data, magic: bytes, head_size: int, what: str) -> _Reader:
    """A reader over ``data`` after the checks of every record: bytes, long enough, the magic, the
    CRC-32."""
    if isinstance(data, memoryview):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"a {what} is bytes, got {type(data).__name__}")
    size = len(data)
    if size < head_size + 4:
        raise ValueError(f"{what} truncated: {size} bytes, the header alone is {head_size + 4}")
    if data[:4] != magic:
        raise ValueError(f"not a {what}: magic {bytes(data[:4])!r}, expected {magic!r}")
    (crc,) = struct.unpack_from("<I", data, size - 4)
    if zlib.crc32(memoryview(data)[: size - 4]) != crc:
        raise ValueError(f"{what} corrupt or truncated: CRC-32 mismatch")
    return _Reader(bytes(data), size - 4, what)


def _read_rows(r: _Reader, n_channels: int, n: int) -> tuple[tuple[Channel, ...], np.ndarray, dict]:
    """The channel table, the missing bits and the rows of a record (see _rows_part)."""
    if n_channels < 1:
        raise ValueError(f"{r.what} has no channel (the ids come first)")
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
            raise ValueError(f"{r.what}'s channel {i} is not a channel: {exc}") from None
        if dtype.kind not in "iuf" or dtype.hasobject:
            raise ValueError(f"{r.what}'s channel {i} has dtype {dtype}, not an integer or float")
        channels.append(channel)
    names = [c.name for c in channels]
    if len(set(names)) != len(names):
        raise ValueError(f"{r.what} names a channel twice: {names}")
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
        raise ValueError(f"{r.what} has {r.end - r.at} bytes after its rows")
    return tuple(channels), missing, rows


def decode_handoff(data: bytes, *, max_rows: int = _MAX_ROWS) -> HandoffRecord:
    """The :class:`HandoffRecord` of ``data``. ValueError naming the problem for bytes that are not
    a whole, intact version-1 record (every size is checked before anything is allocated;
    ``max_rows`` bounds the rows)."""
    r = _opened(data, HANDOFF_MAGIC, _HEAD.size, "handoff record")
    head = r.unpack(_HEAD.format, "the header")
    _, version, flags, n_channels, hid, n, prompt_len, computed, num_experts, rid_len, rid_type, reserved = (
        head
    )
    if version != HANDOFF_VERSION:
        raise ValueError(f"handoff record version {version}, this reader reads {HANDOFF_VERSION}")
    if flags & ~_SAMPLED or reserved:
        raise ValueError(f"handoff record has unknown flags {flags:#x} / reserved {reserved:#x}")
    if n > max_rows:
        raise ValueError(f"handoff record of {n} rows: more than max_rows={max_rows}")
    if computed < n:
        raise ValueError(f"handoff record says its prefill computed {computed} positions, it holds {n} rows")
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
    channels, missing, rows = _read_rows(r, n_channels, n)
    return HandoffRecord(
        req_id,
        hid,
        bool(flags & _SAMPLED),
        prompt_len or None,
        num_experts,
        channels,
        rows,
        missing,
        computed,
    )


# --------------------------------------------------------------------------------------------------
# KV offload tiers: a block's rows beside its KV in a lower tier
# --------------------------------------------------------------------------------------------------

BLOCKS_MAGIC = b"MOEB"
_BLOCKS_HEAD = struct.Struct("<4sBBHIIQ")


@dataclass(frozen=True)
class BlocksRecord:
    """The rows of whole KV blocks, saved beside their KV in a lower tier (``MOEB``)."""

    # tokens per block of the ledger that saved them
    block_size: int
    # experts of the routing shape the rows index
    num_experts: int
    # (ids, *extra) channels, row shapes resolved
    channels: tuple[Channel, ...]
    # channel name -> (num_blocks * block_size, *row_shape) rows, block after block
    rows: dict[str, np.ndarray]
    # (num_blocks * block_size,) bool: True where the slot holds no row (never landed, dropped)
    missing: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.missing.shape[0]) // self.block_size


def encode_blocks(record: BlocksRecord) -> bytes:
    """The bytes of ``record``: magic b"MOEB", version 1, flags 0, C channels (uint16), block_size
    (uint32), num_experts (uint32), num_blocks (uint64), then the channel table, the missing bits and
    the rows as a handoff record has them, and a CRC-32."""
    n = record.missing.shape[0]
    if n != record.num_blocks * record.block_size:
        raise ValueError(f"blocks record: {n} rows are not whole blocks of {record.block_size}")
    head = _BLOCKS_HEAD.pack(
        BLOCKS_MAGIC, 1, 0, len(record.channels), record.block_size, record.num_experts, record.num_blocks
    )
    return _sealed([head, *_rows_part(record.channels, record.rows, record.missing, n, "blocks record")])


def decode_blocks(data: bytes, *, max_rows: int = _MAX_ROWS) -> BlocksRecord:
    """The :class:`BlocksRecord` of ``data``; ValueError naming the problem as decode_handoff."""
    r = _opened(data, BLOCKS_MAGIC, _BLOCKS_HEAD.size, "blocks record")
    _, version, flags, n_channels, block_size, num_experts, num_blocks = r.unpack(
        _BLOCKS_HEAD.format, "the header"
    )
    if version != 1 or flags:
        raise ValueError(f"blocks record version {version} flags {flags:#x}: this reader reads version 1")
    if block_size < 1 or num_blocks * block_size > max_rows:
        raise ValueError(
            f"blocks record of {num_blocks} blocks of {block_size}: more than max_rows={max_rows}"
        )
    channels, missing, rows = _read_rows(r, n_channels, num_blocks * block_size)
    return BlocksRecord(block_size, num_experts, channels, rows, missing)
