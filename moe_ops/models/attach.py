"""``attach_replay`` for a model that lists its own routers: the reference MoE model.

A transformers model is found by its ``config.model_type`` and its router classes
(:mod:`moe_ops.integrations.hf`); the package's reference model needs neither: it says where its
routers are (:meth:`~moe_ops.models.ReferenceMoEModel.replay_routers`: each MoE block's ``router``
method and the block's own routing rule). Both attach with the same plumbing
(:mod:`moe_ops.attach`) and return the same :class:`~moe_ops.attach.replaying.ReplayHandle`.

Who takes what: this ``attach_replay`` takes a model with ``replay_routers()`` only;
``moe_ops.attach_replay`` (= ``moe_ops.integrations.hf.attach_replay``) takes a transformers model
and hands a model with ``replay_routers()`` here (:func:`lists_its_routers`), the one dispatch.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..attach.replaying import ReplayHandle, check_replay_sites, check_replayer, replaying_forward
from ..attach.sites import RouterSite, attach_wrappers, check_against_shape, check_device

__all__ = ["attach_replay", "lists_its_routers"]


def lists_its_routers(model: object) -> bool:
    """True when ``model`` (or the module a ``torch.compile`` wrapper holds) has a callable
    ``replay_routers()``, as :class:`~moe_ops.models.ReferenceMoEModel` has."""
    base = getattr(model, "_orig_mod", model)
    return callable(getattr(base, "replay_routers", None))


def attach_replay(
    model: nn.Module, replayer: Any, *, backend: str = "auto", weights: str = "computed"
) -> ReplayHandle:
    """Makes every MoE router of ``model`` return the ids in ``replayer``, weighted by its own rule.

    Args:
        model: a model with ``replay_routers()`` (:class:`~moe_ops.models.ReferenceMoEModel`), or
            its ``torch.compile`` wrapper.
        replayer: where the ids come from, e.g. :class:`moe_ops.RoutingReplayer`:
            ``layer_ids(model_layer_index, num_tokens)`` returning ``(num_tokens, top_k)`` ids. With
            a ``shape`` its ``moe_layers`` must be exactly the model's MoE layers, its ``top_k`` and
            ``num_experts`` the routers'.
        backend: ``replay_routing``'s backend ("auto", "triton", "torch").
        weights: "computed" or "recorded", as in :func:`moe_ops.integrations.hf.attach_replay`.

    Returns a :class:`~moe_ops.attach.replaying.ReplayHandle` (``arch`` "reference"); ``remove()`` or
    a ``with`` block restores the routers. Each MoE block's ``router`` method is replaced on its
    instance by :func:`~moe_ops.attach.replaying.replaying_forward` with the block's rule (its routing
    method, bias, groups and scale, fixed by its config): the recorded ids, weights from the live
    logits (gradients reach the gate), rows of -1 the block's own routing; a ``capture`` target
    given to the router records the replayed ids.

    Everything is checked before any router is touched: TypeError for a replayer without
    ``layer_ids`` or a model without ``replay_routers()``; ValueError for a bad backend, a replayer
    shape or device that does not fit the model, a rule ``replay_routing`` would refuse, or a
    router that already replays.
    """
    check_replayer(replayer, backend, weights=weights)
    if not lists_its_routers(model):
        raise TypeError(
            "model must list its routers (replay_routers(), e.g. moe_ops.models.ReferenceMoEModel), "
            f"got {type(model).__name__}; a transformers model attaches with "
            "moe_ops.integrations.hf.attach_replay"
        )
    found = getattr(model, "_orig_mod", model).replay_routers()
    sites = [RouterSite(layer, path, module, attr) for layer, path, module, attr, _ in found]
    rules = [rule for *_, rule in found]
    check_against_shape(replayer, sites, "replayer")
    check_device(replayer, sites, "replayer")
    check_replay_sites(replayer, sites, rules)
    # the rules are fixed by the config, so each wrapper holds its rule, not a builder
    wrappers = [
        replaying_forward(
            getattr(site.module, site.attr),
            replayer,
            site.layer,
            rule,
            site.module,
            backend=backend,
            path=site.path,
            weights=weights,
        )
        for site, rule in zip(sites, rules, strict=True)
    ]
    return attach_wrappers(ReplayHandle, "replay", "reference", sites, wrappers, rules)
