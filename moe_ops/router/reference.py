"""PyTorch reference routers: every :class:`RoutingMethod`, literally, in any floating dtype.

This is the oracle of the Triton kernels and the CPU implementation of ``moe_ops.route``. It runs
in the dtype of its input: float32 for the CPU path (bf16/fp16 logits are upcast first), float64
for the accuracy tests. No host reads and fixed output shapes, so it traces under torch.compile and
captures in CUDA graphs.

Selection follows the package's tie-break rule (see :mod:`moe_ops.router.methods`): a stable
descending sort, so among equal scores the lowest expert index wins (``torch.topk`` promises no
order among ties). Every rule comes from the method table (:data:`moe_ops.router.methods.METHODS`):
keys of ``SelectionKey.SIGMOID_BIAS`` sort ``sigmoid(x) + bias``, of ``SOFTMAX_BIAS``
``softmax(x) + bias``, every other key the raw logits;
:func:`rule_weights` writes each weight rule once.
"""

from __future__ import annotations

import torch

from .methods import METHODS, GradientRule, RoutingMethod, SelectionKey, WeightRule

__all__ = [
    "SUM_EPSILON",
    "group_scores",
    "route_reference",
    "rule_gradient",
    "rule_weights",
    "select_experts",
    "selection_keys",
    "weights_for_ids",
]

# Added to (WeightRule.SIGMOID_SCALED) or the floor of (SIGMOID_RENORM) the sum of the chosen weights,
# as FlashInfer's runners and Hugging Face's DeepSeek-V3 do: a guard against 0/0, invisible otherwise.
SUM_EPSILON = 1e-20


def _canonical(keys: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (ranks below every number) and -0.0 -> 0.0 (a radix sort would split them)."""
    keys = torch.where(torch.isnan(keys), torch.full_like(keys, float("-inf")), keys)
    return torch.where(keys == 0, torch.zeros_like(keys), keys)


def selection_keys(x: torch.Tensor, method: RoutingMethod, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The per-expert score that selection sorts, in ``x``'s dtype.

    x: (n, E) float - logits already in the compute dtype
    bias: (E,) float or None - the selection bias of BIAS_METHODS
    Returns (n, E): ``sigmoid(x) + bias`` for the key ``SIGMOID_BIAS``, ``softmax(x) + bias`` for
    ``SOFTMAX_BIAS`` (the row's softmax as ``exp(x - max) / sum``, the kernels' order of
    operations), ``x`` otherwise (canonicalised).
    """
    key = METHODS[method].key
    if key == SelectionKey.SIGMOID_BIAS:
        keys = torch.sigmoid(x)
    elif key == SelectionKey.SOFTMAX_BIAS:
        keys = torch.softmax(x, dim=-1)
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
    computed literally in ``x``'s dtype.

    x: (n, E) float - logits in the compute dtype
    ids: (n, k) int64 - chosen experts
    Returns (n, k) in ``x``'s dtype.
    """
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
    (the backward of ``rule_weights`` with that rule's weight rule), in ``w``'s dtype.

    g: (n, k) float - gradient w.r.t. the weights, in ``w``'s dtype
    w: (n, k) float - the weights (the compute dtype)
    x: (n, E) float - the logits, in ``w``'s dtype
    ids: (n, k) int64 - the experts, distinct per row
    Returns (n, E): zero outside ``ids`` except for the SOFTMAX rule, whose softmax couples every
    expert.
    """
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
    Returns ``(weights (n, top_k) dtype, ids (n, top_k) int64)``.
    """
    if dtype is None:
        dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    x = router_logits.to(dtype)
    keys = selection_keys(x, method, bias)
    ids = select_experts(keys, top_k, n_group, topk_group, group_top)
    return weights_for_ids(x, ids, method, routed_scaling_factor, unnormalized), ids
