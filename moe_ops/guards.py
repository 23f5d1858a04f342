"""Config guards: refuse serving setups whose routing the capture cannot deliver correctly.

Each refusal names the setting, its value, and why, so that an engine can surface it at start-up
instead of returning wrong rows later:

- pipeline parallelism > 1: each stage runs only its own layers, so no rank's capture buffer holds
  every MoE layer of a token, and the step's rows would have to be merged across stages (not built).
- CPU weight offloading: offloaded layers run through a different path (weights streamed in per
  step, typically outside CUDA graphs); the capture's ordering rules were not verified there.
- KV caches filled from outside the engine (disaggregated prefill, KV connectors, KV transfer):
  those tokens never passed through this engine's routers, so their slots hold no routing of them
  (or a previous request's, if the blocks were reused) - unless the engine carries each request's
  handoff record with its KV (``routing_handoff=True``: ``RoutingLedger.export_handoff`` on the
  prefill instance, ``import_handoff`` on the decode instance) and each offloaded block's rows with
  its KV (``offload_blocks`` / ``load_blocks``), which serves disaggregated prefill and the
  connectors of :data:`HANDOFF_CONNECTORS`. Other connectors are refused (unknown: what they move).
- non-MoE models: there is nothing to capture.
- speculative decoding whose draft routes through MoE layers: multi-token-prediction (MTP) layers
  and draft models are not part of the target model's routing layer axis (it holds the target's
  MoE layers, model layers ``0 .. num_hidden_layers - 1``), so their routing has no column, and an
  engine that captures every MoE layer it runs would write the draft pass's ids into the step's
  buffer. Draft-free proposers (n-gram, suffix) are served: the target model computes every row and
  ``RoutingLedger.reject`` drops the rejected ones.

Every argument is checked too: a value of the wrong type or range is one more reason, never a
TypeError or a silently different setting.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .shapes import (
    DENSE_MLP_TYPES,
    EXPERT_FIELDS,
    MTP_LAYER_FIELDS,
    TOP_K_FIELDS,
    RoutingShape,
    UnreadableConfigError,
    _get,
    _is_int,
    _lookup,
    _short_repr,
    _text_config,
    resolve_routing_shape,
)

__all__ = ["SPECULATIVE_METHODS", "UnsupportedConfigError", "validate_serving_config"]

# Speculative-decoding methods by what proposes the draft tokens (vLLM's speculative_config.method,
# SGLang's --speculative-algorithm; names compared lower-case). A method ending in "_mtp" (vLLM's
# deepseek_mtp, qwen3_next_mtp, ...) counts as "mtp".
SPECULATIVE_METHODS = {
    # token lookups, no network: every row comes from the target model
    "draft_free": frozenset({"ngram", "suffix", "lookahead"}),
    # MLP heads on the target's hidden state: no router
    "dense_heads": frozenset({"medusa", "mlp_speculator"}),
    # the checkpoint's own multi-token-prediction layers
    "mtp": frozenset({"mtp", "nextn"}),
    # a separate draft model (EAGLE heads are decoder layers of their own)
    "draft_model": frozenset({"eagle", "eagle3", "draft_model", "standalone"}),
}
# MTP layer-kind fields: Nemotron-H's mtp_layers_block_type, Step3p7 / Mellum's mtp_mlp_layer_types
_MTP_KIND_FIELDS = ("mtp_layers_block_type", "mtp_mlp_layer_types")


class UnsupportedConfigError(ValueError):
    """A serving configuration the routing capture cannot serve; ``reasons`` lists every problem."""

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        lines = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"routing capture cannot serve this configuration:\n{lines}")


# KV connectors served with routing_handoff=True, the engine carrying the rows wherever the KV goes:
# between instances (RoutingLedger.export_handoff / import_handoff: vLLM's kv_transfer_config
# kv_connector names, SGLang's --disaggregation-transfer-backend values) and to offload tiers and back
# (RoutingLedger.offload_blocks / load_blocks: vLLM's LMCache and offloading connectors)
HANDOFF_CONNECTORS = frozenset(
    {
        "NixlConnector",
        "MooncakeConnector",
        "P2pNcclConnector",
        "nixl",
        "mooncake",
        "LMCacheConnectorV1",
        "OffloadingConnector",
    }
)


def validate_serving_config(
    model_config: Any = None,
    *,
    pipeline_parallel_size: int = 1,
    cpu_offload_gb: float = 0,
    kv_connector: str | None = None,
    disaggregated_prefill: bool = False,
    speculative_method: str | None = None,
    draft_model_config: Any = None,
    routing_handoff: bool = False,
) -> RoutingShape | None:
    """Checks a serving setup and returns the model's :class:`RoutingShape` (None without a model).

    Args:
        model_config: the model's Hugging Face style config (object or dict), checked to be MoE
            with :func:`resolve_routing_shape`; None skips the model check.
        pipeline_parallel_size: pipeline-parallel stages; must be 1.
        cpu_offload_gb: weights offloaded to CPU memory (vLLM's ``cpu_offload_gb``); must be 0.
        kv_connector: name of a KV connector / KV transfer backend filling the cache from outside
            (e.g. vLLM's ``kv_transfer_config.kv_connector``); None, or with ``routing_handoff`` one
            of :data:`HANDOFF_CONNECTORS`.
        disaggregated_prefill: True when prefill runs on another instance and the KV cache arrives
            by transfer; served with ``routing_handoff`` only.
        speculative_method: the engine's speculative-decoding method (vLLM's
            ``speculative_config.method``, SGLang's ``--speculative-algorithm``), None without
            speculative decoding. Draft-free methods (``ngram``, ``suffix``, ``lookahead``) and MLP
            heads (``medusa``, ``mlp_speculator``) are served. MTP methods (``mtp``, ``nextn``,
            ``*_mtp``) are refused unless the config says its MTP layers are dense; draft models
            (``eagle``, ``eagle3``, ``draft_model``, ``standalone``) need ``draft_model_config``
            and are refused when it has a router.
        draft_model_config: the draft model's config, for the draft-model methods only.
        routing_handoff: True when the engine carries the rows wherever the KV goes: each
            request's handoff record beside its KV (``RoutingLedger.export_handoff`` /
            ``import_handoff``) and each offloaded block's rows (``offload_blocks`` /
            ``load_blocks``), docs/transfer.md.

    Raises:
        UnsupportedConfigError (a ValueError): every problem found, one line each.
    """
    reasons = []
    if isinstance(pipeline_parallel_size, bool) or not isinstance(pipeline_parallel_size, int):
        reasons.append(f"pipeline_parallel_size must be an int, got {pipeline_parallel_size!r}")
    elif pipeline_parallel_size < 1:
        reasons.append(
            f"pipeline_parallel_size must be an int >= 1 (1: no pipeline parallelism, the only setting "
            f"served), got {pipeline_parallel_size}"
        )
    elif pipeline_parallel_size != 1:
        reasons.append(
            f"pipeline_parallel_size={pipeline_parallel_size}: pipeline parallelism > 1 is not supported "
            "(each stage holds only its own layers' routing); use pipeline_parallel_size=1"
        )
    if (
        isinstance(cpu_offload_gb, bool)
        or not isinstance(cpu_offload_gb, (int, float))
        or not math.isfinite(cpu_offload_gb)
        or cpu_offload_gb < 0
    ):
        reasons.append(f"cpu_offload_gb must be a finite number >= 0, got {cpu_offload_gb!r}")
    elif cpu_offload_gb > 0:
        reasons.append(
            f"cpu_offload_gb={cpu_offload_gb}: CPU weight offloading is not supported (offloaded layers "
            "run outside the verified capture path); use cpu_offload_gb=0"
        )
    handoff = routing_handoff is True
    if not isinstance(routing_handoff, bool):
        reasons.append(f"routing_handoff must be True or False, got {routing_handoff!r}")
    if kv_connector is not None and not isinstance(kv_connector, str):
        reasons.append(f"kv_connector must be None or the connector's name (a str), got {kv_connector!r}")
    elif kv_connector is not None and not (handoff and kv_connector in HANDOFF_CONNECTORS):
        why = (
            f"with routing_handoff=True the connectors whose KV moves the ledger follows are served "
            f"({', '.join(sorted(HANDOFF_CONNECTORS))}); this one is not known"
            if handoff
            else "carry each request's handoff record with its KV and pass routing_handoff=True "
            "(RoutingLedger.export_handoff / import_handoff)"
        )
        reasons.append(
            f"kv_connector={kv_connector!r}: KV caches filled from outside the engine are not supported "
            "(transferred tokens never ran through this engine's routers, so their routing is unknown); "
            f"{why}"
        )
    if not isinstance(disaggregated_prefill, bool):
        reasons.append(f"disaggregated_prefill must be True or False, got {disaggregated_prefill!r}")
    elif disaggregated_prefill and not handoff:
        reasons.append(
            "disaggregated_prefill=True: prefill on another instance is not supported without the "
            "handoff (the prompt's routing is computed there and never reaches this engine's capture "
            "buffer); carry each request's handoff record with its KV (RoutingLedger.export_handoff / "
            "import_handoff) and pass routing_handoff=True"
        )
    shape = None
    if model_config is not None:
        try:
            shape = resolve_routing_shape(model_config)
        except UnreadableConfigError as e:  # the config's own code raised (a get_text_config, a property)
            reasons.append(f"model_config cannot be read: {_raised(e.__cause__)}")
        except ValueError as e:
            reasons.append(f"not a mixture-of-experts model the capture understands: {e}")
    reasons += _speculative_reasons(speculative_method, draft_model_config, model_config, shape)
    if reasons:
        raise UnsupportedConfigError(reasons)
    return shape


def _method_kind(method: str) -> str | None:
    name = method.strip().lower()
    if name.endswith("_mtp"):
        return "mtp"
    return next((kind for kind, names in SPECULATIVE_METHODS.items() if name in names), None)


def _speculative_reasons(
    method: Any, draft_config: Any, model_config: Any, shape: RoutingShape | None
) -> list[str]:
    if method is None:
        if draft_config is not None:
            return ["draft_model_config is set but speculative_method is None: name the method that uses it"]
        return []
    if not isinstance(method, str):
        return [f"speculative_method must be None or the method's name (a str), got {method!r}"]
    kind = _method_kind(method)
    if kind is None:
        known = sorted(set().union(*SPECULATIVE_METHODS.values()))
        return [
            f"speculative_method={method!r} is not a method the guard knows ({', '.join(known)}, or a "
            "name ending in '_mtp'), so it cannot tell whether the draft routes through MoE layers"
        ]
    if kind != "draft_model" and draft_config is not None:
        return [f"draft_model_config is set but speculative_method={method!r} runs no separate draft model"]
    if kind in ("draft_free", "dense_heads"):
        return []
    if kind == "mtp":
        return _mtp_reasons(method, model_config, shape)
    if draft_config is None:
        return [
            f"speculative_method={method!r} runs a separate draft model: pass draft_model_config so the "
            "guard can check that the draft has no router (a draft's routing is not part of the target "
            "model's layer axis)"
        ]
    return _draft_model_reasons(method, draft_config)


def _mtp_reasons(method: str, model_config: Any, shape: RoutingShape | None) -> list[str]:
    if model_config is None:
        return [f"speculative_method={method!r}: pass model_config so the guard can check its MTP layers"]
    try:
        text = _text_config(model_config)
    except Exception:
        return []  # the model check above already reported the config
    announced = [(name, _get(text, name)) for name in MTP_LAYER_FIELDS if _get(text, name) is not None]
    bad = [(name, value) for name, value in announced if not _is_int(value) or value < 0]
    if bad:
        return [f"{name} must be an int >= 0 (MTP layers), got {value!r}" for name, value in bad]
    layers = next((value for _, value in announced if value > 0), 0)
    if layers == 0:
        fields = ", ".join(MTP_LAYER_FIELDS)
        return [
            f"speculative_method={method!r} runs multi-token-prediction layers, but the config announces "
            f"none ({fields} unset or 0): the guard cannot tell which layers they are"
        ]
    kinds = {name: _get(text, name) for name in _MTP_KIND_FIELDS if _get(text, name) is not None}
    if kinds and all(
        isinstance(v, (list, tuple)) and v and all(isinstance(t, str) and _is_dense_kind(t) for t in v)
        for v in kinds.values()
    ):
        return []  # every MTP layer is declared dense: it has no router to capture
    field = next(name for name, value in announced if value > 0)
    n = shape.num_model_layers if shape is not None else _get(text, "num_hidden_layers")
    axis = f"model layers 0..{n - 1}" if _is_int(n) and n > 0 else "the model's decoder layers"
    return [
        f"speculative_method={method!r}: the multi-token-prediction layers ({field}={layers}) run after "
        f"the model's decoder layers with MoE routers of their own; they are not part of the routing "
        f"layer axis ({axis}), so their draft routing has no column and an engine capturing every MoE "
        "layer it runs would write the draft pass's ids into the step's buffer. Serve without "
        "speculative decoding or with a draft-free method (ngram, suffix)"
    ]


def _is_dense_kind(kind: str) -> bool:
    return kind in DENSE_MLP_TYPES or kind in ("attention", "full_attention", "mamba", "sliding_attention")


def _raised(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _draft_model_reasons(method: str, draft_config: Any) -> list[str]:
    """The draft is served when its config is readable and has no router fields (a dense draft);
    anything else is refused with the reason. Readable: a transformers config or a mapping whose
    decoder config has ``num_hidden_layers`` (every decoder config has it, EAGLE heads' too), so a
    model's name, a number, a list or an empty dict is never taken for a dense model."""
    if isinstance(draft_config, (str, bytes, os.PathLike)):
        return [
            f"draft_model_config must be the draft model's config (a transformers config or a dict), got "
            f"{draft_config!r}: a name or path says nothing about its routers; load its config "
            "(transformers.AutoConfig.from_pretrained) and pass that"
        ]
    if isinstance(draft_config, (bool, int, float, complex, list, tuple, set, frozenset)):
        return [
            f"draft_model_config must be the draft model's config (a transformers config or a dict), got "
            f"a {type(draft_config).__name__}: {draft_config!r}"
        ]
    try:
        text = _text_config(draft_config)
        routed = _lookup(text, TOP_K_FIELDS)[0] is not None or _lookup(text, EXPERT_FIELDS)[0] is not None
        layers = _get(text, "num_hidden_layers")
    except Exception as e:  # the config's own code raised (a get_text_config, a property)
        return [f"draft_model_config cannot be read: {_raised(e)}"]
    if not routed:
        if _is_int(layers) and layers >= 1:
            return []  # a decoder config without router fields: a dense draft, nothing of it is captured
        return [
            f"draft_model_config must be a model config with num_hidden_layers an int >= 1, got "
            f"num_hidden_layers={layers!r} in {_short_repr(draft_config)}: the guard cannot tell whether "
            "that draft routes through MoE layers"
        ]
    try:
        draft = resolve_routing_shape(draft_config)
    except ValueError as e:
        why = _raised(e.__cause__) if isinstance(e, UnreadableConfigError) else str(e)
        return [
            f"draft_model_config has router fields but cannot be resolved ({why}); a draft's MoE layers "
            "are not part of the target model's routing layer axis"
        ]
    return [
        f"speculative_method={method!r}: the draft model has {draft.num_layers} MoE layers with routers "
        "of their own; they are not part of the target model's routing layer axis, so the draft's "
        "routing has no column and an engine capturing every MoE layer it runs would write it into the "
        "step's buffer. Use a dense draft model or a draft-free method (ngram, suffix)"
    ]
