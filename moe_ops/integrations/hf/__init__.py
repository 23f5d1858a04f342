"""Hugging Face ``transformers``: record the routing of a MoE model you did not write, and replay it.

``attach_capture(model, capturer)`` finds the router module of every MoE layer of a transformers
model and wraps its ``forward`` so that the ids the router returns - the very tensor the experts
consume next - also flow into ``capturer.capture(layer, ids, layout=layout)``. No model code is
edited; ``remove()`` (or leaving the ``with`` block) restores every router::

    shape = moe_ops.resolve_routing_shape(model.config)
    capturer = moe_ops.RoutingCapturer(shape, max_num_tokens, device)
    with attach_capture(model, capturer):
        capturer.set_step([num_tokens])
        model(input_ids)           # eager, torch.compile'd or replayed from a CUDA graph

``attach_replay(model, replayer)`` is the trainer's mirror: the same routers, wrapped the same way,
return the ids of ``replayer.layer_ids(layer, n)`` (a ``RoutingReplayer``'s buffer) with weights
recomputed from the live logits by each architecture's own rule (:data:`REPLAY_RULES`), so the
experts compute with the rollout's routing and gradients reach the routers (docs/replay.md).

One module per concern, every public name re-exported here:

- :mod:`.architectures`: ``SUPPORTED_ARCHITECTURES`` (``HFArchitecture`` per ``model_type``),
  ``normalize_arch``, ``find_routers``, the transformers version checks.
- :mod:`.rules`: the weight rule of every architecture (``REPLAY_RULES``, ``replay_rule``).
- :mod:`.attach`: ``attach_capture``, ``attach_replay`` and their handles.
- :mod:`.tiny`: tiny real models (``tiny_config``, ``build_tiny_model``), their sizes in
  ``_tiny_sizes``.

``transformers`` is imported lazily, by :func:`tiny_config` and :func:`build_tiny_model` only;
``import moe_ops`` never imports it.
"""

from .architectures import (
    MIN_REPLAY_TRANSFORMERS_VERSION,
    MIN_TRANSFORMERS_VERSION,
    SUPPORTED_ARCHITECTURES,
    HFArchitecture,
    check_transformers_version,
    find_routers,
    needs_release,
    normalize_arch,
)
from .attach import CaptureHandle, ReplayHandle, attach_capture, attach_replay
from .rules import REPLAY_RULES, replay_rule
from .tiny import build_tiny_model, tiny_config

__all__ = [
    "MIN_REPLAY_TRANSFORMERS_VERSION",
    "MIN_TRANSFORMERS_VERSION",
    "REPLAY_RULES",
    "SUPPORTED_ARCHITECTURES",
    "CaptureHandle",
    "HFArchitecture",
    "ReplayHandle",
    "attach_capture",
    "attach_replay",
    "build_tiny_model",
    "check_transformers_version",
    "find_routers",
    "needs_release",
    "normalize_arch",
    "replay_rule",
    "tiny_config",
]
