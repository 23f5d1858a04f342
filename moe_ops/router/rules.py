"""The vocabulary a routing method's rules are written in: what selection sorts (``SelectionKey``), a
group's score (``GroupScore``), the weights of the chosen experts (``WeightRule``) and their gradient
(``GradientRule``), and :class:`MethodSpec`, one row of the method table
(:data:`moe_ops.router.methods.METHODS`, which says what each method does with them).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "GRADIENT_OF",
    "SCALED_RULES",
    "SCORE_KEYS",
    "GradientRule",
    "GroupScore",
    "MethodSpec",
    "SelectionKey",
    "WeightRule",
]


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
