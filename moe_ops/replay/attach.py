"""Attaching to a model's routers, for replay and for capture, written once.

What a replaying router wrapper is made of: :class:`ReplayRule` (how one router's weights are
formed), :func:`replay_router_output` (the replayed ``(weights, ids)`` of one router call) and
:func:`replaying_forward` (a router's forward with its output replaced); the ids come from a
:class:`~moe_ops.replay.replayer.RoutingReplayer`.

The plumbing every ``attach_*`` shares, capture and replay, transformers, Megatron-Core and the
reference model (``moe_ops.models.attach_replay``): a :class:`RouterSite` per router (where it is,
which instance attribute is replaced), the checks made before any router is touched
(:func:`check_against_shape`, :func:`check_device`, :func:`check_replayer`,
:func:`check_replay_sites`), :func:`attach_wrappers` (sets the wrappers) and :class:`AttachHandle`
(what every ``attach_*`` returns: ``remove()`` or a ``with`` block restores each attribute).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from ..router.args import (
    FLOAT32_ROUNDS_TO_INF,
    REPLAY_LOGIT_DTYPES,
    check_routed_scaling_factor,
    validate_route_args,
)
from ..router.methods import GroupScore, RoutingMethod
from .op import BACKENDS, replay_routing

__all__ = [
    "CAPTURE_MARK",
    "REPLAY_MARK",
    "AttachHandle",
    "ReplayHandle",
    "ReplayRule",
    "RouterSite",
    "attach_wrappers",
    "check_against_shape",
    "check_device",
    "check_replay_sites",
    "check_replayer",
    "check_rule",
    "describe_output",
    "replay_router_output",
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

    Returns:
        weights: (n, k) ``live_weights.dtype`` - the rule's weights at the recorded ids; on a row of
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
    x = router_logits if router_logits.dtype in REPLAY_LOGIT_DTYPES else router_logits.to(torch.float32)
    live_row = (recorded_ids == -1).all(dim=-1, keepdim=True)
    ids_in = torch.where(live_row, live_ids.to(torch.int32), recorded_ids.to(torch.int32))
    weights, ids = replay_routing(
        x,
        ids_in,
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
    )
    if rule.weights_fn is not None:
        weights = rule.weights_fn(router_logits, ids.to(torch.int64))
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


def describe_output(output: Any) -> str:
    """A router's output in words, for errors: tensors as shape and dtype, tuples recursively."""
    if isinstance(output, torch.Tensor):
        return f"a tensor {tuple(output.shape)} {output.dtype}"
    if isinstance(output, (tuple, list)):
        return "(" + ", ".join(describe_output(o) for o in output) + ")"
    return type(output).__name__


# set on replaying and capturing wrappers, so that a second attach of one kind on a router is refused
REPLAY_MARK = "_moe_ops_replay"
CAPTURE_MARK = "_moe_ops_capture"


def replaying_forward(
    original: Callable,
    replayer: Any,
    layer: int,
    rule: ReplayRule | Callable[[nn.Module], ReplayRule],
    module: nn.Module,
    *,
    backend: str = "auto",
    path: str | None = None,
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

    def forward(*args, **kwargs):
        capture = kwargs.pop(capture_kwarg, None) if capture_kwarg is not None else None
        output = original(*args, **kwargs)
        logits_at, weights_at, ids_at = _router_positions(output)
        live_ids = output[ids_at]
        n = live_ids.shape[0]
        # a RoutingReplayer's rows come with the row count its device check needs (in a compiled or
        # graphed step; None where the host checked): the check rides in replay_routing's forward
        # kernel, no op of its own. Another replayer checks what it checks
        if rows is not None:
            recorded, row_count = rows(layer, n)
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
            **hashed,
        )
        if capture is not None:
            capture_into(capture, ids)
        if getattr(replayer, "record_live", False):
            replayer.write_live(layer, live_ids)  # what the router chose itself, for routing_mismatch
        replayed = list(output)
        replayed[weights_at], replayed[ids_at] = weights, ids
        return tuple(replayed) if isinstance(output, tuple) else replayed

    setattr(forward, REPLAY_MARK, True)
    return forward


# ---------------------------------------------------------------------------------------------
# The attach plumbing: sites, checks, wrappers, handles
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterSite:
    """One router an ``attach_*`` wraps, and the attribute it replaces on the router's instance."""

    # decoder-layer index (transformers, the reference model), or Megatron's (kind, index)
    layer: Any
    # module path in the model ("model.layers.3.mlp.gate"), for handles and messages
    path: str
    # the router module whose instance attribute is replaced
    module: nn.Module = field(repr=False, compare=False)
    # that attribute: "forward" (transformers), "router" (the reference model's MoE block),
    # "router_replay" (Megatron's hook)
    attr: str = "forward"

    def wrapped_by(self, mark: str) -> bool:
        """True when the attribute is a wrapper carrying ``mark`` (REPLAY_MARK, CAPTURE_MARK)."""
        return bool(getattr(self.module.__dict__.get(self.attr), mark, False))


# what the instance __dict__ held for an attribute that was not there (a class attribute or method)
_ABSENT = object()


@dataclass
class AttachHandle:
    """What an ``attach_*`` attached; ``remove()`` (or leaving a ``with`` block) undoes it.

    One class for every integration: ``ReplayHandle`` and ``CaptureHandle`` (transformers, the
    reference model) and ``MegatronHandle`` are it, by name.
    """

    # "replay" or "capture": the attach_<what> that made this handle
    what: str
    # registry key of the model's architecture (config.model_type), "reference", or "megatron"
    arch: str
    # each wrapped router's layer (RouterSite.layer), strictly increasing
    layers: tuple[Any, ...]
    # module path of each wrapped router, same order as layers
    paths: tuple[str, ...]
    # replay: each router's weight rule when attached, same order as layers (the transformers
    # rules re-read the router's fields at every call: moe_ops.integrations.hf.replay_rule gives
    # the current one; Megatron's are for its config's logits dtype); capture: ()
    rules: tuple[ReplayRule, ...] = ()
    # (router, attribute, what its instance __dict__ held or _ABSENT, our wrapper); empty once removed
    _wrapped: list[tuple[nn.Module, str, Any, Any]] = field(repr=False, default_factory=list)
    # called once by the remove() that restores the routers (Megatron's dispatcher count)
    _on_remove: Callable[[], None] | None = field(repr=False, default=None)

    @property
    def attached(self) -> bool:
        """True until :meth:`remove`."""
        return bool(self._wrapped)

    def remove(self) -> None:
        """Restores every router's attribute; a second call does nothing.

        RuntimeError, before anything is restored, when some router's attribute was replaced
        after this handle was attached (another wrapper or handle on top: remove that one first).
        """
        for path, (module, attr, _, wrapper) in zip(self.paths, self._wrapped):
            if module.__dict__.get(attr) is not wrapper:
                raise RuntimeError(
                    f"the {attr} of the router at {path!r} was replaced after attach_{self.what} (a wrapper "
                    "or handle attached on top of this one): remove that handle first"
                )
        if not self._wrapped:
            return
        for module, attr, previous, _ in self._wrapped:
            if previous is _ABSENT:
                delattr(module, attr)
            else:
                setattr(module, attr, previous)
        self._wrapped = []
        if self._on_remove is not None:
            self._on_remove()

    def __enter__(self) -> AttachHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class ReplayHandle(AttachHandle):
    """What ``attach_replay`` attached (transformers, the reference model); see :class:`AttachHandle`."""


H = TypeVar("H", bound=AttachHandle)


def attach_wrappers(
    handle_type: type[H],
    what: str,
    arch: str,
    sites: Sequence[RouterSite],
    wrappers: Sequence[Any],
    rules: Sequence[ReplayRule] = (),
    on_remove: Callable[[], None] | None = None,
) -> H:
    """Sets ``site.attr`` of each router to its wrapper (the same order) and returns the handle
    that restores them. Call it after every check: it changes the model and raises nothing."""
    wrapped = []
    for site, wrapper in zip(sites, wrappers, strict=True):
        previous = site.module.__dict__.get(site.attr, _ABSENT)
        setattr(site.module, site.attr, wrapper)
        wrapped.append((site.module, site.attr, previous, wrapper))
    return handle_type(
        what=what,
        arch=arch,
        layers=tuple(site.layer for site in sites),
        paths=tuple(site.path for site in sites),
        rules=tuple(rules),
        _wrapped=wrapped,
        _on_remove=on_remove,
    )


def check_against_shape(target: Any, sites: Sequence[RouterSite], name: str) -> None:
    """Checks the routers found against ``target.shape`` (a RoutingShape) when it has one: its
    ``moe_layers`` must be exactly the routers' layers, its ``top_k`` each router's ``top_k``.
    ``name`` ("capturer", "replayer") is the argument the messages name."""
    shape = getattr(target, "shape", None)
    moe_layers = getattr(shape, "moe_layers", None)
    if moe_layers is None:
        return
    found = tuple(site.layer for site in sites)
    if tuple(moe_layers) != found:
        raise ValueError(
            f"{name}.shape.moe_layers={tuple(moe_layers)} but the model's routers are in decoder "
            f"layers {found}: build the {name}'s shape from this model's config "
            "(moe_ops.resolve_routing_shape(model.config))"
        )
    top_k = getattr(shape, "top_k", None)
    for site in sites:
        router_k = getattr(site.module, "top_k", None)
        if isinstance(router_k, int) and top_k is not None and router_k != top_k:
            raise ValueError(
                f"{name}.shape.top_k={top_k} but the router at {site.path!r} picks top_k={router_k}"
            )


def check_device(target: Any, sites: Sequence[RouterSite], name: str) -> None:
    """ValueError when ``target.buffer`` (if it has one) is not on the device of a router's own
    parameters (meta parameters excepted)."""
    buffer = getattr(target, "buffer", None)
    if not isinstance(buffer, torch.Tensor):
        return
    for site in sites:
        for p in site.module.parameters(recurse=False):
            if p.device.type != "meta" and p.device != buffer.device:
                raise ValueError(
                    f"{name}.buffer is on {buffer.device} but the router at {site.path!r} has its weights "
                    f"on {p.device}: create the {name} on the model's device"
                )
            break


def check_replayer(
    replayer: Any, backend: str, call: str = "layer_ids(model_layer_index, num_tokens)"
) -> None:
    """TypeError for a ``replayer`` without ``layer_ids`` (``call`` is the signature the message
    shows), ValueError for an unknown ``backend``."""
    if not callable(getattr(replayer, "layer_ids", None)):
        raise TypeError(
            f"replayer must have a {call} method (e.g. moe_ops.RoutingReplayer), "
            f"got {type(replayer).__name__}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


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
    replays or that has a capture attached (the capture would record the live ids, not the
    replayed ones the experts get)."""
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
        if site.wrapped_by(REPLAY_MARK):
            raise ValueError(
                f"the router at {site.path!r} already has a routing replay attached: "
                "remove() that handle first"
            )
        if site.wrapped_by(CAPTURE_MARK):
            # the capture would wrap the router below the replay and record its live choice
            raise ValueError(
                f"the router at {site.path!r} has a routing capture attached (attach_capture, then "
                "attach_replay): the capture would record the router's live ids, not the replayed ids "
                "the experts get. Attach in the other order: remove() the capture handle, attach_replay, "
                "then attach_capture on top"
            )
