"""Wire formats (moe_ops.wire): routing arrays of every dtype, byte order and memory order, texts built
by a client's own rules (NeMo-RL's envelope), and hostile input for the decoders (generated .npy
headers and payloads, raw MOER headers, byte-level mutations)."""

from __future__ import annotations

import base64
import math
import re
import struct

import numpy as np
from hypothesis import strategies as st

__all__ = [
    "BF16_EDGE_BITS",
    "NEMO_RL_DTYPE_TEXTS",
    "NEMO_RL_NAMES",
    "NEMO_RL_NP_DTYPES",
    "NEMO_RL_SIZE_TEXTS",
    "NPY_DESCRS",
    "NPY_HEADER_JUNK",
    "WIRE_DTYPES",
    "mutated",
    "nemo_rl_arrays",
    "nemo_rl_envelope",
    "nemo_rl_hostile_envelopes",
    "npy_header_texts",
    "npy_payloads",
    "raw_routing_payloads",
    "routing_arrays",
    "weight_arrays",
]


# ---------------------------------------------------------------------------------------------------
# Hostile input for the wire decoders
# ---------------------------------------------------------------------------------------------------


# .npy descr values: what np.save writes for integer arrays, then near misses and other kinds
NPY_DESCRS = (
    "|u1", "<u1", "<u2", ">u2", "<i4", ">i4", "<i8", "|i1", "<u4", ">u8", "=i2", "i4",
    "<f4", "|b1", "|O", "O", "<U3", "|S2", "<u3", "uint8", "", "<i4 ", "<M8[s]", "|V4",
)  # fmt: skip
# text spliced into a header: a hostile " } (" (numpy's reader retried it through Python 2 token
# filtering and raised tokenize.TokenError), unbalanced brackets, quotes, NULs, Python 2 longs
NPY_HEADER_JUNK = ("", " } (", "(", ")", "[", "'", '"', "\\", "\x00", "#", " **", "\n\n", "L", ",", "{")


def _npy_dims():
    return st.one_of(
        st.integers(0, 4),
        st.integers(-3, 2**65),
        st.booleans(),
        st.sampled_from([1.0, None, "2", (1,)]),
    )


@st.composite
def npy_header_texts(draw) -> str:
    """The text of a .npy header dict: a third valid, the rest hostile (wrong types, bools, negative
    or huge dims, too many dims, extra or missing keys, junk spliced in anywhere)."""
    valid_descr = st.sampled_from([d for d in NPY_DESCRS if re.fullmatch(r"[<>|=]?[iu][1248]", d)])
    small_shape = st.lists(st.integers(0, 4), max_size=4).map(tuple)
    if draw(st.integers(0, 2)) == 0:
        entries = {
            "descr": draw(valid_descr),
            "fortran_order": draw(st.booleans()),
            "shape": draw(small_shape),
        }
        return repr(entries) + "\n"
    descr = draw(
        st.one_of(
            valid_descr, st.sampled_from(NPY_DESCRS), st.sampled_from([5, None, [("a", "<i4")], ["|u1"]])
        )
    )
    fortran = draw(st.sampled_from([False, True, False, True, 0, 1, None, "False"]))
    shape = draw(
        st.one_of(
            small_shape,
            st.lists(_npy_dims(), max_size=4).map(tuple),
            st.lists(st.integers(0, 2), min_size=33, max_size=36).map(tuple),
            st.integers(0, 5),
            st.lists(st.integers(0, 3), max_size=3),
        )
    )
    entries = {"descr": descr, "fortran_order": fortran, "shape": shape}
    if draw(st.integers(0, 5)) == 0:
        del entries[draw(st.sampled_from(sorted(entries)))]
    if draw(st.integers(0, 5)) == 0:
        entries[draw(st.sampled_from(["extra", "Shape", "descr "]))] = 0
    text = repr(entries)
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(NPY_HEADER_JUNK)) + text[at:]
    return text + draw(st.sampled_from(["\n", "\n", "", " \n", "\n\x00"]))


def _npy_data_size(text: str) -> int | None:
    """Bytes of data a header text announces, when it parses (None otherwise or when large)."""
    import ast

    if re.search(r"\\|[0-9][A-Za-z_]", text):
        return None  # text the tokenizer warns about: no header announces a size with it
    try:
        header = ast.literal_eval(text)
        shape = header["shape"]
        if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
            return None
        size = math.prod(shape) * np.dtype(header["descr"]).itemsize
    except Exception:  # any failure only means "no exact size": the payload gets random data
        return None
    return size if 0 <= size <= 4096 else None


@st.composite
def npy_payloads(draw) -> bytes:
    """.npy bytes around a generated header: magic and version (1.0, 2.0 or unknown), a length
    field right or wrong, the padding numpy writes or none, data of the announced size or not."""
    text = draw(npy_header_texts())
    if draw(st.booleans()):
        text = text.rstrip("\n") + " " * (-(len(text) + 10) % 64) + "\n"
    header = text.encode("latin-1")
    version = draw(st.sampled_from([(1, 0)] * 6 + [(2, 0)] * 2 + [(3, 0), (0, 9)]))
    length_field = "<H" if version[0] == 1 else "<I"
    length = len(header) if draw(st.integers(0, 4)) else draw(st.integers(0, 2**16 - 1))
    prefix = b"\x93NUMPY" + bytes(version) + struct.pack(length_field, min(length, 2**16 - 1))
    size = _npy_data_size(text)
    if size is not None and draw(st.integers(0, 3)):
        data = draw(st.binary(min_size=size, max_size=size))
    else:
        data = draw(st.binary(max_size=64))
    return prefix + header + data


@st.composite
def mutated(draw, data: bytes, keep: int = 0, max_ops: int = 4) -> bytes:
    """``data`` with a few byte-level edits: flips, overwrites, cuts, insertions, truncation. Edits
    mostly land past the first ``keep`` bytes (a magic number), so most cases reach the checks
    behind it."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "truncate"]))
        low = 0 if draw(st.integers(0, 7)) == 0 else min(keep, len(out))
        at = draw(st.integers(low, len(out)))
        if op == "flip" and at < len(out):
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and at < len(out):
            out[at] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, ord("("), ord("'"), ord("}")]))
        elif op == "cut":
            del out[at : at + draw(st.integers(1, 8))]
        elif op == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "truncate":
            del out[at:]
    return bytes(out)


WIRE_DTYPES = (np.uint8, np.uint16, np.int32, np.int16, np.int64, np.int8, np.uint32, np.uint64)


@st.composite
def routing_arrays(draw, dtypes=WIRE_DTYPES, max_rows: int = 6) -> np.ndarray:
    """A small integer array in any of ``dtypes``, byte order and memory order, values over the
    dtype's whole range; mostly 3-D (n, layers, top_k), sometimes another number of dims."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    if draw(st.integers(0, 4)):
        shape = (draw(st.integers(0, max_rows)), draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    else:
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
    info = np.iinfo(dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    array = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if draw(st.booleans()):
        array = array.astype(dtype.newbyteorder(">"))
    if draw(st.booleans()):
        array = np.asfortranarray(array)
    return array


@st.composite
def raw_routing_payloads(draw) -> bytes:
    """Raw MOER bytes with every header field drawn (magic, version, dtype code, ndim, reserved
    byte, dims up to 2**64 - 1) and data of the announced size or not."""
    magic = draw(st.sampled_from([b"MOER"] * 6 + [b"MOEr", b"NOPE"]))
    version = draw(st.sampled_from([1] * 6 + [0, 2, 255]))
    code = draw(st.one_of(st.integers(1, 8), st.integers(1, 8), st.sampled_from([0, 9, 255])))
    ndim = draw(st.sampled_from([0, 1, 2, 3, 3, 3, 8, 9, 255]))
    reserved = draw(st.sampled_from([0] * 6 + [1, 0x80, 0xFF]))
    dims = draw(
        st.lists(
            st.one_of(st.integers(0, 4), st.integers(0, 4), st.integers(0, 2**64 - 1)),
            min_size=min(ndim, 9),
            max_size=min(ndim, 9),
        )
    )
    head = struct.pack("<4sBBBB", magic, version, code, ndim, reserved)
    head += b"".join(struct.pack("<Q", d) for d in dims)
    itemsize = {1: 1, 2: 2, 3: 4, 4: 2, 5: 8, 6: 1, 7: 4, 8: 8}.get(code, 1)
    size = int(np.prod(dims, dtype=object)) * itemsize if dims else itemsize
    if size <= 4096 and draw(st.integers(0, 3)):
        return head + draw(st.binary(min_size=size, max_size=size))
    return head + draw(st.binary(max_size=64))


# ---------------------------------------------------------------------------------------------------
# NeMo-RL's routed-experts envelope (format="nemo_rl"): envelopes built by NeMo-RL's rules, and hostile
# ones
# ---------------------------------------------------------------------------------------------------


# NeMo-RL's dtype names by item size (nemo_rl/utils/routed_experts_codec.py, _NP_DTYPES)
NEMO_RL_NAMES = {1: "int8", 2: "int16", 4: "int32"}
NEMO_RL_NP_DTYPES = (np.int8, np.int16, np.int32)


def nemo_rl_envelope(array: np.ndarray) -> str:
    """The text NeMo-RL's ``encode_routed_experts`` writes for a 3-D int8 / int16 / int32 ``array``,
    by its rules (not moe-ops' code): ``"nrlre1:" + dtype name + ":" + "SxLxK" + ":"`` and the
    standard base64 of the C-order bytes, little-endian (the order of every host NeMo-RL runs on)."""
    little = array.dtype.newbyteorder("<")
    data = np.ascontiguousarray(array, dtype=little).tobytes()
    tokens, layers, top_k = array.shape
    name = NEMO_RL_NAMES[array.dtype.itemsize]
    return f"nrlre1:{name}:{tokens}x{layers}x{top_k}:" + base64.b64encode(data).decode("ascii")


@st.composite
def nemo_rl_arrays(draw, max_rows: int = 6) -> np.ndarray:
    """A (tokens, layers, top_k) int8 / int16 / int32 array with values over the dtype's whole range
    (-1 rows among them), any byte order and memory order (C, Fortran, strided); sizes from 0."""
    dtype = np.dtype(draw(st.sampled_from(NEMO_RL_NP_DTYPES)))
    shape = (draw(st.integers(0, max_rows)), draw(st.integers(0, 4)), draw(st.integers(0, 4)))
    info = np.iinfo(dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    array = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if shape[0] and draw(st.booleans()):
        array[rng.integers(0, shape[0])] = -1  # a row with no route captured
    if draw(st.booleans()):
        array = array.astype(dtype.newbyteorder(">"))
    layout = draw(st.sampled_from(["C", "F", "strided"]))
    if layout == "F":
        array = np.asfortranarray(array)
    elif layout == "strided":
        array = np.repeat(array, 2, axis=0)[::2]
    return array


# sizes as text: what NeMo-RL's writer writes, then what only its int() reader takes, then junk
NEMO_RL_SIZE_TEXTS = (
    "0", "1", "2", "3", "07", "+3", " 3", "3 ", "3_0", "-1", "\u0663", "", "0x3", "3.0", "1e3",
)  # fmt: skip
NEMO_RL_DTYPE_TEXTS = ("int8", "int16", "int32", "uint16", "uint8", "int64", "float32", "INT16", " int16", "")


@st.composite
def nemo_rl_hostile_envelopes(draw) -> str:
    """An envelope with every field drawn: the magic (right or near), the dtype name, 1-4 sizes
    (small, huge up to 2**70, or text only NeMo-RL's int() reads), the separators, and a payload of
    the announced size or not, sometimes with characters outside the base64 alphabet spliced in."""
    magic = draw(st.sampled_from(["nrlre1"] * 6 + ["nrlre2", "NRLRE1", "nrlre", "", "nrlre1 "]))
    name = draw(st.sampled_from(NEMO_RL_DTYPE_TEXTS[:3] * 3 + NEMO_RL_DTYPE_TEXTS))
    count = draw(st.sampled_from([3] * 6 + [1, 2, 4]))
    sizes = draw(
        st.lists(
            st.one_of(
                st.integers(0, 4).map(str),
                st.integers(0, 4).map(str),
                st.integers(0, 2**70).map(str),
                st.sampled_from(NEMO_RL_SIZE_TEXTS),
            ),
            min_size=count,
            max_size=count,
        )
    )
    sep = draw(st.sampled_from(["x"] * 6 + ["X", "*", ","]))
    itemsize = {"int8": 1, "int16": 2, "int32": 4}.get(name, 2)
    try:
        size = math.prod(int(d) for d in sizes) * itemsize
    except ValueError:
        size = None
    if size is not None and 0 <= size <= 256 and draw(st.integers(0, 3)):
        payload = base64.b64encode(draw(st.binary(min_size=size, max_size=size))).decode()
    else:
        payload = base64.b64encode(draw(st.binary(max_size=48))).decode()
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        at = draw(st.integers(0, len(payload)))
        junk = draw(st.sampled_from(["\n", " ", "-", "_", "=", "\u00c4", ":", "A"]))
        payload = payload[:at] + junk + payload[at:]
    colons = draw(st.sampled_from([":"] * 8 + ["", "::"]))
    return f"{magic}:{name}:{sep.join(sizes)}{colons}{payload}"


# ---------------------------------------------------------------------------------------------------
# Routing weights on the wire
# ---------------------------------------------------------------------------------------------------

# float32 bit patterns where rounding to bfloat16 is decided: exact ties with an even and an odd kept
# half, one ulp either side of a tie, the largest finite value (rounds to inf), the largest that
# does not, subnormals, -0.0, +-inf, quiet and signalling NaNs of either sign (a signalling NaN whose
# payload sits in the low 16 bits only would round to inf if it were rounded as a number)
BF16_EDGE_BITS = (
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x3F818001, 0x3F817FFF,
    0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0xFF7FFFFF, 0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,
    0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF80FFFF,
    0x3DCCCCCD, 0x3E4CCCCD,
)  # fmt: skip


@st.composite
def weight_arrays(draw, max_rows: int = 6, dtypes=(np.float16, np.float32)) -> np.ndarray:
    """(n, num_layers, top_k) float16 / float32 weights, in native or big-endian byte order and C or
    Fortran order: drawn as raw bit patterns (NaNs of any payload, +-inf, subnormals, -0.0) mixed
    with :data:`BF16_EDGE_BITS` (float32) and softmax-like values in [0, 1]."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shape = (draw(st.integers(0, max_rows)), draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bits = np.dtype(f"u{dtype.itemsize}")
    out = rng.integers(0, 2 ** (8 * dtype.itemsize), size=shape, dtype=np.uint64).astype(bits).view(dtype)
    mix = rng.random(shape)
    out[mix < 0.3] = rng.random(shape).astype(dtype)[mix < 0.3]
    if dtype == np.float32:
        edges = np.array(BF16_EDGE_BITS, np.uint32).view(np.float32)
        pick = mix > 0.7
        out[pick] = edges[rng.integers(0, edges.size, size=shape)][pick]
    if draw(st.booleans()):
        out = out.astype(dtype.newbyteorder(">"))
    if draw(st.booleans()):
        out = np.asfortranarray(out)
    return out
