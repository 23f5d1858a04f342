"""Triton helpers the router and the replay kernels share: each method's weights of the chosen
experts and each method's gradient, read from the method table (private: import the launchers, not
this module).

The rules come from :data:`moe_ops.router.methods.METHODS`: ``_WEIGHT_RULE[RULES]`` and
``_GRADIENT_RULE[RULES]`` are constexpr tuples (:func:`moe_ops.router.methods.rule_table`) indexed by
the rules' column ``RULES`` - the method's value, or the value plus the number of methods for its
``renormalize=False`` rule (``rule_column``; the kernels pass ``METHOD + N_METHODS * UNNORM``) - so
``RULES`` stays a constexpr, every branch below is decided at compile time and a kernel holds only
its rule's operations (the helpers are inlined). The helpers' ``METHOD`` parameter is that column.
The kernels evaluate ``WeightRule.computed``:
RENORMALIZE_NAIVE's ``p[sel] / sum p[sel]`` as its exact equal ``softmax(x[sel])``.

Two shapes of per-row values, one set of operations: the router keeps a row's value as a
``(BLOCK_M,)`` vector and broadcasts it with ``[:, None]`` (``KEEP = False``); replay's recorded
path keeps every per-row value in the ``(BLOCK_M, K_PAD)`` tile's layout, as ``keep_dims``
reductions broadcast over the columns (``KEEP = True``; ``moe_ops.replay.kernels`` says why). Both
compute in the dtype of their inputs: float32, or float64 for replay's float64 weights.
"""

from __future__ import annotations

from .._runtime.triton import HAS_TRITON
from .methods import N_METHOD_VALUES, GradientRule, SelectionKey, WeightRule, rule_table, table_column

__all__: list[str] = []


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._select import sqrt_softplus
    from .reference import SOFTPLUS_THRESHOLD, SUM_EPSILON

    # Triton kernels may only read globals that are constexpr: the table's rules by method value.
    _WEIGHT_RULE = tl.constexpr(rule_table(lambda weight, gradient: int(weight)))
    _GRADIENT_RULE = tl.constexpr(rule_table(lambda weight, gradient: int(gradient)))
    # 1 where the rule reads routed_scaling_factor itself (WeightRule.holds_scale); 0 where the
    # helpers apply it around the rule (weights scale * rule, gradient at scale * g)
    _HOLDS_SCALE = tl.constexpr(rule_table(lambda weight, gradient: int(weight.holds_scale)))
    # per rules column (both halves: the key is the method's whatever its weight rule), whether the
    # selection key is softmax(x) + bias, which needs the row's softmax before selection
    _SOFTMAX_KEY = tl.constexpr(table_column(lambda spec: spec.key == SelectionKey.SOFTMAX_BIAS) * 2)
    # the kernels' rules column: METHOD + N_METHODS * UNNORM (methods.rule_column)
    N_METHODS = tl.constexpr(N_METHOD_VALUES)
    _W_LOGIT = tl.constexpr(int(WeightRule.LOGIT))
    _W_SOFTMAX = tl.constexpr(int(WeightRule.SOFTMAX))
    _W_SOFTMAX_CHOSEN = tl.constexpr(int(WeightRule.SOFTMAX_CHOSEN))
    _W_SIGMOID = tl.constexpr(int(WeightRule.SIGMOID))
    _W_SIGMOID_RENORM = tl.constexpr(int(WeightRule.SIGMOID_RENORM))
    _W_SIGMOID_SCALED = tl.constexpr(int(WeightRule.SIGMOID_SCALED))
    _W_SIGMOID_TIMES_SCALE = tl.constexpr(int(WeightRule.SIGMOID_TIMES_SCALE))
    _W_SQRTSOFTPLUS_SCALED = tl.constexpr(int(WeightRule.SQRTSOFTPLUS_SCALED))
    _W_SQRTSOFTPLUS_TIMES_SCALE = tl.constexpr(int(WeightRule.SQRTSOFTPLUS_TIMES_SCALE))
    _G_LOGIT = tl.constexpr(int(GradientRule.LOGIT))
    _G_SOFTMAX = tl.constexpr(int(GradientRule.SOFTMAX))
    _G_SOFTMAX_CHOSEN = tl.constexpr(int(GradientRule.SOFTMAX_CHOSEN))
    _G_SIGMOID = tl.constexpr(int(GradientRule.SIGMOID))
    _G_SIGMOID_RENORM = tl.constexpr(int(GradientRule.SIGMOID_RENORM))
    _G_SIGMOID_SCALED = tl.constexpr(int(GradientRule.SIGMOID_SCALED))
    _G_SIGMOID_TIMES_SCALE = tl.constexpr(int(GradientRule.SIGMOID_TIMES_SCALE))
    _G_SQRTSOFTPLUS_SCALED = tl.constexpr(int(GradientRule.SQRTSOFTPLUS_SCALED))
    _G_SQRTSOFTPLUS_TIMES_SCALE = tl.constexpr(int(GradientRule.SQRTSOFTPLUS_TIMES_SCALE))
    _SUM_EPSILON = tl.constexpr(SUM_EPSILON)
    _SOFTPLUS_THRESHOLD = tl.constexpr(SOFTPLUS_THRESHOLD)

    @triton.jit
    def _row_max(v, KEEP: tl.constexpr):
        if KEEP:
            return tl.max(v, axis=1, keep_dims=True)
        else:
            return tl.max(v, axis=1)

    @triton.jit
    def _row_sum(v, KEEP: tl.constexpr):
        if KEEP:
            return tl.sum(v, axis=1, keep_dims=True)
        else:
            return tl.sum(v, axis=1)

    @triton.jit
    def _column(v, KEEP: tl.constexpr):
        """A per-row value as a column that broadcasts over the row's cells."""
        if KEEP:
            return v
        else:
            return v[:, None]

    @triton.jit
    def masked_softmax(v, ok, row_ok, KEEP: tl.constexpr):
        """Softmax of each row of the 2-D ``v`` over its cells where ``ok`` (0 elsewhere); rows not
        ``row_ok`` take max 0 and sum 1, so they never divide 0 by 0."""
        v_max = tl.where(row_ok, _row_max(tl.where(ok, v, float("-inf")), KEEP), 0.0)
        ex = tl.where(ok, tl.exp(v - _column(v_max, KEEP)), 0.0)
        return ex / _column(tl.where(row_ok, _row_sum(ex, KEEP), 1.0), KEEP)

    @triton.jit
    def row_softmax(x, ok3, row_ok, METHOD: tl.constexpr, KEEP: tl.constexpr):
        """(x_max, z): the softmax over every expert of each row of the ``(BLOCK_M, NG_PAD, G_PAD)``
        logits ``x`` (valid where ``ok3``), as :func:`chosen_weights` and a SOFTMAX_BIAS key
        (``_select.ordered_keys``) read them; computed for the SOFTMAX rule and the SOFTMAX_BIAS key
        only, ``x`` itself (unread) otherwise."""
        if (_WEIGHT_RULE[METHOD] == _W_SOFTMAX) or _SOFTMAX_KEY[METHOD]:
            x_max = tl.where(row_ok, _row_max(tl.max(tl.where(ok3, x, float("-inf")), axis=2), KEEP), 0.0)
            ex = tl.where(ok3, tl.exp(x - _column(x_max, KEEP)[:, :, None]), 0.0)
            z = tl.where(row_ok, _row_sum(tl.sum(ex, axis=2), KEEP), 1.0)
        else:
            x_max = x
            z = x
        return x_max, z

    @triton.jit
    def gathered_row_softmax(
        logits_ptr, row_off, rows_ok, xs, group_size, n_group, stride_le, METHOD: tl.constexpr,
        NG_PAD: tl.constexpr, G_PAD: tl.constexpr, COMPUTE: tl.constexpr,
    ):  # fmt: skip
        """:func:`row_softmax` (``KEEP = True``) of rows held as (BLOCK_M, K_PAD) tiles of per-row
        values (``row_off``, ``rows_ok``: each row's value in every column), loading the rows'
        logits in ``COMPUTE``: the SOFTMAX rule alone reads whole rows; ``xs`` (unread) otherwise."""
        if _WEIGHT_RULE[METHOD] == _W_SOFTMAX:
            grp = tl.arange(0, NG_PAD)
            col = tl.arange(0, G_PAD)
            expert3 = (grp[:, None] * group_size + col[None, :])[None, :, :]
            # one column of the per-row values (they are equal across the columns)
            row_ok1 = tl.max(rows_ok.to(tl.int32), axis=1, keep_dims=True) > 0
            row_off1 = tl.max(row_off, axis=1, keep_dims=True)
            ok3 = row_ok1[:, :, None] & ((grp[:, None] < n_group) & (col[None, :] < group_size))[None, :, :]
            x = tl.load(logits_ptr + row_off1[:, :, None] + expert3 * stride_le, mask=ok3, other=0.0)
            x_max, z = row_softmax(x.to(COMPUTE), ok3, row_ok1, METHOD, True)
        else:
            x_max = xs
            z = xs
        return x_max, z

    @triton.jit
    def chosen_weights(xs, ok, row_ok, scale, x_max, z, METHOD: tl.constexpr, KEEP: tl.constexpr):
        """(BLOCK_M, K_PAD): the method's weights of the chosen experts, in ``xs``' dtype.

        xs: (BLOCK_M, K_PAD) - the chosen experts' logits, valid where ``ok``
        row_ok: the rows' validity ((BLOCK_M,), or (BLOCK_M, K_PAD) with ``KEEP``)
        scale: routed_scaling_factor: inside the rules that hold it, a product after every other
            rule (one multiply per weight on every launch, no constexpr: ``w * 1.0 == w`` exactly)
        x_max, z: :func:`row_softmax` of the rows (read by the SOFTMAX rule only)
        """
        RULE: tl.constexpr = _WEIGHT_RULE[METHOD]
        if RULE == _W_LOGIT:
            w = xs
        elif RULE == _W_SOFTMAX:
            # softmax over every expert, read at the chosen ones
            w = tl.exp(xs - _column(x_max, KEEP)) / _column(z, KEEP)
        elif RULE == _W_SOFTMAX_CHOSEN:
            # softmax over the chosen (== softmax, pick, renormalise)
            w = masked_softmax(xs, ok, row_ok, KEEP)
        elif (RULE == _W_SQRTSOFTPLUS_SCALED) or (RULE == _W_SQRTSOFTPLUS_TIMES_SCALE):  # noqa: SIM109
            q = sqrt_softplus(xs)
            if RULE == _W_SQRTSOFTPLUS_SCALED:
                total = _row_sum(tl.where(ok, q, 0.0), KEEP)
                eps = tl.full([], _SUM_EPSILON, xs.dtype)  # 1e-20 in float64 too
                w = q * scale / _column(total + eps, KEEP)
            else:
                w = q * scale
        else:
            s = tl.sigmoid(xs)
            total = _row_sum(tl.where(ok, s, 0.0), KEEP)
            eps = tl.full([], _SUM_EPSILON, xs.dtype)  # 1e-20 in float64 too (a literal is float32)
            if RULE == _W_SIGMOID_SCALED:
                w = s * scale / _column(total + eps, KEEP)
            elif RULE == _W_SIGMOID_TIMES_SCALE:
                w = s * scale
            elif RULE == _W_SIGMOID_RENORM:
                # NaN-propagating max, as torch.clamp: the default drops a NaN sum, and a NaN
                # logit's row would get 1e-20 as its denominator (finite weights up to 1e20)
                w = s / _column(tl.maximum(total, eps, propagate_nan=tl.PropagateNan.ALL), KEEP)
            else:
                tl.static_assert(RULE == _W_SIGMOID, "a weight rule without a Triton form")
                w = s
        if _HOLDS_SCALE[METHOD] == 0:
            # after the rule (after renormalisation), as vLLM, SGLang and Megatron scale
            w = w * scale
        return w

    @triton.jit
    def finite_rows(w, ok, KEEP: tl.constexpr):
        """(w, zeroed): the weights with 0 in every column of a row that holds a NaN or +-inf
        weight in a cell where ``ok``, and those rows (``(BLOCK_M,)`` bool, or ``(BLOCK_M, 1)`` with
        ``KEEP``; False on rows with no ``ok`` cell). docs/routing.md "Non-finite logits": the row
        contributes nothing and is counted once (:func:`record_zeroed`). A where and a row
        reduction; finite rows keep every bit. The twin is
        ``moe_ops.router.reference.zero_nonfinite_rows``."""
        # w * 0 is +-0 for a finite w and NaN for NaN and +-inf, so a row's sum of them is 0 exactly
        # when its cells are finite. Triton 3.6's LLVM (SLP vectorizer assertion "trying to erase
        # instruction with users") aborted on the equivalent test written as an int32 row max of
        # ~(|w| < inf) in replay's live rows at K_PAD = 32, BLOCK_M = 8, 4 warps, 128 experts.
        probe = _row_sum(tl.where(ok, w * 0.0, 0.0), KEEP)
        zeroed = probe != 0.0
        return tl.where(_column(zeroed, KEEP), 0.0, w), zeroed

    @triton.jit
    def zeroed_evidence(logits_ptr, rows64, id_i, w_i, stride_lm, stride_le, METHOD: tl.constexpr):
        """(BLOCK_M,) int32 of one routed column (``id_i`` -1 where masked): what the backward reads
        to know the rows :func:`finite_rows` zeroed in the forward, from what the forward saved,
        summed over the columns and decided by :func:`zeroed_by_forward`. The LOGIT rule (the
        weight is the logit itself, so a 0 weight may be a real one): 1 where the chosen logit is
        not finite (one gathered load per column). Every other rule: 1 where the saved weight is
        not 0 - a zeroed row has none, and a finite row whose weights are all exactly 0 (every
        score underflowed) has gradient 0 by the rule as well (``s (1 - s)``, ``p (g - dot)``)."""
        ok = id_i >= 0
        if _WEIGHT_RULE[METHOD] == _W_LOGIT:
            x = tl.load(logits_ptr + rows64 * stride_lm + id_i.to(tl.int64) * stride_le, mask=ok, other=0.0)
            return (ok & ~((x == x) & (tl.abs(x) < float("inf")))).to(tl.int32)
        else:
            return (ok & (w_i != 0)).to(tl.int32)

    @triton.jit
    def zeroed_by_forward(evidence, has_id, METHOD: tl.constexpr):
        """(BLOCK_M,) bool: the rows the forward zeroed, from :func:`zeroed_evidence` summed over the
        columns (``has_id``: rows with a routed column)."""
        if _WEIGHT_RULE[METHOD] == _W_LOGIT:
            return evidence > 0
        else:
            return (evidence == 0) & has_id

    @triton.jit
    def record_zeroed(counter_ptr, n_zeroed):
        """Adds a program's zeroed rows to the non-finite rows counter (``moe_ops.router.nonfinite``):
        one atomic per program that zeroed a row, none otherwise (a branch, as the hash kernel's
        faults). ``n_zeroed``: the program's count, ``tl.sum`` of :func:`finite_rows`' rows."""
        if n_zeroed > 0:
            tl.atomic_add(counter_ptr, n_zeroed)

    @triton.jit
    def unscaled_gradient_inputs(g_i, w_i, scale, inv_scale, METHOD: tl.constexpr):
        """(g, w) of one column as the method's gradient rule reads them: ``(scale * g, w * inv_scale)``
        (``inv_scale``: ``1 / scale``, 1 for a scale of 0) for a rule that does not hold
        routed_scaling_factor - the unscaled rule's gradient of ``scale * g`` at the unscaled
        weights, ``d(scale * w)/dx . g = dw/dx . (scale * g)`` - and ``(g, w)`` for one that does.
        A scale of 1 changes no bit (the reference's ``unscaled_gradient_inputs`` is the twin)."""
        if _HOLDS_SCALE[METHOD]:
            g_u = g_i
            w_u = w_i
        else:
            g_u = scale * g_i
            w_u = w_i * inv_scale
        return g_u, w_u

    @triton.jit
    def gradient_sigmoid(logits_ptr, rows64, id_i, ok, w_i, stride_lm, stride_le, METHOD: tl.constexpr):
        """(s, ds), each (BLOCK_M,) in ``w_i``'s dtype: the score of one column as the gradient
        reads it, and its derivative w.r.t. the logit where the rule needs that apart from ``s``.

        The normalised and the scaled sigmoid rules load the logit (an L2 hit: the forward read it)
        for ``s = sigmoid(x[id_i])``; the SIGMOID rule's weight is s itself, and the other rules
        never read it (``w_i`` too). The sqrtsoftplus rules: ``s = q = sqrt(softplus(x))`` and
        ``ds = dq/dx = softplus'(x) / (2 q)``, 0 where ``q == 0`` (the twin's
        ``sqrt_softplus_slope``); ``ds`` is ``s`` (unread) for every other rule."""
        GRAD: tl.constexpr = _GRADIENT_RULE[METHOD]
        # the weight is not s itself: s comes from the logit (no `in` in Triton)
        if (GRAD == _G_SIGMOID_SCALED) or (GRAD == _G_SIGMOID_RENORM) or (GRAD == _G_SIGMOID_TIMES_SCALE):  # noqa: SIM109
            x_i = tl.load(logits_ptr + rows64 * stride_lm + id_i.to(tl.int64) * stride_le, mask=ok, other=0.0)
            s_i = tl.where(ok, tl.sigmoid(x_i.to(w_i.dtype)), 0.0)
            ds_i = s_i
        elif (GRAD == _G_SQRTSOFTPLUS_SCALED) or (GRAD == _G_SQRTSOFTPLUS_TIMES_SCALE):  # noqa: SIM109
            x_i = tl.load(logits_ptr + rows64 * stride_lm + id_i.to(tl.int64) * stride_le, mask=ok, other=0.0)
            x_i = x_i.to(w_i.dtype)
            q_i = tl.where(ok, sqrt_softplus(x_i), 0.0)
            slope = tl.where(x_i > _SOFTPLUS_THRESHOLD, 1.0, tl.sigmoid(x_i))
            s_i = q_i
            ds_i = tl.where(q_i > 0.0, slope / (2.0 * q_i), 0.0)
        else:
            s_i = w_i
            ds_i = w_i
        return s_i, ds_i

    @triton.jit
    def gradient_rows(
        logits_ptr, rows64, cols, ok2, row_ok, dot, total, stride_lm, stride_le, METHOD: tl.constexpr,
        BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, COMPUTE: tl.constexpr,
    ):  # fmt: skip
        """(dense, dot, denom) after the backward's first pass over the columns (``dot = sum(g * w)``,
        ``total = sum(s)``, each (BLOCK_M,)): the (BLOCK_M, E_PAD) part of the gradient row that is
        not at a chosen expert (SOFTMAX: ``-p * dot``, its full softmax couples every expert; 0
        otherwise), ``dot`` as the columns read it and the sigmoid rules' denominator."""
        GRAD: tl.constexpr = _GRADIENT_RULE[METHOD]
        if GRAD == _G_SOFTMAX:
            # the full softmax couples every expert: d x_e = p_e * ([e in ids] g_e - dot)
            x = tl.load(
                logits_ptr + rows64[:, None] * stride_lm + cols[None, :] * stride_le, mask=ok2, other=0.0
            )
            p = masked_softmax(x.to(COMPUTE), ok2, row_ok, False)
            dense = -p * dot[:, None]
        else:
            dense = tl.zeros([BLOCK_M, E_PAD], dtype=COMPUTE)
        eps = tl.full([], _SUM_EPSILON, COMPUTE)  # 1e-20 in float64 too (a literal is float32)
        if (GRAD == _G_SIGMOID_SCALED) or (GRAD == _G_SQRTSOFTPLUS_SCALED):  # noqa: SIM109
            denom = total + eps
        elif GRAD == _G_SIGMOID_RENORM:
            # d max(S, eps) / dS is 1 where S >= eps, as torch.clamp's backward has it (a NaN sum
            # takes 0 there, as in the twin's torch.where)
            dot = tl.where(total >= eps, dot, 0.0)
            # NaN-propagating max, as torch.clamp: the default drops a NaN sum (then 1e-20 divides)
            denom = tl.maximum(total, eps, propagate_nan=tl.PropagateNan.ALL)
        else:
            denom = total  # unread
        return dense, dot, denom

    @triton.jit
    def gradient_column(g_i, w_i, s_i, ds_i, dot, denom, scale, METHOD: tl.constexpr):
        """(BLOCK_M,): the gradient w.r.t. the logit of one chosen column (module doc of
        ``moe_ops.replay.kernels``; SOFTMAX: its part at the chosen expert); ``s_i``, ``ds_i``:
        :func:`gradient_sigmoid`'s."""
        GRAD: tl.constexpr = _GRADIENT_RULE[METHOD]
        if GRAD == _G_LOGIT:
            gs = g_i
        elif GRAD == _G_SOFTMAX_CHOSEN:
            gs = w_i * (g_i - dot)
        elif GRAD == _G_SOFTMAX:
            gs = g_i * w_i  # w = p at the chosen expert
        elif GRAD == _G_SIGMOID_SCALED:
            gs = (scale * g_i - dot) / denom * s_i * (1.0 - s_i)
        elif GRAD == _G_SIGMOID_RENORM:
            gs = (g_i - dot) / denom * s_i * (1.0 - s_i)
        elif GRAD == _G_SIGMOID_TIMES_SCALE:
            gs = scale * g_i * s_i * (1.0 - s_i)
        elif GRAD == _G_SQRTSOFTPLUS_SCALED:
            gs = (scale * g_i - dot) / denom * ds_i
        elif GRAD == _G_SQRTSOFTPLUS_TIMES_SCALE:
            gs = scale * g_i * ds_i
        else:
            tl.static_assert(GRAD == _G_SIGMOID, "a gradient rule without a Triton form")
            gs = g_i * s_i * (1.0 - s_i)
        return gs

    __all__ += [
        "N_METHODS",
        "chosen_weights",
        "finite_rows",
        "gathered_row_softmax",
        "gradient_column",
        "gradient_rows",
        "gradient_sigmoid",
        "masked_softmax",
        "record_zeroed",
        "row_softmax",
        "unscaled_gradient_inputs",
        "zeroed_by_forward",
        "zeroed_evidence",
    ]
