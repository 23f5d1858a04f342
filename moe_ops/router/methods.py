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

:data:`METHODS` holds these rules as one :class:`MethodSpec` per method (selection key, weight
rule, gradient rule, bias, scaling, groups, fixed top_k); everything else reads them from there.

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
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

__all__ = [
    "BIAS_METHODS",
    "GRADIENT_OF",
    "GROUP_METHODS",
    "LOGIT_DTYPES",
    "METHODS",
    "N_METHOD_VALUES",
    "OWN_METHODS_START",
    "RENORMALIZED_METHODS",
    "REPLAY_LOGIT_DTYPES",
    "SCALED_METHODS",
    "SCALED_RULES",
    "SCORE_KEYS",
    "UNNORMALIZED_METHODS",
    "GradientRule",
    "GroupScore",
    "MethodSpec",
    "RouteConfig",
    "RoutingMethod",
    "SelectionKey",
    "WeightRule",
    "group_score_from_value",
    "method_from_value",
    "method_names",
    "rule_column",
    "rule_table",
    "table_column",
    "validate_route_args",
]


# moe-ops' own methods (those FlashInfer's RoutingMethodType lacks) take values from here on:
# FlashInfer's enum ends at 10 (Unspecified) and has grown past its end before, so a gap keeps a
# method it adds later from meeting one of ours at the same integer.
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


class SelectionKey(enum.IntEnum):
    """What selection sorts (the tie-break rule of the module doc applies to every key)."""

    LOGIT = 0  # x
    SOFTMAX_ORDER = 1  # softmax(x): sorted as x, whose order it keeps
    SIGMOID_ORDER = 2  # sigmoid(x): sorted as x, whose order it keeps (no saturation ties)
    SIGMOID_BIAS = 3  # sigmoid(x) + bias (bias optional): not sorted as x
    SOFTMAX_BIAS = 4  # softmax(x) + bias (bias optional): not sorted as x; needs the row's softmax
    SQRTSOFTPLUS_BIAS = 5  # sqrt(softplus(x)) + bias (bias optional): not sorted as x


# Keys that are the scores themselves, not an order of the logits: the keys a bias adds to and a
# group score may sum.
SCORE_KEYS = frozenset({SelectionKey.SIGMOID_BIAS, SelectionKey.SOFTMAX_BIAS, SelectionKey.SQRTSOFTPLUS_BIAS})


class GroupScore(enum.IntEnum):
    """A group's score, from its experts' selection keys (the groups of :data:`GROUP_METHODS`)."""

    MAX = 1  # its best key (DeepSeek-V2; vLLM's grouped_topk without a bias)
    TOP2_SUM = 2  # the sum of its two best keys, its one key for a one-expert group (DeepSeek-V3)
    # the sum of its top_k // topk_group best keys (Megatron's group_limited_topk)
    TOPK_SHARE_SUM = 3

    def keys_summed(self, top_k: int, topk_group: int) -> int:
        """How many of a group's best keys its score sums (TOP2_SUM: 2, fewer in a one-expert group)."""
        if self is GroupScore.MAX:
            return 1
        if self is GroupScore.TOP2_SUM:
            return 2
        return top_k // topk_group


class WeightRule(enum.IntEnum):
    """The weights of the chosen experts ``sel`` (``s = sigmoid(x[sel])``, ``scale`` =
    ``routed_scaling_factor``, ``eps`` = 1e-20)."""

    LOGIT = 0  # x[sel]
    SOFTMAX = 1  # softmax(x)[sel]: over every expert, not renormalised
    SOFTMAX_CHOSEN = 2  # softmax(x[sel])
    # p[sel] / sum p[sel], p = softmax(x): the reference computes it literally; the kernels and the
    # twins compute its exact equal SOFTMAX_CHOSEN (see WeightRule.computed)
    SOFTMAX_RENORM = 3
    SIGMOID = 4  # s
    SIGMOID_RENORM = 5  # s / max(sum s, eps)
    SIGMOID_SCALED = 6  # s * scale / (sum s + eps)
    # s * scale: SIGMOID_SCALED with renormalize=False (vLLM's and SGLang's biased sigmoid with
    # renormalize off, transformers' DeepSeek-V3 with norm_topk_prob=False)
    SIGMOID_TIMES_SCALE = 7
    # q * scale / (sum q + eps), q = sqrt(softplus(x[sel])) (DeepSeek-V4's router)
    SQRTSOFTPLUS_SCALED = 8
    # q * scale: SQRTSOFTPLUS_SCALED with renormalize=False (vLLM's sqrtsoftplus with renormalize off)
    SQRTSOFTPLUS_TIMES_SCALE = 9

    @property
    def holds_scale(self) -> bool:
        """Whether the rule reads ``routed_scaling_factor`` itself (:data:`SCALED_RULES`); the
        weights of every other rule are ``scale * rule`` and its gradient the rule's gradient of
        ``scale * g``, applied around the rule by the reference and the kernels' helpers alike."""
        return self in SCALED_RULES

    @property
    def computed(self) -> WeightRule:
        """The rule the kernels and their twins evaluate: SOFTMAX_RENORM as SOFTMAX_CHOSEN (the
        literal form reads the whole row and underflows to 0 / 0 where the other is finite), every
        other rule as itself."""
        return WeightRule.SOFTMAX_CHOSEN if self is WeightRule.SOFTMAX_RENORM else self


class GradientRule(enum.IntEnum):
    """The gradient w.r.t. ``x[sel]`` (SOFTMAX: w.r.t. every ``x``) of a computed weight rule; ``g``
    the incoming gradient of the weights, ``w`` the weights, ``dot = sum(g * w)``, ``S = sum s``."""

    LOGIT = 0  # g
    SOFTMAX = 1  # p * (onehot(sel) . g - dot), p = softmax(x) over the row (dense)
    SOFTMAX_CHOSEN = 2  # w * (g - dot)
    SIGMOID = 3  # g * s * (1 - s)
    SIGMOID_RENORM = 4  # (g - [S >= eps] * dot) / max(S, eps) * s * (1 - s)
    SIGMOID_SCALED = 5  # (scale * g - dot) / (S + eps) * s * (1 - s)
    SIGMOID_TIMES_SCALE = 6  # scale * g * s * (1 - s)
    # q = sqrt(softplus(x)), Q = sum q, dq/dx = sigmoid(x) / (2 q), taken as 0 where q == 0 (its
    # limit e^(x/2) / 2 as x -> -inf; q is 0 only below about x = -104 in float32, -745 in float64)
    SQRTSOFTPLUS_SCALED = 7  # (scale * g - dot) / (Q + eps) * dq/dx
    SQRTSOFTPLUS_TIMES_SCALE = 8  # scale * g * dq/dx


# The gradient of each computed weight rule (WeightRule.computed): what MethodSpec checks.
GRADIENT_OF: Mapping[WeightRule, GradientRule] = MappingProxyType({
    WeightRule.LOGIT: GradientRule.LOGIT,
    WeightRule.SOFTMAX: GradientRule.SOFTMAX,
    WeightRule.SOFTMAX_CHOSEN: GradientRule.SOFTMAX_CHOSEN,
    WeightRule.SIGMOID: GradientRule.SIGMOID,
    WeightRule.SIGMOID_RENORM: GradientRule.SIGMOID_RENORM,
    WeightRule.SIGMOID_SCALED: GradientRule.SIGMOID_SCALED,
    WeightRule.SIGMOID_TIMES_SCALE: GradientRule.SIGMOID_TIMES_SCALE,
    WeightRule.SQRTSOFTPLUS_SCALED: GradientRule.SQRTSOFTPLUS_SCALED,
    WeightRule.SQRTSOFTPLUS_TIMES_SCALE: GradientRule.SQRTSOFTPLUS_TIMES_SCALE,
})  # fmt: skip
# Weight rules that read routed_scaling_factor inside their formula: exactly the rules of the
# scaled methods. Every other rule's weights are multiplied by it after the rule.
SCALED_RULES = frozenset({
    WeightRule.SIGMOID_SCALED,
    WeightRule.SIGMOID_TIMES_SCALE,
    WeightRule.SQRTSOFTPLUS_SCALED,
    WeightRule.SQRTSOFTPLUS_TIMES_SCALE,
})  # fmt: skip


@dataclass(frozen=True)
class MethodSpec:
    """One routing method: everything validation, the references, the router kernel and the replay
    kernels and twins need to know about it (one row of :data:`METHODS`)."""

    # what selection sorts; SCORE_KEYS are sorted as something other than the raw logits
    key: SelectionKey
    # the weights of the chosen experts (the reference's literal rule; the kernels and twins
    # evaluate weight.computed)
    weight: WeightRule
    # the backward of weight.computed: GRADIENT_OF[weight.computed]
    gradient: GradientRule
    # takes a (num_experts,) selection bias; only with a key of SCORE_KEYS, never part of the weights
    bias: bool = False
    # its weight rule holds routed_scaling_factor inside: exactly when weight is in SCALED_RULES
    # (every method takes the factor; the others' weights are scale * rule, WeightRule.holds_scale)
    scaled: bool = False
    # takes expert groups (n_group, topk_group)
    groups: bool = False
    # the only top_k the method takes, or None for any 1 <= top_k <= num_experts
    top_k: int | None = None
    # whether its weights are divided by their sum over the chosen experts: what renormalize=None
    # keeps; None where the knob cannot apply (raw logits, one expert)
    renormalizes: bool | None = None
    # the weight rule renormalize=False selects, for a renormalising method that has no
    # RoutingMethod of its own without the division (another method's row is that method)
    unnormalized: WeightRule | None = None
    # the group score group_score=None keeps (methods with groups only); a rule that sums keys
    # needs a key of SCORE_KEYS
    group_score: GroupScore | None = None
    # the weight rule renormalize=True selects, for a method that does not renormalise and has no
    # RoutingMethod of its own with the division; it shares the unnormalized rule's kernel column
    # (a method has one of the two: its other rule)
    renormalized: WeightRule | None = None

    @property
    def unnormalized_gradient(self) -> GradientRule | None:
        """The gradient of :attr:`unnormalized` (None without one)."""
        return None if self.unnormalized is None else GRADIENT_OF[self.unnormalized.computed]

    def rule(self, unnormalized: bool = False) -> WeightRule:
        """The literal weight rule: the method's other rule where ``unnormalized`` (a validated
        ``renormalize`` opposite to :attr:`renormalizes`, ``RouteConfig.unnormalized``:
        :attr:`unnormalized`, or :attr:`renormalized`), :attr:`weight` otherwise."""
        other = self.unnormalized if self.unnormalized is not None else self.renormalized
        return other if unnormalized and other is not None else self.weight

    def computed(self, unnormalized: bool = False) -> tuple[WeightRule, GradientRule]:
        """(weight rule, gradient rule) the kernels and twins evaluate (``WeightRule.computed``)."""
        weight = self.rule(unnormalized).computed
        return weight, GRADIENT_OF[weight]

    def __post_init__(self) -> None:
        if self.gradient != GRADIENT_OF[self.weight.computed]:
            raise ValueError(f"gradient must be {GRADIENT_OF[self.weight.computed]!r}, got {self.gradient!r}")
        if self.scaled != (self.weight in SCALED_RULES):
            raise ValueError(f"scaled must be {self.weight in SCALED_RULES} for {self.weight!r}")
        if self.bias and self.key not in SCORE_KEYS:
            raise ValueError("bias needs a key of SCORE_KEYS (a bias adds to a score, not to an order)")
        if self.groups != (self.group_score is not None):
            raise ValueError("groups needs a group_score, and only a method with groups has one")
        if self.group_score not in (None, GroupScore.MAX) and self.key not in SCORE_KEYS:
            raise ValueError(f"group_score {self.group_score!r} sums keys: it needs a key of SCORE_KEYS")
        if self.renormalized is not None:
            if self.renormalizes is not False or self.unnormalized is not None:
                raise ValueError("renormalized needs renormalizes=False (it is the rule with the division)")
            if self.scaled != (self.renormalized in SCALED_RULES):
                raise ValueError(
                    f"scaled must be {self.renormalized in SCALED_RULES} for {self.renormalized!r}"
                )
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {self.top_k}")
        if self.unnormalized is not None:
            if self.renormalizes is not True:
                raise ValueError("unnormalized needs renormalizes=True (it is the rule without the division)")
            if self.scaled != (self.unnormalized in SCALED_RULES):
                want = self.unnormalized in SCALED_RULES
                raise ValueError(f"scaled must be {want} for {self.unnormalized!r}")


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


# What route (and its kernel, which computes in float32) takes.
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What replay_routing takes: float64 logits are computed in float64 (weights and gradients too).
REPLAY_LOGIT_DTYPES = (*LOGIT_DTYPES, torch.float64)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}


def _dtype_list(dtypes: tuple[torch.dtype, ...]) -> str:
    names = [_DTYPE_NAMES[d] for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def method_from_value(method: RoutingMethod | int) -> RoutingMethod:
    """Returns ``method`` as a :class:`RoutingMethod`, raising ValueError for anything but a
    RoutingMethod or an int (numpy ints included) naming one: never a float, str or bool."""
    if isinstance(method, RoutingMethod):
        return method
    if not isinstance(method, bool) and isinstance(method, (int, np.integer)):
        try:
            return RoutingMethod(int(method))
        except ValueError:
            pass
    names = ", ".join(f"{m.name}={m.value}" for m in RoutingMethod)
    raise ValueError(f"method must be a RoutingMethod ({names}), got {method!r}")


@dataclass(frozen=True)
class RouteConfig:
    """Validated routing arguments, normalised for the kernels (host values only)."""

    # the routing method
    method: RoutingMethod
    # experts per token, 1 <= top_k <= num_experts (METHODS[method].top_k where it is set)
    top_k: int
    # experts of the router, >= 1
    num_experts: int
    # DeepSeek-V3 groups; 1 when there is no grouping; divides num_experts
    n_group: int
    # groups kept per token, 1 <= topk_group <= n_group (== n_group when there is no grouping)
    topk_group: int
    # multiplies the weights of every method (1.0 when not given: bit-identical to no factor); finite
    routed_scaling_factor: float
    # renormalize opposite to the method's own (renormalize=False on UNNORMALIZED_METHODS,
    # renormalize=True on RENORMALIZED_METHODS): its other weight rule (MethodSpec.rule)
    unnormalized: bool = False
    # the group score (the method's own where group_score=None); TOP2_SUM for a method without
    # groups (never read)
    group_score: GroupScore = GroupScore.TOP2_SUM

    @property
    def group_top(self) -> int:
        """How many of a group's best keys its score sums: the kernels' constexpr (2 when there is
        no grouping, never read)."""
        if not self.grouped:
            return 2
        return self.group_score.keys_summed(self.top_k, self.topk_group)

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    @property
    def group_size(self) -> int:
        return self.num_experts // self.n_group


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_route_args(
    router_logits: torch.Tensor,
    top_k: int,
    method: RoutingMethod | int,
    bias: torch.Tensor | None,
    n_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float | None,
    *,
    renormalize: bool | None = None,
    logit_dtypes: tuple[torch.dtype, ...] = LOGIT_DTYPES,
    group_score: GroupScore | str | int | None = None,
) -> RouteConfig:
    """Checks everything that is known without reading device values; returns the normalised config.

    ``logit_dtypes``: the dtypes the caller computes with, for ``router_logits`` and ``bias`` alike
    (``route``: :data:`LOGIT_DTYPES`; ``replay_routing``: :data:`REPLAY_LOGIT_DTYPES`). Raises
    TypeError for non-tensors and ValueError naming the argument and the expected value otherwise.
    Reads shapes, dtypes and devices only (no host sync).
    """
    method = method_from_value(method)
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2:
        raise ValueError(
            f"router_logits must be 2-D (n_tokens, num_experts), got shape {tuple(router_logits.shape)}"
        )
    if router_logits.dtype not in logit_dtypes:
        hint = ""
        if router_logits.dtype == torch.float64 and torch.float64 not in logit_dtypes:
            hint = " (the router computes in float32; replay_routing takes float64 logits)"
        raise ValueError(
            f"router_logits must be {_dtype_list(logit_dtypes)}, got {router_logits.dtype}{hint}"
        )
    num_experts = router_logits.shape[1]
    if num_experts < 1:
        raise ValueError("router_logits must have at least one expert column, got num_experts=0")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    spec = METHODS[method]
    if spec.top_k is not None and top_k != spec.top_k:
        picks = "one expert" if spec.top_k == 1 else f"{spec.top_k} experts"
        raise ValueError(
            f"{method.name} routing picks {picks} per token: top_k must be {spec.top_k}, got {top_k}"
        )

    if bias is not None:
        if not spec.bias:
            raise ValueError(
                f"bias is only used by {method_names(BIAS_METHODS)}, not {method.name}; pass None"
            )
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (num_experts,):
            raise ValueError(
                f"bias must have shape (num_experts,) = ({num_experts},), got {tuple(bias.shape)}"
            )
        if bias.dtype not in logit_dtypes:
            raise ValueError(f"bias must be {_dtype_list(logit_dtypes)}, got {bias.dtype}")
        if bias.device != router_logits.device:
            raise ValueError(
                f"bias must be on router_logits' device {router_logits.device}, got {bias.device}"
            )

    if not spec.groups and (n_group is not None or topk_group is not None):
        raise ValueError(
            f"n_group/topk_group are only used by {method_names(GROUP_METHODS)}, not {method.name}; pass None"
        )
    groups, kept = 1, 1
    if n_group is not None:
        if not _is_int(n_group) or n_group < 0:
            raise ValueError(f"n_group must be a non-negative int or None, got {n_group!r}")
        groups = max(n_group, 1)
    if topk_group is not None:
        if n_group is None:
            raise ValueError("topk_group needs n_group (the number of expert groups); pass both or neither")
        if not _is_int(topk_group) or topk_group < 1:
            raise ValueError(f"topk_group must be a positive int, got {topk_group!r}")
        if topk_group > groups:
            raise ValueError(f"topk_group={topk_group} must be <= n_group={n_group}")
        kept = topk_group
    if groups > 1:
        if num_experts % groups:
            raise ValueError(f"n_group={groups} must divide num_experts={num_experts}")
        if topk_group is None:
            raise ValueError(f"n_group={groups} > 1 needs topk_group (groups kept per token)")
        size = num_experts // groups
        if top_k > kept * size:
            raise ValueError(
                f"top_k={top_k} experts cannot be chosen from topk_group={kept} groups of {size} "
                f"experts (n_group={groups}, num_experts={num_experts})"
            )
    else:
        kept = 1

    scale = 1.0
    if routed_scaling_factor is not None:
        if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
            raise ValueError(f"routed_scaling_factor must be a float, got {routed_scaling_factor!r}")
        scale = float(routed_scaling_factor)
        if not math.isfinite(scale):
            raise ValueError(f"routed_scaling_factor must be finite, got {routed_scaling_factor!r}")
    score = _group_score(method, group_score, top_k, groups, kept)
    unnormalized = _unnormalized(method, renormalize)
    return RouteConfig(method, top_k, num_experts, groups, kept, scale, unnormalized, score)


def group_score_from_value(group_score: GroupScore | str | int) -> GroupScore:
    """``group_score`` as a :class:`GroupScore`: a member, its int value or its name (any case);
    ValueError listing the rules otherwise."""
    if isinstance(group_score, GroupScore):
        return group_score
    if isinstance(group_score, str) and group_score.upper() in GroupScore.__members__:
        return GroupScore[group_score.upper()]
    if not isinstance(group_score, bool) and isinstance(group_score, (int, np.integer)):
        try:
            return GroupScore(int(group_score))
        except ValueError:
            pass
    names = ", ".join(f"{g.name}={g.value}" for g in GroupScore)
    raise ValueError(
        f"group_score must be a GroupScore, its value or its name ({names}) or None, got {group_score!r}"
    )


def _group_score(
    method: RoutingMethod, group_score: object, top_k: int, n_group: int, topk_group: int
) -> GroupScore:
    """The validated group score of ``method`` (its own for None); ValueError naming the reason where
    ``group_score`` cannot apply. Without grouping (``n_group`` 1) any rule is accepted and unread."""
    spec = METHODS[method]
    if group_score is None:
        return spec.group_score if spec.group_score is not None else GroupScore.TOP2_SUM
    if not spec.groups:
        raise ValueError(
            f"group_score is only used by {method_names(GROUP_METHODS)} (methods with expert groups), "
            f"not {method.name}; pass None"
        )
    score = group_score_from_value(group_score)
    if score.keys_summed(top_k, topk_group) > 1 and spec.key not in SCORE_KEYS:
        sums = method_names(frozenset(m for m, s in METHODS.items() if s.groups and s.key in SCORE_KEYS))
        raise ValueError(
            f"group_score={score.name} sums a group's best keys, but {method.name} chooses on the "
            f"logits (its scores keep their order, not their sums); {method.name} takes MAX (or "
            f"TOPK_SHARE_SUM with top_k // topk_group == 1). Methods whose keys are their scores: {sums}"
        )
    # the share never exceeds a group's size: top_k <= topk_group * size is checked above
    if score is GroupScore.TOPK_SHARE_SUM and n_group > 1 and top_k < topk_group:
        raise ValueError(
            f"group_score=TOPK_SHARE_SUM sums top_k // topk_group = {top_k} // {topk_group} = 0 keys "
            "per group: it needs top_k >= topk_group"
        )
    return score


def _unnormalized(method: RoutingMethod, renormalize: object) -> bool:
    """Whether ``renormalize`` selects ``method``'s unnormalized rule; ValueError naming the method
    and the reason where the value cannot apply to it."""
    if renormalize is None:
        return False
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be True, False or None, got {renormalize!r}")
    spec = METHODS[method]
    if spec.renormalizes is None:
        raise ValueError(
            f"renormalize={renormalize} cannot apply to {method.name}: its weights "
            f"({spec.weight.name}) are not a distribution over several chosen experts; pass None"
        )
    if renormalize == spec.renormalizes:
        return False  # the method's own rule
    if not renormalize and spec.unnormalized is not None:
        return True
    if renormalize and spec.renormalized is not None:
        return True
    # the other rule is another method's row (FlashInfer's value for it): name it, never alias
    same = frozenset(m for m, s in METHODS.items() if s.renormalizes is renormalize and not s.bias)
    verb = "renormalise" if renormalize else "do not renormalise"
    raise ValueError(
        f"renormalize={renormalize} cannot apply to {method.name}: that rule is another method; the "
        f"methods that {verb} are {method_names(same)}; pass one of them and renormalize=None"
    )
