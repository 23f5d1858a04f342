"""``attach_capture`` and ``attach_replay`` for transformers models: wrap every MoE router's forward.

``attach_capture(model, capturer)`` finds the router module of every MoE layer of a transformers
model (:func:`~moe_ops.integrations.hf.architectures.find_routers`) and wraps its ``forward`` so
that the ids the router returns - the very tensor the experts consume next - also flow into
``capturer.capture(layer, ids, layout=layout)``. ``attach_replay(model, replayer)`` is the
trainer's mirror: the same routers, wrapped the same way, return the ids of
``replayer.layer_ids(layer, n)`` with weights recomputed from the live logits by each
architecture's own rule (:data:`~moe_ops.integrations.hf.rules.REPLAY_RULES`). The wrappers and
the handles are :mod:`moe_ops.attach`'s, shared with Megatron-Core and the reference model.

The layer index handed to the capturer and the replayer is the decoder layer parsed from the
router's module path (``model.layers.3.mlp.gate`` -> 3): the MODEL layer index, which
``RoutingCapturer`` maps to its MoE-only layer axis (dense layers, e.g. DeepSeek's first
``first_k_dense_replace``, have no router and no column; see docs/shapes.md).

Compile and graph safety: each wrapper is plain Python around registered ops, so dynamo inlines it
(no graph break) and a CUDA graph records the ops (no host read). It replaces the router's
``forward`` attribute instead of registering a forward hook because dynamo guards on that
attribute and not on hooks: attaching or removing after a model was compiled recompiles (or reuses
the graph compiled for that state) instead of silently replaying a stale graph.

Order: each wrapper wraps whatever ``forward`` holds. A capture attached before the replay sits
under it and records the router's own (live) choice; a capture attached after it, on top, records
the replayed ids the experts get - as Megatron-Core's hooks do. One capture and one replay per
router; remove the handles in reverse order.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...attach.capturing import CaptureHandle, capturing_forward, check_capture_sites
from ...attach.replaying import ReplayHandle, check_replay_sites, check_replayer, replaying_forward
from ...attach.sites import RouterSite, attach_wrappers, check_against_shape, check_device
from ...capture.protocol import Capturer, check_capturer
from ...layout import BatchLayout, layout_from_value
from ...models.attach import attach_replay as attach_own_replay
from ...models.attach import lists_its_routers
from .architectures import check_replay_version, find_routers
from .rules import rule_builder

__all__ = ["CaptureHandle", "ReplayHandle", "attach_capture", "attach_replay"]


def _sites(routers: list[tuple[int, str, nn.Module]]) -> list[RouterSite]:
    """The routers :func:`find_routers` found, as the sites an attach wraps (their ``forward``)."""
    return [RouterSite(layer, path, module) for layer, path, module in routers]


def attach_capture(
    model: nn.Module, capturer: Capturer, *, layout: BatchLayout | int = BatchLayout.LOCAL
) -> CaptureHandle:
    """Records the routing of every MoE layer of a transformers ``model`` into ``capturer``.

    Args:
        model: a transformers model of a supported architecture (``SUPPORTED_ARCHITECTURES``,
            keyed by ``config.model_type``): the ``*ForCausalLM`` or its base model.
        capturer: where ids go, a :class:`~moe_ops.capture.Capturer` (e.g.
            :class:`moe_ops.RoutingCapturer`); only its ``capture(layer_id, topk_ids,
            layout=...)`` is called, with the MODEL layer index. With a ``shape`` (RoutingShape)
            its ``moe_layers`` must be exactly the decoder layers that have a router, and its
            ``top_k`` the routers' top_k; with a ``buffer``, on the routers' device.
        layout: the :class:`BatchLayout` of the router's rows (LOCAL for a transformers model run
            on one rank: the flattened ``(batch * seq)`` tokens, padding rows last).

    Returns a :class:`CaptureHandle`; ``handle.remove()`` or ``with attach_capture(...):`` restores
    the routers. Per forward, each router's ids ``(batch * seq, top_k)`` go to
    ``capturer.capture(layer, ids, layout=layout)``, which records rows ``[0, token_counts[rank])``
    (LOCAL): set the capturer's counts before the forward (``capturer.set_step``).

    Everything is checked before any router is touched: ValueError for an unsupported architecture
    (listing the supported ones), a model without routers, a capturer shape or device that does not
    fit the model, or a router that already has a capture attached (on top of a replay or under
    it); TypeError for a capturer without ``capture``.

    With a replay attached (:func:`attach_replay`) the capture goes on top of it and records the
    replayed ids the experts get; attached before the replay, it stays under it and records the
    router's own (live) choice.

    Attach before or after ``torch.compile``: dynamo guards on the wrapped ``forward``, so the
    first compiled call after attaching (or removing) recompiles, or reuses a graph compiled for
    that state. No host reads and no graph breaks are added; CUDA graphs record the capture op.
    """
    check_capturer(capturer, members=("capture",))
    layout = layout_from_value(layout)
    arch, routers = find_routers(model)
    sites = _sites(routers)
    check_against_shape(capturer, sites, "capturer")
    check_device(capturer, sites, "capturer")
    check_capture_sites(sites)
    wrappers = [capturing_forward(site.module.forward, capturer, site.layer, layout) for site in sites]
    return attach_wrappers(CaptureHandle, "capture", arch, sites, wrappers)


def attach_replay(
    model: nn.Module, replayer: Any, *, backend: str = "auto", weights: str = "computed"
) -> ReplayHandle:
    """Makes every MoE router of ``model`` return the ids in ``replayer``, weighted by its own rule.

    Args:
        model: a transformers model of a supported architecture (``SUPPORTED_ARCHITECTURES``, the
            ``*ForCausalLM`` or its base model, or their ``torch.compile`` wrapper). A model that
            lists its own routers (``replay_routers()``: :class:`~moe_ops.models.ReferenceMoEModel`)
            is handed to :func:`moe_ops.models.attach_replay` - the one dispatch, here, so that
            ``moe_ops.attach_replay`` takes both.
        replayer: where the ids come from, e.g. :class:`moe_ops.RoutingReplayer`: an object with
            ``layer_ids(model_layer_index, num_tokens)`` returning ``(num_tokens, top_k)`` ids. With
            a ``shape`` its ``moe_layers`` must be exactly the decoder layers that have a router,
            and its ``top_k`` the routers' top_k.
        backend: ``replay_routing``'s backend ("auto", "triton", "torch").
        weights: "computed" (the rule's weights from the live logits) or "recorded" (the rollout's
            weights the replayer holds - ``RoutingReplayer(weights_dtype=...)``,
            ``set_batch(..., weights=...)`` - as values, with the rule's gradient: docs/replay.md
            "Recorded weights"; rows without recorded weights keep the computed ones).

    Returns a :class:`~moe_ops.attach.replaying.ReplayHandle`; ``handle.remove()`` or ``with
    attach_replay(...):`` restores the routers. Each wrapped router runs as before, then returns
    the same tuple (same positions, dtypes, shapes) with its weights and ids replaced by
    :func:`~moe_ops.attach.replaying.replay_router_output` of ``replayer.layer_ids(layer, n)``: the
    recorded ids, weighted by the architecture's own rule (``REPLAY_RULES``) from the live logits,
    so gradients reach the router; rows of -1 keep the router's own output. The rule is built from
    the router's fields at every call, as its bias is read: a field changed after attaching
    (``norm_topk_prob``, ``routed_scaling_factor``, ...) takes effect at the next call (under
    ``torch.compile`` dynamo guards on those fields: a change recompiles once).

    Everything is checked before any router is touched: ValueError for an unsupported
    architecture, a model without routers, a replayer shape or device that does not fit the model
    (a router's ``top_k`` other than ``replayer.shape.top_k`` included), a router whose rule
    ``replay_routing`` would refuse, or a router that already has a replay attached (under a
    capture included); TypeError for a replayer without ``layer_ids``. At a call, ValueError naming
    the router when its ``top_k`` no longer matches the replayer's rows (changed after attaching).
    Attach before or after ``torch.compile`` (dynamo guards on the wrapped attribute, as for
    ``attach_capture``); no host reads and no graph breaks are added.

    A capture attached before (:func:`attach_capture`) stays under the replay and records the
    router's own (live) ids; one attached after it goes on top and records the replayed ids.
    """
    if lists_its_routers(model):
        return attach_own_replay(model, replayer, backend=backend, weights=weights)
    check_replayer(replayer, backend, weights=weights)
    arch, routers = find_routers(model, caller="attach_replay")
    check_replay_version(arch)
    builder = rule_builder(arch)
    sites = _sites(routers)
    # the shape first: a rule refuses some top_k itself (PhiMoE's), with a less useful message
    check_against_shape(replayer, sites, "replayer")
    check_device(replayer, sites, "replayer")
    rules = [builder(site.module) for site in sites]
    check_replay_sites(replayer, sites, rules)
    # each wrapper calls the builder on the router's fields at every call
    wrappers = [
        replaying_forward(
            site.module.forward,
            replayer,
            site.layer,
            builder,
            site.module,
            backend=backend,
            path=site.path,
            weights=weights,
        )
        for site in sites
    ]
    return attach_wrappers(ReplayHandle, "replay", arch, sites, wrappers, rules)
