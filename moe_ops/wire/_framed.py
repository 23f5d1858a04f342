"""A batch of requests' routing in one framed file that a trainer rank reads by (request, token range).

The per-request texts (``encode_routing``) make a data loader decode a whole request to use one
row, and a batch shipped as one array makes every rank materialise every rank's rows. The framed
form (``MOEF``) stores each request's rows raw and contiguous, in blocks of ``rows_per_block`` rows
with a CRC-32 each, and an index at the end: a reader opens it (bytes, a memory map, or a file
read with seeks), and :meth:`FramedReader.read` returns the rows of one request's token range by
reading only the blocks that hold them, checked. A rank of 8 reading its eighth of a batch holds
its eighth.

Layout (little-endian), version 1::

    0   4  magic b"MOEF"
    4   1  version (1)
    5   1  flags, 0
    6   2  reserved, 0
    8   4  L: layers of a row
    12  4  K: entries per layer (top_k)
    16  8  rows_per_block B (>= 1)
    24  16 the rows' numpy dtype string, NUL-padded ("|u1", "<u2", "<i4", "<f2", ...)
    40  ...  per request, in index order: its n rows (n, L, K), C order, then ceil(n / B) CRC-32s
             (uint32), one per block of B rows (the last block may be short)
    ...  the index: uint64 R, then per request: uint16 id length, uint8 id type (0 str utf-8,
         1 int64), the id, uint64 start (token position of its first row), uint64 n, uint64 offset
         of its first row
    end-16  8  offset of the index
    end-8   4  CRC-32 of the index
    end-4   4  magic b"MOEF"

Every size is checked against the file's length before anything is read or allocated; malformed
input is a ValueError naming the problem. A CRC mismatch in a block read is a ValueError naming the
request and the block.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FRAMED_MAGIC", "FramedEntry", "FramedReader", "write_framed"]

FRAMED_MAGIC = b"MOEF"
_VERSION = 1
_HEAD = struct.Struct("<4sBBHIIQ16s")
_TAIL = struct.Struct("<QI4s")
_ENTRY = struct.Struct("<QQQ")
# rows per CRC block unless the writer says otherwise: 256 rows of DeepSeek-V3 (58 x 8 uint8) are
# 116 KiB, so a token-range read reads at most 2 x 255 rows beyond what it asked for
DEFAULT_ROWS_PER_BLOCK = 256
_DTYPES = ("|u1", "<u2", "<u4", "|i1", "<i2", "<i4", "<i8", "<f2", "<f4")


@dataclass(frozen=True)
class FramedEntry:
    """One request of a framed file (from the index)."""

    req_id: Hashable
    # token position of the request's first row (a multi-turn delta starts after the held rows)
    start: int
    # rows of the request
    num_tokens: int
    # byte offset of its first row
    offset: int


def _id_bytes(req_id: Hashable) -> tuple[int, bytes]:
    if isinstance(req_id, str):
        return 0, req_id.encode("utf-8")
    if isinstance(req_id, (int, np.integer)) and not isinstance(req_id, bool):
        return 1, struct.pack("<q", int(req_id))
    raise ValueError(f"a framed file names requests by str or int, got {type(req_id).__name__} {req_id!r}")


def write_framed(
    out: Any,
    requests: Iterable[tuple[Hashable, np.ndarray] | tuple[Hashable, np.ndarray, int]],
    *,
    rows_per_block: int = DEFAULT_ROWS_PER_BLOCK,
) -> int:
    """Writes ``requests`` - ``(req_id, rows)`` or ``(req_id, rows, start)``, rows ``(n, L, K)`` of one
    dtype and row shape for every request - to ``out`` (a path, or a binary file object written in
    order: no seeks), one request at a time (the batch is never held whole). Returns the bytes
    written. ValueError for rows of another shape or dtype than the first request's, a dtype the
    format does not carry, a request id twice or not a str or int."""
    if isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int) or rows_per_block < 1:
        raise ValueError(f"rows_per_block must be an int >= 1, got {rows_per_block!r}")
    if isinstance(out, (str, os.PathLike)):
        with open(out, "wb") as f:
            return write_framed(f, requests, rows_per_block=rows_per_block)
    written = 0
    index: list[tuple[int, bytes, int, int, int]] = []
    seen: set = set()
    row_shape = dtype = None
    for item in requests:
        req_id, rows, start = (*item, 0) if len(item) == 2 else item
        kind, rid = _id_bytes(req_id)
        if (kind, rid) in seen:
            raise ValueError(f"request {req_id!r} appears twice")
        seen.add((kind, rid))
        rows = np.asarray(rows)
        if rows.ndim != 3:
            raise ValueError(f"rows of request {req_id!r} must be (n, num_layers, top_k), got {rows.shape}")
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"start of request {req_id!r} must be an int >= 0, got {start!r}")
        if row_shape is None:
            row_shape, dtype = rows.shape[1:], rows.dtype
            if dtype.newbyteorder("<").str not in _DTYPES:
                raise ValueError(f"rows of dtype {dtype}: the framed format carries {_DTYPES}")
            head = _HEAD.pack(
                FRAMED_MAGIC, _VERSION, 0, 0, row_shape[0], row_shape[1], rows_per_block,
                dtype.newbyteorder("<").str.encode("ascii"),
            )  # fmt: skip
            out.write(head)
            written += len(head)
        elif rows.shape[1:] != row_shape or rows.dtype != dtype:
            raise ValueError(
                f"rows of request {req_id!r} are {rows.shape[1:]} {rows.dtype}, "
                f"the file's {row_shape} {dtype}"
            )
        data = np.ascontiguousarray(rows, dtype=dtype.newbyteorder("<"))
        raw = memoryview(data.reshape(-1).view(np.uint8))  # bytes (a view; 0 rows: empty)
        per_block = rows_per_block * math.prod(row_shape) * dtype.itemsize
        crcs = [zlib.crc32(raw[i : i + per_block]) for i in range(0, len(raw), per_block)]
        index.append((kind, rid, int(start), rows.shape[0], written))
        out.write(raw)
        out.write(struct.pack(f"<{len(crcs)}I", *crcs))
        written += len(raw) + 4 * len(crcs)
    if row_shape is None:  # no request: a file of no rows (shape and dtype unknown: 1 x 1 uint8)
        out.write(_HEAD.pack(FRAMED_MAGIC, _VERSION, 0, 0, 1, 1, rows_per_block, b"|u1"))
        written += _HEAD.size
    table = [struct.pack("<Q", len(index))]
    for kind, rid, start, n, offset in index:
        table += [struct.pack("<HB", len(rid), kind), rid, _ENTRY.pack(start, n, offset)]
    table_bytes = b"".join(table)
    out.write(table_bytes)
    out.write(_TAIL.pack(written, zlib.crc32(table_bytes), FRAMED_MAGIC))
    return written + len(table_bytes) + _TAIL.size


class FramedReader:
    """Reads a framed file's requests by (request, token range), checking each block it reads.

    ``source``: the file's bytes (or a memoryview / ``mmap``: nothing is copied but what is read),
    a path (opened and read with seeks), or a binary file object that can seek. Opening reads the
    header and the index only. Not thread-safe with a file source (a seek and a read per block);
    a bytes or mmap source may be read from several threads.
    """

    def __init__(self, source: Any):
        if isinstance(source, (str, os.PathLike)):
            source = open(source, "rb")  # noqa: SIM115 - kept open for reads; closed by close()
            self._owned = True
        else:
            self._owned = False
        if isinstance(source, (bytes, bytearray, memoryview)) or hasattr(source, "__getitem__"):
            self._buf = (
                memoryview(source).cast("B") if not isinstance(source, memoryview) else source.cast("B")
            )
            self._file = None
            size = len(self._buf)
        elif isinstance(source, io.IOBase) or hasattr(source, "seek"):
            self._buf, self._file = None, source
            size = source.seek(0, io.SEEK_END)
        else:
            raise TypeError(
                f"source must be bytes, a memory map, a path or a binary file, got {type(source).__name__}"
            )
        self.size = size
        if size < _HEAD.size + 8 + _TAIL.size:
            raise ValueError(
                f"framed file truncated: {size} bytes, header and tail alone are "
                f"{_HEAD.size + 8 + _TAIL.size}"
            )
        magic, version, flags, reserved, n_layers, top_k, per_block, dtype = _HEAD.unpack(
            self._read(0, _HEAD.size)
        )
        if magic != FRAMED_MAGIC:
            raise ValueError(f"not a framed routing file: magic {magic!r}, expected {FRAMED_MAGIC!r}")
        if version != _VERSION or flags or reserved:
            raise ValueError(
                f"framed file version {version} flags {flags:#x} reserved {reserved:#x}: reads version 1"
            )
        dtype_text = dtype.rstrip(b"\0").decode("ascii", "replace")
        if dtype_text not in _DTYPES or n_layers < 1 or top_k < 1 or per_block < 1:
            raise ValueError(
                f"framed file header: dtype {dtype_text!r}, row ({n_layers}, {top_k}), "
                f"rows_per_block {per_block}"
            )
        self.dtype = np.dtype(dtype_text)
        self.row_shape = (n_layers, top_k)
        self.rows_per_block = per_block
        self._row_bytes = n_layers * top_k * self.dtype.itemsize
        index_at, index_crc, tail_magic = _TAIL.unpack(self._read(size - _TAIL.size, _TAIL.size))
        if tail_magic != FRAMED_MAGIC or not _HEAD.size <= index_at <= size - _TAIL.size - 8:
            raise ValueError(f"framed file truncated or not closed: tail {tail_magic!r}, index at {index_at}")
        table = self._read(index_at, size - _TAIL.size - index_at)
        if zlib.crc32(table) != index_crc:
            raise ValueError("framed file's index is corrupt: CRC-32 mismatch")
        self.entries: dict[Hashable, FramedEntry] = {}
        (count,) = struct.unpack_from("<Q", table, 0)
        at, end = 8, len(table)
        for i in range(count):
            if at + 3 > end:
                raise ValueError(f"framed file's index ends inside entry {i} of {count}")
            rid_len, kind = struct.unpack_from("<HB", table, at)
            at += 3
            if at + rid_len + _ENTRY.size > end:
                raise ValueError(f"framed file's index ends inside entry {i} of {count}")
            rid = bytes(table[at : at + rid_len])
            at += rid_len
            start, n, offset = _ENTRY.unpack_from(table, at)
            at += _ENTRY.size
            if kind == 0:
                try:
                    req_id: Hashable = rid.decode("utf-8")
                except UnicodeDecodeError:
                    raise ValueError(f"framed file's index entry {i} has an id that is not utf-8") from None
            elif kind == 1 and rid_len == 8:
                (req_id,) = struct.unpack("<q", rid)
            else:
                raise ValueError(f"framed file's index entry {i} has id type {kind} of {rid_len} bytes")
            blocks = -(-n // per_block)
            if offset < _HEAD.size or offset + n * self._row_bytes + 4 * blocks > index_at:
                raise ValueError(f"framed file's request {req_id!r}: {n} rows at {offset} overrun the data")
            if req_id in self.entries:
                raise ValueError(f"framed file's index names request {req_id!r} twice")
            self.entries[req_id] = FramedEntry(req_id, int(start), int(n), int(offset))
        if at != end:
            raise ValueError(f"framed file's index has {end - at} bytes after its {count} entries")

    def _read(self, offset: int, size: int) -> bytes:
        if self._buf is not None:
            return bytes(self._buf[offset : offset + size])
        self._file.seek(offset)
        data = self._file.read(size)
        if len(data) != size:
            raise ValueError(f"framed file truncated: {size} bytes at {offset}, read {len(data)}")
        return data

    def read(self, req_id: Hashable, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` of request ``req_id`` (row indices of the request, default all), as a
        fresh ``(hi - lo, L, K)`` array; reads and checks only the blocks that hold them. KeyError
        for a request not in the file, ValueError for a range outside it or a block whose CRC fails.
        """
        entry = self.entries.get(req_id)
        if entry is None:
            raise KeyError(f"request {req_id!r} is not in this framed file")
        n = entry.num_tokens
        lo = 0 if lo is None else lo
        hi = n if hi is None else hi
        for name, v in (("lo", lo), ("hi", hi)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"rows [{lo}, {hi}) of request {req_id!r}: it has {n}")
        out = np.empty((hi - lo, *self.row_shape), dtype=self.dtype)
        if hi == lo:
            return out
        B, rb = self.rows_per_block, self._row_bytes
        first, last = lo // B, (hi - 1) // B
        blocks = -(-n // B)
        crcs = struct.unpack(
            f"<{last - first + 1}I", self._read(entry.offset + n * rb + 4 * first, 4 * (last - first + 1))
        )
        for i, block in enumerate(range(first, last + 1)):
            b_lo, b_hi = block * B, min((block + 1) * B, n)
            data = self._read(entry.offset + b_lo * rb, (b_hi - b_lo) * rb)
            if zlib.crc32(data) != crcs[i]:
                raise ValueError(
                    f"framed file's request {req_id!r} block {block} of {blocks} is corrupt: CRC-32 mismatch"
                )
            rows = np.frombuffer(data, dtype=self.dtype.newbyteorder("<")).reshape(-1, *self.row_shape)
            take_lo, take_hi = max(lo, b_lo), min(hi, b_hi)
            out[take_lo - lo : take_hi - lo] = rows[take_lo - b_lo : take_hi - b_lo]
        return out

    def close(self) -> None:
        """Closes the file this reader opened from a path (a source handed in stays open)."""
        if self._owned and self._file is not None:
            self._file.close()

    def __enter__(self) -> FramedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
