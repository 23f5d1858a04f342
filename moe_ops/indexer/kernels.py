"""The indexer capture kernel: copies this DP rank's rows of an indexer's top-k key positions into
one indexer layer of a positions buffer, checking each position.

Two implementations of one contract, as the routing capture has:

* :func:`capture_positions_triton` - the Triton kernel (CUDA; CPU tensors under ``TRITON_INTERPRET=1``);
* :func:`capture_positions_torch` - its PyTorch reference twin (the CPU path, and the test oracle).

Contract (both): with ``(start, c_eff)`` from :mod:`moe_ops.capture.window` (the routing capture's
row rule, the same four layouts), ``buffer[r, layer_id, :] = positions[start + r, :]`` for
``r < c_eff``, except that

* -1 is "no position" (a query that sees fewer than k keys: DSA pads its top-k with -1) and is
  stored as -1 without a fault;
* a position below -1, or at or beyond its row's key count (``min(kv_lens[start + r], 2**31)``
  when ``kv_lens`` is given, else 2**31: the int32 buffer's range) is faulty, counted once
  (FAULT_BAD_ID);
* with ``UNIQUE``, a position that already occurs in an earlier column of the same row is faulty,
  counted once per repeat (FAULT_DUPLICATE; the first occurrence is not);
* a row with any faulty position is stored as all -1: no record (the trainer selects that row
  live). Not a shorter set: -1 is DSA's padding too, so a row with its faulty positions blanked
  would replay as a valid, smaller choice.

Every other element of ``buffer`` keeps its value. Window faults and the layer stamp are recorded
as the routing capture records them (:func:`moe_ops.capture.kernels.record_faults`).

Duplicates are found by sorting: each row's keys ``position * K_PAD + column`` (no position and the
padding columns sort last) are sorted, a key whose position equals its left neighbour's is a
repeat, and a second sort of ``column * 2 + repeat`` puts the flags back in column order. Two sorts
of K_PAD int64 keys per row; without ``UNIQUE`` the kernel is a checked copy.
"""

from __future__ import annotations

import functools

import torch

from .._runtime.launcher import KernelLauncher
from .._runtime.library import identity
from .._runtime.triton import HAS_TRITON, next_power_of_2
from ..capture.errors import cpu_counter_lock
from ..capture.kernels import add_faults, fault_delta, has_symbols, record_stamp_torch, size_hint
from ..capture.spec import kernel_args, kernel_constexprs
from ..capture.window import rows_window_torch

__all__ = ["POSITION_LIMIT", "capture_positions_torch", "capture_positions_triton", "duplicates_torch"]

# positions are int32 in every engine (SGLang's, vLLM's and FlashMLA's sparse indices): the
# largest one a buffer holds, and the bound of a row without kv_lens
POSITION_LIMIT = (1 << 31) - 1
# up to 4096 positions per program (one row at k = 2048 or 4096, 8 rows at k = 512): the two
# sorts keep a row's keys in registers
_TILE_ELEMENTS = 4096


def _launch_config(window: int, k_pad: int) -> tuple[int, int]:
    block_m = max(1, min(_TILE_ELEMENTS // k_pad, next_power_of_2(window)))
    return block_m, 4 if k_pad * block_m <= 1024 else 8


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..capture.errors import FAULT_DUPLICATE, FAULT_SLOT
    from ..capture.kernels import record_bad_ids, record_faults, record_stamp
    from ..capture.window import rows_window

    _DUP_SLOT = tl.constexpr(FAULT_SLOT[FAULT_DUPLICATE])
    # sorts after every real position (< 2**31): no position, a refused one and padding columns
    _NONE_KEY = tl.constexpr(1 << 31)
    _POSITION_END = tl.constexpr(POSITION_LIMIT + 1)

    @triton.jit
    def repeated_positions(pos, cols, K_PAD: tl.constexpr):
        """(BLOCK_M, K_PAD) bool: where ``pos`` (int64, -1 for none) repeats a position of an
        earlier column of its row. See the module docstring for the two sorts."""
        key = tl.where(pos >= 0, pos, _NONE_KEY) * K_PAD + cols[None, :]
        ordered = tl.sort(key, dim=1)
        position = ordered // K_PAD
        left = tl.maximum(cols - 1, 0)
        left_pos = tl.gather(ordered, tl.broadcast_to(left[None, :], ordered.shape), axis=1) // K_PAD
        repeat = (cols[None, :] > 0) & (position == left_pos) & (position != _NONE_KEY)
        back = tl.sort((ordered % K_PAD) * 2 + repeat.to(tl.int64), dim=1)
        return (back % 2) != 0

    @triton.jit
    def record_duplicates(errors_ptr, dup):
        """As :func:`moe_ops.capture.kernels.record_bad_ids`, for repeated positions."""
        tl.atomic_add(errors_ptr + _DUP_SLOT + dup.to(tl.int32) * 0, dup.to(tl.int32), mask=dup)

    # As the routing capture's kernel: counts, layer and strides are runtime values (no recompile
    # per layer or batch); see moe_ops.capture.kernels for the reasons.
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
            "stride_pm",
            "stride_len",
            "n_physical",
            "n_logical",
        ]
    )
    def _capture_positions_kernel(
        pos_ptr,
        lens_ptr,
        # the capture's pointers: moe_ops.capture.spec.KERNEL_POINTERS, in its order
        buf_ptr,
        wbuf_ptr,
        counts_ptr,
        sizes_ptr,
        errors_ptr,
        stamps_ptr,
        step_ptr,
        map_ptr,
        n_src,
        stride_pm,
        stride_pk,
        stride_len,
        top_k,
        # the capture's scalars: moe_ops.capture.spec.KERNEL_SCALARS, in its order
        n_dst,
        layer_id,
        dp_rank,
        n_first,
        stride_bm,
        stride_bl,
        stride_bk,
        stride_vm,
        stride_vl,
        stride_vk,
        stride_c,
        stride_s,
        n_physical,
        n_logical,
        stride_map,
        K_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HAS_LENS: tl.constexpr,
        UNIQUE: tl.constexpr,
        S_PAD: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        STAMP: tl.constexpr,
        WEIGHTS: tl.constexpr,
        EXPERT_MAP: tl.constexpr,
    ):
        # WEIGHTS and EXPERT_MAP are always False here (the indexer records positions only)
        pid = tl.program_id(0)
        row0 = pid * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, K_PAD)
        col_ok = (cols < top_k)[None, :]
        count = tl.load(counts_ptr + tl.cast(dp_rank, tl.int64) * stride_c)
        if HAS_OFFSET:
            s_idx = tl.arange(0, S_PAD)
            sizes = tl.load(sizes_ptr + s_idx.to(tl.int64) * stride_s, mask=s_idx < n_first, other=0)
        else:
            sizes = count  # unused: start is 0
        # Programs walk DESTINATION rows: the positions are large (k x 4 bytes a row), so only this
        # rank's block is read.
        start, c_eff, flags = rows_window(count, sizes, n_src, n_dst, HAS_OFFSET)
        if row0 < c_eff:
            row_ok = rows < c_eff
            mask = row_ok[:, None] & col_ok
            src = start + rows.to(tl.int64)
            pos = tl.load(
                pos_ptr + src[:, None] * stride_pm + cols[None, :] * stride_pk, mask=mask, other=-1
            ).to(tl.int64)
            if HAS_LENS:
                lens = tl.load(lens_ptr + src * stride_len, mask=row_ok, other=0).to(tl.int64)
                bound = tl.minimum(lens, _POSITION_END)[:, None]
            else:
                bound = _POSITION_END
            # -1 is no position whatever the bound (a negative key count refuses every real one)
            bad = mask & ((pos < -1) | ((pos >= bound) & (pos != -1)))
            pos = tl.where(bad, -1, pos)
            faulty = bad
            if UNIQUE:
                dup = repeated_positions(pos, cols, K_PAD) & mask
                faulty = faulty | dup
            # a row with a faulty position is stored as no record (all -1), not as a shorter set:
            # -1 is also DSA's padding, so a truncated row would replay as a valid smaller choice
            row_faulty = tl.max(faulty.to(tl.int32), axis=1) > 0
            pos = tl.where(row_faulty[:, None], -1, pos)
            dst = buf_ptr + tl.cast(layer_id, tl.int64) * stride_bl + rows.to(tl.int64)[:, None] * stride_bm
            tl.store(dst + cols[None, :] * stride_bk, pos.to(buf_ptr.dtype.element_ty), mask=mask)
            record_bad_ids(errors_ptr, bad)
            if UNIQUE:
                record_duplicates(errors_ptr, dup)
        if pid == 0:
            record_faults(errors_ptr, flags)
            if STAMP:
                record_stamp(stamps_ptr, step_ptr, layer_id)


def _plan(
    n_src: int,
    top_k: int,
    n_dst: int,
    n_first: int,
    n_sizes: int,
    stamped: bool,
    has_lens: bool,
    unique: bool,
) -> tuple[tuple[int], int, dict]:
    """(grid, warps, constexprs) of one launch: host arithmetic on shapes only (SymInts allowed,
    as the routing capture's plan: the tile size is chosen from the traced example, the grid stays
    an expression in the sizes)."""
    k_pad = next_power_of_2(max(top_k, 1))
    rows = torch.sym_min(n_src, n_dst)
    block_m, num_warps = _launch_config(size_hint(rows), k_pad)
    # at least one program, so a call whose counts overflow an empty source still records its fault
    grid = (torch.sym_max(1, -(-rows // block_m)),)
    constexprs = dict(
        K_PAD=k_pad,
        BLOCK_M=block_m,
        HAS_LENS=bool(has_lens),
        UNIQUE=bool(unique),
        **kernel_constexprs(n_sizes, n_first, stamped),
    )
    return grid, num_warps, constexprs


_cached_plan = functools.lru_cache(maxsize=4096)(_plan)


def capture_positions_triton(
    buffer: torch.Tensor,
    positions: torch.Tensor,
    kv_lens: torch.Tensor,
    weights_buffer: torch.Tensor,
    token_counts: torch.Tensor,
    sizes: torch.Tensor,
    errors: torch.Tensor,
    stamps: torch.Tensor,
    step: torch.Tensor,
    expert_map: torch.Tensor,
    layer_id: int,
    dp_rank: int,
    n_first: int,
    num_logical_experts: int,
    check_duplicates: bool = True,
    *,
    wrap=identity,
) -> None:
    """Launches the indexer capture kernel (validated arguments assumed; see
    :func:`moe_ops.indexer.capture_indexer`), in the op's argument order
    (:data:`moe_ops.indexer.op.CAPTURE_INDEXER_OP`).

    positions: (n, k) int32/int64, any strides - the indexer's top-k key positions, -1 for none
    kv_lens: (n,) int32/int64, any stride - each source row's key count; or (0,): no per-row bound
    the others: a :class:`~moe_ops.capture.spec.CaptureSpec`'s fields (no weights, no map)
    wrap: applied to the ``@triton.jit`` kernel before the launch (``torch.library.wrap_triton``
        when torch.compile traces the op)
    """
    n_src, top_k = positions.shape
    n_dst = buffer.shape[0]
    has_lens = kv_lens.dim() == 1 and kv_lens.shape[0] == n_src and n_src > 0
    plan_args = (
        n_src,
        top_k,
        n_dst,
        n_first,
        sizes.shape[0],
        stamps.numel() > 0,
        has_lens,
        bool(check_duplicates),
    )
    plan = _plan if has_symbols(*plan_args) else _cached_plan
    grid, num_warps, constexprs = plan(*plan_args)
    stride_pm, stride_pk = positions.stride()
    stride_len = kv_lens.stride(0) if kv_lens.dim() == 1 else 0
    args = kernel_args(
        (positions, kv_lens),
        (n_src, stride_pm, stride_pk, stride_len, top_k),
        buffer,
        weights_buffer,
        token_counts,
        sizes,
        errors,
        stamps,
        step,
        expert_map,
        layer_id,
        dp_rank,
        n_first,
        num_logical_experts,
    )
    if buffer.device.type == "cpu":
        # interpreted Triton updates the fault counter in Python: under the CPU counters' lock
        with cpu_counter_lock(buffer.device):
            wrap(_capture_positions_kernel)[grid](*args, **constexprs, num_warps=num_warps)
    elif wrap is identity:
        _launcher()(grid, args, constexprs, num_warps)
    else:
        wrap(_capture_positions_kernel)[grid](*args, **constexprs, num_warps=num_warps)


@functools.cache
def _launcher() -> KernelLauncher:
    return KernelLauncher(_capture_positions_kernel)


# reference
def duplicates_torch(pos: torch.Tensor) -> torch.Tensor:
    """Twin of the kernel's repeat test: (rows, k) bool, where ``pos`` (int64, -1 for none) repeats
    a position of an earlier column of its row (the first occurrence is kept)."""
    if pos.numel() == 0:
        return torch.zeros_like(pos, dtype=torch.bool)
    key = torch.where(pos >= 0, pos, POSITION_LIMIT + 1)
    ordered, order = torch.sort(key, dim=1, stable=True)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] <= POSITION_LIMIT)
    return torch.zeros_like(repeat).scatter_(1, order, repeat)


def capture_positions_torch(
    buffer: torch.Tensor,
    positions: torch.Tensor,
    kv_lens: torch.Tensor,
    weights_buffer: torch.Tensor,
    token_counts: torch.Tensor,
    sizes: torch.Tensor,
    errors: torch.Tensor,
    stamps: torch.Tensor,
    step: torch.Tensor,
    expert_map: torch.Tensor,
    layer_id: int,
    dp_rank: int,
    n_first: int,
    num_logical_experts: int,
    check_duplicates: bool = True,
) -> None:
    """PyTorch twin of :func:`capture_positions_triton`: same arguments, same writes, same faults.

    Fixed shapes and no host reads (``torch.where`` over the static window ``min(n, rows)``)."""
    n_src = positions.shape[0]
    n_dst = buffer.shape[0]
    start, c_eff, flags = rows_window_torch(token_counts, sizes, dp_rank, n_first, n_src, n_dst)
    n_bad = n_dup = 0
    window = min(n_src, n_dst)
    with cpu_counter_lock(buffer.device):
        if window > 0:
            rows = torch.arange(window, device=buffer.device)
            src = (start + rows).clamp(max=n_src - 1)
            valid = rows < c_eff
            pos = positions[src].to(torch.int64)
            if kv_lens.dim() == 1 and kv_lens.shape[0] == n_src:
                bound = kv_lens[src].to(torch.int64).clamp(max=POSITION_LIMIT + 1)[:, None]
            else:
                bound = POSITION_LIMIT + 1
            bad = (pos < -1) | ((pos >= bound) & (pos != -1))
            pos = torch.where(bad, -1, pos)
            n_bad = (bad & valid[:, None]).sum()
            faulty = bad
            if check_duplicates:
                dup = duplicates_torch(pos)
                faulty = faulty | dup
                n_dup = (dup & valid[:, None]).sum()
            pos = torch.where(faulty.any(1, keepdim=True), -1, pos)
            layer = buffer[:window, layer_id]
            layer.copy_(torch.where(valid[:, None], pos.to(buffer.dtype), layer))
        add_faults(errors, fault_delta(flags, n_bad, 0, n_dup))
        record_stamp_torch(stamps, step, layer_id)
