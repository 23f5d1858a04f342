"""The router kernel family: route a block of tokens and, optionally, record the ids for replay.

Two implementations of one destination-passing contract:

* :func:`route_rows_triton` - one Triton kernel for all ten methods (CUDA; CPU tensors under
  ``TRITON_INTERPRET=1``), with the capture fused in;
* :func:`route_rows_torch` - its PyTorch reference twin (:mod:`moe_ops.route.reference`, then
  :func:`moe_ops.capture.kernels.capture_rows_torch`), the CPU path and the test oracle.

Contract (both): ``weights[t], ids[t]`` are token ``t``'s routing (see
:mod:`moe_ops.route.methods`). With a capture destination, ``buffer[r, layer_id] = ids[start + r]``
for ``r < c_eff``, where ``(start, c_eff)`` come from :func:`moe_ops.capture.kernels.rows_window`,
the capture op's own device-side offset rule, and faults are recorded the same way: the result is
bit-identical to routing and then calling ``capture_routing``.

Kernel layout: one program routes ``BLOCK_M`` tokens and holds their logits in registers as a
``(BLOCK_M, NG_PAD, G_PAD)`` tile (``NG_PAD = 1``, ``G_PAD = E`` rounded up to a power of two when
there is no grouping; padding is masked). Each selection key is packed with its expert index into
one int64 (order-preserving float bits, then ``IDX_MAX - index`` in the low 16 bits), so one integer
``max`` per round finds the best score and, among equal scores, the lowest index; the winner is
knocked out (-1) and the next round runs. DeepSeek-V3 groups use the same trick on the
``NG_PAD`` axis. The chosen logits are re-read (cache hits) to form the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import HAS_TRITON, interpreting, next_power_of_2
from ..capture.kernels import capture_rows_torch
from .methods import RoutingMethod
from .reference import SUM_EPSILON, route_reference

__all__ = [
    "TRITON_MAX_TILE",
    "FusedCapture",
    "launch_config",
    "route_rows_torch",
    "route_rows_triton",
    "tile_shape",
]

# Largest padded expert row the kernel holds in registers (NG_PAD * G_PAD); the packed index uses
# 16 bits, and 4096 logits per row are 32 per thread with the 4 warps launch_config gives them.
TRITON_MAX_TILE = 4096
# Launch configuration (see launch_config). A warp reduces a token's row with shuffles alone;
# with more warps Triton spreads the expert axis over them (warpsPerCTA [1, 1, W] for a
# (rows, 1, 256) tile, checked in the TTGIR), and every one of the top_k rounds then crosses shared
# memory and a barrier. So: one warp per program while a row fits (<= 32 logits per thread),
# more rows per program only for large batches, and at most 512 logits per warp then (ptxas for
# sm_90, DeepSeek-V3 tile: 1 row 78 registers, 2 rows 135, 4 rows 255 and spills).
_LOGITS_PER_WARP = 1024
_ROW_LOGITS = 512
# Rows per program grow once a batch exceeds this many programs (an H200 holds 132 SMs x 32
# one-warp blocks; a 4096-token DeepSeek-V3 batch is about one wave at 78 registers per thread).
_TARGET_PROGRAMS = 4096


@dataclass(frozen=True)
class FusedCapture:
    """Where the fused kernel records this rank's ids (arguments of the capture op, validated)."""

    # (max_tokens, num_layers, top_k) int16/int32/int64 - the replay buffer, written in place
    buffer: torch.Tensor
    # (dp_size,) int32 - real tokens of each DP rank, read on the device
    token_counts: torch.Tensor
    # (S,) int32 - shard_sizes (GATHERED/SHARDED) or token_counts; first n_first entries precede us
    sizes: torch.Tensor
    # (2,) int32 - the device fault counter of moe_ops.capture.errors
    errors: torch.Tensor
    # layer index in [0, num_layers)
    layer_id: int
    # index into token_counts
    dp_rank: int
    # number of leading sizes entries before this rank's rows (window_first_size)
    n_first: int


def tile_shape(num_experts: int, n_group: int) -> tuple[int, int]:
    """(NG_PAD, G_PAD): the padded (groups, experts per group) register tile of one token."""
    if n_group > 1:
        return next_power_of_2(n_group), next_power_of_2(num_experts // n_group)
    return 1, next_power_of_2(num_experts)


def launch_config(n_tokens: int, e_tile: int) -> tuple[int, int]:
    """(rows per program, warps) for ``n_tokens`` tokens of a padded expert row of ``e_tile``."""
    if interpreting():
        # The interpreter pays per program and per operation, hardly per element: few programs.
        return min(next_power_of_2(n_tokens), 64), 1
    num_warps = min(8, max(1, e_tile // _LOGITS_PER_WARP))
    rows_cap = max(1, _ROW_LOGITS // e_tile)
    block_m = min(rows_cap, next_power_of_2(-(-n_tokens // _TARGET_PROGRAMS)))
    return block_m, num_warps


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..capture.kernels import record_faults, rows_window

    # Triton kernels may only read globals that are constexpr.
    _DEFAULT = tl.constexpr(int(RoutingMethod.DEFAULT))
    _RENORMALIZE = tl.constexpr(int(RoutingMethod.RENORMALIZE))
    _DEEPSEEK_V3 = tl.constexpr(int(RoutingMethod.DEEPSEEK_V3))
    _RENORMALIZE_NAIVE = tl.constexpr(int(RoutingMethod.RENORMALIZE_NAIVE))
    _TOPK = tl.constexpr(int(RoutingMethod.TOPK))
    _SIGMOID_RENORM = tl.constexpr(int(RoutingMethod.SIGMOID_RENORM))
    _MINIMAX2 = tl.constexpr(int(RoutingMethod.MINIMAX2))
    _SUM_EPSILON = tl.constexpr(SUM_EPSILON)
    _IDX_BITS = tl.constexpr(16)
    _IDX_MAX = tl.constexpr(65535)

    @triton.jit
    def _pack(key, index, valid):
        """int64 whose order is (key, -index); -1 where not valid (below every packed value).

        key: canonical float32 (no NaN, no -0.0). The float's bits are made order-preserving as a
        signed int32 (negative floats have their magnitude bits flipped), shifted to [0, 2^32) and
        placed above the 16 index bits, which hold ``IDX_MAX - index`` (= ``index ^ IDX_MAX``):
        every valid value is >= 0.
        """
        bits = key.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        # (- -2^31 keeps every constant int32: Triton would type 2^31 as uint32)
        packed = ((ordered.to(tl.int64) - (-2147483648)) << _IDX_BITS) | (index ^ _IDX_MAX).to(tl.int64)
        return tl.where(valid, packed, -1)

    @triton.jit
    def _unpack_key(packed):
        """The float32 key of a packed value (inverse of :func:`_pack` on valid values)."""
        ordered = ((packed >> _IDX_BITS) + (-2147483648)).to(tl.int32)
        bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _canonical(key):
        """NaN -> -inf, -0.0 -> 0.0 (the reference's rule)."""
        key = tl.where(key != key, float("-inf"), key)
        return tl.where(key == 0.0, 0.0, key)

    # Nothing that changes per step or per layer is a specialisation key: the token count, the
    # capture window's arguments and the row strides are runtime ints, and so are top_k and the
    # group shape (they only bound loops and masks; their powers of two are the constexprs).
    @triton.jit(
        do_not_specialize=[
            "n_tokens",
            "group_size",
            "n_group",
            "top_k",
            "topk_group",
            "stride_lm",
            "stride_wm",
            "stride_im",
            "n_dst",
            "layer_id",
            "dp_rank",
            "n_first",
            "stride_bm",
            "stride_bl",
        ]
    )
    def _route_kernel(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        buf_ptr,
        counts_ptr,
        sizes_ptr,
        errors_ptr,
        n_tokens,
        group_size,
        n_group,
        top_k,
        topk_group,
        scale,
        stride_lm,
        stride_le,
        stride_wm,
        stride_wk,
        stride_im,
        stride_ik,
        n_dst,
        layer_id,
        dp_rank,
        n_first,
        stride_bm,
        stride_bl,
        stride_bk,
        METHOD: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GROUPED: tl.constexpr,
        CAPTURE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        NG_PAD: tl.constexpr,
        G_PAD: tl.constexpr,
        K_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_tokens
        if CAPTURE:
            # The capture op's window, computed here exactly as there; its loads overlap the
            # logits load below.
            start, c_eff, flags = rows_window(
                counts_ptr, sizes_ptr, dp_rank, n_first, n_tokens, n_dst, S_PAD, HAS_OFFSET
            )
            if pid == 0:
                record_faults(errors_ptr, flags)
        else:
            start = 0
            c_eff = 0

        grp = tl.arange(0, NG_PAD)
        col = tl.arange(0, G_PAD)
        expert = grp[:, None] * group_size + col[None, :]  # (NG_PAD, G_PAD) global expert index
        expert_ok = (grp[:, None] < n_group) & (col[None, :] < group_size)
        expert3 = expert[None, :, :]
        ok3 = row_ok[:, None, None] & expert_ok[None, :, :]
        row_off = rows.to(tl.int64) * stride_lm
        x = tl.load(logits_ptr + row_off[:, None, None] + expert3 * stride_le, mask=ok3, other=0.0)
        x = x.to(tl.float32)

        if METHOD == _DEEPSEEK_V3 or METHOD == _MINIMAX2:  # noqa: SIM109 - no `in` in Triton
            key = tl.sigmoid(x)
            if HAS_BIAS:
                b = tl.load(bias_ptr + expert, mask=expert_ok, other=0.0).to(tl.float32)
                key = key + b[None, :, :]
        else:
            key = x  # softmax and sigmoid keep the order of the logits
        packed = _pack(_canonical(key), expert3, ok3)

        if GROUPED:
            # group score = sum of the group's two best keys (one key if the group has one expert)
            top1 = tl.max(packed, axis=2)
            top2 = tl.max(tl.where(packed == top1[:, :, None], -1, packed), axis=2)
            score = tl.where(top2 >= 0, _unpack_key(top1) + _unpack_key(top2), _unpack_key(top1))
            grp_ok = row_ok[:, None] & (grp[None, :] < n_group)
            gpacked = _pack(_canonical(score), grp[None, :], grp_ok)
            kept = tl.zeros([BLOCK_M, NG_PAD], dtype=tl.int32)
            for _ in range(topk_group):
                best = tl.max(gpacked, axis=1)
                hit = gpacked == best[:, None]
                kept = tl.where(hit, 1, kept)
                gpacked = tl.where(hit, -1, gpacked)
            packed = tl.where(kept[:, :, None] != 0, packed, -1)

        kcol = tl.arange(0, K_PAD)
        ids = tl.zeros([BLOCK_M, K_PAD], dtype=tl.int32)
        for i in range(top_k):
            # groups first: with lanes along the experts of a group, that axis is in-thread, and
            # the lane reduction (two redux.sync per int64 on sm_90) then runs once, not per group
            best = tl.max(tl.max(packed, axis=1), axis=1)
            ids = tl.where(kcol[None, :] == i, ((best & _IDX_MAX) ^ _IDX_MAX).to(tl.int32)[:, None], ids)
            packed = tl.where(packed == best[:, None, None], -1, packed)

        k_ok = kcol[None, :] < top_k
        out_ok = row_ok[:, None] & k_ok
        xs = tl.load(logits_ptr + row_off[:, None] + ids.to(tl.int64) * stride_le, mask=out_ok, other=0.0)
        xs = xs.to(tl.float32)
        if METHOD == _TOPK:
            w = xs
        elif METHOD == _DEFAULT:
            # softmax over every expert, read at the chosen ones
            x_max = tl.max(tl.max(tl.where(ok3, x, float("-inf")), axis=2), axis=1)
            x_max = tl.where(row_ok, x_max, 0.0)
            z = tl.sum(tl.sum(tl.where(ok3, tl.exp(x - x_max[:, None, None]), 0.0), axis=2), axis=1)
            z = tl.where(row_ok, z, 1.0)
            w = tl.exp(xs - x_max[:, None]) / z[:, None]
        elif METHOD == _RENORMALIZE or METHOD == _RENORMALIZE_NAIVE:  # noqa: SIM109 - no `in` in Triton
            # softmax over the chosen (== softmax, pick, renormalise)
            xs_max = tl.max(tl.where(out_ok, xs, float("-inf")), axis=1)
            xs_max = tl.where(row_ok, xs_max, 0.0)
            ex = tl.where(out_ok, tl.exp(xs - xs_max[:, None]), 0.0)
            w = ex / tl.where(row_ok, tl.sum(ex, axis=1), 1.0)[:, None]
        else:
            s = tl.sigmoid(xs)
            total = tl.sum(tl.where(out_ok, s, 0.0), axis=1)
            if METHOD == _DEEPSEEK_V3 or METHOD == _MINIMAX2:  # noqa: SIM109 - no `in` in Triton
                w = s * scale / (total + _SUM_EPSILON)[:, None]
            elif METHOD == _SIGMOID_RENORM:
                w = s / tl.maximum(total, _SUM_EPSILON)[:, None]
            else:  # LLAMA4, SIGMOID, TOPK_SIGMOID
                w = s

        rows64 = rows.to(tl.int64)
        tl.store(weights_ptr + rows64[:, None] * stride_wm + kcol[None, :] * stride_wk, w, mask=out_ok)
        tl.store(ids_ptr + rows64[:, None] * stride_im + kcol[None, :] * stride_ik, ids, mask=out_ok)
        if CAPTURE:
            mine = (rows >= start) & (rows < start + c_eff)
            dst = buf_ptr + layer_id.to(tl.int64) * stride_bl + (rows64 - start)[:, None] * stride_bm
            dst += kcol[None, :] * stride_bk
            tl.store(dst, ids.to(buf_ptr.dtype.element_ty), mask=mine[:, None] & k_ok)


def route_rows_triton(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    method: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    capture: FusedCapture | None = None,
    *,
    block_m: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Launches the router kernel (validated arguments assumed; see ``moe_ops.route``).

    router_logits: (n, E) float32/bf16/fp16 - router outputs, read once
    bias: (E,) float or None - DEEPSEEK_V3/MINIMAX2 selection bias
    weights: (n, top_k) float32 - written
    ids: (n, top_k) int32 - written
    capture: where to record this rank's ids, or None
    block_m, num_warps: override :func:`launch_config` (tests and tuning)

    One launch, no host reads, no allocation: CUDA-graph capturable.
    """
    n_tokens, num_experts = router_logits.shape
    top_k = ids.shape[1]
    ng_pad, g_pad = tile_shape(num_experts, n_group)
    default_m, default_warps = launch_config(n_tokens, ng_pad * g_pad)
    block_m = block_m or default_m
    num_warps = num_warps or default_warps
    programs = triton.cdiv(n_tokens, block_m)
    if capture is None:
        if programs == 0:
            return
        buf, counts, sizes, errors = ids, ids, ids, ids  # never read: CAPTURE is False
        n_dst = layer_id = dp_rank = n_first = 0
        stride_bm = stride_bl = stride_bk = 0
        s_pad = 1
    else:
        # At least one program, so a call whose counts overflow an empty batch still records its fault.
        programs = max(programs, 1)
        buf, counts, sizes, errors = capture.buffer, capture.token_counts, capture.sizes, capture.errors
        n_dst, layer_id, dp_rank, n_first = buf.shape[0], capture.layer_id, capture.dp_rank, capture.n_first
        stride_bm, stride_bl, stride_bk = buf.stride()
        s_pad = next_power_of_2(sizes.shape[0])
    _route_kernel[(programs,)](
        router_logits,
        router_logits if bias is None else bias,
        weights,
        ids,
        buf,
        counts,
        sizes,
        errors,
        n_tokens,
        num_experts // n_group,
        n_group,
        top_k,
        topk_group,
        float(routed_scaling_factor),
        router_logits.stride(0),
        router_logits.stride(1),
        weights.stride(0),
        weights.stride(1),
        ids.stride(0),
        ids.stride(1),
        n_dst,
        layer_id,
        dp_rank,
        n_first,
        stride_bm,
        stride_bl,
        stride_bk,
        METHOD=int(method),
        HAS_BIAS=bias is not None,
        GROUPED=n_group > 1,
        CAPTURE=capture is not None,
        BLOCK_M=block_m,
        NG_PAD=ng_pad,
        G_PAD=g_pad,
        K_PAD=next_power_of_2(top_k),
        S_PAD=s_pad,
        HAS_OFFSET=n_first > 0,
        num_warps=num_warps,
    )


# reference
def route_rows_torch(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    method: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    capture: FusedCapture | None = None,
) -> None:
    """PyTorch twin of :func:`route_rows_triton`: same arguments, same writes, same fault bits.

    Routes in float32 with :func:`moe_ops.route.reference.route_reference`, then records with the
    capture op's own twin. No host reads; allocates its intermediates (it is the CPU path and the
    oracle, not the fast path).
    """
    ref_weights, ref_ids = route_reference(
        router_logits,
        ids.shape[1],
        RoutingMethod(method),
        bias,
        n_group,
        topk_group,
        routed_scaling_factor,
        dtype=torch.float32,
    )
    weights.copy_(ref_weights)
    ids.copy_(ref_ids)
    if capture is not None:
        capture_rows_torch(
            capture.buffer,
            ids,
            capture.token_counts,
            capture.sizes,
            capture.errors,
            capture.layer_id,
            capture.dp_rank,
            capture.n_first,
        )
