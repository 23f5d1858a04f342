"""Batch layouts: which rows of a MoE layer's ``topk_ids`` belong to this data-parallel rank.

A MoE layer sees its tokens in one of four arrangements, depending on how the engine moved them
before routing. The capture op must pick out exactly the rows of *this* DP rank's real tokens and
never a padding row. ``c = token_counts[dp_rank]`` is the number of real tokens of this rank.

LOCAL (0): rows are this DP rank's own tokens, padded at the tail to a CUDA-graph size::

    rows:  | t0 | t1 | t2 | pad | pad |          c = 3, rows [0, 3) are taken

GATHERED (1): every DP rank's tokens concatenated (naive all-gather dispatch). Rank ``i`` owns a
block of ``sizes[i]`` rows (``sizes`` = ``shard_sizes`` for a padded all-gather, else the counts)::

    rows:  | r0 t0 | r0 t1 | r0 pad | r1 t0 | r1 t1 | r1 t2 | r2 t0 |
           |<----- sizes[0]=3 ---->|<------ sizes[1]=3 ----->| ...
    dp_rank = 1, c = 3: start = sizes[0] = 3, rows [3, 6)

SHARDED (2): DP+EP gather of sequence-parallel shards, DP-then-TP order. Each DP rank's (padded)
batch was cut into ``spr`` contiguous shards, one per TP rank, and all shards were gathered::

    rows:  | r0 s0 | r0 s1 | r1 s0 | r1 s1 |      spr = 2, shard_sizes = [2, 2, 2, 2]
           | a  b  | c  -  | d  e  | f  -  |      (- is padding)
    dp_rank = 1, c = 3: start = sum(shard_sizes[:1 * 2]) = 4, rows [4, 7) = d e f

    The shards of one rank are contiguous chunks of its padded batch, so its real tokens are the
    first ``c`` rows of its block; padding only ever sits after them.
    vLLM's ``dp_metadata.local_sizes`` inside ``sp_local_sizes(tp)`` is exactly this
    ``shard_sizes``: ``ceil(padded / tp)`` for each TP rank of each DP rank.

SEQUENCE_PARALLEL (3): this TP rank holds ``ceil(padded / tp)`` rows of its DP rank's batch. The
capture all-gathers them over the TP group first, which turns the batch back into LOCAL::

    tp rank 0: | t0 | t1 |      tp rank 1: | t2 | pad |
    gathered:  | t0 | t1 | t2 | pad |      c = 3, rows [0, 3)
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BatchLayout", "infer_layout", "layout_from_value"]


class BatchLayout(enum.IntEnum):
    """How the rows of ``topk_ids`` are arranged; see the module docstring for diagrams."""

    LOCAL = 0  # rows are this DP rank's tokens (modular-kernel path); tail rows are padding
    GATHERED = 1  # all DP ranks' tokens concatenated (naive dispatch), rank i owns a block
    SHARDED = 2  # DP+EP gather of sequence-parallel shards, DP-then-TP order, with padding
    SEQUENCE_PARALLEL = 3  # this TP rank holds ceil(count/tp) rows; gathered over the TP group first


def layout_from_value(layout: BatchLayout | int) -> BatchLayout:
    """Returns ``layout`` as a :class:`BatchLayout`, raising ValueError for anything but a
    BatchLayout or an int (numpy ints included) naming one: never a float, str or bool."""
    if isinstance(layout, BatchLayout):
        return layout
    try:
        if isinstance(layout, bool) or not isinstance(layout, (int, np.integer)):
            raise TypeError
        return BatchLayout(int(layout))
    except (ValueError, TypeError):
        names = ", ".join(f"{m.name}={m.value}" for m in BatchLayout)
        raise ValueError(f"layout must be a BatchLayout ({names}), got {layout!r}") from None


def _as_int(value) -> int | None:
    """``value`` as an int if it is one (Python, NumPy or 0-d integer tensor), else None."""
    # bool is an int subclass and 2.5 would truncate to 2: both are caller bugs, not sizes.
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _host_int(name: str, value: int) -> int:
    out = _as_int(value)
    if out is None:
        raise ValueError(f"{name} must be an int, got {value!r}")
    return out


def _host_ints(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    # Host read by design: infer_layout is for host-side callers that only know shapes.
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"{name} must have an integer dtype, got {values.dtype}")
        values = values.tolist()
    values = list(values)
    out = [_as_int(v) for v in values]
    for v, got in zip(values, out):
        if got is None:
            raise ValueError(f"{name} must hold ints, got {v!r} in {values!r}")
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be non-negative, got {out}")
    return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def infer_layout(
    num_rows: int,
    token_counts: Sequence[int] | torch.Tensor,
    dp_rank: int,
    *,
    local_sizes: Sequence[int] | torch.Tensor | None = None,
    tp_size: int = 1,
) -> BatchLayout:
    """Decides, from shapes alone, which layout a ``topk_ids`` with ``num_rows`` rows is in.

    This is for host-side callers that only know shapes (the way existing engines decide). It
    reads ``token_counts``/``local_sizes`` on the host: if they are CUDA tensors that is a
    device-to-host copy and a synchronisation, so never call it inside a captured or compiled step.

    Args:
        num_rows: rows of ``topk_ids`` the MoE layer produced.
        token_counts: (dp_size,) int - real (unpadded) tokens of each DP rank this step.
        dp_rank: this rank's index into ``token_counts``.
        local_sizes: (dp_size * spr,) int - rows each DP rank contributed, padding included, as
            ``spr = len(local_sizes) // dp_size`` shards per rank in DP-then-TP order: the exact
            all-gatherv layout (vLLM's ``dp_metadata.local_sizes``). ``spr == 1`` is one padded
            size per rank (e.g. its CUDA-graph size). None means ``token_counts`` (no padding).
        tp_size: tensor-parallel size; > 1 makes SEQUENCE_PARALLEL and SHARDED of ceil-div shards
            possible. With ``spr > 1`` it must divide ``spr`` (each TP rank sent ``spr / tp_size``
            shards of its DP rank's batch; vLLM sends one, more with replicas such as context
            parallelism).

    Candidate row counts, with ``S = local_sizes``, ``P[i] = sum(S[i*spr:(i+1)*spr])`` (rank
    ``i``'s padded size) and ``C = token_counts`` (an unpadded and a padded form of each; they
    coincide when ``local_sizes`` is None):
        LOCAL ``C[r]`` or ``P[r]``; GATHERED ``sum(C)`` or ``sum(P)``; SHARDED ``sum(S)`` when
        ``spr > 1`` (this rank from ``sum(S[:r*spr])``, exactly how the capture op reads
        ``shard_sizes=S``), and the sequence-parallel ceil-div shards ``sum(tp * ceil(X[i] / tp))``
        for X = C, and X = P when ``spr == 1``; SEQUENCE_PARALLEL ``ceil(X[r] / tp)``.

    Returns the layout whose expected row count equals ``num_rows``. With a single DP rank and
    ``tp_size == 1`` it returns LOCAL (after checking ``num_rows >= c``). When several fit and all
    select the same rows it returns the first in this order: LOCAL, SHARDED over ``S`` (spr > 1),
    GATHERED, SHARDED over ceil-div shards, SEQUENCE_PARALLEL; unpadded before padded. SHARDED over
    ``S`` comes before GATHERED because the two always select the same rows when ``spr > 1`` but
    only SHARDED reads them from ``S`` itself (GATHERED takes ``dp_size`` sizes). Pass the
    returned layout to ``capture_routing`` with these ``shard_sizes``:
        LOCAL, SEQUENCE_PARALLEL: None. GATHERED: ``local_sizes`` if ``num_rows == sum(S)`` (then
        ``spr == 1``), else None. SHARDED: ``local_sizes`` if ``num_rows == sum(S)`` (then
        ``spr > 1``), else ``ceil(X[i] / tp)`` repeated ``tp`` times per rank, X = C if
        ``num_rows == sum(tp * ceil(C[i] / tp))`` else P.

    Raises:
        ValueError: bad arguments (lengths, negative or non-integer values, a rank's
            ``local_sizes`` holding fewer rows than its ``token_counts``, ``tp_size`` not dividing
            ``spr``); no layout fits (the message lists every expected size); or several fit and
            they would select different rows (existing engines pick by precedence here and
            silently take the wrong rows, e.g. when a padded gather happens to equal another size).
    """
    counts = _host_ints("token_counts", token_counts)
    dp_size = len(counts)
    if dp_size == 0:
        raise ValueError("token_counts must have one entry per DP rank, got an empty sequence")
    num_rows = _host_int("num_rows", num_rows)
    dp_rank = _host_int("dp_rank", dp_rank)
    tp_size = _host_int("tp_size", tp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}) for {dp_size} DP ranks, got {dp_rank}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    shards = counts if local_sizes is None else _host_ints("local_sizes", local_sizes)
    if not shards or len(shards) % dp_size:
        raise ValueError(
            f"local_sizes must have a positive multiple of dp_size={dp_size} entries "
            f"(dp_size * shards_per_rank), got {len(shards)}"
        )
    spr = len(shards) // dp_size
    if spr > 1 and spr % tp_size:
        raise ValueError(
            f"local_sizes has {spr} shards per DP rank ({len(shards)} entries for dp_size={dp_size}), "
            f"which tp_size={tp_size} does not divide: every TP rank of a DP rank sends the same "
            "number of shards"
        )
    sizes = [sum(shards[i * spr : (i + 1) * spr]) for i in range(dp_size)]
    for rank, (c, p) in enumerate(zip(counts, sizes)):
        if p < c:
            if spr == 1:
                what = f"local_sizes[{rank}]={p} is"
            else:
                lo, hi = rank * spr, (rank + 1) * spr
                what = f"DP rank {rank}'s {spr} shards local_sizes[{lo}:{hi}]={shards[lo:hi]} sum to {p},"
            raise ValueError(
                f"{what} smaller than token_counts[{rank}]={c}: padded sizes must hold every real token"
            )
    c = counts[dp_rank]

    if dp_size == 1 and tp_size == 1:
        if num_rows < c:
            raise ValueError(
                f"num_rows={num_rows} is smaller than this rank's token count {c} (single DP rank: LOCAL)"
            )
        return BatchLayout.LOCAL

    # (layout, expected rows, selection) where selection = (first source row, needs a TP gather).
    # Unpadded forms come first so that a padding-free step reports the plain layout.
    candidates: list[tuple[BatchLayout, int, tuple[int, bool]]] = []
    forms = [counts] if sizes == counts else [counts, sizes]
    for xs in forms:
        candidates.append((BatchLayout.LOCAL, xs[dp_rank], (0, False)))
    if dp_size > 1:
        if spr > 1:
            # The exact all-gatherv layout, read as the capture op reads shard_sizes=local_sizes.
            candidates.append((BatchLayout.SHARDED, sum(shards), (sum(shards[: dp_rank * spr]), False)))
        for xs in forms:
            candidates.append((BatchLayout.GATHERED, sum(xs), (sum(xs[:dp_rank]), False)))
    if tp_size > 1:
        for padded, xs in enumerate(forms):
            # With spr > 1 the padded shards are given exactly: no ceil-div guess of them.
            if dp_size > 1 and (not padded or spr == 1):
                shard = [tp_size * _ceil_div(x, tp_size) for x in xs]
                candidates.append((BatchLayout.SHARDED, sum(shard), (sum(shard[:dp_rank]), False)))
        for xs in forms:
            candidates.append((BatchLayout.SEQUENCE_PARALLEL, _ceil_div(xs[dp_rank], tp_size), (0, True)))

    fits = [(layout, sel) for layout, rows, sel in candidates if rows == num_rows]
    if not fits:
        expected = ", ".join(f"{layout.name}={rows}" for layout, rows, _ in candidates)
        raise ValueError(
            f"num_rows={num_rows} matches no batch layout for token_counts={counts}, "
            f"local_sizes={shards}, dp_rank={dp_rank}, tp_size={tp_size}; expected one of: {expected}"
        )
    if len({sel for _, sel in fits}) > 1 and c > 0:
        detail = ", ".join(
            f"{layout.name} (rows from {start}{', after a TP all-gather' if gather else ''})"
            for layout, (start, gather) in fits
        )
        raise ValueError(
            f"ambiguous batch layout: num_rows={num_rows} fits {detail}, and they select different "
            f"rows for dp_rank={dp_rank} (c={c}). Pass the layout explicitly instead of inferring it."
        )
    return fits[0][0]
