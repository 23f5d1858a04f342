"""The indexer's own top-k selection as a Triton kernel that records as it selects (the DSA rule),
as the router with fused capture does for experts.

``select_indexer_topk(scores, k, kv_lens=..., target=...)``: per query row of ``scores`` (n, T),
the k positions of the largest scores among the row's keys ``[0, min(kv_lens[row], T))`` (a causal
mask and the sequence's end: a position beyond them is never chosen), ties to the lower position,
returned ascending (a set: see docs/indexer.md), -1 after them where the row has fewer than k keys.
With a capture ``target`` (an indexer buffer's :class:`~moe_ops.capture.target.CaptureTarget`) the
same launch writes this rank's rows into the record with the routing capture's row rule.

Scores are ordered as numbers (float32; bfloat16/float16 widened exactly; -0.0 ties with 0.0), a NaN
below every number (never chosen before a real score). The selection is exact: the k-th largest key
is found by a binary search over its 32 bits (each step counts the row's keys at or above a
candidate), then one pass keeps the keys above it and, of the keys equal to it, the first ones by
position. 33 passes over a row of T scores, one program per row.

* :func:`select_topk_triton` - the kernel's launcher (CUDA; CPU tensors under ``TRITON_INTERPRET=1``);
* :func:`select_topk_torch` - its PyTorch twin (a stable sort; the CPU path and the test oracle).
"""

from __future__ import annotations

import functools

import torch

from .._runtime.launcher import KernelLauncher
from .._runtime.library import destination_op, identity, reference_op
from .._runtime.triton import HAS_TRITON, next_power_of_2
from ..capture.errors import cpu_counter_lock
from ..capture.kernels import add_faults, fault_delta, record_stamp_torch
from ..capture.spec import Arg, CaptureSpec, OpArgs, absent_kernel_args
from ..capture.target import CaptureTarget
from ..capture.window import rows_window_torch

__all__ = ["select_indexer_topk", "select_topk_torch", "select_topk_triton"]

_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# scores per step of a pass
_BLOCK_T = 1024
_NO_CAPTURE = dict(S_PAD=1, HAS_OFFSET=False, STAMP=False, WEIGHTS=False, EXPERT_MAP=False)


def orderable_keys_torch(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) ordered as the float32 values of ``scores``: equal numbers equal
    keys (-0.0 is 0.0), NaN lowest (0)."""
    bits = scores.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = torch.where(scores == 0, 0x80000000, key)
    return torch.where(scores.isnan(), 0, key)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..capture.kernels import record_faults, record_stamp
    from ..capture.window import rows_window

    @triton.jit
    def orderable_keys(s):
        """Triton twin of :func:`orderable_keys_torch` (int64)."""
        f = s.to(tl.float32)
        bits = f.to(tl.uint32, bitcast=True).to(tl.int64)
        key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
        key = tl.where(f == 0, 0x80000000, key)
        return tl.where(f != f, 0, key)

    @triton.jit(do_not_specialize=["n_rows", "n_keys", "top_k", "stride_sm", "stride_len", "stride_om"])
    def _select_kernel(
        scores_ptr,
        lens_ptr,
        out_ptr,
        # the capture's pointers: moe_ops.capture.spec.KERNEL_POINTERS, in its order
        buf_ptr,
        wbuf_ptr,
        counts_ptr,
        sizes_ptr,
        errors_ptr,
        stamps_ptr,
        step_ptr,
        map_ptr,
        n_rows,
        n_keys,
        top_k,
        stride_sm,
        stride_st,
        stride_len,
        stride_om,
        stride_ok,
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
        BLOCK_T: tl.constexpr,
        K_PAD: tl.constexpr,
        HAS_LENS: tl.constexpr,
        CAPTURE: tl.constexpr,
        S_PAD: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        STAMP: tl.constexpr,
        WEIGHTS: tl.constexpr,
        EXPERT_MAP: tl.constexpr,
    ):
        row = tl.program_id(0)
        live = row < n_rows
        row64 = tl.cast(row, tl.int64)
        if HAS_LENS:
            # HAS_LENS only with n_rows >= 1 entries: row 0 stands in for a program past the rows
            limit = tl.load(lens_ptr + tl.where(live, row64, 0) * stride_len).to(tl.int64)
            limit = tl.minimum(tl.maximum(limit, 0), n_keys)
        else:
            limit = tl.cast(n_keys, tl.int64)
        limit = tl.where(live, limit, 0)
        offs = tl.arange(0, BLOCK_T)
        cols = tl.arange(0, K_PAD)
        # `live` as vectors (a scalar predicate and'ed into a block mask is refused by the interpreter)
        live_t = (offs * 0 + row) < n_rows
        live_k = (cols * 0 + row) < n_rows
        base = scores_ptr + row64 * stride_sm
        # the k-th largest key: the largest v with count(key >= v) >= k (all keys when fewer)
        need = tl.minimum(tl.cast(top_k, tl.int64), limit)
        prefix = tl.cast(0, tl.int64)
        for step in range(32):
            bit = 31 - step
            candidate = prefix | (tl.cast(1, tl.int64) << bit)
            count = tl.cast(0, tl.int64)
            for start in range(0, n_keys, BLOCK_T):
                pos = start + offs
                ok = pos < limit
                key = orderable_keys(tl.load(base + pos.to(tl.int64) * stride_st, mask=ok, other=0.0))
                count += tl.sum(((key >= candidate) & ok).to(tl.int64), axis=0)
            prefix = tl.where(count >= need, candidate, prefix)
        # keys above the threshold, then ties by position, written in position order
        above_total = tl.cast(0, tl.int64)
        for start in range(0, n_keys, BLOCK_T):
            pos = start + offs
            ok = pos < limit
            key = orderable_keys(tl.load(base + pos.to(tl.int64) * stride_st, mask=ok, other=0.0))
            above_total += tl.sum(((key > prefix) & ok).to(tl.int64), axis=0)
        ties_wanted = need - above_total
        taken = tl.cast(0, tl.int64)
        ties_taken = tl.cast(0, tl.int64)
        if CAPTURE:
            count_c = tl.load(counts_ptr + tl.cast(dp_rank, tl.int64) * stride_c)
            if HAS_OFFSET:
                s_idx = tl.arange(0, S_PAD)
                sizes = tl.load(sizes_ptr + s_idx.to(tl.int64) * stride_s, mask=s_idx < n_first, other=0)
            else:
                sizes = count_c
            w_start, c_eff, flags = rows_window(count_c, sizes, n_rows, n_dst, HAS_OFFSET)
            dst = row64 - w_start
            dst_t = offs.to(tl.int64) * 0 + dst  # vectors, as live_t
            dst_k = cols.to(tl.int64) * 0 + dst
            in_window_t = (dst_t >= 0) & (dst_t < c_eff)
            in_window_k = (dst_k >= 0) & (dst_k < c_eff)
            buf_row = buf_ptr + tl.cast(layer_id, tl.int64) * stride_bl + dst * stride_bm
        for start in range(0, n_keys, BLOCK_T):
            pos = start + offs
            ok = pos < limit
            key = orderable_keys(tl.load(base + pos.to(tl.int64) * stride_st, mask=ok, other=0.0))
            tie = (key == prefix) & ok
            tie_rank = ties_taken + tl.cumsum(tie.to(tl.int64), axis=0) - tie.to(tl.int64)
            chosen = ((key > prefix) & ok) | (tie & (tie_rank < ties_wanted))
            slot = taken + tl.cumsum(chosen.to(tl.int64), axis=0) - chosen.to(tl.int64)
            tl.store(out_ptr + row64 * stride_om + slot * stride_ok, pos.to(tl.int32), mask=chosen & live_t)
            if CAPTURE:
                tl.store(
                    buf_row + slot * stride_bk,
                    pos.to(buf_ptr.dtype.element_ty),
                    mask=chosen & live_t & in_window_t,
                )
            taken += tl.sum(chosen.to(tl.int64), axis=0)
            ties_taken += tl.sum(tie.to(tl.int64), axis=0)
        # -1 after the chosen positions
        pad = (cols >= taken) & (cols < top_k)
        tl.store(
            out_ptr + row64 * stride_om + cols * stride_ok, tl.full([K_PAD], -1, tl.int32), mask=pad & live_k
        )
        if CAPTURE:
            tl.store(
                buf_row + cols * stride_bk,
                tl.full([K_PAD], -1, buf_ptr.dtype.element_ty),
                mask=pad & live_k & in_window_k,
            )
            if row == 0:
                record_faults(errors_ptr, flags)
                if STAMP:
                    record_stamp(stamps_ptr, step_ptr, layer_id)


def select_topk_triton(
    out: torch.Tensor,
    scores: torch.Tensor,
    kv_lens: torch.Tensor,
    capture: CaptureSpec | None = None,
    *,
    wrap=identity,
) -> None:
    """Launches the selection (validated arguments assumed; see :func:`select_indexer_topk`).

    out: (n, k) int32, written; scores: (n, T) float, any strides; kv_lens: (n,) int32/int64 or
    (0,): no per-row limit; capture: where to record this rank's rows, or None."""
    n_rows, n_keys = scores.shape
    top_k = out.shape[1]
    pointers = (scores, kv_lens, out)
    stride_len = kv_lens.stride(0) if kv_lens.dim() == 1 and kv_lens.numel() else 0
    scalars = (n_rows, n_keys, top_k, *scores.stride(), stride_len, *out.stride())
    if capture is None:
        if n_rows == 0:
            return
        args = absent_kernel_args(pointers, scalars, out, distinct=wrap is not identity)
        capture_constexprs = _NO_CAPTURE
        programs = n_rows
    else:
        args = capture.kernel_args(pointers, scalars)
        capture_constexprs = capture.kernel_constexprs()
        programs = torch.sym_max(n_rows, 1)  # a call over no rows still records its window fault
    constexprs = dict(
        BLOCK_T=_BLOCK_T if n_keys > 256 else max(16, next_power_of_2(n_keys)),
        K_PAD=next_power_of_2(max(top_k, 1)),
        HAS_LENS=bool(kv_lens.dim() == 1 and kv_lens.numel() > 0),
        CAPTURE=capture is not None,
        **capture_constexprs,
    )
    if scores.device.type == "cpu":
        with cpu_counter_lock(scores.device):
            wrap(_select_kernel)[(programs,)](*args, **constexprs, num_warps=4)
    elif wrap is identity:
        _launcher()((programs,), args, constexprs, 4)
    else:
        wrap(_select_kernel)[(programs,)](*args, **constexprs, num_warps=4)


@functools.cache
def _launcher() -> KernelLauncher:
    return KernelLauncher(_select_kernel)


# reference
def select_topk_torch(
    out: torch.Tensor,
    scores: torch.Tensor,
    kv_lens: torch.Tensor,
    capture: CaptureSpec | None = None,
) -> None:
    """PyTorch twin of :func:`select_topk_triton`: same arguments, same writes, same faults."""
    n_rows, n_keys = scores.shape
    top_k = out.shape[1]
    key = orderable_keys_torch(scores)
    pos = torch.arange(n_keys, device=scores.device)
    if kv_lens.dim() == 1 and kv_lens.numel() > 0:
        limit = kv_lens.to(torch.int64).clamp(0, n_keys)[:, None]
    else:
        limit = torch.full((n_rows, 1), n_keys, dtype=torch.int64, device=scores.device)
    allowed = pos[None, :] < limit
    key = torch.where(allowed, key, -1)
    # descending by key, ties by position (a stable sort of rows already in position order)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :top_k]
    taken = torch.gather(allowed, 1, order)
    chosen = torch.where(taken, order, n_keys).sort(dim=1).values
    rows = torch.where(chosen < n_keys, chosen, -1).to(torch.int32)
    if rows.shape[1] < top_k:
        rows = torch.cat([rows, rows.new_full((n_rows, top_k - rows.shape[1]), -1)], dim=1)
    out.copy_(rows)
    if capture is None:
        return
    spec = capture
    buffer = spec.buffer
    n_dst = buffer.shape[0]
    start, c_eff, flags = rows_window_torch(
        spec.token_counts, spec.sizes, spec.dp_rank, spec.n_first, n_rows, n_dst
    )
    window = min(n_rows, n_dst)
    with cpu_counter_lock(buffer.device):
        if window > 0:
            r = torch.arange(window, device=buffer.device)
            src = (start + r).clamp(max=n_rows - 1)
            layer = buffer[:window, spec.layer_id]
            layer.copy_(torch.where((r < c_eff)[:, None], rows[src].to(buffer.dtype), layer))
        add_faults(spec.errors, fault_delta(flags, 0))
        record_stamp_torch(spec.stamps, spec.step, spec.layer_id)


# moe_ops::select_indexer_topk_ (no capture) and ::select_indexer_topk_capture_ (the capture spec's
# arguments after the selection's, as the router's fused capture op takes them)
_SELECT_ARGS = (Arg("out", "Tensor", written=True), Arg("scores", "Tensor"), Arg("kv_lens", "Tensor"))
SELECT_CAPTURE_OP = OpArgs.fused(_SELECT_ARGS)


def _select(out: torch.Tensor, scores: torch.Tensor, kv_lens: torch.Tensor, *, wrap=identity) -> None:
    select_topk_triton(out, scores, kv_lens, None, wrap=wrap)


def _select_twin(out: torch.Tensor, scores: torch.Tensor, kv_lens: torch.Tensor) -> None:
    select_topk_torch(out, scores, kv_lens, None)


def _select_capture(*args, wrap=identity) -> None:
    host, spec = SELECT_CAPTURE_OP.split(args)
    select_topk_triton(*host, spec, wrap=wrap)


def _select_capture_twin(*args) -> None:
    host, spec = SELECT_CAPTURE_OP.split(args)
    select_topk_torch(*host, spec)


_KERNELS = (_select_kernel,) if HAS_TRITON else ()
_SELECT_SCHEMA = "(Tensor(a0!) out, Tensor scores, Tensor kv_lens) -> ()"
select_op = destination_op(
    "select_indexer_topk_",
    mutates=("out",),
    cuda=_select if HAS_TRITON else None,
    cpu=_select_twin,
    interpreted=_select if HAS_TRITON else None,
    traceable=_select if HAS_TRITON else None,
    kernels=_KERNELS,
    schema=_SELECT_SCHEMA,
)
select_reference_op = reference_op(
    "select_indexer_topk_", _select_twin, mutates=("out",), schema=_SELECT_SCHEMA
)
select_capture_op = destination_op(
    "select_indexer_topk_capture_",
    mutates=SELECT_CAPTURE_OP.mutates,
    cuda=_select_capture if HAS_TRITON else None,
    cpu=_select_capture_twin,
    interpreted=_select_capture if HAS_TRITON else None,
    traceable=_select_capture if HAS_TRITON else None,
    kernels=_KERNELS,
    schema=SELECT_CAPTURE_OP.schema(),
)
select_capture_reference_op = reference_op(
    "select_indexer_topk_capture_",
    _select_capture_twin,
    mutates=SELECT_CAPTURE_OP.mutates,
    schema=SELECT_CAPTURE_OP.schema(),
)


def select_indexer_topk(
    scores: torch.Tensor,
    k: int,
    *,
    kv_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    target: CaptureTarget | None = None,
) -> torch.Tensor:
    """The indexer's top-k positions of each query row (see the module docstring), recorded into
    ``target`` in the same launch when one is given.

    Args:
        scores: (n, T) float32/bfloat16/float16, any strides - the index scores of n query rows
            over T keys.
        k: positions per row (>= 1).
        kv_lens: (n,) int32/int64 on the scores' device, any stride - the keys each row may choose
            from (``[0, kv_lens[row])``, clamped to T); read on the device. None: all T.
        out: (n, k) int32 on the scores' device to write (destination-passing); None allocates.
        target: a :class:`~moe_ops.capture.target.CaptureTarget` of an int32 indexer buffer
            (max_tokens, num_indexer_layers, k), without weights or expert map - records this
            rank's rows (its layout's row rule), counts read on the device; None: no record.

    Returns ``out``. No host reads, no synchronisation: CUDA-graph capturable, traced by
    torch.compile. ValueError/TypeError naming the argument for bad input.
    """
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2 or scores.dtype not in _SCORE_DTYPES:
        raise ValueError(
            f"scores must be (n, T) float32/bfloat16/float16, got {scores.dtype} {tuple(scores.shape)}"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    n = scores.shape[0]
    if kv_lens is None:
        lens = scores.new_empty(0, dtype=torch.int32)
    else:
        if not isinstance(kv_lens, torch.Tensor) or kv_lens.dtype not in (torch.int32, torch.int64):
            raise ValueError("kv_lens must be an int32/int64 torch.Tensor or None")
        if kv_lens.shape != (n,) or kv_lens.device != scores.device:
            raise ValueError(
                f"kv_lens must be ({n},) on {scores.device}, got {tuple(kv_lens.shape)} on {kv_lens.device}"
            )
        lens = kv_lens
    if out is None:
        out = torch.empty((n, k), dtype=torch.int32, device=scores.device)
    elif (
        not isinstance(out, torch.Tensor)
        or out.shape != (n, k)
        or out.dtype != torch.int32
        or out.device != scores.device
    ):
        raise ValueError(f"out must be ({n}, {k}) int32 on {scores.device}")
    if target is None:
        select_op(out, scores, lens)
        return out
    if not isinstance(target, CaptureTarget):
        raise TypeError(f"target must be a CaptureTarget or None, got {type(target).__name__}")
    buffer = target.buffer
    if buffer.dtype != torch.int32 or buffer.shape[2] != k or target.has_weights or target.has_expert_map:
        raise ValueError(
            f"target must record into an int32 (max_tokens, num_indexer_layers, {k}) buffer without weights "
            f"or expert map, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    if buffer.device != scores.device:
        raise ValueError(
            f"target's buffer must be on the scores' device {scores.device}, got {buffer.device}"
        )
    select_capture_op(*SELECT_CAPTURE_OP.join((out, scores, lens), target.spec))
    return out
