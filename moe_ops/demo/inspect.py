"""``moe-ops inspect FILE``: what a saved routing file holds, and which of it the file says.

Reads the demo's ``routing.npz``, a bare ``.npy`` array, raw ``MOER`` bytes, and the text of every
wire format of :mod:`moe_ops.wire` whose texts start with a prefix of their own (base64 ``.npy``
text, ...: ``moe_ops.wire.sniff_format``). Only ``routing.npz`` carries the model's MoE layer
indices and expert count; for the other forms they are guessed (layer columns numbered 0, 1, ...;
the largest id seen + 1 experts), and the summary marks every guessed value as guessed, so a reader
never takes a guess for what the file recorded.
"""

from __future__ import annotations

import os
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ..wire import (
    FORMATS,
    RAW_MAGIC,
    decode_routing,
    decode_routing_bytes,
    decode_routing_weights,
    sniff_format,
)
from ..wire.npy import _MAX_NPY_HEADER, _WEIGHT_DESCR, _parse_npy_header

__all__ = ["MAX_COMPRESSION_RATIO", "RoutingFile", "inspect_file", "main_inspect", "read_routing_file"]

# the values a summary reports that a file may lack; RoutingFile.guessed names those it guessed
GUESSABLE = ("moe_layers", "num_experts")


@dataclass(frozen=True)
class RoutingFile:
    """A routing file as read: the ids, and the model facts that came with them or were guessed."""

    # the file read
    path: str
    # "npz" (the demo's routing.npz), "npy", "raw" (MOER bytes) or "text NAME" (the text of the wire
    # format NAME that moe_ops.wire.sniff_format recognised, e.g. "text npy": base64 .npy)
    form: str
    # (tokens, num_moe_layers, top_k) integer - the expert ids
    routing: np.ndarray
    # model-layer index of each routing column; len == routing.shape[1]
    moe_layers: tuple[int, ...]
    # experts of the model (guessed: largest id + 1, 0 for an empty file)
    num_experts: int
    # (num_tokens,) int64 request tokens (prompt + generated), or None when the file has none
    tokens: np.ndarray | None
    # prompt tokens of the request, or None when the file does not say
    prompt_len: int | None
    # the names in GUESSABLE that the file did not hold and that were guessed; the rest were read
    guessed: frozenset[str]


# A deflated .npz member may declare at most this many times its compressed size. Routing ids
# compress 1.1-3x (np.savez_compressed of the demo's files: 1.3x; of random uint8 ids below 64: 1.2x);
# deflate itself reaches ~1030x, which a zip bomb uses (7 MB of zeros announcing 1.5 GiB).
MAX_COMPRESSION_RATIO = 64
# Members that declare at most this many bytes are read whatever their ratio: small enough to hold.
_ALWAYS_READ_BYTES = 64 << 20
# the .npy header: magic, version and length field (12 bytes at most), then at most this many bytes
_NPY_HEAD_BYTES = 12 + _MAX_NPY_HEADER
# the arrays a routing.npz holds (write_routing); other members are never read
_NPZ_MEMBERS = ("routing", "tokens", "prompt_len", "moe_layers", "num_experts")
# what a malformed zip raises from zipfile and zlib
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, struct.error)


def _read_npy(f: BinaryIO, name: str, stored: int, compressed: int | None) -> np.ndarray:
    """The integer array of ``.npy`` bytes read from ``f``: ``stored`` bytes in all (the file's or
    the zip member's size), ``compressed`` the member's deflated size (None: not compressed).

    The header's shape and dtype must account for exactly ``stored`` bytes, and a compressed
    member may declare at most MAX_COMPRESSION_RATIO times its compressed size (or
    _ALWAYS_READ_BYTES): both are checked before the data is read, so a file never makes this
    allocate more than it holds.
    """
    head = f.read(_NPY_HEAD_BYTES)
    try:
        shape, fortran, dtype, count, offset = _parse_npy_header(head, None, complete=False)
    except ValueError as e:
        try:  # a float array: say it is weights rather than "not an integer dtype"
            weights = _parse_npy_header(head, None, complete=False, descr=_WEIGHT_DESCR)
        except ValueError:
            raise ValueError(f"{name}: {e}") from None
        raise ValueError(
            f"{name}: {weights[2]} values of shape {weights[0]}: routing weights, not expert ids "
            f"({_READS_IDS})"
        ) from None
    size = count * dtype.itemsize
    if offset + size != stored:
        raise ValueError(
            f"{name}: the header declares shape {shape} of {dtype} ({size} bytes), but "
            f"{stored - offset} bytes follow it"
        )
    if compressed is not None and size > max(_ALWAYS_READ_BYTES, MAX_COMPRESSION_RATIO * compressed):
        raise ValueError(
            f"{name}: {compressed} compressed bytes declare {size} bytes of shape {shape}, more than "
            f"{MAX_COMPRESSION_RATIO}x (routing ids compress about 1-3x): refused unread"
        )
    data = head[offset:] + f.read(max(0, size - len(head) + offset))
    if len(data) != size:
        raise ValueError(f"{name}: truncated, {len(data)} of {size} data bytes")
    array = np.frombuffer(data, dtype=dtype, count=count).reshape(shape, order="F" if fortran else "C")
    return array.astype(dtype.newbyteorder("="), order="C")


def _load_npz(path: str) -> dict[str, np.ndarray]:
    """The members of ``_NPZ_MEMBERS`` that the zip ``path`` holds, each checked by _read_npy."""
    file_size = os.path.getsize(path)
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            for name in _NPZ_MEMBERS:
                try:
                    info = z.getinfo(name + ".npy")
                except KeyError:
                    continue
                compressed = None if info.compress_type == zipfile.ZIP_STORED else info.compress_size
                if info.compress_size > file_size or (
                    compressed is None and info.compress_size != info.file_size
                ):
                    raise ValueError(
                        f"{name}: the zip declares {info.compress_size} bytes of it, {info.file_size} "
                        f"uncompressed, in a {file_size}-byte file"
                    )
                with z.open(info) as f:
                    out[name] = _read_npy(f, name, info.file_size, compressed)
    except _ZIP_ERRORS as e:
        raise ValueError(f"not a readable .npz ({type(e).__name__}: {e})") from None
    if "routing" not in out:
        raise ValueError("an .npz without a 'routing' array")
    return out


def _load(path: str) -> tuple[str, np.ndarray, dict[str, np.ndarray]]:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":  # a zip: .npz
        extra = _load_npz(path)
        return "npz", extra.pop("routing"), extra
    if head == RAW_MAGIC:
        with open(path, "rb") as f:
            return "raw", decode_routing_bytes(f.read()), {}
    if head == b"\x93NUM":
        with open(path, "rb") as f:
            return "npy", _read_npy(f, "routing", os.path.getsize(path), None), {}
    with open(path) as f:
        text = f.read().strip()
    fmt = sniff_format(text)
    if fmt is None:
        known = ", ".join(f"{w.magic!r} ({w.name})" for w in FORMATS.values() if w.magic is not None)
        raise ValueError(
            f"text that starts with the prefix of no wire format ({known}); SGLang's bare base64 has "
            "none: decode it with moe_ops.decode_routing(text, format='sglang', ...)"
        )
    try:
        return f"text {fmt.name}", decode_routing(text, format=fmt.name), {}
    except ValueError as ids_error:
        if fmt.weights is None:
            raise
        try:  # the format's weights text (float32, float16): say so rather than "not an integer dtype"
            weights = decode_routing_weights(text, format=fmt.name)
        except ValueError:
            raise ids_error from None
        raise ValueError(
            f"a text of routing weights ({fmt.name}, float values, shape {weights.shape}, "
            f"{_value_range(weights)}), not expert ids ({_READS_IDS}; "
            f"moe_ops.decode_routing_weights(text, format={fmt.name!r}) decodes it)"
        ) from None


# what an array of routing weights is told
_READS_IDS = "moe-ops inspect reads expert ids"
# bfloat16 bits of a weight in [2**-30, 2**8]: the top 16 bits of the float32 (sign 0, exponent
# 127-30 = 97 and 127+8 = 135, mantissa 0). Routers' weights lie there (softmax / sigmoid values,
# times a routed scaling factor such as DeepSeek-V3's 2.5); 0 is a zeroed row.
_BF16_LOW, _BF16_HIGH = 97 << 7, 135 << 7


def _bfloat16_weights(routing: np.ndarray) -> np.ndarray | None:
    """The float32 values of ``routing`` read as bfloat16 bits, when it looks like routing weights
    rather than expert ids: uint16, every value 0, a bfloat16 NaN (no weight recorded: 0x7FC0 from
    the wire, 0xFFFF from a capturer's channel) or a weight in [2**-30, 2**8] (bits 12416-17280),
    and at least one such weight. As expert ids that array would name only experts 12416 to 17280
    (and 0), of a model with more than 12416: none has that many. None otherwise."""
    if routing.dtype != np.uint16 or routing.size == 0:
        return None
    bits = routing.reshape(-1)
    nan = ((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)
    weight = (bits >= _BF16_LOW) & (bits <= _BF16_HIGH)
    if not weight.any() or not (weight | nan | (bits == 0)).all():
        return None
    return (routing.astype(np.uint32) << 16).view(np.float32)


def _value_range(weights: np.ndarray) -> str:
    finite = weights[~np.isnan(weights)]
    span = f"values {float(finite.min()):.3g} to {float(finite.max()):.3g}" if finite.size else "no values"
    missing = int(weights.size - finite.size)
    return span + (f", {missing} NaN (no weight recorded)" if missing else "")


def _scalar(extra: dict[str, np.ndarray], name: str, minimum: int) -> int | None:
    """The int ``name`` of an .npz (a 0-d integer array >= ``minimum``), None when absent."""
    if name not in extra:
        return None
    value = extra[name]
    if value.shape != () or int(value) < minimum:
        raise ValueError(f"{name} must be one integer >= {minimum}, got {_short(value)}")
    return int(value)


def _short(value: np.ndarray) -> str:
    text = np.array2string(value, threshold=8, edgeitems=3).replace("\n", "")
    return f"{text} (shape {value.shape})" if value.shape else text


def _missing_marker(routing: np.ndarray, num_experts: int | None) -> int | None:
    """The value that marks a row with no routing: -1 in a signed array; in an unsigned one its
    largest value where that cannot be an id (``num_experts`` read and <= it), as SlotStore writes."""
    if routing.dtype.kind == "i":
        return -1
    top = int(np.iinfo(routing.dtype).max)
    return top if num_experts is not None and num_experts <= top else None


def read_routing_file(path: str) -> RoutingFile:
    """Reads ``path`` (see the module docstring); ValueError when it is not routing, naming why.

    Sizes are checked against the file before anything is allocated (an ``.npz`` member's declared
    shape against its stored and compressed bytes, see MAX_COMPRESSION_RATIO); the model facts of
    an ``.npz`` must be integers of the right shape, and ids must lie in [0, num_experts) or be the
    no-routing marker (-1; an unsigned array's largest value when num_experts is smaller).
    """
    form, routing, extra = _load(path)
    weights = None if "num_experts" in extra else _bfloat16_weights(routing)
    if weights is not None:
        raise ValueError(
            f"uint16 values that read as bfloat16 routing weights (shape {routing.shape}, "
            f"{_value_range(weights)}), not expert ids: as ids they would need more than "
            f"{_BF16_LOW} experts ({_READS_IDS}; moe_ops.decode_routing_weights decodes a weights text, "
            "moe_ops.decode_routing an ids text of such a model)"
        )
    if routing.ndim != 3:
        raise ValueError(f"routing must be (tokens, num_layers, top_k), got shape {routing.shape}")
    if routing.shape[2] < 1:
        raise ValueError(f"routing must have top_k >= 1 ids per row, got shape {routing.shape}")
    layers = routing.shape[1]
    guessed = set()
    if "moe_layers" in extra:
        value = extra["moe_layers"]
        if value.ndim != 1 or (value.size and int(value.min()) < 0):
            raise ValueError(f"moe_layers must be a list of model-layer indices >= 0, got {_short(value)}")
        if len(value) != layers:
            raise ValueError(f"moe_layers has {len(value)} entries but routing has {layers} layer columns")
        moe_layers = tuple(int(v) for v in value)
    else:
        moe_layers = tuple(range(layers))
        guessed.add("moe_layers")
    num_experts = _scalar(extra, "num_experts", 1)
    marker = _missing_marker(routing, num_experts)
    ids = routing if marker is None else routing[routing != marker]
    if ids.size and int(ids.min()) < 0:
        raise ValueError(f"routing holds id {int(ids.min())}: ids are >= 0, or -1 for a row with no routing")
    top = int(ids.max()) if ids.size else -1
    if num_experts is None:
        num_experts = top + 1
        guessed.add("num_experts")
    elif top >= num_experts:
        raise ValueError(f"routing holds id {top}, but the file's num_experts is {num_experts}")
    elif num_experts - 1 > np.iinfo(routing.dtype).max:
        # write_routing stores ids in a dtype that holds num_experts - 1 (RoutingShape.id_dtype)
        raise ValueError(
            f"num_experts={num_experts} does not fit the routing's dtype {routing.dtype} (ids up to "
            f"{np.iinfo(routing.dtype).max}): the file contradicts itself"
        )
    tokens = None
    if "tokens" in extra:
        tokens = extra["tokens"]
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be one token id per position, got {_short(tokens)}")
    prompt_len = _scalar(extra, "prompt_len", 0)
    if prompt_len is not None and tokens is not None and prompt_len > len(tokens):
        raise ValueError(f"prompt_len={prompt_len} exceeds the {len(tokens)} tokens")
    return RoutingFile(path, form, routing, moe_layers, num_experts, tokens, prompt_len, frozenset(guessed))


def _source(f: RoutingFile, name: str, how: str) -> str:
    return f"guessed: {how}; the file does not say" if name in f.guessed else "read from the file"


def inspect_file(path: str) -> str:
    """A text summary of a saved routing file (:func:`read_routing_file`); each model fact says
    whether it was read from the file or guessed."""
    f = read_routing_file(path)
    routing = f.routing
    tokens, layers, top_k = routing.shape
    lines = [
        f"{path}",
        f"  routing: {tokens} tokens x {layers} MoE layers x top-{top_k}, dtype {routing.dtype} ({f.form})",
    ]
    if f.tokens is not None:
        n = len(f.tokens)
        prompt = (
            f"{f.prompt_len} prompt + {n - f.prompt_len} generated"
            if f.prompt_len is not None
            else "prompt length not in the file"
        )
        lines.append(f"  request: {n} tokens ({prompt}); routing rows = num_tokens - 1 = {n - 1}")
    lines.append(f"  experts: {f.num_experts} ({_source(f, 'num_experts', 'largest id + 1')})")
    lines.append(
        f"  MoE layers (model index): {list(f.moe_layers)} "
        f"({_source(f, 'moe_layers', 'the columns numbered from 0')})"
    )
    if tokens:
        rows = routing.reshape(-1, top_k)
        marker = _missing_marker(routing, None if "num_experts" in f.guessed else f.num_experts)
        empty = np.zeros(len(rows), bool) if marker is None else (rows == marker).all(axis=1)
        ordered = np.sort(rows[~empty], axis=1)
        dup = int((ordered[:, 1:] == ordered[:, :-1]).any(axis=1).sum())
        ids = routing if marker is None else routing[routing != marker]
        span = f"[{int(ids.min())}, {int(ids.max())}]" if ids.size else "(none)"
        lines.append(f"  ids in {span}; rows with repeated ids: {dup}")
        if empty.any():
            lines.append(f"  rows with no routing (marker {marker}): {int(empty.sum())} of {len(rows)}")
        for col, layer in enumerate(f.moe_layers):
            column = routing[:, col].reshape(-1)
            if marker is not None:
                column = column[column != marker]
            # counts of the ids present only: an array of num_experts counts would be as large as
            # the file says (num_experts=10**12, or one id of 10**9 in a bare .npy)
            experts, counts = np.unique(column, return_counts=True)
            top = np.lexsort((experts, -counts))[:3]
            busiest = ", ".join(f"{int(experts[i])} ({int(counts[i])})" for i in top)
            lines.append(
                f"  layer {layer:>3}: {len(experts)}/{f.num_experts} experts used; busiest {busiest or '-'}"
            )
    read = [name for name in GUESSABLE if name not in f.guessed]
    lines.append(
        "  read from the file: routing"
        + "".join(f", {name}" for name in read)
        + ("" if f.tokens is None else ", tokens")
        + ("" if f.prompt_len is None else ", prompt_len")
        + (f"; guessed: {', '.join(sorted(f.guessed))}" if f.guessed else "; guessed: nothing")
    )
    return "\n".join(lines)


def main_inspect(args: Any) -> int:
    """``moe-ops inspect FILE``: prints a summary of each file; exit 1 if one cannot be read."""
    status = 0
    for path in args.files:
        try:
            print(inspect_file(path))
        except (OSError, ValueError) as exc:
            print(f"{path}: cannot read routing: {exc}", file=sys.stderr)
            status = 1
        except MemoryError:  # every size is checked first; this is the last line of defence
            print(f"{path}: cannot read routing: out of memory", file=sys.stderr)
            status = 1
    return status
