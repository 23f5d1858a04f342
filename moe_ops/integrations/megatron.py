"""Megatron-Core: replay recorded routing in, and capture the routing of, Megatron's ``TopKRouter``.

The mirror of :mod:`moe_ops.integrations.hf` for Megatron-Core (tested with megatron-core 0.16.1)::

    shape = routing_shape(config)                      # the MoE-only layer axis of the decoder
    replayer = RoutingReplayer(shape, max_num_tokens, "cuda", num_mtp_layers=config.mtp_num_layers or 0)
    with attach_replay(model, replayer):               # a GPTModel, or the list of its chunks
        replayer.set_batch(to_megatron_order(routing, micro_batch_size))
        loss = loss_fn(model(tokens, position_ids, attention_mask))
        loss.backward()

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

The hook first runs the router's own routing (fused or not, through whatever ``router_replay`` the
router had: Megatron's ``RouterReplay`` or None), then returns, per row, either that output
unchanged (a row of -1, and a faulty row: routed live and counted for ``check_replay_errors``) or
the recorded ids with weights from the live logits by Megatron's own rule (:func:`replay_rule`),
scattered into Megatron's dense ``(probs, routing_map)`` exactly as ``topk_routing_with_score_function``
does (``index_put_`` under deterministic algorithms, ``scatter`` otherwise). Gradients reach the
router through those weights.

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

``megatron`` is imported on first use (``attach_*``, :func:`find_routers`, :func:`routing_shape`
does not need it); ``import moe_ops`` never imports this module.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from ..capture.protocol import Capturer, check_capturer
from ..layout import BatchLayout, layout_from_value
from ..replay.attach import (
    AttachHandle,
    ReplayRule,
    RouterSite,
    attach_wrappers,
    check_replayer,
    replay_router_output,
)
from ..router.args import validate_route_args
from ..router.methods import BIAS_METHODS, GroupScore, RoutingMethod
from ..shapes import RoutingShape

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

# megatron-core releases this module was tested against (tests/test_megatron.py). The hook needs
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


# ---------------------------------------------------------------------------------------------------
# Weight rules: Megatron's score functions as moe-ops methods
# ---------------------------------------------------------------------------------------------------


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
    """The :class:`~moe_ops.replay.attach.ReplayRule` of a Megatron router config.

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


def _call_rule(arguments: dict, dtype: torch.dtype) -> ReplayRule:
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


# ---------------------------------------------------------------------------------------------------
# The dispatcher in router.py and the per-router hooks
# ---------------------------------------------------------------------------------------------------

_lock = threading.Lock()
# moe-ops handles attached: the dispatcher is in router.py while > 0
_attached = 0


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
    routing_map = torch.zeros_like(template, dtype=torch.int32).scatter(1, ids, 1).bool()
    return probs, routing_map


class _ReplayHook(_Hook):
    def __init__(self, inner: Any, kind: str, index: int, replayer: Any, backend: str):
        super().__init__(inner, kind, index)
        self.replayer = replayer
        self.backend = backend

    def __call__(self, arguments: dict) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map = self.routed(arguments)
        logits, top_k = arguments["logits"], arguments["topk"]
        n = logits.shape[0]
        # a RoutingReplayer's rows come with the row count its device check needs (None where the
        # host checked): the check rides in replay_routing's forward kernel
        kind = {"kind": "mtp"} if self.kind == "mtp" else {}
        if callable(getattr(self.replayer, "rows", None)):
            recorded, row_count = self.replayer.rows(self.index, n, **kind)
        else:
            recorded, row_count = self.replayer.layer_ids(self.index, n, **kind), None
        rule = _call_rule(arguments, logits.dtype)
        bias = arguments["expert_bias"] if rule.method in BIAS_METHODS else None
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
    routing function. See :class:`~moe_ops.replay.attach.AttachHandle`: ``what`` is "replay" or
    "capture", ``arch`` "megatron", ``layers`` the ``(kind, index)`` of each hooked router
    (("decoder", layer) then ("mtp", mtp layer)); replay ``rules`` are each router's rule for its
    config's logits dtype (calls with another dtype use that dtype's rule)."""

    @property
    def _hooks(self) -> list[tuple[nn.Module, _Hook]]:
        """(router, our hook) of each hooked router; empty once removed."""
        return [(module, hook) for module, _, _, hook in self._wrapped]


def _check_rule(rule: ReplayRule, router: MegatronRouter) -> None:
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
    model: nn.Module | Sequence[nn.Module], replayer: Any, *, backend: str = "auto"
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

    Returns a :class:`MegatronHandle`; ``handle.remove()`` or ``with attach_replay(...):`` restores
    the routers. Each router then returns Megatron's ``(probs, routing_map)`` of the recorded ids,
    weighted by its config's rule (:func:`replay_rule`) from its live logits, so gradients reach the
    gate; a row of -1 (and a faulty row, counted for ``check_replay_errors``) keeps the router's
    own output bit for bit. Works with ``moe_router_fusion=True``, where Megatron's own
    ``RouterReplay`` never runs. A router that has Megatron's ``RouterReplay`` keeps it for its
    live routing; while attached, that RouterReplay's recorded/target ids see the live routing.

    Everything is checked before any router is touched: ValueError for a model without
    TopKRouters, a replayer shape, MTP count or device that does not fit them, a config whose rule
    ``replay_routing`` refuses, or a router that already replays; TypeError for a replayer without
    ``layer_ids``; ImportError without megatron-core.
    """
    check_replayer(replayer, backend, call="layer_ids(layer, num_tokens, kind=...)")
    routers = find_routers(model)
    _check_target(replayer, "replayer", routers)
    rules = []
    for r in routers:
        if any(isinstance(h, _ReplayHook) for h in _chain(r.module)):
            raise ValueError(f"the router at {r.path!r} already replays: remove() that handle first")
        rule = replay_rule(r.module.config)
        _check_rule(rule, r)
        rules.append(rule)
    return _attach(
        "replay",
        routers,
        lambda inner, r: _ReplayHook(inner, r.kind, r.index, replayer, backend),
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


# ---------------------------------------------------------------------------------------------------
# Pipeline schedules: one replay slot per micro-batch
# ---------------------------------------------------------------------------------------------------


def _current_microbatch(model: nn.Module) -> int:
    """The micro-batch Megatron's schedule runs: what ``set_current_microbatch`` stored on the
    decoder's (or, on a stage without decoder layers, the MTP block's) transformer layers."""
    from megatron.core.utils import get_attr_wrapped_model

    layers: list[Any] = []
    for attr, pick in (
        ("decoder", lambda m: m.layers),
        ("mtp", lambda m: [x.transformer_layer for x in m.layers]),
    ):
        try:
            owner = get_attr_wrapped_model(model, attr, allow_none=False, return_model_obj=True)
        except RuntimeError:
            continue
        layers = list(pick(getattr(owner, attr)))
        if layers:
            break
    microbatch = getattr(layers[0], "current_microbatch", None) if layers else None
    if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 0:
        raise ValueError(
            "replaying_forward_step reads the micro-batch that Megatron's schedule runs from "
            "model.decoder.layers[0].current_microbatch (set by forward_backward_func before each "
            f"forward step), got {microbatch!r}: call the wrapped function through Megatron's schedule"
        )
    return microbatch


def _hook_outputs(replayer: Any, output: Any, slot: int) -> Any:
    if isinstance(output, torch.Tensor):
        return replayer.select_in_backward(output, slot)
    if isinstance(output, (list, tuple)):
        hooked = [_hook_outputs(replayer, o, slot) for o in output]
        return type(output)(hooked) if isinstance(output, list) else tuple(hooked)
    return output


def replaying_forward_step(forward_step_func: Callable, replayer: Any) -> Callable:
    """Wraps a Megatron ``forward_step_func(data_iterator, model[, ...])`` so that micro-batch ``m``
    routes with replay slot ``m % replayer.num_slots``, in its forward and in the activation
    recompute of its backward.

    Before calling ``forward_step_func`` the wrapper selects that slot (``replayer.select``), the
    micro-batch number being what Megatron's schedule (``forward_backward_func``: no pipelining,
    1F1B, interleaved) stored on the model's layers for this forward step; after it, it puts
    ``replayer.select_in_backward`` on the returned output tensor(s), so the slot is selected again
    when that micro-batch's backward starts, even after later micro-batches' forwards (1F1B). Fill
    the slots before the step (``replayer.set_batch(routing_of[m], slot=m)`` for every micro-batch,
    with ``num_slots >= num_microbatches``), or inside ``forward_step_func`` from the batch it reads
    (``replayer.set_batch(batch_routing, slot=replayer.slot)``; then ``num_slots`` must be at least
    the micro-batches in flight at once). The signature is ``forward_step_func``'s
    (``functools.wraps``), so Megatron passes the same arguments. ValueError (at the forward step)
    when no schedule set the micro-batch.
    """
    if not callable(forward_step_func):
        raise TypeError(f"forward_step_func must be callable, got {type(forward_step_func).__name__}")
    for name in ("select", "select_in_backward", "num_slots"):
        if not hasattr(replayer, name):
            raise TypeError(
                f"replayer must be a moe_ops.RoutingReplayer (no {name!r}), got {type(replayer).__name__}"
            )

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator: Any, model: nn.Module, *args: Any, **kwargs: Any):
        slot = _current_microbatch(model) % replayer.num_slots
        replayer.select(slot)
        output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
        return _hook_outputs(replayer, output, slot), loss_func

    return forward_step
