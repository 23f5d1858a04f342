"""The replaying router wrapper: a router's forward returning the recorded ids instead of its own.

:class:`ReplayRule` (how one router's weights are formed), :func:`replay_router_output` (the
replayed ``(weights, ids)`` of one router call) and :func:`replaying_forward` (a router's forward
with its output replaced); the ids come from a :class:`~moe_ops.replay.replayer.RoutingReplayer`.
The checks a replay makes before any router is touched (:func:`check_replayer`,
:func:`check_rule`, :func:`check_replay_sites`) and :class:`ReplayHandle`, what the transformers
and reference-model ``attach_replay`` return. The plumbing around them (sites, marks, handles) is
:mod:`moe_ops.attach.sites`, shared with capture.

Order with a capture (:mod:`moe_ops.attach.capturing`): each wrapper wraps whatever the router's
attribute holds, so a capture attached before the replay sits under it and records the router's
own (live) ids, and a capture attached after it sits on top and records the replayed ids - the
order Megatron-Core's hooks give too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..replay.op import BACKENDS, _check_weights_mode, _straight_through, replay_routing
from ..router.args import (
    FLOAT32_ROUNDS_TO_INF,
    REPLAY_LOGIT_DTYPES,
    check_routed_scaling_factor,
    validate_route_args,
)
from ..router.methods import GroupScore, RoutingMethod
from .sites import REPLAY_MARK, AttachHandle, RouterSite, check_unwrapped, describe_output, mark_wrapper

__all__ = [
    "WEIGHT_MODES",
    "ReplayHandle",
    "ReplayRule",
    "check_replay_sites",
    "check_replayer",
    "check_rule",
    "replay_router_output",
    "replay_routing_rule",
    "replaying_forward",
]


@dataclass(frozen=True)
class ReplayRule:
    """How one router's replayed weights are formed from its live logits at the recorded ids."""

    # replay_routing's method: its weight rule at the recorded ids (unless weights_fn), and the
    # live routing of faulty rows
    method: RoutingMethod
    # DEEPSEEK_V3 expert groups, for faulty rows routed live (None: no grouping)
    n_group: int | None = None
    # DEEPSEEK_V3 groups kept per token (None when n_group is None)
    topk_group: int | None = None
    # multiplies the method's weights (None: 1.0), as replay_routing's routed_scaling_factor
    routed_scaling_factor: float | None = None
    # replay_routing's renormalize: None the method's own rule; False on DEEPSEEK_V3/MINIMAX2
    # weights s * routed_scaling_factor (norm_topk_prob=False)
    renormalize: bool | None = None
    # attribute of the router module holding its selection bias, read at every call; None: none
    bias_attr: str | None = None
    # the architecture's exact rule where no method has it: (router_logits (n, E), ids (n, k)
    # int64) -> weights (n, k), differentiable torch ops gathered from the dense scores; None: the
    # method's rule
    weights_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # keyword argument of the router carrying a CaptureTarget: withheld from the live router and
    # given the replayed ids instead (the reference model); None: the router takes none
    capture_kwarg: str | None = None
    # the architecture's weight rule in words (docs, handle.rules, error messages)
    description: str = ""
    # a hash layer (docs/routing.md, "Hash routing"): the attribute of the router module holding
    # its (vocab, top_k) token-id table, read at every call (DeepseekV4HashRouter: "tid2eid"), and
    # the position of the router's forward argument carrying the token ids (its input_ids: 1),
    # flattened; rows without a usable record take the table's ids. None: not a hash layer
    hash_table_attr: str | None = None
    token_ids_arg: int | None = None
    # replay_routing's group_score (a GroupScore; None: the method's own), for faulty rows routed
    # live with groups
    group_score: GroupScore | None = None

    def __post_init__(self) -> None:
        # a scale that is inf in float32 (the kernels' type) would zero, and count, every row: refused
        # here as route and replay_routing refuse it. Inline for a float in range: the transformers
        # rules build a rule at every router call
        scale = self.routed_scaling_factor
        if scale is not None and not (type(scale) is float and abs(scale) < FLOAT32_ROUNDS_TO_INF):
            check_routed_scaling_factor(scale)  # raises, naming what is wrong (an int passes)


def replay_routing_rule(
    router_logits: torch.Tensor,
    recorded_ids: torch.Tensor,
    rule: ReplayRule,
    *,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    row_count: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    recorded_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``replay_routing`` of ``recorded_ids`` under ``rule``: ``(weights, ids)``, ids int64.

    ``router_logits`` of a dtype ``replay_routing`` does not take are replayed in float32;
    ``rule.weights_fn`` (where it has one) forms the weights from the logits at the returned ids.
    A row of -1 and a faulty row are routed live by ``rule.method`` (faulty ones counted), as
    ``replay_routing`` does. Weights have ``replay_routing``'s dtype (float32, float64 for
    float64 logits) or ``weights_fn``'s.

    ``recorded_weights``: (n, top_k) - the rollout's weights of ``recorded_ids`` (NaN: none):
    ``replay_routing``'s ``weights="recorded"`` - on every replayed row whose recorded weights are
    all finite the value is the record and the gradient the rule's (straight-through, also for a
    ``weights_fn`` rule); other rows keep the computed weights.
    """
    if recorded_weights is not None:  # checked before anything runs, for both kinds of rule
        _check_weights_mode("recorded", recorded_weights, recorded_ids, router_logits)
    x = router_logits if router_logits.dtype in REPLAY_LOGIT_DTYPES else router_logits.to(torch.float32)
    weights, ids = replay_routing(
        x,
        recorded_ids,
        rule.method,
        bias=bias,
        n_group=rule.n_group,
        topk_group=rule.topk_group,
        routed_scaling_factor=rule.routed_scaling_factor,
        renormalize=rule.renormalize,
        backend=backend,
        row_count=row_count,
        hash_table=hash_table,
        token_ids=token_ids,
        group_score=rule.group_score,
        **({} if recorded_weights is None or rule.weights_fn is not None else {
            "weights": "recorded", "recorded_weights": recorded_weights,
        }),
    )  # fmt: skip
    ids = ids.to(torch.int64)
    if rule.weights_fn is not None:
        weights = rule.weights_fn(router_logits, ids)
        if recorded_weights is not None:  # replay_routing's straight-through rule, on these weights
            weights = _straight_through(weights, ids, recorded_ids, recorded_weights)
    return weights, ids


def replay_router_output(
    router_logits: torch.Tensor,
    live_weights: torch.Tensor,
    live_ids: torch.Tensor,
    recorded_ids: torch.Tensor,
    rule: ReplayRule,
    *,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    row_count: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    recorded_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The replayed ``(weights, ids)`` of one router call.

    Args:
        router_logits: (n, num_experts) float - the router's live logits (float32, bfloat16,
            float16 or float64: ``replay_routing`` computes float64 in float64; other floating
            dtypes are replayed in float32); gradients flow back through them.
        live_weights: (n, k) float - the weights the router computed.
        live_ids: (n, k) integer - the ids the router chose.
        recorded_ids: (n, k) integer, any strides - the replayer's rows of this layer.
        rule: the router's :class:`ReplayRule`.
        bias: (num_experts,) float - the selection bias of ``rule.method`` (DeepSeek-V3 family).
        backend: ``replay_routing``'s backend.
        row_count: ``replay_routing``'s ``row_count`` (the replayer's; its check fused into the
            forward kernel), or None.
        hash_table, token_ids: a hash layer's table and token ids (``replay_routing``'s): a faulty
            row takes the table's ids instead of the method's live routing.
        recorded_weights: (n, k) or None - the rollout's weights of ``recorded_ids`` (NaN: none),
            for ``weights="recorded"`` (:func:`replay_routing_rule`).

    Returns:
        weights: (n, k) ``live_weights.dtype`` - the rule's weights at the recorded ids (the
            recorded weights' values where given and finite, the rule's gradient); on a row of
            -1 the router's own ``live_weights`` row, unchanged.
        ids: (n, k) ``live_ids.dtype`` - the recorded ids, column order kept; on a row of -1 the
            router's own ids; on a faulty row (an id out of range, an expert twice) the live
            routing of ``rule.method``, counted for ``check_replay_errors``.

    A row of -1 takes the router's own output rather than ``replay_routing``'s live routing, so a
    batch of -1 rows runs exactly as the model without replay (bit for bit), whatever the
    architecture's selection (DeepSeek-V2's group-limited greedy, PhiMoE's sparsemixer, ties).

    ValueError (shapes only, host values) when ``recorded_ids`` is not ``live_ids``' shape.
    """
    if tuple(recorded_ids.shape) != tuple(live_ids.shape):
        raise ValueError(
            f"recorded_ids must have live_ids' shape {tuple(live_ids.shape)} (n, top_k), got "
            f"{tuple(recorded_ids.shape)}"
        )
    live_row = (recorded_ids == -1).all(dim=-1, keepdim=True)
    ids_in = torch.where(live_row, live_ids.to(torch.int32), recorded_ids.to(torch.int32))
    weights, ids = replay_routing_rule(
        router_logits,
        ids_in,
        rule,
        bias=bias,
        backend=backend,
        row_count=row_count,
        hash_table=hash_table,
        token_ids=token_ids,
        recorded_weights=recorded_weights,
    )
    weights = torch.where(live_row, live_weights, weights.to(live_weights.dtype))
    return weights, ids.to(live_ids.dtype)


def _router_positions(output: Any) -> tuple[int, int, int]:
    """(logits, weights, ids) positions in a router's output tuple: ids is its one integer tensor,
    weights sits in the middle in every supported order ((logits, weights, ids), and GraniteMoE's
    (ids, weights, logits) up to transformers 5.17). Shapes and dtypes only, never values."""
    if (
        isinstance(output, (tuple, list))
        and len(output) == 3
        and all(isinstance(t, torch.Tensor) for t in output)
    ):
        ints = [i for i, t in enumerate(output) if not (t.dtype.is_floating_point or t.dtype.is_complex)]
        if len(ints) == 1 and ints[0] != 1 and output[ints[0]].dim() == 2:
            ids_at = ints[0]
            return 2 - ids_at, 1, ids_at
    raise TypeError(
        "a replayed router's forward must return (router_logits, weights, ids) with ids a 2-D integer "
        f"tensor; got {describe_output(output)}"
    )


def replaying_forward(
    original: Callable,
    replayer: Any,
    layer: int,
    rule: ReplayRule | Callable[[nn.Module], ReplayRule],
    module: nn.Module,
    *,
    backend: str = "auto",
    path: str | None = None,
    weights: str = "computed",
) -> Callable:
    """``original`` (a router returning ``(router_logits, weights, ids)``) with its weights and ids
    replaced by the replayed ones of ``replayer.layer_ids(layer, n)``; same tuple, dtypes, shapes.

    Args:
        original: the router's forward (``module.forward``, or a method of ``module``).
        replayer: where the ids come from: ``layer_ids(layer, n)`` returning ``(n, top_k)`` ids.
        layer: the model layer index handed to ``replayer.layer_ids``.
        rule: the router's :class:`ReplayRule`, or a function of ``module`` returning it, called
            at every call (after the router, as the bias is read): a rule field changed after
            attaching (``norm_topk_prob``, ``routed_scaling_factor``, ...) takes effect at the next
            call. Its ``capture_kwarg`` is the one of the rule it returns now, when wrapping.
        module: the router module (its bias, and the argument of a ``rule`` function).
        backend: ``replay_routing``'s backend.
        path: the router's module path, for error messages.
        weights: "computed" (the rule's weights from the live logits) or "recorded" (the
            replayer's recorded weights where it has them, :func:`replay_routing_rule`; the
            replayer needs ``rows(..., weights=True)``, a ``RoutingReplayer`` with
            ``weights_dtype``: :func:`check_replayer`).

    Per call, ValueError when the router's ids per token differ from the replayer's (a ``top_k``
    changed after attaching): shapes are host values, so the check reads nothing from the device.
    With a replayer that records live ids (``RoutingReplayer(record_live=True)``) the router's own
    choice is written to its ``live_buffer`` too.

    Plain Python around registered ops: dynamo inlines it (no graph break), CUDA graphs record it.
    Under ``torch.compile`` the rule's fields are Python attributes of the module, which dynamo
    guards on: a changed field recompiles once, an unchanged one costs nothing per step.
    """
    from ..capture.op import capture_into

    where = f"the router at {path!r}" if path is not None else f"the router of layer {layer}"
    # the router's signature: fixed when wrapping, whatever its fields do later
    capture_kwarg = (rule if isinstance(rule, ReplayRule) else rule(module)).capture_kwarg
    rows = getattr(replayer, "rows", None) if callable(getattr(replayer, "rows", None)) else None
    with_weights = weights == "recorded"

    def forward(*args, **kwargs):
        capture = kwargs.pop(capture_kwarg, None) if capture_kwarg is not None else None
        output = original(*args, **kwargs)
        logits_at, weights_at, ids_at = _router_positions(output)
        live_ids = output[ids_at]
        n = live_ids.shape[0]
        # a RoutingReplayer's rows come with the row count its device check needs (in a compiled or
        # graphed step; None where the host checked): the check rides in replay_routing's forward
        # kernel, no op of its own. Another replayer checks what it checks
        recorded_weights = None
        if rows is not None:
            if with_weights:
                recorded, row_count, recorded_weights = rows(layer, n, weights=True)
            else:  # a replayer's rows() without weights: (ids, row_count) first
                recorded, row_count = rows(layer, n)[:2]
        else:
            recorded, row_count = replayer.layer_ids(layer, n), None
        if recorded.shape[-1] != live_ids.shape[-1]:
            raise ValueError(
                f"{where} picks top_k={live_ids.shape[-1]} experts per token but the replayer's rows "
                f"hold {recorded.shape[-1]} (replayer.shape.top_k): was the router's top_k changed after "
                "attach_replay? Set it back, or replay with a replayer of that top_k"
            )
        current = rule if isinstance(rule, ReplayRule) else rule(module)
        logits = output[logits_at]
        bias = getattr(module, current.bias_attr) if current.bias_attr is not None else None
        hashed = {}
        if current.hash_table_attr is not None:
            if current.token_ids_arg is None or current.token_ids_arg >= len(args):
                raise ValueError(
                    f"{where} is a hash layer (ReplayRule.hash_table_attr={current.hash_table_attr!r}) "
                    f"but its call has no token ids at argument {current.token_ids_arg!r} "
                    "(ReplayRule.token_ids_arg)"
                )
            hashed = dict(
                hash_table=getattr(module, current.hash_table_attr),
                token_ids=args[current.token_ids_arg].reshape(-1),
            )
        weights, ids = replay_router_output(
            logits.reshape(n, logits.shape[-1]),
            output[weights_at],
            live_ids,
            recorded,
            current,
            bias=bias,
            backend=backend,
            row_count=row_count,
            recorded_weights=recorded_weights,
            **hashed,
        )
        if capture is not None:
            capture_into(capture, ids)
        if getattr(replayer, "record_live", False):
            replayer.write_live(layer, live_ids)  # what the router chose itself, for routing_mismatch
        replayed = list(output)
        replayed[weights_at], replayed[ids_at] = weights, ids
        return tuple(replayed) if isinstance(output, tuple) else replayed

    return mark_wrapper(forward, REPLAY_MARK, original)


class ReplayHandle(AttachHandle):
    """What ``attach_replay`` attached (transformers, the reference model); see :class:`AttachHandle`."""


WEIGHT_MODES = ("computed", "recorded")


def check_replayer(
    replayer: Any,
    backend: str,
    call: str = "layer_ids(model_layer_index, num_tokens)",
    weights: str = "computed",
) -> None:
    """TypeError for a ``replayer`` without ``layer_ids`` (``call`` is the signature the message
    shows), ValueError for an unknown ``backend`` or ``weights`` mode, and for ``weights="recorded"``
    with a replayer that keeps no weights (a ``RoutingReplayer`` without ``weights_dtype``)."""
    if not callable(getattr(replayer, "layer_ids", None)):
        raise TypeError(
            f"replayer must have a {call} method (e.g. moe_ops.RoutingReplayer), "
            f"got {type(replayer).__name__}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(map(repr, WEIGHT_MODES))}, got {weights!r}")
    if weights == "recorded" and (
        not callable(getattr(replayer, "rows", None)) or getattr(replayer, "weights_dtype", None) is None
    ):
        raise ValueError(
            'weights="recorded" needs a replayer that keeps the recorded weights: '
            "RoutingReplayer(..., weights_dtype=torch.float32) and set_batch(routing, weights=...)"
        )


def check_rule(rule: ReplayRule, module: nn.Module, path: str, top_k: int | None) -> None:
    """replay_routing's argument checks, once at attach time, on a (0, num_experts) stand-in of the
    router's logits (skipped when the router has no int ``num_experts`` or ``top_k`` is unknown)."""
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int) or top_k is None:
        return
    bias = None if rule.bias_attr is None else getattr(module, rule.bias_attr)
    try:
        validate_route_args(
            torch.empty(0, num_experts),
            top_k,
            rule.method,
            None if bias is None else bias.detach().to("cpu", torch.float32),
            rule.n_group,
            rule.topk_group,
            rule.routed_scaling_factor,
            renormalize=rule.renormalize,
            group_score=rule.group_score,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"the router at {path!r} cannot be replayed with {rule.method.name}: {e}") from None


def check_replay_sites(replayer: Any, sites: Sequence[RouterSite], rules: Sequence[ReplayRule]) -> None:
    """The per-router checks of a replay, before any router is touched: ``num_experts`` against
    ``replayer.shape``, the rule (:func:`check_rule`), and ValueError for a router that already
    replays (its replay outermost, or under a capture attached on top of it). A capture attached
    before is no error: it stays under the replay and records the router's own ids."""
    shape = getattr(replayer, "shape", None)
    top_k, num_experts = getattr(shape, "top_k", None), getattr(shape, "num_experts", None)
    for site, rule in zip(sites, rules, strict=True):
        router_experts = getattr(site.module, "num_experts", None)
        if isinstance(router_experts, int) and num_experts is not None and router_experts != num_experts:
            raise ValueError(
                f"replayer.shape.num_experts={num_experts} but the router at {site.path!r} has "
                f"{router_experts} experts"
            )
        check_rule(rule, site.module, site.path, getattr(site.module, "top_k", top_k))
        check_unwrapped([site], REPLAY_MARK, "replay")
