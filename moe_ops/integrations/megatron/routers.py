"""Megatron-Core's routers: where they are, which layer each one reads, the order of their rows.

Megatron's names are imported on first use (:func:`_megatron`): ImportError without megatron-core,
or with one whose router does not pass ``fused`` and ``router_replay`` to
``topk_routing_with_score_function`` (where :mod:`.attach` hooks it).

Layer indexing. A decoder router reads ``replayer.layer_ids(router.layer_number - 1, n)``
(``layer_number`` is 1-based and global across pipeline stages, so each stage's routers read their
own layers' columns); a router inside the multi-token-prediction block (``model.mtp.layers[i]``)
reads ``replayer.layer_ids(i, n, kind="mtp")``, ``i`` its MTP layer's own 0-based number. Megatron
numbers the MTP layers' transformer layers after the decoder's (0.16: ``num_layers + i + 1``;
other versions restart at 1), so keying by ``layer_number`` alone would read a decoder layer's
rows, or none: an MTP layer never reads a decoder layer's rows here, and a batch set without MTP
rows routes the MTP layers live. Dense layers have no router and no column.

Token order. Megatron's activations are ``[seq, batch, hidden]``, so a router's rows are the tokens
in ``[s, b]`` order (row ``i * b + j`` is token ``i`` of sequence ``j``). ``replay_batch(...,
pad_to=seq)`` builds batch-major rows; :func:`to_megatron_order` reorders them. With sequence
parallelism each tensor-parallel rank routes its own slice of the sequence, and with context
parallelism its own chunks: give each rank the rows its routers see.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from ...shapes import RoutingShape

__all__ = [
    "TESTED_MEGATRON_VERSIONS",
    "MegatronRouter",
    "find_routers",
    "from_megatron_order",
    "routing_shape",
    "to_megatron_order",
]

# megatron-core releases this module was tested against (tests/integrations/test_megatron.py). The hook needs
# only that TopKRouter.routing passes fused= and router_replay= to router.py's
# topk_routing_with_score_function, which attach_* checks on the installed version.
TESTED_MEGATRON_VERSIONS = ("0.16.1",)


# ---------------------------------------------------------------------------------------------------
# Megatron, imported on first use
# ---------------------------------------------------------------------------------------------------


@functools.cache
def _megatron() -> SimpleNamespace:
    """The Megatron-Core names this module uses; ImportError when megatron-core is missing or its
    router does not pass ``fused`` and ``router_replay`` to ``topk_routing_with_score_function``."""
    try:
        import megatron.core
        from megatron.core.transformer.moe import router as router_module
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"moe_ops.integrations.megatron needs megatron-core: pip install 'moe-ops[megatron]' ({e})"
        ) from e
    version = getattr(megatron.core, "__version__", "unknown")
    original = router_module.topk_routing_with_score_function
    if getattr(original, "_moe_ops_dispatch", False):  # a reload of this module left one installed
        original = original._moe_ops_original
    parameters = inspect.signature(original).parameters
    if not {"logits", "topk", "fused", "router_replay"} <= set(parameters):
        raise ImportError(
            f"megatron-core {version}: topk_routing_with_score_function takes no router_replay "
            f"argument, where moe-ops hooks TopKRouter (tested: {', '.join(TESTED_MEGATRON_VERSIONS)})"
        )
    return SimpleNamespace(
        version=version,
        router_module=router_module,
        original=original,
        signature=inspect.signature(original),
        replay_position=list(parameters).index("router_replay"),
        parameter_names=tuple(parameters),
        # per count of positional arguments: the names the rest must be passed by
        keywords=tuple(frozenset(list(parameters)[i:]) for i in range(3)),
        Router=router_module.Router,
        TopKRouter=router_module.TopKRouter,
        MultiTokenPredictionLayer=MultiTokenPredictionLayer,
    )


# ---------------------------------------------------------------------------------------------------
# Shapes and token order
# ---------------------------------------------------------------------------------------------------


def routing_shape(config: Any) -> RoutingShape:
    """The :class:`~moe_ops.RoutingShape` of a Megatron ``TransformerConfig``'s decoder.

    ``num_moe_experts``, ``moe_router_topk``, ``num_layers``, and the MoE layers from
    ``moe_layer_freq`` as Megatron's ``get_gpt_decoder_layer_specs`` reads it: an int ``f`` makes
    layer ``i`` a MoE layer when ``i % f == 0``, a list holds one 0/1 flag per layer. The
    multi-token-prediction layers (``mtp_num_layers``) are not on this axis: give their count to
    ``RoutingReplayer(..., num_mtp_layers=config.mtp_num_layers or 0)``. ValueError naming the
    field for a config without experts or with a bad ``moe_layer_freq``.
    """
    num_layers = getattr(config, "num_layers", None)
    num_experts = getattr(config, "num_moe_experts", None)
    top_k = getattr(config, "moe_router_topk", None)
    for name, value in (
        ("num_layers", num_layers),
        ("num_moe_experts", num_experts),
        ("moe_router_topk", top_k),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive int (a MoE model's config), got {value!r}")
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        flags = [i % freq == 0 for i in range(num_layers)]
    elif isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(f in (0, 1) for f in freq):
        flags = [bool(f) for f in freq]
    else:
        raise ValueError(
            f"config.moe_layer_freq must be a positive int or num_layers={num_layers} flags (0/1), "
            f"got {freq!r}"
        )
    moe_layers = tuple(i for i, moe in enumerate(flags) if moe)
    if not moe_layers:
        raise ValueError(f"config.moe_layer_freq={freq!r} makes every layer dense: no router to replay")
    return RoutingShape(
        num_layers=len(moe_layers),
        num_experts=num_experts,
        top_k=top_k,
        moe_layers=moe_layers,
        num_model_layers=num_layers,
    )


def _reorder(rows: Any, batch_size: int, to_megatron: bool) -> Any:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(rows, (np.ndarray, torch.Tensor)):
        raise TypeError(f"rows must be a numpy array or a torch.Tensor, got {type(rows).__name__}")
    if rows.ndim < 1 or rows.shape[0] % batch_size:
        raise ValueError(
            f"rows must have batch_size * seq_len rows (batch_size={batch_size}), "
            f"got shape {tuple(rows.shape)}"
        )
    seq_len = rows.shape[0] // batch_size
    outer, inner = (batch_size, seq_len) if to_megatron else (seq_len, batch_size)
    grid = rows.reshape(outer, inner, *rows.shape[1:])
    swapped = grid.swapaxes(0, 1) if isinstance(rows, np.ndarray) else grid.transpose(0, 1)
    return swapped.reshape(rows.shape)


def to_megatron_order(rows: np.ndarray | torch.Tensor, batch_size: int) -> np.ndarray | torch.Tensor:
    """Batch-major rows (``b * s + i``: token ``i`` of sequence ``b``, what ``replay_batch(...,
    pad_to=seq_len)`` builds) reordered into Megatron's ``[s, b]`` order (row ``i * batch_size + b``).

    ``rows``: ``(batch_size * seq_len, ...)`` numpy array or tensor; returns a new array / tensor of
    the same shape and dtype. With ``batch_size == 1`` (packed sequences) the order is the same.
    """
    return _reorder(rows, batch_size, to_megatron=True)


def from_megatron_order(rows: np.ndarray | torch.Tensor, batch_size: int) -> np.ndarray | torch.Tensor:
    """The inverse of :func:`to_megatron_order`: Megatron's ``[s, b]`` rows (e.g. captured ones)
    back to batch-major order."""
    return _reorder(rows, batch_size, to_megatron=False)


# ---------------------------------------------------------------------------------------------------
# Finding the routers
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MegatronRouter:
    """One ``TopKRouter`` of a Megatron model and the replay slot it reads."""

    # "decoder" or "mtp" (RoutingReplayer's LAYER_KINDS)
    kind: str
    # decoder: the 0-based decoder layer (router.layer_number - 1); mtp: the 0-based MTP layer
    index: int
    # module path in the model ("decoder.layers.3.mlp.router"; "chunk1.<path>" for a chunk list)
    path: str
    module: nn.Module = field(repr=False, compare=False)


def _chunks(model: Any) -> list[tuple[str, nn.Module]]:
    if isinstance(model, nn.Module):
        return [("", model)]
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return [(f"chunk{i}.", m) for i, m in enumerate(model)]
    raise TypeError(
        "model must be a torch.nn.Module (a Megatron model, or a module holding TopKRouters) or a "
        f"non-empty list of them (virtual pipeline chunks), got {type(model).__name__}"
    )


def find_routers(model: nn.Module | Sequence[nn.Module]) -> list[MegatronRouter]:
    """Every ``TopKRouter`` of ``model`` (a module, e.g. a ``GPTModel`` wrapped or not, or the list
    of its virtual-pipeline chunks), decoder routers by layer, then MTP routers by MTP layer.

    ValueError for a model without a TopKRouter, a router without ``layer_number`` (it is set by
    its ``TransformerLayer``; call ``set_layer_number`` on a router built alone), a router class
    other than TopKRouter (Megatron's ``Router`` interface without its routing function), a router
    with ``moe_router_load_balancing_type="sinkhorn"`` (which never calls the hooked function),
    and two routers of one layer.
    """
    mt = _megatron()
    found: list[MegatronRouter] = []
    for prefix, chunk in _chunks(model):
        named = list(chunk.named_modules())
        mtp_layers = [(path, m) for path, m in named if isinstance(m, mt.MultiTokenPredictionLayer)]
        for path, module in named:
            if not isinstance(module, mt.Router):
                continue
            where = prefix + path
            if not isinstance(module, mt.TopKRouter):
                raise ValueError(f"the router at {where!r} is a {type(module).__name__}, not a TopKRouter")
            if module.routing_type == "sinkhorn":
                raise ValueError(
                    f"the router at {where!r} routes with sinkhorn, which never calls "
                    "topk_routing_with_score_function: replay and capture hook that function"
                )
            owner = next((m for p, m in mtp_layers if path.startswith(p + ".")), None)
            if owner is not None:
                found.append(MegatronRouter("mtp", int(owner.layer_number) - 1, where, module))
                continue
            number = module.layer_number
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(
                    f"the router at {where!r} has layer_number={number!r}: build it inside a "
                    "TransformerLayer, or call router.set_layer_number(n) (1-based) on a router built alone"
                )
            found.append(MegatronRouter("decoder", number - 1, where, module))
    if not found:
        raise ValueError(f"found no TopKRouter in {type(model).__name__}: nothing to replay or capture")
    found.sort(key=lambda r: (r.kind != "decoder", r.index))
    for a, b in itertools.pairwise(found):
        if (a.kind, a.index) == (b.kind, b.index):
            raise ValueError(f"two routers of {a.kind} layer {a.index} ({a.path!r} and {b.path!r})")
    return found
