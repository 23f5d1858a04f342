"""The hash router: experts from a token-id table, weights by the method's weight rule, capture fused.

Two implementations of one destination-passing contract:

* :func:`route_hash_rows_triton` - a small Triton kernel of its own (CUDA; CPU tensors under
  ``TRITON_INTERPRET=1``), with the capture fused in;
* :func:`route_hash_rows_torch` - its PyTorch twin, the CPU path.

Contract (both): ``ids[t] = hash_table[token_ids[t]]`` and ``weights[t]`` the method's weight rule
(``WeightRule.computed`` of its table row, its ``renormalize=False`` rule where ``unnormalized``)
evaluated at those ids from the row's logits - there is no selection, so the method's selection key,
bias and groups play no part. A faulty row (a token id outside ``[0, vocab)`` or an entry outside
``[0, num_experts)``; :mod:`moe_ops.router._hash`) gets ids ``-1`` and weights ``0`` and is counted
in ``faults`` ([faulty rows, OR of HASH_FAULT_* bits]); nothing is read at a bad address. Any
other row whose weights are not all finite is written as 0 and counted in the non-finite rows
counter (:mod:`moe_ops.router.nonfinite`). With a
capture destination the ids (``-1`` on faulty rows: "no record, route live" for replay) are recorded
exactly as ``capture_routing`` would record them (its FAULT_BAD_ID count of the -1 ids included).

Why a kernel of its own rather than a HASH branch in the router kernel: the router kernel holds a
``(BLOCK_M, NG_PAD, G_PAD)`` tile of every logit for its selection rounds; a hash row needs its
``top_k`` table entries and ``top_k`` gathered logits (DEFAULT's softmax alone reads the whole row),
so this kernel works in the ``(BLOCK_M, K_PAD)`` tile of replay's recorded rows and shares the
router's weight helpers (:mod:`moe_ops.router._weights`). A branch would add three pointers, the
fault counter and their strides to the router's launch and to ``route_``'s schema, which compiled
graphs hold, for a path that shares none of its selection code. About 90 lines here.
"""

from __future__ import annotations

import functools

import torch

from .._runtime.faults import cpu_counter_lock
from .._runtime.launcher import KernelLauncher
from .._runtime.library import identity
from .._runtime.triton import HAS_TRITON, interpreting, next_power_of_2
from ..capture.kernels import capture_rows_torch, size_hint
from ..capture.spec import CAPTURE_OP, CaptureSpec, absent_kernel_args, kernel_constexprs
from ._hash import hash_ids_torch
from .methods import METHODS, RoutingMethod
from .nonfinite import count_zeroed_rows, nonfinite_counter
from .reference import rule_weights, zero_nonfinite_rows

__all__ = ["hash_launch_config", "route_hash_rows_torch", "route_hash_rows_triton"]

# Up to 1024 logits per program (the DEFAULT rule's whole rows), 4 warps: replay's forward tile,
# whose recorded rows do the same work (k ids and k gathered logits per row). Not timed on a GPU.
_HASH_TILE = 1024
_HASH_WARPS = 4
_NO_CAPTURE = kernel_constexprs(1, 0, False)


def hash_launch_config(n_tokens: int, e_pad: int) -> tuple[int, int]:
    """(rows per program, warps) of the hash router kernel for rows of ``e_pad`` padded experts."""
    if interpreting():
        # The interpreter pays per program and per operation, hardly per element: few programs.
        return min(next_power_of_2(n_tokens), 64), 1
    return max(1, min(next_power_of_2(n_tokens), _HASH_TILE // e_pad)), _HASH_WARPS


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..capture.errors import FAULT_BAD_ID, FAULT_SLOT
    from ..capture.kernels import record_faults, record_stamp, to_bfloat16
    from ..capture.window import rows_window
    from ._hash import hash_ids
    from ._weights import N_METHODS, chosen_weights, finite_rows, gathered_row_softmax, record_zeroed

    _BAD_ID_SLOT = tl.constexpr(FAULT_SLOT[FAULT_BAD_ID])

    # As the router: nothing that changes per step or per layer is a specialisation key.
    @triton.jit(
        do_not_specialize=[
            "n_tokens",
            "num_experts",
            "vocab",
            "top_k",
            "stride_lm",
            "stride_hv",
            "stride_t",
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
    def _route_hash_kernel(
        logits_ptr,
        table_ptr,
        tok_ptr,
        weights_ptr,
        ids_ptr,
        faults_ptr,
        # (1,) int32: the non-finite rows counter (moe_ops.router.nonfinite)
        nonfinite_ptr,
        # the capture's pointers: moe_ops.capture.spec.KERNEL_POINTERS, in its order
        buf_ptr,
        wbuf_ptr,
        counts_ptr,
        sizes_ptr,
        errors_ptr,
        stamps_ptr,
        step_ptr,
        map_ptr,
        n_tokens,
        num_experts,
        vocab,
        top_k,
        scale,
        stride_lm,
        stride_le,
        stride_hv,
        stride_hk,
        stride_t,
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
        CAPTURE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        E_PAD: tl.constexpr,
        K_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        STAMP: tl.constexpr,
        WEIGHTS: tl.constexpr,
        # the capture's expert map: always False here (route records the logical ids it chooses;
        # CaptureTarget.check_router_capture refuses a map), a parameter so the capture
        # constexprs are one list for every capturing kernel
        EXPERT_MAP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if CAPTURE:
            # the capture op's window, computed here exactly as there (see the router kernel)
            count = tl.load(counts_ptr + tl.cast(dp_rank, tl.int64) * stride_c)
            if HAS_OFFSET:
                s_idx = tl.arange(0, S_PAD)
                sizes = tl.load(sizes_ptr + s_idx.to(tl.int64) * stride_s, mask=s_idx < n_first, other=0)
            else:
                sizes = count  # unused: start is 0
            start, c_eff, flags = rows_window(count, sizes, n_tokens, n_dst, HAS_OFFSET)
        # every per-row value in the (BLOCK_M, K_PAD) tile's layout (replay's recorded path says why)
        kcol = tl.arange(0, K_PAD)[None, :]
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)[:, None] + kcol * 0
        row_ok = rows < n_tokens
        rows64 = rows.to(tl.int64)
        k_ok = kcol < top_k
        out_ok = row_ok & k_ok
        ids, faulty, hash_flags = hash_ids(
            table_ptr, tok_ptr, rows64, row_ok, kcol, k_ok, vocab, num_experts, stride_t, stride_hv, stride_hk
        )
        good = out_ok & ~faulty  # only in-range ids are ever addresses
        # the ids are stored before the gather below: stored after it, triton 3.6 failed to build the
        # capturing kernel for one- and two-column tiles ("operand #0 does not dominate this use")
        tl.store(ids_ptr + rows64 * stride_im + kcol * stride_ik, ids, mask=out_ok)
        row_good = row_ok & ~faulty
        row_off = rows64 * stride_lm
        xs = tl.load(logits_ptr + row_off + ids.to(tl.int64) * stride_le, mask=good, other=0.0)
        xs = xs.to(tl.float32)
        # the method's weights (moe_ops.router._weights); UNNORM: its renormalize=False rule
        RULES: tl.constexpr = METHOD + N_METHODS * UNNORM
        x_max, z = gathered_row_softmax(
            logits_ptr, row_off, row_good, xs, num_experts, 1, stride_le, RULES, 1, E_PAD, tl.float32
        )
        w = chosen_weights(xs, good, row_good, scale, x_max, z, RULES, True)
        w = tl.where(good, w, 0.0)
        # a row with a non-finite weight: zeroed, counted last (a faulty row is not: its ids are -1)
        w, zeroed = finite_rows(w, good, True)
        tl.store(weights_ptr + rows64 * stride_wm + kcol * stride_wk, w, mask=out_ok)
        if CAPTURE:
            mine = (rows >= start) & (rows < start + c_eff)
            dst = buf_ptr + tl.cast(layer_id, tl.int64) * stride_bl + (rows64 - start) * stride_bm
            dst += kcol * stride_bk
            tl.store(dst, ids.to(buf_ptr.dtype.element_ty), mask=mine & k_ok)
            if WEIGHTS:
                # the weights just stored, to the same rows (a faulty row's 0 beside its -1 ids)
                wdst = wbuf_ptr + tl.cast(layer_id, tl.int64) * stride_vl + (rows64 - start) * stride_vm
                if wbuf_ptr.dtype.element_ty == tl.bfloat16:
                    wv = to_bfloat16(w)
                else:
                    wv = w.to(wbuf_ptr.dtype.element_ty)
                tl.store(wdst + kcol * stride_vk, wv, mask=mine & k_ok)
            # a faulty row's -1 ids count as the capture op counts a negative id (FAULT_BAD_ID):
            # the fused record equals routing, then capture_routing, fault bits included. One
            # atomic under a branch, not capture's masked per-id atomic: an address or mask that
            # depends on the table's values makes torch's mutation analysis of the traced kernel
            # report the table and the token ids as written (inductor would clone them per call)
            n_bad_ids = tl.sum(tl.sum((mine & k_ok & faulty).to(tl.int32), axis=1), axis=0)
            if n_bad_ids > 0:
                tl.atomic_add(errors_ptr + _BAD_ID_SLOT, n_bad_ids)
        # Last: one atomic pair per program that saw a faulty row (column 0 counts the rows).
        n_faulty = tl.sum(tl.where((kcol == 0) & row_ok, faulty, False).to(tl.int32))
        if n_faulty > 0:
            tl.atomic_add(faults_ptr, n_faulty)
            tl.atomic_or(faults_ptr + 1, hash_flags)
        record_zeroed(nonfinite_ptr, tl.sum(zeroed.to(tl.int32)))
        if CAPTURE:  # noqa: SIM102 - a constexpr branch: Triton drops it when False; `and` would not
            if pid == 0:
                record_faults(errors_ptr, flags)
                if STAMP:
                    record_stamp(stamps_ptr, step_ptr, layer_id)


def route_hash_rows_triton(
    router_logits: torch.Tensor,
    hash_table: torch.Tensor,
    token_ids: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    faults: torch.Tensor,
    method: int,
    routed_scaling_factor: float,
    capture: CaptureSpec | None = None,
    *,
    unnormalized: bool = False,
    nonfinite: torch.Tensor | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    wrap=identity,
) -> None:
    """Launches the hash router kernel (validated arguments assumed; see ``moe_ops.route``).

    router_logits: (n, E) float32/bf16/fp16 - router outputs (the weights' logits)
    hash_table: (vocab, top_k) integer - expert ids per token id
    token_ids: (n,) integer - each row's token id
    weights: (n, top_k) float32 - written (0 on faulty rows)
    ids: (n, top_k) int32 - written (-1 on faulty rows)
    faults: (2,) int32 - [faulty rows, OR of HASH_FAULT_* bits], added to
    capture: where to record this rank's ids, or None
    nonfinite: (1,) int32 - the non-finite rows counter (``moe_ops.router.nonfinite``), added to;
        None: the logits' device's
    block_m, num_warps: override :func:`hash_launch_config` (tests and tuning)
    wrap: as :func:`moe_ops.router.kernels.route_rows_triton`

    One launch, no host reads, no allocation: CUDA-graph capturable.
    """
    n_tokens, num_experts = router_logits.shape
    top_k = ids.shape[1]
    e_pad = next_power_of_2(num_experts)
    default_m, default_warps = hash_launch_config(size_hint(n_tokens), e_pad)
    block_m = block_m or default_m
    num_warps = num_warps or default_warps
    programs = triton.cdiv(n_tokens, block_m)
    if nonfinite is None:
        nonfinite = nonfinite_counter(router_logits.device)
    pointers = (router_logits, hash_table, token_ids, weights, ids, faults, nonfinite)
    scalars = (
        n_tokens,
        num_experts,
        hash_table.shape[0],
        top_k,
        float(routed_scaling_factor),
        router_logits.stride(0),
        router_logits.stride(1),
        hash_table.stride(0),
        hash_table.stride(1),
        token_ids.stride(0),
        weights.stride(0),
        weights.stride(1),
        ids.stride(0),
        ids.stride(1),
    )
    if capture is None:
        if programs == 0:
            return
        args = absent_kernel_args(pointers, scalars, ids, distinct=wrap is not identity)
        capture_constexprs = _NO_CAPTURE
    else:
        # at least one program, so a call whose counts overflow an empty batch records its fault
        programs = torch.sym_max(programs, 1)
        args = capture.kernel_args(pointers, scalars)
        capture_constexprs = capture.kernel_constexprs()
    constexprs = dict(
        METHOD=int(method),
        UNNORM=bool(unnormalized),
        CAPTURE=capture is not None,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        K_PAD=next_power_of_2(top_k),
        **capture_constexprs,
    )
    if router_logits.device.type == "cpu":
        # interpreted Triton updates the fault counters in Python (moe_ops._runtime.faults)
        with cpu_counter_lock(router_logits.device):
            wrap(_route_hash_kernel)[(programs,)](*args, **constexprs, num_warps=num_warps)
    elif wrap is identity:
        _hash_launcher()((programs,), args, constexprs, num_warps)
    else:
        wrap(_route_hash_kernel)[(programs,)](*args, **constexprs, num_warps=num_warps)


@functools.cache
def _hash_launcher() -> KernelLauncher:
    return KernelLauncher(_route_hash_kernel)


# reference
def route_hash_rows_torch(
    router_logits: torch.Tensor,
    hash_table: torch.Tensor,
    token_ids: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    faults: torch.Tensor,
    method: int,
    routed_scaling_factor: float,
    capture: CaptureSpec | None = None,
    *,
    unnormalized: bool = False,
    nonfinite: torch.Tensor | None = None,
) -> None:
    """PyTorch twin of :func:`route_hash_rows_triton`: same arguments, same writes, same faults.

    Weights in float32 by the method's ``WeightRule.computed`` rule (as the kernel), from
    :func:`moe_ops.router.reference.rule_weights` at the table's ids (row 0's experts stand in on
    faulty rows, whose weights are then 0). No host reads; allocates its intermediates.
    """
    x = router_logits.to(torch.float32)
    table_ids, faulty, flags = hash_ids_torch(hash_table, token_ids, router_logits.shape[1])
    rule, _ = METHODS[RoutingMethod(method)].computed(unnormalized)
    w = rule_weights(x, torch.where(faulty[:, None], 0, table_ids), rule, routed_scaling_factor)
    w, zeroed = zero_nonfinite_rows(torch.where(faulty[:, None], 0.0, w))
    count_zeroed_rows(nonfinite_counter(x.device) if nonfinite is None else nonfinite, zeroed)
    weights.copy_(w)
    ids.copy_(table_ids)
    # under the CPU counters' lock (moe_ops._runtime.faults); on CUDA an atomic index_add_
    with cpu_counter_lock(faults.device):
        slot = torch.zeros(1, dtype=torch.int64, device=faults.device)
        faults.index_add_(0, slot, faulty.sum().to(faults.dtype).reshape(1))
        faults[1] |= flags.to(faults.dtype)
    if capture is not None:
        capture_rows_torch(*CAPTURE_OP.join((ids, weights), capture))
