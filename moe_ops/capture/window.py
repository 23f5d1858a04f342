"""Which rows of a MoE layer's ids belong to this DP rank: the one rule every capture path uses.

The capture op, the router's fused capture and the monolithic experts' capture all select rows
here, so that they cannot disagree:

* host half, :func:`plan_window` - validates the count tensors for a layout and returns the sizes
  tensor the layout reads and ``n_first``, how many of its entries precede this rank's rows;
* device half, :func:`rows_window` (Triton) and its twin :func:`rows_window_torch` - compute
  ``(start, c_eff, flags)`` from the LIVE counts on the device, in int64.

The rule, with ``c = token_counts[dp_rank]`` and ``sizes`` = ``shard_sizes`` if given, else
``token_counts``::

    layout              sizes read         n_first                       start
    LOCAL               -                  0                             0
    SEQUENCE_PARALLEL   -                  0 (after the TP all-gather)   0
    GATHERED            shard_sizes or     dp_rank * spr                 sum(sizes[:n_first])
                        token_counts
    SHARDED             shard_sizes        dp_rank * spr                 sum(shard_sizes[:n_first])

where ``spr = len(sizes) // dp_size`` (shards per rank; 1 for per-rank sizes and for token_counts).
A GATHERED batch described by ``dp_size * spr`` shard sizes is the same batch as SHARDED: each
rank's block is the sum of its shards, so both read the same start. ``c_eff = clamp(c, 0,
min(n_src - start, n_dst))``; the fault bits say what was clamped.

Count tensors may be strided (sliced out of larger tensors) or expanded: both halves index them by
stride. Sums run in int64, so counts near the int32 limit cannot wrap into a valid-looking offset.
"""

from __future__ import annotations

import torch

from .._runtime.triton import HAS_TRITON
from ..layout import BatchLayout
from .errors import FAULT_BAD_OFFSET, FAULT_DEST_SHORT, FAULT_NEGATIVE_COUNT, FAULT_SOURCE_SHORT

__all__ = ["check_count_tensor", "plan_window", "rows_window_torch"]


def check_count_tensor(name: str, t: object, device: torch.device) -> None:
    """ValueError/TypeError unless ``t`` is a 1-D int32 tensor on ``device`` (any strides)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on the buffer's device {device}, got {t.device}")


def plan_window(
    layout: BatchLayout,
    token_counts: torch.Tensor,
    dp_rank: int,
    shard_sizes: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """Host half of the rule: checks the counts for ``layout``; returns ``(sizes, n_first)``.

    token_counts: (dp_size,) int32 on ``device`` - real tokens of each DP rank (read on the device)
    shard_sizes: (dp_size * spr,) int32 on ``device`` or None - rows each rank (spr = 1) or each of
        its shards occupies in the gathered batch; GATHERED and SHARDED only

    Reads no device values. Raises ValueError (TypeError for non-tensors) naming the argument.
    """
    check_count_tensor("token_counts", token_counts, device)
    dp_size = token_counts.shape[0]
    if dp_size < 1:
        raise ValueError("token_counts must have one entry per DP rank (dp_size >= 1), got 0 entries")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"dp_rank must be an int in [0, {dp_size}) (dp_size from token_counts), got {dp_rank!r}"
        )
    if layout in (BatchLayout.GATHERED, BatchLayout.SHARDED):
        if shard_sizes is None:
            if layout == BatchLayout.SHARDED:
                raise ValueError(
                    "SHARDED needs shard_sizes: an int32 tensor of dp_size * shards_per_rank shard sizes"
                )
            return token_counts, dp_rank
        check_count_tensor("shard_sizes", shard_sizes, device)
        n = shard_sizes.shape[0]
        if n == 0 or n % dp_size:
            raise ValueError(
                f"shard_sizes must have a positive multiple of dp_size={dp_size} entries "
                f"(dp_size * shards_per_rank), got {n}"
            )
        return shard_sizes, dp_rank * (n // dp_size)
    if shard_sizes is not None:
        raise ValueError(f"shard_sizes is only used by GATHERED and SHARDED, not {layout.name}; pass None")
    return token_counts, 0


# reference
def rows_window_torch(
    token_counts: torch.Tensor, sizes: torch.Tensor, dp_rank: int, n_first: int, n_src: int, n_dst: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`rows_window`: 0-d int64 tensors ``(start, c_eff, flags)``.

    No host reads; ``start`` is clamped to ``[0, n_src]`` (FAULT_BAD_OFFSET when it had to be).
    """
    c = token_counts[dp_rank].to(torch.int64)
    head = sizes[:n_first].to(torch.int64)
    start = head.sum()
    flags = torch.where(c < 0, FAULT_NEGATIVE_COUNT, 0)
    c = c.clamp(min=0)
    bad_offset = (head < 0).any() | (start < 0) | (start > n_src)
    flags = flags | torch.where(bad_offset, FAULT_BAD_OFFSET, 0)
    start = start.clamp(0, n_src)
    flags = flags | torch.where(c > n_src - start, FAULT_SOURCE_SHORT, 0)
    flags = flags | torch.where(c > n_dst, FAULT_DEST_SHORT, 0)
    c_eff = torch.minimum(c, n_src - start).clamp(max=n_dst)
    return start, c_eff, flags


if HAS_TRITON:
    import triton
    import triton.language as tl

    # Triton kernels may only read globals that are constexpr.
    _NEGATIVE_COUNT = tl.constexpr(FAULT_NEGATIVE_COUNT)
    _SOURCE_SHORT = tl.constexpr(FAULT_SOURCE_SHORT)
    _DEST_SHORT = tl.constexpr(FAULT_DEST_SHORT)
    _BAD_OFFSET = tl.constexpr(FAULT_BAD_OFFSET)

    @triton.jit
    def rows_window(count, sizes, n_src, n_dst, HAS_OFFSET: tl.constexpr):
        """Device half of the rule: int64 ``(start, c_eff, fault flags)`` for this rank.

        count: this rank's ``token_counts[dp_rank]``; sizes: ``(S_PAD,)``, ``sizes[:n_first]`` with
        0 past ``n_first``. The calling kernel loads both itself, by stride (the two loads are
        written out in each kernel: a helper taking the pointers would bring back the problem
        below). HAS_OFFSET=False (n_first == 0: LOCAL, rank 0) ignores ``sizes``: start is 0.

        Takes values, not pointers: torch's mutation analysis of a traced kernel
        (``torch.library.wrap_triton``) counts every pointer passed to a called function whose
        result reaches a store address as written. With the loads in here, the count tensors were
        reported as mutated, so inductor cloned them before every launch and copied them back
        after, and ``mode="reduce-overhead"`` skipped CUDA graphs ("mutated inputs").
        """
        c = count.to(tl.int64)
        flags = tl.where(c < 0, _NEGATIVE_COUNT, 0)
        c = tl.maximum(c, 0)
        if HAS_OFFSET:
            sizes = sizes.to(tl.int64)
            start = tl.sum(sizes, axis=0)
            n_negative = tl.sum((sizes < 0).to(tl.int32), axis=0)
            flags |= tl.where((n_negative > 0) | (start < 0) | (start > n_src), _BAD_OFFSET, 0)
            start = tl.minimum(tl.maximum(start, 0), n_src)
        else:
            start = c * 0  # int64 zero
        flags |= tl.where(c > n_src - start, _SOURCE_SHORT, 0)
        flags |= tl.where(c > n_dst, _DEST_SHORT, 0)
        c_eff = tl.minimum(tl.minimum(c, n_src - start), n_dst)
        return start, c_eff, flags

    __all__ += ["rows_window"]
