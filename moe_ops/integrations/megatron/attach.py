"""``attach_replay`` and ``attach_capture`` for Megatron-Core: a dispatcher and per-router hooks.

Where the hook sits. ``TopKRouter.routing`` calls ``topk_routing_with_score_function(logits, ...,
fused=config.moe_router_fusion, router_replay=self.router_replay)``, a module-level function of
``megatron/core/transformer/moe/router.py``. With ``moe_router_fusion=True`` that function returns
Transformer Engine's ``fused_topk_with_score_function(...)`` before it reaches ``compute_topk``,
the only place Megatron's own ``RouterReplay`` acts: Megatron's replay silently routes live there.
moe-ops replaces the name ``topk_routing_with_score_function`` in ``router.py`` with a dispatcher
(installed while a handle is attached, the original restored when the last one is removed) and
sets each attached router's ``router_replay`` attribute to a moe-ops hook. The dispatcher hands
every call whose ``router_replay`` is a moe-ops hook to that hook, whichever path (fused or not)
the call would take; every other call (other routers, other processes' models) goes to the
original unchanged. So, in Megatron's order::

    TopKRouter.forward -> gating (logits) -> routing:
        z-loss on logits
        topk_routing_with_score_function   <- the hook: (probs, routing_map) of the recorded ids
        token dropping (capacity)           (on the replayed map, as with Megatron's RouterReplay)
        aux losses (own top-k of logits)    (as with Megatron's RouterReplay)
        expert-bias token counts            (of the replayed map, as with Megatron's RouterReplay)
    MoELayer: dispatcher (expert-parallel remapping) -> experts

The hook returns the recorded ids with weights from the live logits by Megatron's own rule
(:func:`replay_rule`), scattered into Megatron's dense ``(probs, routing_map)`` exactly as
``topk_routing_with_score_function`` does (``index_put_`` under deterministic algorithms,
``scatter`` otherwise); gradients reach the router through those weights. A row of -1 and a faulty
row (counted for ``check_replay_errors``) are routed live: by default (``live_rows="rule"``) by
``replay_routing`` under that rule, in the replay kernel, so the router's own routing never runs;
with ``live_rows="router"`` (and wherever something reads the live routing: a capture under the
hook, Megatron's ``RouterReplay`` with an action, ``record_live``) the hook first runs the router's
own routing (fused or not, through whatever ``router_replay`` the router had) and those rows return
its output unchanged.

Order: each hook wraps what the router's ``router_replay`` held. A capture attached before the
replay sits under it and records the router's own (live) ids; attached after it, on top, it
records the replayed ids - as the transformers integration's wrappers do. One capture and one
replay per router; remove the handles in reverse order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...attach.replaying import ReplayRule, check_replayer, replay_router_output, replay_routing_rule
from ...attach.sites import AttachHandle, RouterSite, attach_wrappers
from ...capture.protocol import Capturer, check_capturer
from ...layout import BatchLayout, layout_from_value
from ...router.methods import BIAS_METHODS
from .routers import MegatronRouter, _megatron, find_routers
from .rules import call_rule, check_router_rule, replay_rule

__all__ = ["MegatronHandle", "attach_capture", "attach_replay"]

_lock = threading.Lock()
# moe-ops handles attached: the dispatcher is in router.py while > 0
_attached = 0


def routing_ids(routing_map: torch.Tensor, top_k: int) -> torch.Tensor:
    """(n, top_k) int64 - the experts of each row of a Megatron ``routing_map``, ascending.

    ``routing_map``: (n, num_experts) bool with ``top_k`` True per row (what
    ``topk_routing_with_score_function`` returns, fused or not). A map has no column order, so the
    ids come out in ascending expert order (deterministic on every device). On the device, no sync.
    """
    num_experts = routing_map.shape[-1]
    # expert e gets key num_experts - e where chosen, 0 elsewhere: the top_k keys are the chosen
    # experts, distinct, the lowest id first
    key = torch.arange(num_experts, 0, -1, dtype=torch.int32, device=routing_map.device)
    return torch.where(routing_map, key, 0).topk(top_k, dim=-1).indices


class _Hook:
    """A router's ``router_replay`` while a moe-ops handle is attached; ``inner`` is what it held
    before (Megatron's ``RouterReplay``, None, or another moe-ops hook)."""

    def __init__(self, inner: Any, kind: str, index: int):
        self.inner = inner
        self.kind = kind
        self.index = index

    def routed(self, arguments: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's own ``(probs, routing_map)``: the original function with ``inner``."""
        if isinstance(self.inner, _Hook):
            return self.inner(arguments)
        return _megatron().original(**{**arguments, "router_replay": self.inner})

    def __call__(self, arguments: dict) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError


def _dense(
    template: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``(routing_probs, routing_map)`` of ``(ids, weights)``, built as
    ``topk_routing_with_score_function`` builds them."""
    if torch.are_deterministic_algorithms_enabled():
        rows = torch.arange(template.shape[0], device=template.device).unsqueeze(1)
        probs = torch.zeros_like(template)
        probs.index_put_((rows, ids), weights, accumulate=False)
        routing_map = torch.zeros_like(template)
        routing_map.index_put_((rows, ids), torch.ones_like(weights, dtype=template.dtype), accumulate=False)
        return probs, routing_map.bool()
    probs = torch.zeros_like(template).scatter(1, ids, weights)
    # Megatron's zeros(int32).scatter(1).bool() in two kernels: the same map, written as bools
    routing_map = torch.zeros_like(template, dtype=torch.bool).scatter_(1, ids, True)
    return probs, routing_map


LIVE_ROWS = ("rule", "router")


def _selects_as_megatron(arguments: dict, rule: ReplayRule) -> bool:
    """True where replay_routing's live routing under the call's rule chooses Megatron's experts
    (up to scores that tie after rounding): every call whose groups the rule routes too - not
    softmax with groups, nor sigmoid top-1 without a bias with groups (their rules weigh without
    groups: no moe-ops method routes them)."""
    return not arguments["group_topk"] or rule.n_group is not None


class _ReplayHook(_Hook):
    def __init__(
        self, inner: Any, kind: str, index: int, replayer: Any, backend: str, live_rows: str, weights: str
    ):
        super().__init__(inner, kind, index)
        self.replayer = replayer
        self.backend = backend
        self.live_rows = live_rows
        self.with_weights = weights == "recorded"
        # the rule of each set of arguments call_rule reads (the router's config at call time),
        # built once: a router call looks it up instead of building it again
        self.rules: dict[tuple, ReplayRule] = {}

    def _needs_router_output(self, arguments: dict, rule: ReplayRule) -> bool:
        """Whether this call runs the router's own routing: asked for (``live_rows="router"``), or
        needed by what sits under the hook or reads the live ids - a capture under it, Megatron's
        RouterReplay with an action (it records or replays), a replayer keeping the live ids - or
        a selection no moe-ops rule routes."""
        inner = self.inner
        return (
            self.live_rows == "router"
            or isinstance(inner, _Hook)
            or getattr(inner, "router_replay_action", None) is not None
            or getattr(self.replayer, "record_live", False)
            or not _selects_as_megatron(arguments, rule)
        )

    def __call__(self, arguments: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logits, top_k = arguments["logits"], arguments["topk"]
        n = logits.shape[0]
        # a RoutingReplayer's rows come with the row count its device check needs (None where the
        # host checked): the check rides in replay_routing's forward kernel
        kind = {"kind": "mtp"} if self.kind == "mtp" else {}
        recorded_weights = None
        if callable(getattr(self.replayer, "rows", None)):
            if self.with_weights:
                recorded, row_count, recorded_weights = self.replayer.rows(
                    self.index, n, **kind, weights=True
                )
            else:  # a replayer's rows() without weights: (ids, row_count) first
                recorded, row_count = self.replayer.rows(self.index, n, **kind)[:2]
        else:
            recorded, row_count = self.replayer.layer_ids(self.index, n, **kind), None
        key = (
            arguments["score_function"], arguments["use_pre_softmax"], arguments["topk"],
            arguments["scaling_factor"], arguments["expert_bias"] is not None, arguments["num_groups"],
            arguments["group_topk"], logits.dtype,
        )  # fmt: skip
        rule = self.rules.get(key)
        if rule is None:
            rule = self.rules[key] = call_rule(arguments, logits.dtype)
        bias = arguments["expert_bias"] if rule.method in BIAS_METHODS else None
        if not self._needs_router_output(arguments, rule):
            # the router's own routing never runs: replay_routing routes the -1 and faulty rows by
            # the rule (Megatron's selection), one kernel; then Megatron's dense form
            weights, ids = replay_routing_rule(
                logits, recorded, rule, bias=bias, backend=self.backend, row_count=row_count,
                recorded_weights=recorded_weights,
            )  # fmt: skip
            return _dense(logits, ids, weights.to(logits.dtype))
        probs, routing_map = self.routed(arguments)
        live_ids = routing_ids(routing_map, top_k)
        if getattr(self.replayer, "record_live", False):
            self.replayer.write_live(self.index, live_ids, kind=self.kind)
        weights, ids = replay_router_output(
            logits,
            probs.gather(1, live_ids),
            live_ids,
            recorded,
            rule,
            bias=bias,
            backend=self.backend,
            row_count=row_count,
            recorded_weights=recorded_weights,
        )
        # rows whose ids are not the record: -1 rows and faulty ones (routed live by the method,
        # counted); both take the router's own output, so its selection (groups, fusion) decides
        keep_live = (ids != recorded).any(dim=-1, keepdim=True)
        replayed_probs, replayed_map = _dense(probs, ids, weights)
        return torch.where(keep_live, probs, replayed_probs), torch.where(
            keep_live, routing_map, replayed_map
        )


class _CaptureHook(_Hook):
    def __init__(self, inner: Any, kind: str, index: int, capturer: Capturer, layout: BatchLayout):
        super().__init__(inner, kind, index)
        self.capturer = capturer
        self.layout = layout

    def __call__(self, arguments: dict) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map = self.routed(arguments)
        self.capturer.capture(self.index, routing_ids(routing_map, arguments["topk"]), layout=self.layout)
        return probs, routing_map


def _dispatch(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``router.topk_routing_with_score_function`` is while a handle is attached: a call whose
    ``router_replay`` is a moe-ops hook goes to the hook (fused or not), any other to Megatron."""
    mt = _megatron()
    hook = kwargs.get("router_replay")
    if hook is None and len(args) > mt.replay_position:
        hook = args[mt.replay_position]
    if not isinstance(hook, _Hook):
        return mt.original(*args, **kwargs)
    names = mt.parameter_names
    if len(args) <= 2 and len(args) + len(kwargs) == len(names) and kwargs.keys() == mt.keywords[len(args)]:
        # TopKRouter.routing's call: (logits, topk, every other argument by name); a dict without
        # inspect's bind (~25 us of host time a call on a 2-core host)
        return hook(dict(zip(names, args), **kwargs))
    call = mt.signature.bind(*args, **kwargs)
    call.apply_defaults()
    return hook(dict(call.arguments))


_dispatch._moe_ops_dispatch = True  # type: ignore[attr-defined]


def _install() -> None:
    global _attached
    mt = _megatron()
    with _lock:
        if _attached == 0:
            _dispatch._moe_ops_original = mt.original  # type: ignore[attr-defined]
            mt.router_module.topk_routing_with_score_function = _dispatch
        _attached += 1


def _release() -> None:
    global _attached
    mt = _megatron()
    with _lock:
        _attached -= 1
        if _attached == 0 and mt.router_module.topk_routing_with_score_function is _dispatch:
            mt.router_module.topk_routing_with_score_function = mt.original


def _chain(router: nn.Module) -> list[Any]:
    """The hooks in a router's ``router_replay`` chain, outermost first."""
    out, hook = [], router.__dict__.get("router_replay")
    while isinstance(hook, _Hook):
        out.append(hook)
        hook = hook.inner
    return out


def _check_target(target: Any, name: str, routers: list[MegatronRouter]) -> None:
    """The routers against ``target.shape`` (a RoutingShape), ``num_mtp_layers`` and device."""
    shape = getattr(target, "shape", None)
    moe_layers = getattr(shape, "moe_layers", None)
    num_mtp = getattr(target, "num_mtp_layers", None)
    buffer = getattr(target, "buffer", None)
    for r in routers:
        if r.kind == "decoder" and moe_layers is not None and r.index not in moe_layers:
            raise ValueError(
                f"the router at {r.path!r} is in decoder layer {r.index} (layer_number {r.index + 1}), "
                f"which {name}.shape.moe_layers={tuple(moe_layers)} does not hold: build the shape with "
                "moe_ops.integrations.megatron.routing_shape(config)"
            )
        if r.kind == "mtp" and isinstance(num_mtp, int) and r.index >= num_mtp:
            raise ValueError(
                f"the router at {r.path!r} is in MTP layer {r.index} but {name}.num_mtp_layers={num_mtp}: "
                "pass num_mtp_layers=config.mtp_num_layers"
            )
        config = r.module.config
        for field_name, theirs in (
            ("top_k", config.moe_router_topk),
            ("num_experts", config.num_moe_experts),
        ):
            ours = getattr(shape, field_name, None)
            if ours is not None and ours != theirs:
                raise ValueError(
                    f"{name}.shape.{field_name}={ours} but the router at {r.path!r} has {theirs}"
                )
        weight = r.module.weight
        # Megatron moves a CPU-initialised gate to the current CUDA device at its first forward
        if not isinstance(buffer, torch.Tensor) or weight.device == buffer.device:
            continue
        if not (weight.device.type == "cpu" and buffer.device.type == "cuda"):
            raise ValueError(
                f"{name}.buffer is on {buffer.device} but the router at {r.path!r} has its weights on "
                f"{weight.device}: create the {name} on the model's device"
            )


# ---------------------------------------------------------------------------------------------------
# Attaching
# ---------------------------------------------------------------------------------------------------


class MegatronHandle(AttachHandle):
    """What :func:`attach_replay` / :func:`attach_capture` attached; ``remove()`` (or leaving a
    ``with`` block) restores every router's ``router_replay`` and, with the last handle, Megatron's
    routing function. See :class:`~moe_ops.attach.sites.AttachHandle`: ``what`` is "replay" or
    "capture", ``arch`` "megatron", ``layers`` the ``(kind, index)`` of each hooked router
    (("decoder", layer) then ("mtp", mtp layer)); replay ``rules`` are each router's rule for its
    config's logits dtype (calls with another dtype use that dtype's rule)."""

    @property
    def _hooks(self) -> list[tuple[nn.Module, _Hook]]:
        """(router, our hook) of each hooked router; empty once removed."""
        return [(module, hook) for module, _, _, hook in self._wrapped]


def _attach(
    what: str, routers: list[MegatronRouter], make: Callable[[Any, MegatronRouter], _Hook], rules=()
) -> MegatronHandle:
    """Hooks each router (``make(inner, router)``, ``inner`` its ``router_replay`` now) with the
    dispatcher installed; the handle releases the dispatcher when removed."""
    _install()
    sites = [RouterSite((r.kind, r.index), r.path, r.module, "router_replay") for r in routers]
    hooks = [make(r.module.__dict__.get("router_replay"), r) for r in routers]
    return attach_wrappers(MegatronHandle, what, "megatron", sites, hooks, rules, on_remove=_release)


def attach_replay(
    model: nn.Module | Sequence[nn.Module],
    replayer: Any,
    *,
    backend: str = "auto",
    live_rows: str = "rule",
    weights: str = "computed",
) -> MegatronHandle:
    """Makes every ``TopKRouter`` of ``model`` route the ids in ``replayer``, fused or not.

    Args:
        model: a Megatron model (``GPTModel``, wrapped in DDP / Float16Module or not), a module
            holding TopKRouters (an ``MoELayer``), or the list of a rank's virtual-pipeline chunks.
        replayer: where the ids come from, e.g. :class:`moe_ops.RoutingReplayer` built with
            :func:`routing_shape` (and ``num_mtp_layers`` when the model has MTP layers): an
            object with ``layer_ids(layer, num_tokens)`` (and ``kind="mtp"``) returning
            ``(num_tokens, top_k)`` ids, rows in Megatron's ``[s, b]`` token order.
        backend: ``replay_routing``'s backend ("auto", "triton", "torch").
        live_rows: what a row of -1 (and a faulty row) returns. "rule" (default): the live routing
            of ``replay_routing`` under the router's rule, Megatron's selection (the same experts
            except where two scores tie after rounding; weights to float rounding), computed in
            the replay kernel: the router's own routing never runs, so a replayed router call
            costs about what Megatron's ``RouterReplay`` does. "router": the router's own output
            bit for bit (fused or not), which runs the router's own routing as well on every call.
            A call runs the router's own routing whatever this says where something needs it: a
            capture under the replay, Megatron's ``RouterReplay`` with an action set, a replayer
            with ``record_live``, softmax routing with groups (no moe-ops rule selects like it).
        weights: "computed" (Megatron's rule from the live logits) or "recorded" (the rollout's
            weights the replayer holds, ``RoutingReplayer(weights_dtype=...)``, as values with the
            rule's gradient; rows without recorded weights keep the computed ones).

    Returns a :class:`MegatronHandle`; ``handle.remove()`` or ``with attach_replay(...):`` restores
    the routers. Each router then returns Megatron's ``(probs, routing_map)`` of the recorded ids,
    weighted by its config's rule (:func:`replay_rule`) from its live logits, so gradients reach the
    gate; a row of -1 (and a faulty row, counted for ``check_replay_errors``) keeps the router's
    own output (``live_rows``). Works with ``moe_router_fusion=True``, where Megatron's own
    ``RouterReplay`` never runs. A router that has Megatron's ``RouterReplay`` keeps it for its
    live routing; while attached, that RouterReplay's recorded/target ids see the live routing.

    Everything is checked before any router is touched: ValueError for a model without
    TopKRouters, a replayer shape, MTP count or device that does not fit them, a config whose rule
    ``replay_routing`` refuses, or a router that already replays; TypeError for a replayer without
    ``layer_ids``; ImportError without megatron-core.
    """
    check_replayer(replayer, backend, call="layer_ids(layer, num_tokens, kind=...)", weights=weights)
    if live_rows not in LIVE_ROWS:
        raise ValueError(f"live_rows must be one of {LIVE_ROWS}, got {live_rows!r}")
    routers = find_routers(model)
    _check_target(replayer, "replayer", routers)
    rules = []
    for r in routers:
        if any(isinstance(h, _ReplayHook) for h in _chain(r.module)):
            raise ValueError(f"the router at {r.path!r} already replays: remove() that handle first")
        rule = replay_rule(r.module.config)
        check_router_rule(rule, r)
        rules.append(rule)
    return _attach(
        "replay",
        routers,
        lambda inner, r: _ReplayHook(inner, r.kind, r.index, replayer, backend, live_rows, weights),
        rules,
    )


def attach_capture(
    model: nn.Module | Sequence[nn.Module],
    capturer: Capturer,
    *,
    layout: BatchLayout | int = BatchLayout.LOCAL,
) -> MegatronHandle:
    """Records the routing of every decoder ``TopKRouter`` of ``model`` into ``capturer``.

    Args:
        model: as for :func:`attach_replay`.
        capturer: a :class:`~moe_ops.capture.Capturer`, e.g. :class:`moe_ops.RoutingCapturer` with
            a :func:`routing_shape` shape; only its ``capture(layer, ids, layout=...)`` is called,
            with the 0-based decoder layer.
        layout: the :class:`~moe_ops.BatchLayout` of a router's rows (LOCAL: this rank's tokens in
            ``[s, b]`` order; set the capturer's counts before each forward).

    Per forward, each decoder router's ids go to ``capturer.capture(layer_number - 1, ids,
    layout=layout)``: the experts of its ``routing_map`` as Megatron's routing function returned it
    (fused or not), in ascending id order - the logical expert ids, before the token dispatcher
    maps them to expert-parallel ranks, and before token dropping. MTP routers are not captured
    (they are not on the MoE-only layer axis). Attached on top of :func:`attach_replay`, the
    replayed ids are recorded; under it, the router's own. No host reads.

    ValueError before anything is touched for a model without decoder TopKRouters, a capturer
    shape or device that does not fit them, or a router that already captures; TypeError for a
    capturer without ``capture``.
    """
    check_capturer(capturer, members=("capture",))
    layout = layout_from_value(layout)
    routers = [r for r in find_routers(model) if r.kind == "decoder"]
    if not routers:
        raise ValueError("the model has MTP routers only: nothing on the decoder's MoE layer axis to capture")
    _check_target(capturer, "capturer", routers)
    for r in routers:
        if any(isinstance(h, _CaptureHook) for h in _chain(r.module)):
            raise ValueError(f"the router at {r.path!r} already captures: remove() that handle first")
    return _attach(
        "capture", routers, lambda inner, r: _CaptureHook(inner, r.kind, r.index, capturer, layout)
    )
