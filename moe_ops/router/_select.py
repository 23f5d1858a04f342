"""Triton helpers the router and the replay kernels share: order-preserving keys, the expert-group
phase and the unrolled top-k rounds (private: import the launchers, not this module).

One rule for both kernels, so that replay's live rows are exactly what ``route`` chooses: keys
become order-preserving int32s (float bits with the magnitude of negatives flipped; masked and
knocked-out entries hold INT32_MIN); each round takes the best key with one integer ``max``, then
the lowest expert index holding it with one integer ``min`` - among equal scores the lowest index
wins - and knocks that expert out.

float64 keys (replay's float64 logits) take the same rule in 64 bits: int64 keys, INT64_MIN for
masked and knocked-out entries. The key's dtype picks the width at compile time, so the float32
kernels compile to what they did before (the same TTGIR).
"""

from __future__ import annotations

from .._runtime.triton import HAS_TRITON
from .methods import SelectionKey, table_column
from .reference import SOFTPLUS_THRESHOLD

__all__: list[str] = []

if HAS_TRITON:
    import triton
    import triton.language as tl

    # Triton kernels may only read globals that are constexpr: per method value, whether its key
    # is sigmoid(x) + bias (the method table's SelectionKey.SIGMOID_BIAS).
    _SIGMOID_BIAS_KEY = tl.constexpr(table_column(lambda spec: spec.key == SelectionKey.SIGMOID_BIAS))
    # per method value, whether its key is sqrt(softplus(x)) + bias (SelectionKey.SQRTSOFTPLUS_BIAS)
    _SQRTSOFTPLUS_BIAS_KEY = tl.constexpr(
        table_column(lambda spec: spec.key == SelectionKey.SQRTSOFTPLUS_BIAS)
    )
    _SOFTPLUS_THRESHOLD = tl.constexpr(SOFTPLUS_THRESHOLD)
    # per method value, whether its key is softmax(x) + bias (SelectionKey.SOFTMAX_BIAS)
    _SOFTMAX_BIAS_KEY = tl.constexpr(table_column(lambda spec: spec.key == SelectionKey.SOFTMAX_BIAS))
    NONE = tl.constexpr(-2147483648)  # INT32_MIN: knocked out / masked (below every valid key)
    NONE64 = tl.constexpr(-9223372036854775808)  # INT64_MIN: the same for float64 keys
    NO_EXPERT = tl.constexpr(1 << 30)  # above every expert index (min-reduction identity)

    @triton.jit
    def ordered(key, valid):
        """int32 (int64 for float64 keys) whose signed order is the order of ``key``; ``NONE``
        (``NONE64``; below all) where not valid.

        key: canonical float32 or float64 (no NaN, no -0.0). Negative floats get their magnitude
        bits flipped, so the bits compare as signed ints; -inf maps to 0x807FFFFF > ``NONE`` =
        INT32_MIN (0x800FFFFFFFFFFFFF > INT64_MIN).
        """
        if key.dtype == tl.float64:
            bits64 = key.to(tl.int64, bitcast=True)
            return tl.where(valid, bits64 ^ ((bits64 >> 63) & 0x7FFFFFFFFFFFFFFF), NONE64)
        else:
            bits = key.to(tl.int32, bitcast=True)
            return tl.where(valid, bits ^ ((bits >> 31) & 0x7FFFFFFF), NONE)

    @triton.jit
    def unordered(ordered):
        """The float key of an ordered int (the mapping of :func:`ordered` is an involution)."""
        if ordered.dtype == tl.int64:
            bits64 = ordered ^ ((ordered >> 63) & 0x7FFFFFFFFFFFFFFF)
            return bits64.to(tl.float64, bitcast=True)
        else:
            bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
            return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def canonical(key):
        """NaN -> -inf, -0.0 -> 0.0 (the reference's rule)."""
        key = tl.where(key != key, float("-inf"), key)
        return tl.where(key == 0.0, 0.0, key)

    @triton.jit
    def sqrt_softplus(x):
        """``sqrt(softplus(x))`` in ``x``'s dtype: the operations of
        :func:`moe_ops.router.reference.sqrt_softplus`, in its order (log1p written with log: the
        interpreter has no libdevice). IEEE-rounded division and square root, as torch's ``/`` and
        ``sqrt``: float32 ``/`` and ``tl.sqrt`` are approximate on CUDA (``div_rn``, ``sqrt_rn``
        take float32 only; float64 ``/`` and ``tl.sqrt`` are IEEE-rounded)."""
        u = tl.exp(x)
        v = 1.0 + u
        sp = tl.log(v) * u
        if x.dtype == tl.float64:
            log1p = tl.where(v == 1.0, u, sp / (v - 1.0))
            return tl.sqrt(tl.where(x > _SOFTPLUS_THRESHOLD, x, log1p))
        else:
            log1p = tl.where(v == 1.0, u, tl.div_rn(sp, v - 1.0))
            return tl.sqrt_rn(tl.where(x > _SOFTPLUS_THRESHOLD, x, log1p))

    @triton.jit
    def ordered_keys(
        x, bias_ptr, expert, expert_ok, ok3, x_max, z, METHOD: tl.constexpr, HAS_BIAS: tl.constexpr
    ):
        """(BLOCK_M, NG_PAD, G_PAD) ordered int32 selection keys of float32 logits ``x`` (int64 keys
        of float64 logits; the bias is rounded to the logits' dtype, as the twin does).

        x_max, z: (BLOCK_M,) the rows' softmax max and denominator (``_weights.row_softmax``, which
        computes them for a SOFTMAX_BIAS key), read by that key alone."""
        if _SIGMOID_BIAS_KEY[METHOD] or _SOFTMAX_BIAS_KEY[METHOD] or _SQRTSOFTPLUS_BIAS_KEY[METHOD]:
            if _SIGMOID_BIAS_KEY[METHOD]:
                key = tl.sigmoid(x)
            elif _SOFTMAX_BIAS_KEY[METHOD]:
                # the chosen_weights SOFTMAX rule's operations: exp(x - max) / sum
                key = tl.exp(x - x_max[:, None, None]) / z[:, None, None]
            else:
                key = sqrt_softplus(x)
            if HAS_BIAS:
                b = tl.load(bias_ptr + expert, mask=expert_ok, other=0.0).to(x.dtype)
                key = key + b[None, :, :]
        else:
            key = x  # softmax and sigmoid keep the order of the logits
        return ordered(canonical(key), ok3)

    @triton.jit
    def keep_groups(
        okey, row_ok, n_group, topk_group, BLOCK_M: tl.constexpr, NG_PAD: tl.constexpr, G_PAD: tl.constexpr,
        GROUP_TOP: tl.constexpr = 2,
    ):  # fmt: skip
        """The group phase: the keys of the ``topk_group`` best groups, NONE elsewhere.

        Group score = the sum of the group's ``GROUP_TOP`` best keys, best first
        (``RouteConfig.group_top``: 1 for GroupScore.MAX, its best key itself; 2 for TOP2_SUM, one
        key if the group has one expert - DeepSeek-V3's code, unchanged; more for TOPK_SHARE_SUM,
        which validation keeps at most the group's size). Each round's best is the lowest column
        among equal keys, and only that one is knocked out.
        """
        none: tl.constexpr = NONE64 if okey.dtype == tl.int64 else NONE
        grp = tl.arange(0, NG_PAD)
        col3 = tl.arange(0, G_PAD)[None, None, :]
        top1 = tl.max(okey, axis=2)
        if GROUP_TOP == 1:
            grp_ok = row_ok[:, None] & (grp[None, :] < n_group)
            gkey = tl.where(grp_ok, top1, none)  # the best key, already ordered and canonical
        elif GROUP_TOP == 2:
            col1 = tl.min(tl.where(okey == top1[:, :, None], col3, G_PAD), axis=2)
            top2 = tl.max(tl.where(col3 == col1[:, :, None], none, okey), axis=2)
            score = tl.where(top2 != none, unordered(top1) + unordered(top2), unordered(top1))
            grp_ok = row_ok[:, None] & (grp[None, :] < n_group)
            gkey = ordered(canonical(score), grp_ok)
        else:
            # GROUP_TOP <= the group's size: every round takes a real key (above NONE)
            rest = okey
            best = top1
            score = unordered(top1)
            for _ in tl.static_range(GROUP_TOP - 1):
                col = tl.min(tl.where(rest == best[:, :, None], col3, G_PAD), axis=2)
                rest = tl.where(col3 == col[:, :, None], none, rest)
                best = tl.max(rest, axis=2)
                score = score + unordered(best)
            grp_ok = row_ok[:, None] & (grp[None, :] < n_group)
            gkey = ordered(canonical(score), grp_ok)
        kept = tl.zeros([BLOCK_M, NG_PAD], dtype=tl.int32)
        for _ in range(topk_group):
            gbest = tl.max(gkey, axis=1)
            gwin = tl.min(tl.where(gkey == gbest[:, None], grp[None, :], NG_PAD), axis=1)
            hit = grp[None, :] == gwin[:, None]
            kept = tl.where(hit, 1, kept)
            gkey = tl.where(hit, none, gkey)
        return tl.where(kept[:, :, None] != 0, okey, none)

    @triton.jit
    def topk_rounds(okey, expert3, BLOCK_M: tl.constexpr, K_PAD: tl.constexpr):
        """(BLOCK_M, K_PAD) int32 ids by descending key (int32 or int64 ``okey``), ties to the lowest
        expert index.

        top_k rounds, unrolled to K_PAD (rounds past top_k are masked at the stores). A round is
        two dependent 32-bit warp reductions (redux.sync on sm_90): the best key, then the lowest
        expert holding it. The int64 (key, -index) packing this replaced took a chain of both
        halves plus 64-bit compares in every thread, in a loop the compiler could not unroll
        (H200, DeepSeek-V3 256/8 with capture, kernel time: n=1 5.3 us -> 2.8 us, n=4096 17.8 us
        -> 9.3 us, with the router's launch configuration). Loading each round's chosen logit inside
        the round measured slower than one gather after the rounds (DeepSeek-V3 n=4096 with
        capture 10.4 vs 9.6 us at 1 row / 1 warp), so the weights re-read them at the end.
        """
        none: tl.constexpr = NONE64 if okey.dtype == tl.int64 else NONE
        kcol = tl.arange(0, K_PAD)
        ids = tl.zeros([BLOCK_M, K_PAD], dtype=tl.int32)
        for i in tl.static_range(K_PAD):
            # groups first: with lanes along the experts of a group, that axis is in-thread and
            # the lane reduction then runs once, not once per group
            best = tl.max(tl.max(okey, axis=1), axis=1)
            win = tl.min(tl.min(tl.where(okey == best[:, None, None], expert3, NO_EXPERT), axis=1), axis=1)
            ids = tl.where(kcol[None, :] == i, win[:, None], ids)
            okey = tl.where(expert3 == win[:, None, None], none, okey)
        return ids

    __all__ += [
        "canonical",
        "keep_groups",
        "ordered",
        "ordered_keys",
        "sqrt_softplus",
        "topk_rounds",
        "unordered",
    ]
