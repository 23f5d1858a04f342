"""The router kernel family: route a block of tokens and, optionally, record the ids for replay.

Two implementations of one destination-passing contract:

* :func:`route_rows_triton` - one Triton kernel for every method (CUDA; CPU tensors under
  ``TRITON_INTERPRET=1``), with the capture fused in;
* :func:`route_rows_torch` - its PyTorch reference twin (:mod:`moe_ops.router.reference`, then
  :func:`moe_ops.capture.kernels.capture_rows_torch`), the CPU path and the test oracle.

Contract (both): ``weights[t], ids[t]`` are token ``t``'s routing (see
:mod:`moe_ops.router.methods`); a row whose routed weights are not all finite is written as 0 and
counted in the non-finite rows counter (:mod:`moe_ops.router.nonfinite`). With a capture destination,
``buffer[r, layer_id] = ids[start + r]``
(and, with a weights buffer, ``weights_buffer[r, layer_id] = weights[start + r]`` cast to its dtype)
for ``r < c_eff``, where ``(start, c_eff)`` come from :func:`moe_ops.capture.window.rows_window`,
the capture op's own device-side offset rule, and faults are recorded the same way: the result is
bit-identical to routing and then calling ``capture_routing``.

Kernel layout: one program routes ``BLOCK_M`` tokens and holds their logits in registers as a
``(BLOCK_M, NG_PAD, G_PAD)`` tile (``NG_PAD = 1``, ``G_PAD = E`` rounded up to a power of two when
there is no grouping; padding is masked). Selection keys become order-preserving int32s (float
bits with the magnitude of negatives flipped; masked and knocked-out entries hold INT32_MIN). Each
of the ``top_k`` rounds takes the best key with one integer ``max``, then the lowest expert index
holding it with one integer ``min`` - the tie rule: among equal scores the lowest index wins - and
knocks that expert out. DeepSeek-V3 groups use the same two-step rule on the ``NG_PAD`` axis. The
chosen logits are re-read (cache hits) to form the weights.
"""

from __future__ import annotations

import functools

import torch

from .._runtime.launcher import KernelLauncher
from .._runtime.library import identity
from .._runtime.triton import HAS_TRITON, interpreting, next_power_of_2
from ..capture.errors import cpu_counter_lock
from ..capture.kernels import capture_rows_torch, size_hint
from ..capture.spec import CAPTURE_OP, CaptureSpec, absent_kernel_args, kernel_constexprs
from .args import tile_shape
from .methods import METHODS, RoutingMethod
from .nonfinite import count_zeroed_rows, nonfinite_counter
from .reference import rule_weights, select_experts, selection_keys, zero_nonfinite_rows

__all__ = ["launch_config", "route_rows_torch", "route_rows_triton", "write_shared_columns"]

# Launch configuration (see launch_config), from `benchmarks/bench_routing.py --sweep` and a sweep
# of kernel variants on an H200 (kernel times with capture, us; sizes 1 / 128 / 4096 tokens):
#
# * grouped (DeepSeek-V3 256/8, 8 groups of 32): 2 rows x 2 warps 2.8 / 2.9 / 9.3 against
#   1 row x 1 warp 3.8 / 4.1 / 9.6. Triton then puts the two warps on the group axis
#   (warpsPerCTA [1, 2, 1] in the TTGIR), half the groups each, and every round crosses shared memory
#   once - and still wins, at one token too (16384 tokens: 2 x 2 32.0 us, 2 x 1 31.9, a tie).
# * ungrouped: one warp per row reduces with redux.sync alone; more warps spread the expert axis and
#   add a shared-memory hop per round, which pays only for long rows in small batches (RENORMALIZE
#   512/8: 4 warps 2.8 / 3.1 us at 1 / 128 tokens against 3.1 / 3.3 with 1; at 1024 tokens 4 warps
#   lose, 5.6 against 4.5 us). Large batches of short rows take several rows per program
#   (RENORMALIZE 128/8 at 4096 tokens: 2 rows 4.0 us, 1 row 4.5; at 16384: 4 rows 10.1, 2 rows
#   10.9), at most _ROW_LOGITS logits per program.
_GROUPED_CONFIG = (2, 2)
_LOGITS_PER_WARP = 1024
_SMALL_BATCH_WARPS = 4
_SMALL_BATCH = 256
_ROW_LOGITS = 512
_MIN_PROGRAM_LOGITS = 256
_LARGE_BATCH = 2048
_TARGET_PROGRAMS = 4096
# the capture constexprs of a launch without capture: one (unread) sizes entry, no offset, no stamp
_NO_CAPTURE = kernel_constexprs(1, 0, False)


def launch_config(n_tokens: int, ng_pad: int, g_pad: int) -> tuple[int, int]:
    """(rows per program, warps) for ``n_tokens`` tokens of a ``(ng_pad, g_pad)`` expert tile."""
    if interpreting():
        # The interpreter pays per program and per operation, hardly per element: few programs.
        return min(next_power_of_2(n_tokens), 64), 1
    e_tile = ng_pad * g_pad
    if ng_pad > 1 and e_tile <= _ROW_LOGITS:
        return _GROUPED_CONFIG
    num_warps = min(8, max(1, e_tile // _LOGITS_PER_WARP))
    if e_tile >= 512 and n_tokens <= _SMALL_BATCH:
        num_warps = max(num_warps, _SMALL_BATCH_WARPS)
    rows_cap = max(1, _ROW_LOGITS // e_tile)
    block_m = next_power_of_2(-(-n_tokens // _TARGET_PROGRAMS))
    if n_tokens >= _LARGE_BATCH:
        block_m = max(block_m, _MIN_PROGRAM_LOGITS // e_tile)
    return max(1, min(rows_cap, block_m)), num_warps


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..capture.kernels import record_faults, record_stamp, store_weights
    from ..capture.window import rows_window
    from ._select import keep_groups, ordered_keys, topk_rounds
    from ._weights import N_METHODS, chosen_weights, finite_rows, record_zeroed, row_softmax

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
            "stride_vm",
            "stride_vl",
        ]
    )
    def _route_kernel(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        # (1,) int32: the non-finite rows counter (moe_ops.router.nonfinite)
        nonfinite_ptr,
        # the capture's pointers: moe_ops.capture.spec.KERNEL_POINTERS, in its order (pointers
        # first: torch 2.11's mutation analysis of traced kernels maps written parameters to
        # tensors by position)
        buf_ptr,
        wbuf_ptr,
        counts_ptr,
        sizes_ptr,
        errors_ptr,
        stamps_ptr,
        step_ptr,
        map_ptr,
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
        METHOD: tl.constexpr,
        UNNORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GROUPED: tl.constexpr,
        GROUP_TOP: tl.constexpr,
        CAPTURE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        NG_PAD: tl.constexpr,
        G_PAD: tl.constexpr,
        K_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        STAMP: tl.constexpr,
        WEIGHTS: tl.constexpr,
        # the capture's expert map: always False here (route records the logical ids it chooses;
        # CaptureTarget.check_router_capture refuses a map), a parameter so the capture
        # constexprs are one list for every capturing kernel
        EXPERT_MAP: tl.constexpr,
        # fused shared experts: columns top_k .. top_k + N_SHARED - 1 hold ids num_experts + j at
        # weight 1.0; CAPTURE_SHARED records them too (the buffer is top_k + N_SHARED wide)
        N_SHARED: tl.constexpr = 0,
        CAPTURE_SHARED: tl.constexpr = False,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_tokens
        if CAPTURE:
            # The capture op's window, computed here exactly as there. Its loads overlap the logits
            # load below; the fault record (a branch with atomics, which the compiler will not
            # move loads across) is the kernel's last statement, so nothing waits for the counts.
            # (rows_window says why its inputs are loaded here)
            count = tl.load(counts_ptr + tl.cast(dp_rank, tl.int64) * stride_c)
            if HAS_OFFSET:
                s_idx = tl.arange(0, S_PAD)
                sizes = tl.load(sizes_ptr + s_idx.to(tl.int64) * stride_s, mask=s_idx < n_first, other=0)
            else:
                sizes = count  # unused: start is 0
            start, c_eff, flags = rows_window(count, sizes, n_tokens, n_dst, HAS_OFFSET)
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

        # the rows' softmax (moe_ops.router._weights): DEFAULT's and DEEPSEEK_V2's weights and
        # SOFTMAX_BIAS's key read it, one computation for both; UNNORM: the method's other weight
        # rule (the table's column METHOD + N_METHODS)
        RULES: tl.constexpr = METHOD + N_METHODS * UNNORM
        x_max, z = row_softmax(x, ok3, row_ok, RULES, False)
        okey = ordered_keys(x, bias_ptr, expert, expert_ok, ok3, x_max, z, METHOD, HAS_BIAS)
        if GROUPED:
            okey = keep_groups(okey, row_ok, n_group, topk_group, BLOCK_M, NG_PAD, G_PAD, GROUP_TOP)
        # top_k rounds, unrolled to K_PAD (rounds past top_k are masked at the stores)
        ids = topk_rounds(okey, expert3, BLOCK_M, K_PAD)
        kcol = tl.arange(0, K_PAD)
        k_ok = kcol[None, :] < top_k
        out_ok = row_ok[:, None] & k_ok
        xs = tl.load(logits_ptr + row_off[:, None] + ids.to(tl.int64) * stride_le, mask=out_ok, other=0.0)
        xs = xs.to(tl.float32)
        # the method's weights (moe_ops.router._weights): the SOFTMAX rule's softmax over the whole
        # row from the logits in registers, every other rule from the k chosen logits
        w = chosen_weights(xs, out_ok, row_ok, scale, x_max, z, RULES, False)
        # a row with a non-finite weight is zeroed (and counted last, below): what is stored and
        # captured is the zeroed weights
        w, zeroed = finite_rows(w, out_ok, False)

        rows64 = rows.to(tl.int64)
        tl.store(weights_ptr + rows64[:, None] * stride_wm + kcol[None, :] * stride_wk, w, mask=out_ok)
        tl.store(ids_ptr + rows64[:, None] * stride_im + kcol[None, :] * stride_ik, ids, mask=out_ok)
        # the shared columns are constants: N_SHARED stores of one id and one weight per row, no
        # load (the id is num_experts + j, the weight 1.0, routed_scaling_factor does not touch it)
        for j in tl.static_range(N_SHARED):
            shared_id = tl.zeros((BLOCK_M,), tl.int32) + (n_group * group_size + j)
            one = tl.full((BLOCK_M,), 1.0, tl.float32)
            tl.store(weights_ptr + rows64 * stride_wm + (top_k + j) * stride_wk, one, mask=row_ok)
            tl.store(ids_ptr + rows64 * stride_im + (top_k + j) * stride_ik, shared_id, mask=row_ok)
        if CAPTURE:
            mine = (rows >= start) & (rows < start + c_eff)
            row_dst = buf_ptr + tl.cast(layer_id, tl.int64) * stride_bl + (rows64 - start) * stride_bm
            dst = row_dst[:, None] + kcol[None, :] * stride_bk
            tl.store(dst, ids.to(buf_ptr.dtype.element_ty), mask=mine[:, None] & k_ok)
            if CAPTURE_SHARED:
                for j in tl.static_range(N_SHARED):
                    shared_id = tl.zeros((BLOCK_M,), tl.int32) + (n_group * group_size + j)
                    dst_j = row_dst + (top_k + j) * stride_bk
                    tl.store(dst_j, shared_id.to(buf_ptr.dtype.element_ty), mask=mine)
                    if WEIGHTS:  # their weight, 1.0 (exact in every weights dtype)
                        wdst_j = (
                            wbuf_ptr
                            + tl.cast(layer_id, tl.int64) * stride_vl
                            + (rows64 - start) * stride_vm
                            + (top_k + j) * stride_vk
                        )
                        one = tl.full((BLOCK_M,), 1.0, tl.float32).to(wbuf_ptr.dtype.element_ty)
                        tl.store(wdst_j, one, mask=mine)
            if WEIGHTS:
                # the weights in registers, to the same rows under the ids' store mask
                store_weights(
                    wbuf_ptr,
                    w,
                    rows64 - start,
                    kcol,
                    layer_id,
                    mine[:, None] & k_ok,
                    stride_vm,
                    stride_vl,
                    stride_vk,
                )
            if pid == 0:
                record_faults(errors_ptr, flags)
                if STAMP:
                    record_stamp(stamps_ptr, step_ptr, layer_id)
        # last, as the capture's faults: one atomic per program that zeroed a row
        record_zeroed(nonfinite_ptr, tl.sum(zeroed.to(tl.int32)))


def route_rows_triton(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    method: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    capture: CaptureSpec | None = None,
    *,
    unnormalized: bool = False,
    num_fused_shared_experts: int = 0,
    group_top: int = 2,
    nonfinite: torch.Tensor | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    wrap=identity,
) -> None:
    """Launches the router kernel (validated arguments assumed; see ``moe_ops.route``).

    router_logits: (n, E) float32/bf16/fp16 - router outputs, read once
    bias: (E,) float or None - the selection bias of BIAS_METHODS
    weights: (n, top_k + s) float32 - written (s = ``num_fused_shared_experts``)
    ids: (n, top_k + s) int32 - written: the routed top_k, then ids E .. E + s - 1
    unnormalized: the method's other weight rule (``RouteConfig.unnormalized``)
    num_fused_shared_experts: s, the shared columns appended at weight 1.0
    group_top: the keys a group score sums (``RouteConfig.group_top``; read with n_group > 1)
    capture: where to record this rank's ids (and, with its weights buffer, their weights), or
        None; its buffer is top_k wide (the routed columns are recorded) or top_k + s wide (the
        shared columns too)
    nonfinite: (1,) int32 - the non-finite rows counter, added to (rows whose routed weights were
        not all finite, written as 0; ``moe_ops.router.nonfinite``); None: the logits' device's
    block_m, num_warps: override :func:`launch_config` (tests and tuning)
    wrap: applied to the ``@triton.jit`` kernel before the launch (``torch.library.wrap_triton``
        when torch.compile traces the op; see :mod:`moe_ops._runtime.library`)

    One launch, no host reads, no allocation: CUDA-graph capturable.
    """
    n_tokens, num_experts = router_logits.shape
    n_shared = int(num_fused_shared_experts)
    top_k = ids.shape[1] - n_shared
    ng_pad, g_pad = tile_shape(num_experts, n_group)
    # n_tokens may be a SymInt (dynamic shapes): the tile only tunes speed, so it is chosen from
    # the traced example's size without a guard; the grid below stays an expression in n_tokens
    default_m, default_warps = launch_config(size_hint(n_tokens), ng_pad, g_pad)
    block_m = block_m or default_m
    num_warps = num_warps or default_warps
    programs = triton.cdiv(n_tokens, block_m)
    # no bias: never read (HAS_BIAS is False); traced, not an alias of the logits (see
    # moe_ops.capture.spec.absent_kernel_args)
    bias_arg = bias
    if bias is None:
        bias_arg = router_logits if wrap is identity else router_logits.new_empty(0)
    if nonfinite is None:
        nonfinite = nonfinite_counter(router_logits.device)
    pointers = (router_logits, bias_arg, weights, ids, nonfinite)
    scalars = (
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
    )
    if capture is None:
        if programs == 0:
            return
        # never read: CAPTURE is False (eagerly any tensor does; traced, each pointer its own)
        args = absent_kernel_args(pointers, scalars, ids, distinct=wrap is not identity)
        capture_constexprs = _NO_CAPTURE
    else:
        # At least one program, so a call whose counts overflow an empty batch still records its fault.
        programs = torch.sym_max(programs, 1)
        args = capture.kernel_args(pointers, scalars)
        capture_constexprs = capture.kernel_constexprs()
    constexprs = dict(
        METHOD=int(method),
        UNNORM=bool(unnormalized),
        HAS_BIAS=bias is not None,
        GROUPED=n_group > 1,
        # one variant without groups whatever the rule (unread there)
        GROUP_TOP=int(group_top) if n_group > 1 else 2,
        CAPTURE=capture is not None,
        BLOCK_M=block_m,
        NG_PAD=ng_pad,
        G_PAD=g_pad,
        K_PAD=next_power_of_2(top_k),
        **capture_constexprs,
        N_SHARED=n_shared,
        CAPTURE_SHARED=capture is not None and n_shared > 0 and capture.buffer.shape[2] > top_k,
    )
    if router_logits.device.type == "cpu":
        # interpreted Triton updates the fault counters in Python (see capture.errors); on CUDA the
        # kernel's atomics need no lock, and a context manager per launch is host time for nothing
        with cpu_counter_lock(router_logits.device):
            wrap(_route_kernel)[(programs,)](*args, **constexprs, num_warps=num_warps)
    elif wrap is identity:
        _route_launcher()((programs,), args, constexprs, num_warps)
    else:
        wrap(_route_kernel)[(programs,)](*args, **constexprs, num_warps=num_warps)


@functools.cache
def _route_launcher() -> KernelLauncher:
    return KernelLauncher(_route_kernel)


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
    capture: CaptureSpec | None = None,
    *,
    unnormalized: bool = False,
    num_fused_shared_experts: int = 0,
    group_top: int = 2,
    nonfinite: torch.Tensor | None = None,
) -> None:
    """PyTorch twin of :func:`route_rows_triton`: same arguments, same writes, same fault bits.

    Routes in float32 as :func:`moe_ops.router.reference.route_reference` does, then records with
    the capture op's own twin. The weights follow ``WeightRule.computed``, as the kernel computes
    them (replay's rule too): RENORMALIZE_NAIVE's as ``softmax(x[sel])``, since the literal
    ``p[sel] / sum p[sel]`` reads the whole row, so a NaN logit the router did not choose would make
    the row's weights NaN where the kernel's are finite. No host reads; allocates its
    intermediates (it is the CPU path and the oracle, not the fast path).
    """
    method = RoutingMethod(method)
    n_shared = int(num_fused_shared_experts)
    top_k = ids.shape[1] - n_shared
    # route_reference in float32, with the weight rule the kernel computes (WeightRule.computed)
    x = router_logits.to(torch.float32)
    ref_ids = select_experts(selection_keys(x, method, bias), top_k, n_group, topk_group, group_top)
    rule, _ = METHODS[method].computed(unnormalized)
    ref_weights, zeroed = zero_nonfinite_rows(rule_weights(x, ref_ids, rule, routed_scaling_factor))
    count_zeroed_rows(nonfinite_counter(x.device) if nonfinite is None else nonfinite, zeroed)
    weights[:, :top_k].copy_(ref_weights)
    ids[:, :top_k].copy_(ref_ids)
    if n_shared:
        write_shared_columns(weights, ids, router_logits.shape[1], n_shared)
    if capture is not None:
        # the buffer's width says what is recorded: the routed columns, or the shared ones too
        # (the weights just written beside them: read only with a weights buffer, the twin's WEIGHTS)
        width = capture.buffer.shape[2]
        capture_rows_torch(*CAPTURE_OP.join((ids[:, :width], weights[:, :width]), capture))


def write_shared_columns(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, n_shared: int) -> None:
    """Writes the fused shared experts' columns, the last ``n_shared`` of ``weights`` and ``ids``:
    ids ``num_experts + j`` at weight 1.0 (vLLM's and FlashInfer's rule, docs/routing.md "Fused
    shared experts"). No host reads."""
    top_k = ids.shape[1] - n_shared
    shared = torch.arange(num_experts, num_experts + n_shared, dtype=ids.dtype, device=ids.device)
    ids[:, top_k:].copy_(shared.expand(ids.shape[0], n_shared))
    weights[:, top_k:].fill_(1.0)
