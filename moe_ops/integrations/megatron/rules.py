"""Megatron's score functions as moe-ops routing methods: the :class:`ReplayRule` of a router config.

:func:`replay_rule` maps a ``TransformerConfig``'s ``moe_router_*`` fields (score function,
pre-softmax, top_k, scaling factor, expert bias, groups) and the logits' dtype to the rule whose
weights equal Megatron's ``RouterReplay`` at the same ids: a method where one computes Megatron's
rule, else ``weights_fn`` with Megatron's own operations (docs/megatron.md has the table). The
hooks (:mod:`.attach`) take the rule of each call's arguments (:func:`call_rule`); attaching
checks each router's rule once (:func:`check_router_rule`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...attach.replaying import ReplayRule
from ...router.args import validate_route_args
from ...router.methods import BIAS_METHODS, GroupScore, RoutingMethod
from .routers import MegatronRouter

__all__ = ["call_rule", "check_router_rule", "replay_rule"]


def _softmax_weights(
    logits: torch.Tensor, ids: torch.Tensor, *, pre: bool, scale: float | None
) -> torch.Tensor:
    """Megatron's softmax probs at ``ids``, in its own operations and dtypes (moe_utils.py,
    ``topk_routing_with_score_function``, as its RouterReplay gathers them)."""
    if pre:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits).gather(1, ids)
    else:
        probs = torch.softmax(logits.gather(1, ids), dim=-1, dtype=torch.float32).type_as(logits)
    return probs * scale if scale else probs


def _sigmoid_weights(
    logits: torch.Tensor, ids: torch.Tensor, *, top_k: int, scale: float | None
) -> torch.Tensor:
    """Megatron's sigmoid probs at ``ids``: scores rounded to the logits' dtype, normalised (top_k
    > 1) by their sum + 1e-20 in that dtype, then scaled."""
    scores = torch.sigmoid(logits.float()).type_as(logits).gather(1, ids)
    probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if top_k > 1 else scores
    return probs * scale if scale else probs


@functools.cache
def _rule(
    score_function: str,
    pre_softmax: bool,
    top_k: int,
    scale: float | None,
    has_bias: bool,
    num_groups: int | None,
    group_topk: int | None,
    dtype: torch.dtype,
) -> ReplayRule:
    """The rule of one combination of Megatron's routing arguments (see :func:`replay_rule`)."""
    scale = float(scale) if scale else None  # Megatron scales only when the factor is truthy
    if score_function == "softmax":
        method = RoutingMethod.DEFAULT if pre_softmax else RoutingMethod.RENORMALIZE
        words = "softmax(x)[ids]" if pre_softmax else "softmax(x[ids])"
        words += f" * {scale}" if scale else ""
        # Megatron's softmax(..., dtype=float32).type_as(x) computes in float32 whatever the logits'
        # dtype (float64 too) and rounds once, as replay_routing does; a scale multiplies after
        # that rounding, in the logits' dtype: Megatron's own ops
        if scale is None:
            return ReplayRule(method, description=words)
        return ReplayRule(
            method,
            weights_fn=functools.partial(_softmax_weights, pre=pre_softmax, scale=scale),
            description=words,
        )
    if score_function != "sigmoid":
        raise ValueError(f"moe_router_score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    grouped = bool(group_topk)
    words = "sigmoid(x)[ids] / (sum + 1e-20)" if top_k > 1 else "sigmoid(x)[ids]"
    words += f" * {scale}" if scale else ""
    if top_k == 1 and not has_bias:
        method, groups, method_scale = RoutingMethod.SIGMOID, {}, None
        exact = scale is None
    else:
        # DEEPSEEK_V3's weight is sigmoid(x)[ids] * scale / (sum + 1e-20): Megatron's for top_k > 1
        method = RoutingMethod.DEEPSEEK_V3
        # Megatron's group_limited_topk scores a group by the sum of its top_k // group_topk best
        # scores, not DeepSeek-V3's two (another choice of groups in many rows)
        groups = {}
        if grouped:
            groups = dict(n_group=num_groups, topk_group=group_topk, group_score=GroupScore.TOPK_SHARE_SUM)
        method_scale = scale
        exact = top_k > 1
    # in float32 the method computes Megatron's rule; for other logits Megatron rounds the float32
    # sigmoid to their dtype and normalises in it (bf16/fp16 rounding, float64 precision): its own ops
    if exact and dtype == torch.float32:
        return ReplayRule(method, **groups, routed_scaling_factor=method_scale, description=words)
    return ReplayRule(
        method,
        **groups,
        routed_scaling_factor=method_scale,
        weights_fn=functools.partial(_sigmoid_weights, top_k=top_k, scale=scale),
        description=words,
    )


def _router_dtype(config: Any) -> torch.dtype:
    """The dtype of a router's logits: ``moe_router_dtype``, else the activations' (params_dtype)."""
    named = {"fp32": torch.float32, "fp64": torch.float64}.get(getattr(config, "moe_router_dtype", None))
    return named or getattr(config, "params_dtype", torch.float32)


def replay_rule(config: Any, dtype: torch.dtype | None = None) -> ReplayRule:
    """The :class:`~moe_ops.attach.replaying.ReplayRule` of a Megatron router config.

    ``config``: a ``TransformerConfig`` (its ``moe_router_*`` fields); ``dtype``: the router logits'
    dtype (default: ``moe_router_dtype``, else ``params_dtype``). The weights equal Megatron's
    ``RouterReplay`` at the same ids (to float rounding): ``method`` where a moe-ops method computes
    Megatron's rule, else ``weights_fn`` with Megatron's own operations gathered from the dense
    scores (docs/megatron.md has the table). The method also routes faulty rows for the fault count,
    but the integration returns the router's own live output for them.
    """
    dtype = _router_dtype(config) if dtype is None else dtype
    return _rule(
        config.moe_router_score_function,
        bool(config.moe_router_pre_softmax),
        int(config.moe_router_topk),
        config.moe_router_topk_scaling_factor,
        bool(config.moe_router_enable_expert_bias),
        config.moe_router_num_groups,
        config.moe_router_group_topk,
        dtype,
    )


def call_rule(arguments: dict, dtype: torch.dtype) -> ReplayRule:
    """The rule of one ``topk_routing_with_score_function`` call, from the arguments the router
    passed (its config at call time)."""
    return _rule(
        arguments["score_function"],
        bool(arguments["use_pre_softmax"]),
        int(arguments["topk"]),
        arguments["scaling_factor"],
        arguments["expert_bias"] is not None,
        arguments["num_groups"],
        arguments["group_topk"],
        dtype,
    )


def check_router_rule(rule: ReplayRule, router: MegatronRouter) -> None:
    """replay_routing's argument checks, once at attach time, on a (0, num_experts) stand-in."""
    config = router.module.config
    bias = None
    if rule.method in BIAS_METHODS and config.moe_router_enable_expert_bias:
        bias = torch.zeros(config.num_moe_experts)
    try:
        validate_route_args(
            torch.empty(0, config.num_moe_experts),
            config.moe_router_topk,
            rule.method,
            bias,
            rule.n_group,
            rule.topk_group,
            rule.routed_scaling_factor,
            renormalize=rule.renormalize,
            group_score=rule.group_score,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"the router at {router.path!r} cannot be replayed with {rule.method.name}: {e}"
        ) from None
