"""Indexer records on the wire: the compact format's exact round trips (random sets, traces whose
adjacent rows share most positions, -1 padding, edge shapes), SGLang's int32 layout, and hostile
input (truncation, corruption, crafted headers with a valid CRC) giving ValueError with bounded
memory."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threads import run_threads

from moe_ops.indexer import wire
from moe_ops.indexer.wire import (
    canonical_positions,
    decode_positions,
    decode_positions_bytes,
    encode_positions,
    encode_positions_bytes,
    set_bound_bits,
)


def trace(rng, n, n_layers, k, context, share, pad=0.0):
    """(n, L, k) rows: row t of a layer keeps ``share`` of row t-1's positions and draws the rest
    anew (a decode trace); ``pad`` of the rows hold fewer than k positions (-1 after shuffling)."""
    k_eff = min(k, context)
    out = np.full((n, n_layers, k), -1, dtype=np.int64)
    for layer in range(n_layers):
        cur = rng.choice(context, size=k_eff, replace=False)
        for t in range(n):
            if t:
                keep = rng.choice(k_eff, size=int(k_eff * share), replace=False)
                kept = set(cur[keep].tolist())
                fresh = rng.permutation(context)
                for p in fresh.tolist():
                    if len(kept) == k_eff:
                        break
                    kept.add(p)
                cur = np.array(sorted(kept))
            row = cur.copy()
            if rng.random() < pad:
                row = row[: rng.integers(0, k_eff + 1)]
            full = np.full(k, -1, dtype=np.int64)
            full[: row.size] = row
            out[t, layer] = rng.permutation(full)
    return out


@st.composite
def indexer_records(draw):
    context = draw(st.sampled_from([1, 2, 7, 100, 5000, 2**31]))
    k = draw(st.sampled_from([1, 2, 5, 16, 64]))
    n = draw(st.integers(0, 12))
    n_layers = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    share = draw(st.sampled_from([0.0, 0.5, 0.95, 1.0]))
    pad = draw(st.sampled_from([0.0, 0.3, 1.0]))
    if context == 2**31:  # a huge context: draw positions directly, not a permutation of it
        rows = (
            np.stack(
                [
                    np.stack([rng.choice(2**31, size=k, replace=False) for _ in range(n_layers)])
                    for _ in range(n)
                ]
            )
            if n
            else np.zeros((0, n_layers, k), np.int64)
        )
        rows[..., 0] = 2**31 - 1 if n and k > 1 else rows[..., 0]
        return rows, context
    return trace(rng, n, n_layers, k, context, share, pad), context


@settings(max_examples=300, deadline=None)
@given(record=indexer_records(), dtype=st.sampled_from([np.int32, np.int64]))
def test_compact_round_trip_is_exact(record, dtype):
    rows, context = record
    rows = rows.astype(dtype)
    text = encode_positions(rows, context=context)
    back = decode_positions(text)
    assert back.dtype == np.int32 and back.shape == rows.shape
    assert np.array_equal(back, canonical_positions(rows))
    # the C codec (where it is built) writes the numpy twin's bytes and reads its rows
    data = encode_positions_bytes(rows, context=context)
    assert data == wire._encode_numpy(rows, context)
    assert np.array_equal(wire._decode(data, None, native_ok=False), back)
    # the set of every row, whatever order the indexer listed it in
    assert np.array_equal(
        decode_positions_bytes(encode_positions_bytes(rows[:, :, ::-1], context=context)), back
    )


@settings(max_examples=100, deadline=None)
@given(record=indexer_records())
def test_sglang_layout_keeps_order_and_padding(record):
    rows, _ = record
    rows = rows.astype(np.int32)
    _, n_layers, k = rows.shape
    text = encode_positions(rows, format="sglang")
    assert np.array_equal(decode_positions(text, format="sglang", num_layers=n_layers, k=k), rows)
    # SGLang's own client code: np.frombuffer(base64 bytes, int32).reshape(-1, layers, k)
    import base64

    assert np.array_equal(np.frombuffer(base64.b64decode(text), np.int32).reshape(-1, n_layers, k), rows)


def test_sizes_of_the_two_workloads():
    """Bytes per (token, layer) at k = 2048, context 128K: a decode trace sharing 95% of adjacent
    rows stays under 0.5 KiB (int32 takes 8 KiB); random sets stay within 1.35x of log2 C(context, k)."""
    rng = np.random.default_rng(0)
    k, context, n = 2048, 131072, 16
    shared = trace(rng, n, 1, k, context, 0.95)
    per_row = len(encode_positions_bytes(shared, context=context)) / n
    assert per_row <= 512, per_row
    random = np.stack([rng.choice(context, size=(1, k), replace=False) for _ in range(n)])
    per_row = len(encode_positions_bytes(random, context=context)) / n
    assert per_row <= 1.35 * set_bound_bits(k, context) / 8, per_row


@pytest.mark.parametrize(
    "rows, match",
    [
        (np.array([[[0, 0]]]), "repeat within a row"),
        (np.array([[[0, 10]]]), r"lie in \[0, context=10\)"),
        (np.array([[[-2, 1]]]), r"lie in \[0, context=10\)"),
        (np.array([[0, 1]]), "must be 3-D"),
        (np.array([[[0.0, 1.0]]]), "integer array"),
    ],
)
def test_encode_refuses_what_is_not_a_record(rows, match):
    with pytest.raises(ValueError, match=match):
        encode_positions(rows, context=10)


def test_encode_refuses_bad_arguments():
    rows = np.zeros((1, 1, 1), np.int32)
    with pytest.raises(ValueError, match="needs context"):
        encode_positions(rows)
    with pytest.raises(ValueError, match="context must be an int"):
        encode_positions(rows, context=0)
    with pytest.raises(ValueError, match="format must be one of"):
        encode_positions(rows, format="npy", context=4)
    with pytest.raises(ValueError, match="format must be one of"):
        decode_positions("AAAA", format="npy")
    with pytest.raises(ValueError, match="pass num_layers, top_k"):
        decode_positions("AAAA", format="sglang")


def _recrc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _sample() -> bytes:
    rng = np.random.default_rng(1)
    return encode_positions_bytes(trace(rng, 6, 2, 8, 300, 0.7, pad=0.3), context=300)


def test_every_truncation_and_every_flipped_byte_is_refused():
    data = _sample()
    for cut in range(len(data)):
        with pytest.raises(ValueError):
            decode_positions_bytes(data[:cut])
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x41
        with pytest.raises(ValueError):
            decode_positions_bytes(bytes(bad))


@settings(max_examples=400, deadline=None)
@given(i=st.integers(0, 10_000), value=st.integers(0, 255), seed=st.integers(0, 3))
def test_crafted_bytes_with_a_valid_crc_decode_or_raise_value_error(i, value, seed):
    """A byte changed and the CRC recomputed (an attacker, not line noise): the decoder either
    refuses with ValueError or returns a well-formed record (rows of distinct ascending positions
    below the context, -1 after them), never anything else."""
    rng = np.random.default_rng(seed)
    data = encode_positions_bytes(trace(rng, 5, 2, 8, 64, 0.8, pad=0.3), context=64)
    body = bytearray(data[:-4])
    body[i % len(body)] = value
    crafted = _recrc(bytes(body))
    try:
        twin = wire._decode(crafted, wire.DEFAULT_MAX_ELEMENTS, native_ok=False)
    except ValueError:
        twin = None
    try:
        out = decode_positions_bytes(crafted)
    except ValueError:
        assert twin is None, "the C decoder refused what the numpy twin reads"
        return
    assert twin is not None and np.array_equal(out, twin), "the C decoder read what the twin refuses"
    assert out.dtype == np.int32 and out.ndim == 3
    _, _, _, _, _, _, _, context = struct.unpack_from("<4sBBHIIII", body, 0)
    for row in out.reshape(-1, out.shape[-1]):
        valid = row[row >= 0]
        assert (row[valid.size :] == -1).all()
        assert (np.diff(valid) > 0).all() and (valid < context).all()


def test_header_sizes_are_checked_before_allocation():
    """A header claiming 2**32 - 1 tokens of 2**32 - 1 layers is refused from its sizes alone."""
    body = struct.pack("<4sBBHIIII", b"MOEI", 1, 0, 0, 2**32 - 1, 2**32 - 1, 2**15, 100)
    with pytest.raises(ValueError, match="max_elements"):
        decode_positions_bytes(_recrc(body))
    small = struct.pack("<4sBBHIIII", b"MOEI", 1, 0, 0, 1000, 4, 8, 100)
    with pytest.raises(ValueError, match="record headers need"):
        decode_positions_bytes(_recrc(small))


def test_structural_lies_are_named():
    rows = np.array([[[1, 2]], [[2, 3]]])  # two rows of one layer: the second a DELTA (drop 1, add 3)
    data = encode_positions_bytes(rows, context=8)
    head = 24
    body = bytearray(data[:-4])
    assert body[head + 1] & 0x80, "the second row is coded as a DELTA"
    lie = bytearray(body)
    lie[head] |= 0x80  # the first row a DELTA
    with pytest.raises(ValueError, match="first row is a DELTA"):
        decode_positions_bytes(_recrc(bytes(lie)))
    lie = bytearray(body)
    lie[head + 1] = 0x80 | 31
    with pytest.raises(ValueError, match="payload is"):
        decode_positions_bytes(_recrc(bytes(lie)))
    lie = bytearray(body)
    lie[4] = 2
    with pytest.raises(ValueError, match="version 2"):
        decode_positions_bytes(_recrc(bytes(lie)))
    with pytest.raises(ValueError, match="magic"):
        decode_positions_bytes(_recrc(b"MOER" + bytes(body[4:])))
    with pytest.raises(TypeError, match="data must be bytes"):
        decode_positions_bytes("MOEI")


def test_torch_tensors_are_accepted():
    import torch

    rows = torch.tensor([[[3, -1, 1]], [[1, 4, 3]]], dtype=torch.int32)
    back = decode_positions(encode_positions(rows, context=5))
    assert back.tolist() == [[[1, 3, -1]], [[1, 3, 4]]]


def test_spans_decode_what_one_span_decodes(monkeypatch):
    """The numpy decoder works in spans of records; a DELTA at a span's start continues from the
    row decoded before it. Tiny spans give the same rows as one span."""
    rng = np.random.default_rng(3)
    rows = trace(rng, 20, 3, 16, 400, 0.8, pad=0.2)
    data = encode_positions_bytes(rows, context=400)
    whole = decode_positions_bytes(data)
    for span in (1, 2, 7, 33):
        monkeypatch.setattr(wire, "_SPAN", span)
        assert np.array_equal(wire._decode(data, None, native_ok=False), whole)  # spans: the twin's
    assert np.array_equal(whole, canonical_positions(rows))


def test_a_short_text_of_a_large_record_decodes_in_bounded_memory():
    """A dense row codes in 0 bits, so 40 bytes of headers may describe 2**22 positions (64 rows of
    65535): the decoder's peak beyond the output stays within a span's temporaries."""
    import tracemalloc

    n, k = 64, 0xFFFF
    body = struct.pack("<4sBBHIIII", b"MOEI", 1, 0, 0, n, 1, k, k)
    # row 0 FULL (m = k, width 0: positions 0..k-1), the rest DELTA dropping and adding nothing
    mode = bytes([0] + [0x80] * (n - 1))
    body += mode + bytes(n) + struct.pack("<H", k) + bytes(2 * (n - 1)) + bytes(2 * n)
    data = _recrc(body)
    for native_ok in (True, False):  # the C decoder where it is built, and the numpy twin
        tracemalloc.start()
        out = wire._decode(data, wire.DEFAULT_MAX_ELEMENTS, native_ok=native_ok)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert out.shape == (n, 1, k) and (out[:, 0] == np.arange(k)).all()
        assert peak < 3 * out.nbytes + (64 << 20), peak  # output, its transposed copy, one span's work
    with pytest.raises(ValueError, match="at most 65535"):
        decode_positions_bytes(_recrc(struct.pack("<4sBBHIIII", b"MOEI", 1, 0, 0, 1, 1, 1 << 25, 1 << 25)))


def test_wide_unsigned_input_is_refused_not_wrapped():
    with pytest.raises(ValueError, match="must fit int64"):
        encode_positions(np.array([[[2**64 - 1]]], dtype=np.uint64), context=10)
    with pytest.raises(ValueError, match="at most 65535"):
        encode_positions(np.zeros((1, 1, 70_000), np.int32) - 1, context=10)


# ---------------------------------------------------------------------------------------------------
# the C codec (codec.c, built at first use) against its numpy twin
# ---------------------------------------------------------------------------------------------------

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler: the numpy codec runs alone"
)


@needs_compiler
def test_the_c_codec_is_built_where_a_compiler_is():
    assert wire.codec() == "native"


@needs_compiler
@pytest.mark.parametrize("context", [8192, 131072, 1 << 23])  # bitmaps, bitmaps, a merge (codec.c)
def test_c_and_numpy_write_the_same_bytes_for_views_and_dtypes(context):
    rng = np.random.default_rng(context)
    rows = trace(rng, 9, 3, 64, context, 0.9, pad=0.3)
    views = {
        "int64": rows,
        "int32 transposed copy": np.ascontiguousarray(rows.transpose(1, 0, 2))
        .transpose(1, 0, 2)
        .astype(np.int32),
        "reversed k": rows[:, :, ::-1].astype(np.int32),
        "every other token": np.repeat(rows, 2, axis=0)[::2].astype(np.int32),
        "uint32": trace(rng, 9, 3, 64, context, 0.9).astype(np.uint32),  # no -1 in an unsigned record
    }
    for name, view in views.items():
        data = encode_positions_bytes(view, context=context)
        assert data == wire._encode_numpy(view, context), name
        assert np.array_equal(decode_positions_bytes(data), canonical_positions(view)), name


@needs_compiler
def test_c_codec_refuses_as_the_twin_does():
    for rows, match in (
        (np.array([[[1, 1, 2]]]), "repeat"),
        (np.array([[[1, 9, 2]]]), "lie in"),
        (np.array([[[1, -2, 2]]], dtype=np.int32), "lie in"),
    ):
        with pytest.raises(ValueError, match=match):
            encode_positions_bytes(rows, context=9)


@needs_compiler
def test_threads_share_the_c_codec():
    """Encode and decode from 8 threads at once (the C loops run without the GIL): every result
    equals the one-thread result."""
    rng = np.random.default_rng(5)
    records = [trace(rng, 16, 2, 128, 50_000, 0.9, pad=0.1) for _ in range(8)]
    want = [encode_positions_bytes(r, context=50_000) for r in records]
    errors = []

    def work(i):
        try:
            for _ in range(20):
                data = encode_positions_bytes(records[i], context=50_000)
                assert data == want[i]
                assert np.array_equal(decode_positions_bytes(data), canonical_positions(records[i]))
        except Exception as exc:  # reported below with the thread's index
            errors.append((i, exc))

    run_threads(work, 8, timeout=300.0)
    assert not errors, errors


_BUILD = """
import sys, numpy as np
from moe_ops.indexer import wire
rows = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
print(wire.codec(), wire.encode_positions_bytes(rows, context=100).hex())
"""


@needs_compiler
def test_processes_building_at_once_share_one_library(tmp_path):
    """Four processes build the codec into one empty cache at once (each builds under a temporary
    name and renames it); all load it and write the same bytes. MOE_OPS_NATIVE=0 runs the twin:
    the same bytes again."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MOE_OPS_CACHE_DIR=str(tmp_path), PYTHONPATH=root)
    runs = [
        subprocess.Popen([sys.executable, "-c", _BUILD], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [r.communicate(timeout=300)[0].split() for r in runs]
    assert all(r.returncode == 0 for r in runs)
    assert {o[0] for o in outs} == {"native"} and len({o[1] for o in outs}) == 1
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".so" and not p.name.startswith(".")]
    off = subprocess.run(
        [sys.executable, "-c", _BUILD], env=dict(env, MOE_OPS_NATIVE="0"), capture_output=True, text=True,
        timeout=300, check=True,
    ).stdout.split()  # fmt: skip
    assert " ".join(off[:-1]) == "disabled by MOE_OPS_NATIVE=0" and off[-1] == outs[0][1]
