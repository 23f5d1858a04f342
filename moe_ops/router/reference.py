"""PyTorch reference routers: every :class:`RoutingMethod`, literally, in any floating dtype.

This is the oracle of the Triton kernels and the CPU implementation of ``moe_ops.route``. It runs
in the dtype of its input: float32 for the CPU path (bf16/fp16 logits are upcast first), float64
for the accuracy tests. No host reads and fixed output shapes, so it traces under torch.compile and
captures in CUDA graphs.

Selection follows the package's tie-break rule (see :mod:`moe_ops.router.methods`): a stable
descending sort, so among equal scores the lowest expert index wins (``torch.topk`` promises no
order among ties). Every rule comes from the method table (:data:`moe_ops.router.methods.METHODS`):
keys of ``SelectionKey.SIGMOID_BIAS`` sort ``sigmoid(x) + bias``, of ``SOFTMAX_BIAS``
``softmax(x) + bias``, of ``SQRTSOFTPLUS_BIAS`` ``sqrt_softplus(x) + bias``, every other key the raw
logits; :func:`rule_weights` writes each weight rule once.
"""

from __future__ import annotations

import torch

from .methods import GRADIENT_OF, METHODS, GradientRule, RoutingMethod, SelectionKey, WeightRule

__all__ = [
    "SOFTPLUS_THRESHOLD",
    "SUM_EPSILON",
    "group_scores",
    "hash_route_reference",
    "route_reference",
    "rule_gradient",
    "rule_weights",
    "select_experts",
    "selection_keys",
    "sqrt_softplus",
    "sqrt_softplus_slope",
    "unscaled_gradient_inputs",
    "weights_for_ids",
    "zero_nonfinite_rows",
]

# The gradient rules of the weight rules that hold routed_scaling_factor (WeightRule.holds_scale).
_HOLDS_SCALE = frozenset(GRADIENT_OF[rule.computed] for rule in WeightRule if rule.holds_scale)

# Added to (WeightRule.SIGMOID_SCALED, SQRTSOFTPLUS_SCALED) or the floor of (SIGMOID_RENORM) the sum
# of the chosen weights, as FlashInfer's runners and Hugging Face's DeepSeek-V3 and -V4 do: a guard
# against 0/0, invisible otherwise.
SUM_EPSILON = 1e-20
# softplus(x) is x above this (torch.nn.functional.softplus's default threshold, which transformers'
# DeepSeek-V4, Megatron and SGLang call, and vLLM's kernels write out)
SOFTPLUS_THRESHOLD = 20.0


def _canonical(keys: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (ranks below every number) and -0.0 -> 0.0 (a radix sort would split them)."""
    keys = torch.where(torch.isnan(keys), torch.full_like(keys, float("-inf")), keys)
    return torch.where(keys == 0, torch.zeros_like(keys), keys)


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    """``q = sqrt(softplus(x))`` (DeepSeek-V4's router score), in ``x``'s dtype, with the operations
    of the Triton helper ``moe_ops.router._select.sqrt_softplus`` in the same order, so that the
    kernels and this twin round alike (ids decided by one rounding agree).

    softplus is ``x`` above :data:`SOFTPLUS_THRESHOLD` (torch's rule), else ``log1p(exp(x))``,
    written as ``log(v) * u / (v - 1)`` with ``u = exp(x)``, ``v = 1 + u`` (``u`` where ``v``
    rounds to 1): Triton has no log1p the interpreter runs. Measured against float64
    ``F.softplus(x).sqrt()``: 1.5e-7 relative in float32 (torch's own float32 softplus: 1.1e-7),
    3.2e-16 in float64. ``x = -inf`` gives 0, ``+inf`` gives inf, NaN gives NaN.
    """
    u = torch.exp(x)
    v = 1 + u
    log1p = torch.where(v == 1, u, torch.log(v) * u / (v - 1))
    return torch.sqrt(torch.where(x > SOFTPLUS_THRESHOLD, x, log1p))


def sqrt_softplus_slope(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``dq/dx = softplus'(x) / (2 q)`` of :func:`sqrt_softplus` (``softplus'`` is ``sigmoid(x)``,
    1 above the threshold), 0 where ``q == 0``: the limit ``e^(x/2) / 2`` as ``x -> -inf`` (``q``
    is 0 only where softplus underflows, ``x`` below about -104 in float32 and -745 in float64:
    the true slope there is below 1.2e-23 and 4e-162). In ``x``'s dtype.
    """
    slope = torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
    return torch.where(q > 0, slope / (2 * q), torch.zeros_like(q))


def selection_keys(x: torch.Tensor, method: RoutingMethod, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The per-expert score that selection sorts, in ``x``'s dtype.

    x: (n, E) float - logits already in the compute dtype
    bias: (E,) float or None - the selection bias of BIAS_METHODS
    Returns (n, E): ``sigmoid(x) + bias`` for the key ``SIGMOID_BIAS``, ``softmax(x) + bias`` for
    ``SOFTMAX_BIAS`` (the row's softmax as ``exp(x - max) / sum``, the kernels' order of
    operations), ``sqrt_softplus(x) + bias`` for ``SQRTSOFTPLUS_BIAS``, ``x`` otherwise
    (canonicalised).
    """
    key = METHODS[method].key
    if key == SelectionKey.SIGMOID_BIAS:
        keys = torch.sigmoid(x)
    elif key == SelectionKey.SOFTMAX_BIAS:
        keys = torch.softmax(x, dim=-1)
    elif key == SelectionKey.SQRTSOFTPLUS_BIAS:
        keys = sqrt_softplus(x)
    else:
        return _canonical(x)
    if bias is not None:
        keys = keys + bias.to(x.dtype)
    return _canonical(keys)


def _sort_desc(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # stable: equal values keep ascending index order, i.e. the lowest index wins a tie
    return torch.sort(values, dim=-1, descending=True, stable=True)


def group_scores(keys: torch.Tensor, n_group: int, group_top: int = 2) -> torch.Tensor:
    """Group scores: the sum of each group's ``group_top`` best keys (``RouteConfig.group_top``: 1
    for GroupScore.MAX, 2 for TOP2_SUM; fewer where a group has fewer experts), added best first
    (the kernels' order: the same float sums).

    keys: (n, E) float - selection keys
    Returns (n, n_group) float, canonicalised (inf + -inf = NaN -> -inf).
    """
    n, num_experts = keys.shape
    size = num_experts // n_group
    top = _sort_desc(keys.reshape(n, n_group, size))[0][..., : min(group_top, size)]
    score = top[..., 0]
    for i in range(1, top.shape[-1]):
        score = score + top[..., i]
    return _canonical(score)


def select_experts(
    keys: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1, group_top: int = 2
) -> torch.Tensor:
    """Chosen experts by descending key, ties to the lowest index, inside the kept groups.

    keys: (n, E) float - selection keys (canonical: no NaN)
    group_top: the keys a group score sums (:func:`group_scores`)
    Returns (n, top_k) int64 expert ids.
    """
    n, num_experts = keys.shape
    order = _sort_desc(keys)[1]
    if n_group > 1:
        groups = _sort_desc(group_scores(keys, n_group, group_top))[1][:, :topk_group]
        kept = torch.zeros(n, n_group, dtype=torch.bool, device=keys.device)
        kept.scatter_(1, groups, True)
        kept = kept.repeat_interleave(num_experts // n_group, dim=1)
        # Kept experts first, each part still in key order: a stable sort on "kept" after the key
        # sort is a lexicographic (kept, key, -index) order. A -inf key inside a kept group thus
        # still beats every expert of a dropped group.
        kept_in_order = kept.gather(1, order).to(torch.int8)
        order = order.gather(1, _sort_desc(kept_in_order)[1])
    return order[:, :top_k]


def rule_weights(
    x: torch.Tensor,
    ids: torch.Tensor,
    rule: WeightRule,
    routed_scaling_factor: float = 1.0,
) -> torch.Tensor:
    """The weight rule ``rule`` (:class:`moe_ops.router.methods.WeightRule`) at the experts ``ids``,
    computed literally in ``x``'s dtype, times ``routed_scaling_factor`` (inside the rule where it
    holds the factor, ``WeightRule.holds_scale``; after it otherwise).

    x: (n, E) float - logits in the compute dtype
    ids: (n, k) int64 - chosen experts
    Returns (n, k) in ``x``'s dtype.
    """
    w = _rule_weights(x, ids, rule, routed_scaling_factor)
    # one product after the rule (after renormalisation), as vLLM, SGLang and Megatron apply it;
    # exact for the default 1.0
    return w if rule.holds_scale else w * routed_scaling_factor


def _rule_weights(
    x: torch.Tensor, ids: torch.Tensor, rule: WeightRule, routed_scaling_factor: float
) -> torch.Tensor:
    xs = x.gather(1, ids)
    if rule == WeightRule.LOGIT:
        return xs
    if rule == WeightRule.SOFTMAX:
        return torch.softmax(x, dim=-1).gather(1, ids)
    if rule == WeightRule.SOFTMAX_CHOSEN:
        return torch.softmax(xs, dim=-1)
    if rule == WeightRule.SOFTMAX_RENORM:
        probs = torch.softmax(x, dim=-1).gather(1, ids)
        return probs / probs.sum(-1, keepdim=True)
    if rule in (WeightRule.SQRTSOFTPLUS_SCALED, WeightRule.SQRTSOFTPLUS_TIMES_SCALE):
        q = sqrt_softplus(xs)
        if rule == WeightRule.SQRTSOFTPLUS_SCALED:
            return q * routed_scaling_factor / (q.sum(-1, keepdim=True) + SUM_EPSILON)
        return q * routed_scaling_factor
    s = torch.sigmoid(xs)
    if rule == WeightRule.SIGMOID_SCALED:
        return s * routed_scaling_factor / (s.sum(-1, keepdim=True) + SUM_EPSILON)
    if rule == WeightRule.SIGMOID_RENORM:
        return s / s.sum(-1, keepdim=True).clamp(min=SUM_EPSILON)
    if rule == WeightRule.SIGMOID_TIMES_SCALE:
        return s * routed_scaling_factor
    if rule == WeightRule.SIGMOID:
        return s
    raise ValueError(f"rule must be a WeightRule, got {rule!r}")


def zero_nonfinite_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, zeroed): ``w`` with 0 in every column of a row that holds a NaN or +-inf weight,
    and the (n,) bool mask of those rows - docs/routing.md "Non-finite logits": such a row
    contributes nothing (as padding) and is counted once. Rows whose weights are all finite are
    returned bit for bit. The twin of the kernels' ``moe_ops.router._weights.finite_rows``; every
    twin (router, hash router, replay forward and backward) calls it.

    w: (n, k) float - the method's weights of the routed columns, as the rule computed them
    """
    zeroed = ~torch.isfinite(w).all(dim=1)
    return torch.where(zeroed[:, None], torch.zeros_like(w), w), zeroed


def rule_gradient(
    g: torch.Tensor,
    w: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    rule: GradientRule,
    routed_scaling_factor: float = 1.0,
) -> torch.Tensor:
    """The gradient rule ``rule`` (:class:`moe_ops.router.methods.GradientRule`): the gradient of
    the loss w.r.t. every logit, from the gradient ``g`` of the weights ``w`` of the experts ``ids``
    (the backward of ``rule_weights`` with that rule's weight rule and ``routed_scaling_factor``),
    in ``w``'s dtype.

    g: (n, k) float - gradient w.r.t. the weights, in ``w``'s dtype
    w: (n, k) float - the weights (the compute dtype), scaled as ``rule_weights`` returns them
    x: (n, E) float - the logits, in ``w``'s dtype
    ids: (n, k) int64 - the experts, distinct per row
    Returns (n, E): zero outside ``ids`` except for the SOFTMAX rule, whose softmax couples every
    expert.

    A rule that does not hold the factor (``scale * rule``, ``WeightRule.holds_scale``) is
    differentiated as the rule's gradient of ``scale * g`` at the unscaled weights
    ``w * (1 / scale)`` (:func:`unscaled_gradient_inputs`).
    """
    if rule not in _HOLDS_SCALE:
        g, w = unscaled_gradient_inputs(g, w, routed_scaling_factor)
    dot = (g * w).sum(-1, keepdim=True)
    dense = torch.zeros(x.shape, dtype=w.dtype, device=x.device)
    if rule == GradientRule.LOGIT:
        gs = g
    elif rule == GradientRule.SOFTMAX_CHOSEN:
        gs = w * (g - dot)
    elif rule == GradientRule.SOFTMAX:
        p = torch.softmax(x, dim=-1)
        dense = -p * dot
        gs = g * p.gather(1, ids)
    elif rule in (GradientRule.SQRTSOFTPLUS_SCALED, GradientRule.SQRTSOFTPLUS_TIMES_SCALE):
        xs = x.gather(1, ids)
        q = sqrt_softplus(xs)
        if rule == GradientRule.SQRTSOFTPLUS_SCALED:
            gs_q = (routed_scaling_factor * g - dot) / (q.sum(-1, keepdim=True) + SUM_EPSILON)
        else:
            gs_q = routed_scaling_factor * g
        gs = gs_q * sqrt_softplus_slope(xs, q)
    else:
        s = torch.sigmoid(x.gather(1, ids))
        total = s.sum(-1, keepdim=True)
        if rule == GradientRule.SIGMOID_SCALED:
            gs_s = (routed_scaling_factor * g - dot) / (total + SUM_EPSILON)
        elif rule == GradientRule.SIGMOID_RENORM:
            # d max(S, eps) / dS is 1 where S >= eps, as torch.clamp's backward has it
            gs_s = (g - torch.where(total >= SUM_EPSILON, dot, 0.0)) / total.clamp(min=SUM_EPSILON)
        elif rule == GradientRule.SIGMOID_TIMES_SCALE:
            gs_s = routed_scaling_factor * g
        elif rule == GradientRule.SIGMOID:
            gs_s = g
        else:
            raise ValueError(f"rule must be a GradientRule, got {rule!r}")
        gs = gs_s * s * (1 - s)
    return dense.scatter_add(1, ids, gs)


def unscaled_gradient_inputs(
    g: torch.Tensor, w: torch.Tensor, routed_scaling_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale * g, w * (1 / scale))``: the incoming gradient and the weights of ``scale * rule`` as
    the unscaled rule's gradient reads them (``d(scale * w)/dx . g = dw/dx . (scale * g)``). A
    scale of 0 takes the reciprocal 1 (the weights are 0, ``0 / 0`` would be NaN; the gradient is
    0 either way), and a scale of 1 returns ``g`` and ``w`` unchanged, bit for bit. The kernels'
    helper (``moe_ops.router._weights.unscaled_gradient_inputs``) computes the same.

    g, w: (n, k) float - the incoming gradient and the scaled weights, in the compute dtype
    """
    inverse = 1.0 / (routed_scaling_factor if routed_scaling_factor != 0 else 1.0)
    return g * routed_scaling_factor, w * inverse


def weights_for_ids(
    x: torch.Tensor,
    ids: torch.Tensor,
    method: RoutingMethod,
    routed_scaling_factor: float = 1.0,
    unnormalized: bool = False,
) -> torch.Tensor:
    """The method's weights of the experts ``ids``, computed literally in ``x``'s dtype: its table
    row's weight rule (:func:`rule_weights`; its ``unnormalized`` rule where ``unnormalized``, the
    validated ``renormalize=False``).

    x: (n, E) float - logits in the compute dtype
    ids: (n, k) int64 - chosen experts
    Returns (n, k) in ``x``'s dtype.
    """
    return rule_weights(x, ids, METHODS[method].rule(unnormalized), routed_scaling_factor)


def route_reference(
    router_logits: torch.Tensor,
    top_k: int,
    method: RoutingMethod,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    dtype: torch.dtype | None = None,
    unnormalized: bool = False,
    group_top: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes every token; arguments as validated by :func:`validate_route_args`.

    router_logits: (n, E) float - router outputs
    bias: (E,) float or None - the selection bias of BIAS_METHODS
    dtype: compute dtype (default: float32, or float64 for float64 logits)
    unnormalized: the method's other weight rule (``RouteConfig.unnormalized``)
    group_top: the keys a group score sums (``RouteConfig.group_top``)
    Returns ``(weights (n, top_k) dtype, ids (n, top_k) int64)``: the literal formulas in IEEE
    arithmetic (NaN or inf weights kept; the router's twin then applies
    :func:`zero_nonfinite_rows`, docs/routing.md "Non-finite logits").
    """
    if dtype is None:
        dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    x = router_logits.to(dtype)
    keys = selection_keys(x, method, bias)
    ids = select_experts(keys, top_k, n_group, topk_group, group_top)
    return weights_for_ids(x, ids, method, routed_scaling_factor, unnormalized), ids


def hash_route_reference(
    router_logits: torch.Tensor,
    hash_table: torch.Tensor,
    token_ids: torch.Tensor,
    method: RoutingMethod,
    routed_scaling_factor: float = 1.0,
    dtype: torch.dtype | None = None,
    unnormalized: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (``route(..., hash_table=, token_ids=)``), literally: ``ids = hash_table[token_ids]``
    and the method's literal weight rule at them (:func:`weights_for_ids`). Faulty rows (a token id
    outside ``[0, vocab)``, an entry outside ``[0, num_experts)``) get ids -1 and weights 0.

    router_logits: (n, E) float; hash_table: (vocab, k) integer; token_ids: (n,) integer
    dtype: compute dtype (default: float32, or float64 for float64 logits)
    Returns ``(weights (n, k) dtype, ids (n, k) int64)``.
    """
    if dtype is None:
        dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    x = router_logits.to(dtype)
    vocab, num_experts = hash_table.shape[0], x.shape[1]
    tok = token_ids.to(torch.int64)
    token_ok = (tok >= 0) & (tok < vocab)
    rows = hash_table[tok.clamp(0, vocab - 1)].to(torch.int64)
    ok = token_ok & ((rows >= 0) & (rows < num_experts)).all(1)
    ids = torch.where(ok[:, None], rows, -1)
    w = weights_for_ids(x, ids.clamp(min=0), method, routed_scaling_factor, unnormalized)
    return torch.where(ok[:, None], w, 0.0), ids
