"""Megatron-Core: replay recorded routing in, and capture the routing of, Megatron's ``TopKRouter``.

The mirror of :mod:`moe_ops.integrations.hf` for Megatron-Core (tested with megatron-core 0.16.1)::

    shape = routing_shape(config)                      # the MoE-only layer axis of the decoder
    replayer = RoutingReplayer(shape, max_num_tokens, "cuda", num_mtp_layers=config.mtp_num_layers or 0)
    with attach_replay(model, replayer):               # a GPTModel, or the list of its chunks
        replayer.set_batch(to_megatron_order(routing, micro_batch_size))
        loss = loss_fn(model(tokens, position_ids, attention_mask))
        loss.backward()

One module per concern, every public name re-exported here (import them from
``moe_ops.integrations.megatron``):

- :mod:`.routers`: Megatron's names (imported on first use), :func:`find_routers` and the layer
  each router reads, :func:`routing_shape`, Megatron's ``[s, b]`` token order
  (:func:`to_megatron_order`, :func:`from_megatron_order`).
- :mod:`.rules`: Megatron's score functions as moe-ops routing methods (:func:`replay_rule`).
- :mod:`.attach`: the dispatcher in Megatron's ``router.py``, the per-router hooks and the ids
  of a routing map they read (:func:`routing_ids`), :func:`attach_replay`, :func:`attach_capture`
  and :class:`MegatronHandle`.
- :mod:`.schedule`: one replay slot per micro-batch of a pipeline schedule
  (:func:`replaying_forward_step`).

``megatron`` is imported on first use (``attach_*``, :func:`find_routers`; :func:`routing_shape`
does not need it); ``import moe_ops`` never imports this package.
"""

from .attach import MegatronHandle, attach_capture, attach_replay, routing_ids
from .routers import (
    TESTED_MEGATRON_VERSIONS,
    MegatronRouter,
    find_routers,
    from_megatron_order,
    routing_shape,
    to_megatron_order,
)
from .rules import replay_rule
from .schedule import replaying_forward_step

__all__ = [
    "TESTED_MEGATRON_VERSIONS",
    "MegatronHandle",
    "MegatronRouter",
    "attach_capture",
    "attach_replay",
    "find_routers",
    "from_megatron_order",
    "replay_rule",
    "replaying_forward_step",
    "routing_ids",
    "routing_shape",
    "to_megatron_order",
]
