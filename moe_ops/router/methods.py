"""Routing methods (``RoutingMethod``) and the checks every router backend runs before it computes.

``RoutingMethod`` has the integer values and semantics of FlashInfer's ``RoutingMethodType``, so an id
means the same method in moe-ops and FlashInfer. Not in TensorRT-LLM: its own ``RoutingMethodType``
agrees on 0-4 only (its 5 is MiniMax2, its 6 and 7 changed between versions), so a peer's method is
translated by name (docs/routing.md, "Peers' names"), never by its integer.

Selection and weights, per method (``x`` = logits, ``s = sigmoid(x)``, ``sel`` = the chosen experts
of a token, ``scale`` = ``routed_scaling_factor``)::

    value  name               chooses by            weights
    0      DEFAULT            x (softmax order)     softmax(x)[sel] (over all experts, not renormalised)
    1      RENORMALIZE        x                     softmax(x[sel])
    2      DEEPSEEK_V3        s + bias, in groups   s * scale / (sum s + 1e-20)
    3      LLAMA4             x, top_k = 1          s
    4      RENORMALIZE_NAIVE  x (softmax order)     p[sel] / sum p[sel], p = softmax(x) (computed as
                                                  its equal softmax(x[sel]) by the kernels and twins)
    5      TOPK               x                     x
    6      SIGMOID_RENORM     x (sigmoid order)     s / max(sum s, 1e-20)
    7      MINIMAX2           s + bias              s * scale / (sum s + 1e-20)
    8      SIGMOID            x (sigmoid order)     s
    9      TOPK_SIGMOID       x                     s
    32     DEEPSEEK_V2        x (softmax order),    softmax(x)[sel] (over all experts, not renormalised;
                              in groups (MAX)       renormalize=True: p[sel] / sum p[sel])
    33     SOFTMAX_BIAS       softmax(x) + bias,    p[sel] / sum p[sel], p = softmax(x) (unbiased;
                              groups optional       renormalize=False: p[sel])
    34     SQRTSOFTPLUS       q + bias              q * scale / (sum q + 1e-20), q = sqrt(softplus(x))

``routed_scaling_factor`` applies to every method (vLLM's and SGLang's ``routed_scaling_factor``,
Megatron's ``moe_router_topk_scaling_factor``): DEEPSEEK_V3's and MINIMAX2's rules hold it inside
(:data:`SCALED_RULES`, as written above); every other method's weights are ``scale * weights``,
the product taken after its rule (after renormalisation), and its gradient is the rule's gradient
of ``scale * g``. Without it the scale is 1.0, and ``w * 1.0 == w`` exactly.

:data:`METHODS` holds these rules as one :class:`~moe_ops.router.rules.MethodSpec` per method
(selection key, weight rule, gradient rule, bias, scaling, groups, fixed top_k), written in the
vocabulary of :mod:`moe_ops.router.rules`; everything else reads them from there. The checks of a
routing call's arguments against the table are :mod:`moe_ops.router.args`.

Expert groups (the methods of :data:`GROUP_METHODS`): each group gets a score from its keys by the
:class:`GroupScore` rule (``group_score``; None: the method's own, ``MethodSpec.group_score``), the
``topk_group`` best groups stay and the top-k experts are chosen inside them. ``n_group`` None or
``<= 1`` means no grouping. DeepSeek-V3's score is the sum of a group's two best ``s + bias`` values
(its one value when a group has a single expert, ``TOP2_SUM``); DeepSeek-V2's is its best expert's
softmax (``MAX``), which DEEPSEEK_V2 takes as the best logit: softmax keeps the logits' order, so
the groups, the experts and the tie rule below are the same, and no rounding of a softmax merges two
different logits into a tie. A score that sums several keys needs keys that are the scores
themselves (``SIGMOID_BIAS``, ``SOFTMAX_BIAS``: the sum of two logits orders groups differently from
the sum of their probabilities), so DEEPSEEK_V2 takes ``MAX`` only (softmax sums: SOFTMAX_BIAS).

Tie-break rule (all backends of this package): **among equal selection scores the lowest expert
index wins**, and the chosen experts are listed by descending score, equal scores in ascending
index. Groups tie the same way. Methods without a bias choose on the raw logits (softmax and
sigmoid keep their order), so rounding inside a softmax or a saturating sigmoid never merges two
different logits into a tie; NaN scores rank below every number (as -inf), and -0.0 equals 0.0.

SQRTSOFTPLUS (DeepSeek-V4) chooses on ``q + bias``, ``q = sqrt(softplus(x))`` in float32 (float64
in replay's float64 path), softplus with torch's threshold: ``x`` where ``x > 20``, else
``log1p(exp(x))``. The same rule orders the keys: equal keys go to the lowest index. The key is
not order-preserving in ``x``: with a bias two experts' order is the bias's as much as the
logits', and without one, ``q`` rounds different logits to one key (every ``x`` below about -104
gives ``q = 0`` in float32); those are ties, decided by the index. NaN logits key as -inf.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping

# the rules' vocabulary, re-exported: a method's row is written in it
from .rules import (
    GRADIENT_OF,
    SCALED_RULES,
    SCORE_KEYS,
    GradientRule,
    GroupScore,
    MethodSpec,
    SelectionKey,
    WeightRule,
)

__all__ = [
    "BIAS_METHODS",
    "GRADIENT_OF",
    "GROUP_METHODS",
    "METHODS",
    "N_METHOD_VALUES",
    "OWN_METHODS_START",
    "RENORMALIZED_METHODS",
    "SCALED_METHODS",
    "SCALED_RULES",
    "SCORE_KEYS",
    "UNNORMALIZED_METHODS",
    "GradientRule",
    "GroupScore",
    "MethodSpec",
    "RoutingMethod",
    "SelectionKey",
    "WeightRule",
    "method_names",
    "rule_column",
    "rule_table",
    "table_column",
]


OWN_METHODS_START = 32


class RoutingMethod(enum.IntEnum):
    """How a router turns logits into (weights, ids); values below :data:`OWN_METHODS_START`
    equal FlashInfer's RoutingMethodType (not TensorRT-LLM's, whose 5 is MiniMax2:
    docs/routing.md); moe-ops' own methods take values from :data:`OWN_METHODS_START` on."""

    DEFAULT = 0  # softmax over all experts, then top-k; weights not renormalised
    RENORMALIZE = 1  # top-k on logits, then softmax over the k selected
    DEEPSEEK_V3 = 2  # sigmoid + bias, grouped top-k; weights unbiased sigmoid, normalised, scaled
    LLAMA4 = 3  # top-1 on logits, weight sigmoid(logit)
    RENORMALIZE_NAIVE = 4  # softmax, top-k, renormalise (same ids and weights as RENORMALIZE)
    TOPK = 5  # top-k on logits; weights are the raw logits
    SIGMOID_RENORM = 6  # sigmoid, top-k, divide by the sum
    MINIMAX2 = 7  # sigmoid + bias chooses top-k; weights unbiased sigmoid, normalised, scaled
    SIGMOID = 8  # sigmoid, top-k, no renormalisation
    TOPK_SIGMOID = 9  # top-k on raw logits, then sigmoid
    # moe-ops' own methods (OWN_METHODS_START on; FlashInfer has none of these)
    DEEPSEEK_V2 = 32  # softmax, group-limited greedy (a group's best score); weights softmax(x)[sel]
    SOFTMAX_BIAS = 33  # softmax + bias chooses (groups optional); weights unbiased softmax, renormalised
    # DeepSeek-V4: sqrt(softplus(x)) + bias chooses; weights unbiased q, normalised, scaled
    SQRTSOFTPLUS = 34


_SIGMOID_SCALED = dict(
    weight=WeightRule.SIGMOID_SCALED,
    gradient=GradientRule.SIGMOID_SCALED,
    scaled=True,
    renormalizes=True,
    unnormalized=WeightRule.SIGMOID_TIMES_SCALE,
)
_SIGMOID = dict(weight=WeightRule.SIGMOID, gradient=GradientRule.SIGMOID)
_RENORM = dict(renormalizes=True)
_PLAIN = dict(renormalizes=False)
_M = RoutingMethod
# The method table: the one place a method's rules are written. Validation, BIAS_METHODS and
# SCALED_METHODS, the reference (selection keys, weights), the replay twins and the Triton helpers
# of the router and replay kernels (moe_ops.router._select, moe_ops.router._weights) read it.
# A plain dict, never mutated: torch.compile traces validate_route_args, and Dynamo cannot read a
# mappingproxy keyed by enum members (a graph break in every compiled route, torch 2.13).
METHODS: Mapping[RoutingMethod, MethodSpec] = {
    _M.DEFAULT: MethodSpec(SelectionKey.SOFTMAX_ORDER, WeightRule.SOFTMAX, GradientRule.SOFTMAX, **_PLAIN),
    _M.RENORMALIZE: MethodSpec(
        SelectionKey.LOGIT, WeightRule.SOFTMAX_CHOSEN, GradientRule.SOFTMAX_CHOSEN, **_RENORM
    ),
    _M.DEEPSEEK_V3: MethodSpec(
        SelectionKey.SIGMOID_BIAS, **_SIGMOID_SCALED, bias=True, groups=True, group_score=GroupScore.TOP2_SUM
    ),
    _M.LLAMA4: MethodSpec(SelectionKey.LOGIT, **_SIGMOID, top_k=1),
    _M.RENORMALIZE_NAIVE: MethodSpec(
        SelectionKey.SOFTMAX_ORDER, WeightRule.SOFTMAX_RENORM, GradientRule.SOFTMAX_CHOSEN, **_RENORM
    ),
    _M.TOPK: MethodSpec(SelectionKey.LOGIT, WeightRule.LOGIT, GradientRule.LOGIT),
    _M.SIGMOID_RENORM: MethodSpec(
        SelectionKey.SIGMOID_ORDER, WeightRule.SIGMOID_RENORM, GradientRule.SIGMOID_RENORM, **_RENORM
    ),
    _M.MINIMAX2: MethodSpec(SelectionKey.SIGMOID_BIAS, **_SIGMOID_SCALED, bias=True),
    _M.SIGMOID: MethodSpec(SelectionKey.SIGMOID_ORDER, **_SIGMOID, **_PLAIN),
    _M.TOPK_SIGMOID: MethodSpec(SelectionKey.LOGIT, **_SIGMOID, **_PLAIN),
    # softmax scores, so the weights read the whole row (not renormalised) unless renormalize=True;
    # routed_scaling_factor multiplies after the rule (WeightRule.holds_scale), as DeepSeek-V2's
    _M.DEEPSEEK_V2: MethodSpec(
        SelectionKey.SOFTMAX_ORDER, WeightRule.SOFTMAX, GradientRule.SOFTMAX, **_PLAIN, groups=True,
        group_score=GroupScore.MAX, renormalized=WeightRule.SOFTMAX_RENORM,
    ),
    _M.SOFTMAX_BIAS: MethodSpec(
        SelectionKey.SOFTMAX_BIAS, WeightRule.SOFTMAX_RENORM, GradientRule.SOFTMAX_CHOSEN, **_RENORM,
        bias=True, groups=True, group_score=GroupScore.TOP2_SUM, unnormalized=WeightRule.SOFTMAX,
    ),
    # no groups: no peer groups sqrtsoftplus scores but Megatron (docs/routing.md)
    _M.SQRTSOFTPLUS: MethodSpec(
        SelectionKey.SQRTSOFTPLUS_BIAS, WeightRule.SQRTSOFTPLUS_SCALED, GradientRule.SQRTSOFTPLUS_SCALED,
        bias=True, scaled=True, renormalizes=True, unnormalized=WeightRule.SQRTSOFTPLUS_TIMES_SCALE,
    ),
}  # fmt: skip
del _M, _SIGMOID, _SIGMOID_SCALED, _RENORM, _PLAIN
if set(METHODS) != set(RoutingMethod):
    raise ValueError(f"METHODS needs one row per RoutingMethod, missing {set(RoutingMethod) - set(METHODS)}")

# The width of a table column (table_column): every value up to the largest method's.
N_METHOD_VALUES = max(RoutingMethod) + 1
_METHOD_VALUES = frozenset(int(m) for m in RoutingMethod)

# Methods that take a selection bias (their key is one of SCORE_KEYS: a score, not an order).
BIAS_METHODS = frozenset(m for m, spec in METHODS.items() if spec.bias)
# Methods whose weight rule holds routed_scaling_factor inside (WeightRule.holds_scale); every
# method takes the factor, the others multiply their rule's weights by it.
SCALED_METHODS = frozenset(m for m, spec in METHODS.items() if spec.scaled)
# Methods that take expert groups (n_group, topk_group) and group_score.
GROUP_METHODS = frozenset(m for m, spec in METHODS.items() if spec.groups)
# Methods that renormalize=False switches to their unnormalized weight rule.
UNNORMALIZED_METHODS = frozenset(m for m, spec in METHODS.items() if spec.unnormalized is not None)
# Methods that renormalize=True switches to their renormalized weight rule.
RENORMALIZED_METHODS = frozenset(m for m, spec in METHODS.items() if spec.renormalized is not None)


def table_column(read: Callable[[MethodSpec], object]) -> tuple:
    """``(read(METHODS[m]) for m of value 0, 1, ..., N_METHOD_VALUES - 1)``: a column of the table
    that a Triton kernel indexes with its constexpr ``METHOD`` (kernels read constexpr globals only,
    never a dict). A value no method has (FlashInfer's 10 and the gap up to
    :data:`OWN_METHODS_START`) holds DEFAULT's entry: no kernel is ever launched with it."""
    return tuple(
        read(METHODS[RoutingMethod(value) if value in _METHOD_VALUES else RoutingMethod.DEFAULT])
        for value in range(N_METHOD_VALUES)
    )


def rule_table(read: Callable[[WeightRule, GradientRule], object]) -> tuple:
    """The weight/gradient rule columns a Triton kernel indexes with ``rule_column(METHOD, UNNORM)``:
    ``read(weight.computed, gradient)`` of every method by value, then of every method's
    renormalize=False rule (its own rule where it has none: that column is never selected)."""
    return table_column(lambda spec: read(*spec.computed(False))) + table_column(
        lambda spec: read(*spec.computed(True))
    )


def rule_column(method: int, unnormalized: bool) -> int:
    """The column of :func:`rule_table` that holds ``method``'s rules (with renormalize=False where
    ``unnormalized``)."""
    return int(method) + N_METHOD_VALUES * bool(unnormalized)


def method_names(methods: frozenset[RoutingMethod]) -> str:
    """``"A"``, ``"A and B"``, ``"A, B and C"``: the names of ``methods`` in value order."""
    names = [m.name for m in sorted(methods)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
