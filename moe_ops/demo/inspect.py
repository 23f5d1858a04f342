"""``moe-ops inspect FILE``: what a saved routing file holds, and which of it the file says.

Reads the demo's ``routing.npz``, a bare ``.npy`` array, and both wire formats of
:mod:`moe_ops.wire` (base64 ``.npy`` text, raw ``MOER`` bytes). Only ``routing.npz`` carries the
model's MoE layer indices and expert count; for the other forms they are guessed (layer columns
numbered 0, 1, ...; the largest id seen + 1 experts), and the summary marks every guessed value as
guessed, so a reader never takes a guess for what the file recorded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..wire import RAW_MAGIC, decode_routing, decode_routing_bytes

__all__ = ["RoutingFile", "inspect_file", "main_inspect", "read_routing_file"]

# the values a summary reports that a file may lack; RoutingFile.guessed names those it guessed
GUESSABLE = ("moe_layers", "num_experts")


@dataclass(frozen=True)
class RoutingFile:
    """A routing file as read: the ids, and the model facts that came with them or were guessed."""

    # the file read
    path: str
    # "npz" (the demo's routing.npz), "npy", "raw" (MOER bytes) or "text" (base64 .npy)
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


def _load(path: str) -> tuple[str, np.ndarray, dict[str, Any]]:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":  # a zip: .npz
        with np.load(path, allow_pickle=False) as data:
            if "routing" not in data:
                raise ValueError(f"{path}: an .npz without a 'routing' array (arrays: {sorted(data.files)})")
            return "npz", data["routing"], {k: data[k] for k in data.files if k != "routing"}
    if head == RAW_MAGIC:
        with open(path, "rb") as f:
            return "raw", decode_routing_bytes(f.read()), {}
    if head == b"\x93NUM":
        return "npy", np.load(path, allow_pickle=False), {}
    with open(path) as f:
        return "text", decode_routing(f.read().strip()), {}


def read_routing_file(path: str) -> RoutingFile:
    """Reads ``path`` (see the module docstring); ValueError when it is not routing, naming why."""
    form, routing, extra = _load(path)
    if routing.ndim != 3:
        raise ValueError(f"{path}: routing must be (tokens, num_layers, top_k), got shape {routing.shape}")
    layers = routing.shape[1]
    guessed = set()
    if "moe_layers" in extra:
        moe_layers = tuple(int(v) for v in extra["moe_layers"].reshape(-1))
        if len(moe_layers) != layers:
            raise ValueError(
                f"{path}: moe_layers has {len(moe_layers)} entries but routing has {layers} layer columns"
            )
    else:
        moe_layers = tuple(range(layers))
        guessed.add("moe_layers")
    if "num_experts" in extra:
        num_experts = int(extra["num_experts"])
    else:
        num_experts = int(routing.max()) + 1 if routing.size else 0
        guessed.add("num_experts")
    tokens = np.asarray(extra["tokens"]) if "tokens" in extra else None
    prompt_len = int(extra["prompt_len"]) if "prompt_len" in extra else None
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
        dup = sum(len(set(row)) != top_k for row in routing.reshape(-1, top_k).tolist())
        lines.append(f"  ids in [{int(routing.min())}, {int(routing.max())}]; rows with repeated ids: {dup}")
        for col, layer in enumerate(f.moe_layers):
            counts = np.bincount(routing[:, col].reshape(-1).astype(np.int64), minlength=f.num_experts)
            top = np.argsort(-counts, kind="stable")[:3]
            busiest = ", ".join(f"{int(e)} ({int(counts[e])})" for e in top)
            used = int((counts > 0).sum())
            lines.append(f"  layer {layer:>3}: {used}/{f.num_experts} experts used; busiest {busiest}")
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
    return status
