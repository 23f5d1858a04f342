"""The slicing kernel: copies this DP rank's rows of ``topk_ids`` into one layer of the capture buffer.

The row window is computed on the device from ``token_counts`` / ``sizes`` (never on the host), so a
CUDA graph captured once replays correctly for any live counts. Two implementations of one contract:

* :func:`capture_rows_triton` - the Triton kernel (CUDA; CPU tensors under ``TRITON_INTERPRET=1``);
* :func:`capture_rows_torch` - its PyTorch reference twin (the CPU path, and the test oracle).

Contract (both): with ``c = token_counts[dp_rank]`` and ``start`` from the layout (see
:mod:`moe_ops.layout`), ``buffer[r, layer_id, :] = topk_ids[start + r, :]`` for ``r < c_eff`` where
``c_eff = clamp(c, 0, min(n - start, buffer rows))``; every other element of ``buffer`` keeps its
value. A clamped call adds 1 to ``errors[0]`` and ORs its fault bits into ``errors[1]``.

:func:`rows_window` is the device-side offset rule shared with the fused router kernels, so both
paths select rows in exactly the same way.
"""

from __future__ import annotations

import torch

from .._triton import HAS_TRITON, next_power_of_2
from ..layout import BatchLayout
from .errors import FAULT_BAD_OFFSET, FAULT_DEST_SHORT, FAULT_NEGATIVE_COUNT, FAULT_SOURCE_SHORT

__all__ = ["capture_rows_torch", "capture_rows_triton", "launch_config", "window_first_size"]

# At most 1024 ids per program (n=8192, k=8 uses 64 programs); a batch smaller than that gets a
# tile just big enough. Inside a CUDA graph of 61 layers on an H200 (n=1, k=8, LOCAL), per layer:
# 1024-id tile 1.11 us, 1-row tile with 1 warp 1.05 us, with 4 warps 1.03 us; a plain copy 0.96 us.
# At n=64: 64-row tile with 4 warps 1.16 us, 1 warp 1.37 us. So: smallest tile, always 4 warps.
_TILE_ELEMENTS = 1024


def launch_config(window: int, k_pad: int) -> tuple[int, int]:
    """(rows per program, warps) for a kernel that covers ``window`` rows of ``k_pad`` ids."""
    block_m = max(1, min(_TILE_ELEMENTS // k_pad, next_power_of_2(window)))
    return block_m, 4


def window_first_size(layout: int, dp_rank: int, shards_per_rank: int) -> int:
    """Number of leading ``sizes`` entries that precede this rank's rows (host arithmetic on ints)."""
    if layout == BatchLayout.GATHERED:
        return dp_rank
    if layout == BatchLayout.SHARDED:
        return dp_rank * shards_per_rank
    return 0  # LOCAL, and SEQUENCE_PARALLEL after its gather


if HAS_TRITON:
    import triton
    import triton.language as tl

    # Triton kernels may only read globals that are constexpr.
    _NEGATIVE_COUNT = tl.constexpr(FAULT_NEGATIVE_COUNT)
    _SOURCE_SHORT = tl.constexpr(FAULT_SOURCE_SHORT)
    _DEST_SHORT = tl.constexpr(FAULT_DEST_SHORT)
    _BAD_OFFSET = tl.constexpr(FAULT_BAD_OFFSET)

    @triton.jit
    def rows_window(
        counts_ptr, sizes_ptr, dp_rank, n_first, n_src, n_dst, S_PAD: tl.constexpr, HAS_OFFSET: tl.constexpr
    ):
        """Device-side row window: returns (start, c_eff, fault flags) for this rank.

        start = sum(sizes[:n_first]) clamped to [0, n_src]; c_eff = clamp(c, 0, min(n_src - start,
        n_dst)). Every program of a launch computes the same values (S_PAD <= 64 loads, cached).
        HAS_OFFSET=False (n_first == 0: LOCAL, rank 0) compiles the sizes load away: start is 0.
        """
        c = tl.load(counts_ptr + dp_rank)
        flags = tl.where(c < 0, _NEGATIVE_COUNT, 0)
        c = tl.maximum(c, 0)
        if HAS_OFFSET:
            idx = tl.arange(0, S_PAD)
            sizes = tl.load(sizes_ptr + idx, mask=idx < n_first, other=0)
            start = tl.sum(sizes, axis=0)
            n_negative = tl.sum((sizes < 0).to(tl.int32), axis=0)
            flags |= tl.where((n_negative > 0) | (start < 0) | (start > n_src), _BAD_OFFSET, 0)
            start = tl.minimum(tl.maximum(start, 0), n_src)
        else:
            start = 0
        flags |= tl.where(c > n_src - start, _SOURCE_SHORT, 0)
        flags |= tl.where(c > n_dst, _DEST_SHORT, 0)
        c_eff = tl.minimum(tl.minimum(c, n_src - start), n_dst)
        return start, c_eff, flags

    @triton.jit
    def record_faults(errors_ptr, flags):
        """Called by program 0 only: one count per faulty call, flags OR-ed."""
        if flags != 0:
            tl.atomic_add(errors_ptr, 1)
            tl.atomic_or(errors_ptr + 1, flags)

    # Counts live on the device, so nothing that changes per step is a specialisation key: the
    # row count n_src, the layer and the rank are runtime ints (no recompile per layer or batch).
    # Strides other than the innermost ones are runtime values too: specialising them (Triton keys
    # on stride % 16 and stride == 1) multiplied the compiled variants for no speed-up.
    @triton.jit(
        do_not_specialize=[
            "n_src",
            "n_dst",
            "layer_id",
            "dp_rank",
            "n_first",
            "top_k",
            "stride_bm",
            "stride_bl",
            "stride_im",
        ]
    )
    def _capture_rows_kernel(
        buf_ptr,
        ids_ptr,
        counts_ptr,
        sizes_ptr,
        errors_ptr,
        n_src,
        n_dst,
        layer_id,
        dp_rank,
        n_first,
        stride_bm,
        stride_bl,
        stride_bk,
        stride_im,
        stride_ik,
        top_k,
        K_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        S_PAD: tl.constexpr,
        SOURCE_ORDER: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row0 = pid * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, K_PAD)
        col_ok = (cols < top_k)[None, :]
        layer_base = buf_ptr + layer_id.to(tl.int64) * stride_bl + cols[None, :] * stride_bk
        if SOURCE_ORDER:
            # Programs walk SOURCE rows: the id load does not wait for the counts (its addresses
            # are known at launch), only the store does (row r goes to buffer row r - start). One
            # global-memory round trip less on the critical path of a launch-bound kernel (GATHERED
            # n=1 in a 61-layer CUDA graph on an H200: 1.29 us per layer with the dependent load,
            # 1.13 us this way; a plain copy 0.96 us). Used when start is 0 (LOCAL, rank 0) or the
            # source is small.
            ids = tl.load(
                ids_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :] * stride_ik,
                mask=(rows < n_src)[:, None] & col_ok,
            )
            start, c_eff, flags = rows_window(
                counts_ptr, sizes_ptr, dp_rank, n_first, n_src, n_dst, S_PAD, HAS_OFFSET
            )
            dst_rows = rows - start
            ok = (dst_rows >= 0) & (dst_rows < c_eff)
            tl.store(
                layer_base + dst_rows.to(tl.int64)[:, None] * stride_bm,
                ids.to(buf_ptr.dtype.element_ty),
                mask=ok[:, None] & col_ok,
            )
            # last: a branch with atomics, which nothing above should wait behind
            if pid == 0:
                record_faults(errors_ptr, flags)
        else:
            # Programs walk DESTINATION rows (large gathers: read only this rank's block).
            start, c_eff, flags = rows_window(
                counts_ptr, sizes_ptr, dp_rank, n_first, n_src, n_dst, S_PAD, HAS_OFFSET
            )
            if row0 < c_eff:
                mask = (rows < c_eff)[:, None] & col_ok
                src = (start + rows).to(tl.int64)
                ids = tl.load(ids_ptr + src[:, None] * stride_im + cols[None, :] * stride_ik, mask=mask)
                tl.store(
                    layer_base + rows.to(tl.int64)[:, None] * stride_bm,
                    ids.to(buf_ptr.dtype.element_ty),
                    mask=mask,
                )
            if pid == 0:
                record_faults(errors_ptr, flags)


def capture_rows_triton(
    buffer: torch.Tensor,
    topk_ids: torch.Tensor,
    token_counts: torch.Tensor,
    sizes: torch.Tensor,
    errors: torch.Tensor,
    layer_id: int,
    dp_rank: int,
    n_first: int,
) -> None:
    """Launches the slicing kernel (validated arguments assumed; see ``capture_routing``).

    buffer: (max_tokens, num_layers, top_k) int16/int32/int64 - written in place, rows [0, c_eff)
    topk_ids: (n, top_k) integer - source rows
    token_counts: (dp_size,) int32 - real tokens of each DP rank, read on the device
    sizes: (S,) int32 - per-rank (GATHERED) or per-shard (SHARDED) row counts; the first ``n_first``
        entries precede this rank's block
    errors: (2,) int32 - fault counter, see :mod:`moe_ops.capture.errors`
    """
    n_src, top_k = topk_ids.shape
    n_dst = buffer.shape[0]
    k_pad = next_power_of_2(top_k)
    # Walk source rows when that reads nothing extra (this rank's block starts at row 0) or little
    # (the whole source is at most 8 tiles of 1024 ids); otherwise walk this rank's window only.
    source_order = n_first == 0 or n_src * k_pad <= 8 * _TILE_ELEMENTS
    rows = n_src if source_order else min(n_src, n_dst)
    block_m, num_warps = launch_config(rows, k_pad)
    # At least one program, so a call whose counts overflow an empty source still records its fault.
    grid = (max(1, triton.cdiv(rows, block_m)),)
    _capture_rows_kernel[grid](
        buffer,
        topk_ids,
        token_counts,
        sizes,
        errors,
        n_src,
        n_dst,
        layer_id,
        dp_rank,
        n_first,
        buffer.stride(0),
        buffer.stride(1),
        buffer.stride(2),
        topk_ids.stride(0),
        topk_ids.stride(1),
        top_k,
        K_PAD=k_pad,
        BLOCK_M=block_m,
        S_PAD=next_power_of_2(sizes.shape[0]),
        SOURCE_ORDER=source_order,
        HAS_OFFSET=n_first > 0,
        num_warps=num_warps,
    )


# reference
def capture_rows_torch(
    buffer: torch.Tensor,
    topk_ids: torch.Tensor,
    token_counts: torch.Tensor,
    sizes: torch.Tensor,
    errors: torch.Tensor,
    layer_id: int,
    dp_rank: int,
    n_first: int,
) -> None:
    """PyTorch twin of :func:`capture_rows_triton`: same arguments, same writes, same fault bits.

    Fixed shapes and no host reads (``torch.where`` over the static window ``min(n, rows)``), so it
    runs on any device and inside graphs; on CPU it is the capture op's implementation.
    """
    n_src = topk_ids.shape[0]
    n_dst = buffer.shape[0]
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

    window = min(n_src, n_dst)
    if window > 0:
        rows = torch.arange(window, device=buffer.device)
        src = (start + rows).clamp(max=n_src - 1)
        valid = (rows < c_eff)[:, None]
        dst = buffer[:window, layer_id]
        dst.copy_(torch.where(valid, topk_ids[src].to(buffer.dtype), dst))
    faulty = (flags != 0).to(errors.dtype)
    errors[0] += faulty
    errors[1] |= flags.to(errors.dtype)
