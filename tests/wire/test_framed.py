"""The framed batch file (MOEF): rows read by (request, token range) equal what was written, from
bytes, a memory map, a path or a file object; a rank reads its own rows' blocks only; truncated or
corrupt files are a ValueError naming the problem."""

from __future__ import annotations

import io
import mmap
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ops.wire import FramedReader, write_framed


def _batch(seed, n_requests, max_tokens, shape=(3, 2), dtype=np.uint8):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_requests):
        n = int(rng.integers(0, max_tokens + 1))
        hi = np.iinfo(dtype).max if np.dtype(dtype).kind in "iu" else 1
        rows = (rng.random((n, *shape)) * hi).astype(dtype)
        out.append((f"req-{i}" if i % 2 else i, rows, int(rng.integers(0, 100))))
    return out


def _file(batch, **kw) -> bytes:
    buf = io.BytesIO()
    size = write_framed(buf, iter(batch), **kw)  # a generator: the writer never holds the batch
    assert size == len(buf.getvalue())
    return buf.getvalue()


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_requests=st.integers(0, 6),
    max_tokens=st.integers(0, 40),
    per_block=st.integers(1, 17),
    dtype=st.sampled_from([np.uint8, np.uint16, np.int32, np.float16]),
    ranges=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=4),
)
def test_every_range_reads_back_what_was_written(seed, n_requests, max_tokens, per_block, dtype, ranges):
    batch = _batch(seed, n_requests, max_tokens, dtype=dtype)
    data = _file(batch, rows_per_block=per_block)
    reader = FramedReader(data)
    assert list(reader.entries) == [r for r, _, _ in batch]
    for req_id, rows, start in batch:
        entry = reader.entries[req_id]
        assert (entry.start, entry.num_tokens) == (start, rows.shape[0])
        got = reader.read(req_id)
        assert got.dtype == rows.dtype and np.array_equal(got, rows, equal_nan=True)
        for a, b in ranges:
            lo, hi = sorted((min(a, rows.shape[0]), min(b, rows.shape[0])))
            assert np.array_equal(reader.read(req_id, lo, hi), rows[lo:hi], equal_nan=True)


def test_sources_bytes_mmap_path_and_file(tmp_path):
    batch = _batch(1, 5, 300)
    path = tmp_path / "batch.moef"
    with open(path, "wb") as f:
        write_framed(f, batch, rows_per_block=32)
    data = path.read_bytes()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        sources = [data, bytearray(data), memoryview(data), mapped, str(path), io.BytesIO(data)]
        for source in sources:
            with FramedReader(source) as reader:
                for req_id, rows, _ in batch:
                    hi = min(250, rows.shape[0])
                    lo = min(3, hi)
                    assert np.array_equal(reader.read(req_id, lo, hi), rows[lo:hi])


class _CountingFile(io.BytesIO):
    def __init__(self, data):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size=-1):
        out = super().read(size)
        self.bytes_read += len(out)
        return out


def test_a_rank_reads_its_own_rows_not_the_batch():
    """8 ranks, each its eighth of 64 requests' rows (a DP slice by request and a CP slice by token
    range): each reads about its eighth of the file (its blocks, their CRCs, the index)."""
    rng = np.random.default_rng(2)
    batch = [(i, rng.integers(0, 256, (512, 8, 4)).astype(np.uint8)) for i in range(64)]
    data = _file(batch, rows_per_block=64)
    total_rows = sum(r.nbytes for _, r in batch)
    for rank in range(8):
        src = _CountingFile(data)
        reader = FramedReader(src)
        index_bytes = src.bytes_read
        mine = range(rank * 8, rank * 8 + 8)
        for req_id in mine:  # half its requests whole, half a token range (context parallel)
            lo, hi = (0, 512) if req_id % 2 else (128, 384)
            assert np.array_equal(reader.read(req_id, lo, hi), batch[req_id][1][lo:hi])
        wanted = sum((512 if i % 2 else 256) * 32 for i in mine)
        read = src.bytes_read - index_bytes
        assert wanted <= read <= wanted * 1.05, (read, wanted)  # the blocks' CRCs beside the rows
        assert read < total_rows / 7


def test_truncated_and_corrupt_files_are_named():
    batch = _batch(3, 3, 50)
    data = _file(batch, rows_per_block=8)
    for cut in range(len(data)):
        with pytest.raises(ValueError):
            FramedReader(data[:cut])
    with pytest.raises(ValueError, match="not a framed routing file"):
        FramedReader(b"MOEX" + data[4:])
    bad = bytearray(data)
    bad[-20] ^= 1  # inside the index
    with pytest.raises(ValueError, match="index is corrupt"):
        FramedReader(bytes(bad))
    req_id, rows, _ = next(b for b in batch if b[1].shape[0] > 8)
    bad = bytearray(data)
    entry = FramedReader(data).entries[req_id]
    bad[entry.offset + 9 * rows[0].nbytes] ^= 0x55  # a byte of row 9: block 1
    reader = FramedReader(bytes(bad))
    assert np.array_equal(reader.read(req_id, 0, 8), rows[:8])  # block 0 reads fine
    with pytest.raises(ValueError, match=f"request {req_id!r} block 1 .* corrupt"):
        reader.read(req_id, 5, 10)
    with pytest.raises(KeyError):
        reader.read("no-such-request")
    with pytest.raises(ValueError, match=r"rows \[0, 999\)"):
        reader.read(req_id, 0, 999)


def test_crafted_indexes_with_a_valid_crc_raise_value_error():
    """An index entry rewritten (its CRC recomputed): rows past the data, an id twice, garbage after
    the entries: ValueError, never an out-of-range read."""
    batch = [("a", np.zeros((4, 3, 2), np.uint8)), ("b", np.ones((2, 3, 2), np.uint8))]
    data = _file(batch)
    index_at, _, magic = struct.unpack("<QI4s", data[-16:])
    table = bytearray(data[index_at:-16])
    import zlib

    def rebuilt(t):
        return data[:index_at] + bytes(t) + struct.pack("<QI4s", index_at, zlib.crc32(bytes(t)), magic)

    grown = bytearray(table)
    grown[8 + 3 + 1 + 8 : 8 + 3 + 1 + 16] = struct.pack("<Q", 10**6)  # a's n
    with pytest.raises(ValueError, match="overrun the data"):
        FramedReader(rebuilt(grown))
    twice = bytearray(table)
    twice[8 + 3 + 1 + 24 + 3] = ord("a")  # b renamed a
    with pytest.raises(ValueError, match="names request 'a' twice"):
        FramedReader(rebuilt(twice))
    with pytest.raises(ValueError, match="bytes after its 2 entries"):
        FramedReader(rebuilt(table + b"x"))


def test_writer_refuses_what_it_cannot_frame():
    with pytest.raises(ValueError, match="appears twice"):
        _file([("a", np.zeros((1, 2, 2), np.uint8)), ("a", np.zeros((1, 2, 2), np.uint8))])
    with pytest.raises(ValueError, match="the file's"):
        _file([("a", np.zeros((1, 2, 2), np.uint8)), ("b", np.zeros((1, 2, 3), np.uint8))])
    with pytest.raises(ValueError, match="str or int"):
        _file([(("t",), np.zeros((1, 2, 2), np.uint8))])
    with pytest.raises(ValueError, match="carries"):
        _file([("a", np.zeros((1, 2, 2), np.float64))])
    with pytest.raises(ValueError, match="rows_per_block"):
        _file([], rows_per_block=0)
    assert FramedReader(_file([])).entries == {}
