"""The weight rule of every supported transformers architecture, as a :class:`ReplayRule`.

:data:`REPLAY_RULES` maps each ``model_type`` to a function of its router module returning the
router's :class:`~moe_ops.attach.replaying.ReplayRule` from the router's fields as they are now:
``attach_replay`` calls it at every router call, so a field changed after attaching
(``norm_topk_prob``, ``routed_scaling_factor``, ...) takes effect at the next call. Where a routing
method computes an architecture's weights the rule names it; elsewhere (DeepSeek-V4's score
function, PhiMoE's sparsemixer, a scale that must stay a tensor multiply under ``torch.compile``)
``weights_fn`` carries the router's own operations. docs/replay.md has the table.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ...attach.replaying import ReplayRule
from ...router.methods import RoutingMethod
from .architectures import normalize_arch

__all__ = ["REPLAY_RULES", "replay_rule", "rule_builder"]


def _softmax_topk_rule(router: nn.Module) -> ReplayRule:
    """Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo: softmax over every expert, top-k of it, and with
    ``norm_topk_prob`` the k values renormalised (equal to a softmax over the k logits)."""
    if router.norm_topk_prob:
        return ReplayRule(
            RoutingMethod.RENORMALIZE, description="softmax(x)[ids] renormalised (norm_topk_prob)"
        )
    return ReplayRule(RoutingMethod.DEFAULT, description="softmax(x)[ids], not renormalised")


def _renormalize_rule(router: nn.Module) -> ReplayRule:
    """Mixtral and Qwen3.5-MoE (softmax, top-k, renormalised, with no field to turn it off), GPT-OSS
    and GraniteMoE (softmax over the top-k logits; GPT-OSS's logits include the router's bias)."""
    return ReplayRule(RoutingMethod.RENORMALIZE, description="softmax(x[ids])")


def _sigmoid_weights(
    router_logits: torch.Tensor, ids: torch.Tensor, *, norm: bool, scale: float
) -> torch.Tensor:
    # the DeepSeek-V3 family's weights, in its router's own order of operations
    weights = router_logits.sigmoid().gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


def _sigmoid_bias_rule(router: nn.Module) -> ReplayRule:
    """DeepSeek-V3, GLM-4-MoE, GLM-4.7-Flash, dots1: sigmoid scores, chosen with
    ``e_score_correction_bias`` in groups; weights the unbiased scores, divided by their sum + 1e-20
    with ``norm_topk_prob``, times ``routed_scaling_factor``.

    The weights are torch ops (``_sigmoid_weights``), the scale a multiplier of a tensor: under
    ``torch.compile`` a float field that changed becomes a symbolic float (dynamo's automatic
    dynamic), which a tensor multiply takes but ``replay_routing``'s float argument would not (its
    argument check is a graph break on one). ``replay_routing`` still decides the ids (the bias and
    groups of faulty rows routed live)."""
    groups = dict(n_group=router.num_group, topk_group=router.topk_group if router.num_group else None)
    norm = bool(router.norm_topk_prob)
    return ReplayRule(
        RoutingMethod.DEEPSEEK_V3,
        **groups,
        bias_attr="e_score_correction_bias",
        weights_fn=functools.partial(_sigmoid_weights, norm=norm, scale=router.routed_scaling_factor),
        description=(
            "sigmoid(x)[ids] / (sum + 1e-20) * routed_scaling_factor"
            if norm
            else "sigmoid(x)[ids] * routed_scaling_factor (norm_topk_prob=False)"
        ),
    )


def _scaled_softmax(router_logits: torch.Tensor, ids: torch.Tensor, *, scale: float) -> torch.Tensor:
    # DeepSeek-V2's rule, as its router computes it
    return router_logits.softmax(dim=-1, dtype=torch.float32).gather(1, ids) * scale


def _deepseek_v2_rule(router: nn.Module) -> ReplayRule:
    """DeepSeek-V2: softmax over every expert; ``greedy`` takes its top-k, ``group_limited_greedy``
    the top-k inside the best groups (by their best expert: DEEPSEEK_V2 with its groups, so faulty
    rows route live as the model does); either way the weights are
    ``softmax(x)[ids] * routed_scaling_factor`` (this router never applies ``norm_topk_prob``).

    DEEPSEEK_V2's own rule with ``routed_scaling_factor=`` gives these weights to float32 rounding
    (tested), but the scale stays a tensor multiply (``weights_fn``) for the reason
    :func:`_sigmoid_bias_rule` gives: a changed field is a symbolic float under ``torch.compile``,
    which ``replay_routing``'s float argument turns into a graph break (fullgraph: an error)."""
    if router.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"DeepSeek-V2 topk_method must be 'greedy' or 'group_limited_greedy', got {router.topk_method!r}"
        )
    groups = {}
    if router.topk_method == "group_limited_greedy":
        groups = dict(n_group=router.num_group, topk_group=router.topk_group)
    scale = router.routed_scaling_factor
    if scale == 1.0:
        return ReplayRule(RoutingMethod.DEEPSEEK_V2, **groups, description="softmax(x)[ids]")
    return ReplayRule(
        RoutingMethod.DEEPSEEK_V2,
        **groups,
        weights_fn=functools.partial(_scaled_softmax, scale=scale),
        description="softmax(x)[ids] * routed_scaling_factor",
    )


# DeepSeek-V4's score function (the router's ``score_fn``, transformers' ACT2FN[scoring_func]) by
# class name -> the method whose weight rule is the router's ``score * scale / (sum + 1e-20)``
_DEEPSEEK_V4_SCORES: Mapping[str, tuple[RoutingMethod, str]] = MappingProxyType(
    {
        "SqrtSoftplusActivation": (RoutingMethod.SQRTSOFTPLUS, "sqrt(softplus(x))"),
        "Sigmoid": (RoutingMethod.DEEPSEEK_V3, "sigmoid(x)"),
    }
)


def _scored_weights(
    router_logits: torch.Tensor, ids: torch.Tensor, *, score_fn: nn.Module, scale: float
) -> torch.Tensor:
    # DeepSeek-V4's weights, in its routers' own order of operations with their own score function
    weights = score_fn(router_logits).gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale


def _deepseek_v4_rule(router: nn.Module) -> ReplayRule:
    """DeepSeek-V4: scores ``q = score_fn(x)`` (``scoring_func="sqrtsoftplus"``: SQRTSOFTPLUS;
    ``"sigmoid"``: DEEPSEEK_V3 without groups), weights ``q[ids] * routed_scaling_factor /
    (sum q[ids] + 1e-20)`` always (the router never reads ``norm_topk_prob``). A routed layer
    (``DeepseekV4TopKRouter``) chooses by ``q + e_score_correction_bias``; a hash layer
    (``DeepseekV4HashRouter``) takes ``tid2eid[input_ids]``, its forward's argument 1, for rows
    without a usable record, and has no bias. The method decides the ids (and routes faulty rows
    live); the weights are the router's own operations (``weights_fn``), the scale a tensor
    multiply, for the compile reason :func:`_sigmoid_bias_rule` gives."""
    score = type(router.score_fn).__name__
    if score not in _DEEPSEEK_V4_SCORES:
        raise ValueError(
            f"DeepSeek-V4 scoring_func must be 'sqrtsoftplus' or 'sigmoid' (the router's score_fn "
            f"SqrtSoftplusActivation or Sigmoid), got a router scoring with {score}"
        )
    method, formula = _DEEPSEEK_V4_SCORES[score]
    description = f"q = {formula}; q[ids] * routed_scaling_factor / (sum + 1e-20)"
    weights = functools.partial(_scored_weights, score_fn=router.score_fn, scale=router.routed_scaling_factor)
    if hasattr(router, "tid2eid"):
        return ReplayRule(
            method,
            weights_fn=weights,
            hash_table_attr="tid2eid",
            token_ids_arg=1,
            description=f"{description}; ids tid2eid[input_ids] where not recorded",
        )
    return ReplayRule(
        method,
        weights_fn=weights,
        bias_attr="e_score_correction_bias",
        description=f"{description}; chosen by q + e_score_correction_bias",
    )


def _sparsemixer_weights(
    router_logits: torch.Tensor, ids: torch.Tensor, *, router: nn.Module, multiplier_fn: Any
) -> torch.Tensor:
    """PhiMoE's sparsemixer multipliers at given ids: transformers' ``sparsemixer`` with its
    ``selected_experts`` (the argmax in eval mode, a Gumbel sample in training) replaced by ``ids``.

    Expert 1 gets its softmax over the experts within ``2 * router_jitter_noise`` (relative) of the
    row's best score, expert 2 its softmax over those within that of the best score other than
    expert 1; an expert outside its window gets weight 0 (as a training sample there would). In
    training mode (``router.training``) each multiplier goes through the model's own
    ``PhimoeMultiplier`` (Heun's third-order gradient estimator, its 1 or 1/3 factor drawn with
    ``torch.rand_like`` as the model draws it; ``multiplier_fn`` is that class); in eval mode
    autograd differentiates the softmax.
    """
    eps = router.router_jitter_noise
    scores = router_logits
    selected = (ids[:, :1], ids[:, 1:2])
    multipliers = []
    masked_scores = scores
    for k, chosen in enumerate(selected):
        if k == 1:
            masked_scores = torch.scatter(scores, -1, selected[0], float("-inf"))
        with torch.no_grad():
            threshold = masked_scores.max(dim=-1, keepdim=True).values
            factor = scores.abs().clamp(min=threshold)
            outside = ((threshold - scores) / factor) > (2 * eps)
        masked_gates = torch.softmax(masked_scores.masked_fill(outside, float("-inf")), dim=-1)
        multiplier = masked_gates.gather(dim=-1, index=chosen)
        if router.training:
            max_ind = masked_gates.max(dim=-1, keepdim=True).indices
            mask_for_one = torch.logical_or(chosen == max_ind, torch.rand_like(multiplier) > 0.75)
            mask_for_one = torch.add(0.3333, mask_for_one, alpha=0.6667).type_as(masked_gates)
            multiplier = multiplier_fn.apply(scores, multiplier, chosen, masked_gates, mask_for_one)
        multipliers.append(multiplier)
    return torch.cat(multipliers, dim=-1)


def _phimoe_multiplier(router: nn.Module):
    """transformers' ``PhimoeMultiplier`` (the autograd function of sparsemixer's training branch),
    from the module that defines the router's class."""
    cls = getattr(sys.modules.get(type(router).__module__), "PhimoeMultiplier", None)
    if cls is None:
        raise ValueError(
            f"{type(router).__module__} has no PhimoeMultiplier: this transformers version's PhiMoE "
            "training rule is unknown to attach_replay"
        )
    return cls


def _phimoe_rule(router: nn.Module) -> ReplayRule:
    """PhiMoE: sparsemixer, top-2 only; no method has its weights, so they are computed here
    (``_sparsemixer_weights``). Faulty rows route live with RENORMALIZE, whose top-2 by logit is
    sparsemixer's own choice in eval mode."""
    if router.top_k != 2:
        raise ValueError(f"PhiMoE's sparsemixer routes top-2 only; the router has top_k={router.top_k}")
    return ReplayRule(
        RoutingMethod.RENORMALIZE,
        weights_fn=functools.partial(
            _sparsemixer_weights, router=router, multiplier_fn=_phimoe_multiplier(router)
        ),
        description="sparsemixer multipliers (router_jitter_noise window)",
    )


# The weight rule of every supported architecture, from its router module's own fields; attach_replay
# calls it at every router call, so a field changed after attaching takes effect at the next call.
REPLAY_RULES: Mapping[str, Callable[[nn.Module], ReplayRule]] = MappingProxyType(
    {
        "qwen3_moe": _softmax_topk_rule,
        "mixtral": _renormalize_rule,
        "olmoe": _softmax_topk_rule,
        "deepseek_v3": _sigmoid_bias_rule,
        "gpt_oss": _renormalize_rule,
        "qwen2_moe": _softmax_topk_rule,
        "deepseek_v2": _deepseek_v2_rule,
        "glm4_moe": _sigmoid_bias_rule,
        "dots1": _sigmoid_bias_rule,
        "flex_olmo": _softmax_topk_rule,
        "phimoe": _phimoe_rule,
        "granitemoe": _renormalize_rule,
        "glm4_moe_lite": _sigmoid_bias_rule,
        "qwen3_5_moe": _renormalize_rule,
        "qwen3_5_moe_text": _renormalize_rule,
        "deepseek_v4": _deepseek_v4_rule,
    }
)


def rule_builder(arch: str) -> Callable[[nn.Module], ReplayRule]:
    """The rule function of ``arch`` (its ``REPLAY_RULES`` entry), which ``attach_replay`` calls on
    the router at every call. ValueError for an architecture without one."""
    builder = REPLAY_RULES.get(normalize_arch(arch))
    if builder is None:  # an architecture added to SUPPORTED_ARCHITECTURES without its rule
        raise ValueError(f"attach_replay has no weight rule for {arch!r}; known: {', '.join(REPLAY_RULES)}")
    return builder


def replay_rule(arch: str, router: nn.Module) -> ReplayRule:
    """The :class:`~moe_ops.attach.replaying.ReplayRule` of one router module of ``arch``, from the
    router's fields as they are now."""
    return rule_builder(arch)(router)
