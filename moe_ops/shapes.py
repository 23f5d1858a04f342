"""Model shapes: how many layers, experts and ids per token a MoE model's routing has.

:class:`RoutingShape` fixes the shape of everything downstream (the capture buffer, the snapshots,
the slot store, the wire arrays): ``(tokens, num_layers, top_k)`` ids in ``[0, num_experts)``.

The layer axis holds the MoE layers only, in model order. Dense layers (DeepSeek's first
``first_k_dense_replace`` layers, Qwen's ``decoder_sparse_step``/``mlp_only_layers``, Llama-4's
interleaving, ...) have no router, so they get no column: a 61-layer DeepSeek-V3 with 3 dense layers
has a layer axis of 58. ``moe_layers[i]`` is the model-layer index of buffer layer ``i``;
:meth:`RoutingShape.buffer_layer` maps back and raises for a dense layer, and
:meth:`RoutingShape.to_model_layers` widens an array to all ``num_model_layers`` layers (dense
columns filled with -1), which is how vLLM's ``routed_experts`` lays them out::

    model layer:   0      1      2      3      4      5          (first_k_dense_replace = 2)
                 dense  dense   MoE    MoE    MoE    MoE
    buffer layer:   -      -      0      1      2      3          moe_layers = (2, 3, 4, 5)

:func:`resolve_routing_shape` reads Hugging Face style configs (objects with attributes, or dicts);
see docs/shapes.md for every field it reads and the order it tries them in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

__all__ = ["RoutingShape", "narrow_dtype", "resolve_routing_shape"]

# Field names, first match wins; a None value counts as missing.
TOP_K_FIELDS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "top_k_experts",
    "moe_topk",
    "moe_top_k",
    "moe_k",
)
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
LAYER_FIELDS = ("num_hidden_layers",)
# MLP types of ``mlp_layer_types`` entries (DeepSeek-V3.2, GLM-MoE-DSA, Kimi-Linear, ...).
MOE_MLP_TYPES = frozenset({"sparse", "moe", "hash_moe"})
DENSE_MLP_TYPES = frozenset({"dense", "mlp"})
# Models whose decoder-layer count is not ``num_hidden_layers``: LongCat-Flash reports two attention
# sublayers per decoder layer in ``num_hidden_layers``; each decoder layer has one MoE.
_LAYER_COUNT_FIELD_BY_MODEL_TYPE = {"longcat_flash": "num_layers"}


def narrow_dtype(num_experts: int) -> np.dtype:
    """The smallest dtype that holds ids in ``[0, num_experts)``: uint8 up to 256 experts, uint16 up
    to 65536, int32 beyond."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class RoutingShape:
    """Shape of one model's routing: ``(tokens, num_layers, top_k)`` ids in ``[0, num_experts)``.

    Built directly (``RoutingShape(num_layers=58, num_experts=256, top_k=8, moe_layers=range(3, 61))``)
    or from a config with :func:`resolve_routing_shape`. With ``moe_layers`` omitted every model layer
    is a MoE layer.
    """

    # layers on the routing layer axis: the model's MoE layers, >= 1
    num_layers: int
    # distinct ids the router can emit: ids are in [0, num_experts); >= top_k
    num_experts: int
    # ids per token per layer, 1 <= top_k <= num_experts
    top_k: int
    # model-layer index of each buffer layer, strictly increasing, len == num_layers (None: 0..num_layers-1)
    moe_layers: tuple[int, ...] | None = None
    # layers of the whole model, dense ones included; > moe_layers[-1] (None: moe_layers[-1] + 1)
    num_model_layers: int | None = None

    def __post_init__(self) -> None:
        num_layers = _check_positive("num_layers", self.num_layers)
        num_experts = _check_positive("num_experts", self.num_experts)
        top_k = _check_positive("top_k", self.top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")
        if self.moe_layers is None:
            moe_layers = tuple(range(num_layers))
        else:
            moe_layers = tuple(int(i) for i in self.moe_layers)
        if len(moe_layers) != num_layers:
            raise ValueError(
                f"moe_layers must have num_layers={num_layers} entries (one per buffer layer), "
                f"got {len(moe_layers)}: {moe_layers}"
            )
        if moe_layers[0] < 0 or any(b <= a for a, b in pairwise(moe_layers)):
            raise ValueError(f"moe_layers must be non-negative and strictly increasing, got {moe_layers}")
        if self.num_model_layers is None:
            num_model_layers = moe_layers[-1] + 1
        else:
            num_model_layers = _check_positive("num_model_layers", self.num_model_layers)
        if moe_layers[-1] >= num_model_layers:
            raise ValueError(
                f"moe_layers must be < num_model_layers={num_model_layers}, got {moe_layers[-1]} in it"
            )
        for name, value in (
            ("num_layers", num_layers),
            ("num_experts", num_experts),
            ("top_k", top_k),
            ("moe_layers", moe_layers),
            ("num_model_layers", num_model_layers),
        ):
            object.__setattr__(self, name, value)

    @property
    def id_dtype(self) -> np.dtype:
        """The narrow dtype of this model's ids (uint8 / uint16 / int32), see :func:`narrow_dtype`."""
        return narrow_dtype(self.num_experts)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Model-layer indices of the layers without a router (no column on the layer axis)."""
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_model_layers) if i not in moe)

    def row_bytes(self, dtype: np.dtype | None = None) -> int:
        """Bytes of one token's routing, ``num_layers * top_k * itemsize`` (default: the narrow dtype)."""
        itemsize = np.dtype(dtype if dtype is not None else self.id_dtype).itemsize
        return self.num_layers * self.top_k * itemsize

    def is_moe_layer(self, model_layer: int) -> bool:
        """True when model layer ``model_layer`` has a router (IndexError outside the model)."""
        self._check_model_layer(model_layer)
        return model_layer in self._buffer_index

    def buffer_layer(self, model_layer: int) -> int:
        """Index on the layer axis of model layer ``model_layer``.

        Raises IndexError outside ``[0, num_model_layers)`` and ValueError for a dense layer.
        """
        self._check_model_layer(model_layer)
        index = self._buffer_index.get(model_layer)
        if index is None:
            raise ValueError(
                f"model layer {model_layer} is dense (no router): the routing layer axis holds the MoE "
                f"layers {_short(self.moe_layers)} only"
            )
        return index

    def model_layer(self, buffer_layer: int) -> int:
        """Model-layer index of buffer layer ``buffer_layer`` (IndexError outside ``[0, num_layers)``)."""
        if isinstance(buffer_layer, bool) or not isinstance(buffer_layer, (int, np.integer)):
            raise TypeError(f"buffer_layer must be an int, got {type(buffer_layer).__name__}")
        if not 0 <= buffer_layer < self.num_layers:
            raise IndexError(f"buffer_layer must be in [0, {self.num_layers}), got {buffer_layer}")
        return self.moe_layers[buffer_layer]

    def to_model_layers(self, routing: np.ndarray, fill: int = -1) -> np.ndarray:
        """Widens ``routing`` from the MoE-only layer axis to all model layers.

        Args:
            routing: (n, num_layers, top_k) integer - ids on this shape's layer axis.
            fill: value of the dense layers' columns.

        Returns a new (n, num_model_layers, top_k) array whose dtype holds both the ids and ``fill``
        (uint8 ids with fill -1 give int16).
        """
        routing = np.asarray(routing)
        if routing.ndim != 3 or routing.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"routing must have shape (n, {self.num_layers}, {self.top_k}), got {routing.shape}"
            )
        dtype = np.result_type(routing.dtype, np.min_scalar_type(fill))
        out = np.full((routing.shape[0], self.num_model_layers, self.top_k), fill, dtype=dtype)
        out[:, list(self.moe_layers)] = routing
        return out

    @property
    def _buffer_index(self) -> dict[int, int]:
        cached = self.__dict__.get("_index_cache")
        if cached is None:
            cached = {layer: i for i, layer in enumerate(self.moe_layers)}
            object.__setattr__(self, "_index_cache", cached)
        return cached

    def _check_model_layer(self, model_layer: int) -> None:
        if isinstance(model_layer, bool) or not isinstance(model_layer, (int, np.integer)):
            raise TypeError(f"model layer index must be an int, got {type(model_layer).__name__}")
        if not 0 <= model_layer < self.num_model_layers:
            raise IndexError(
                f"model layer index must be in [0, {self.num_model_layers}) for this model, got {model_layer}"
            )


def _short(layers: Sequence[int]) -> str:
    layers = tuple(layers)
    if len(layers) > 8:
        return f"({layers[0]}, {layers[1]}, ..., {layers[-1]}; {len(layers)} layers)"
    return str(layers)


def _get(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _text_config(config: Any) -> Any:
    """The decoder's config: ``get_text_config(decoder=True)`` of transformers configs, else a nested
    ``text_config`` (dicts), else ``config`` itself."""
    if not isinstance(config, Mapping):
        getter = getattr(config, "get_text_config", None)
        if callable(getter):
            try:
                return getter(decoder=True)
            except TypeError:  # older signature without the keyword
                return getter()
    nested = _get(config, "text_config")
    if nested is not None and nested is not config:
        return _text_config(nested)
    return config


def _sources(config: Any) -> list[tuple[str, Any]]:
    """(prefix, object) pairs to look fields up in: the config, then DBRX-style ``ffn_config``."""
    out = [("", config)]
    ffn = _get(config, "ffn_config")
    if ffn is not None:
        out.append(("ffn_config.", ffn))
    return out


def _lookup(config: Any, fields: Sequence[str]) -> tuple[str | None, Any, list[str]]:
    """First non-None field: (name, value, every 'name=value' tried, for error messages)."""
    tried = []
    for prefix, source in _sources(config):
        for name in fields:
            value = _get(source, name)
            tried.append(f"{prefix}{name}={value!r}")
            if value is not None:
                return prefix + name, value, tried
    return None, None, tried


def _positive_field(what: str, config: Any, fields: Sequence[str], per_layer: str) -> int:
    """Resolves one positive int from the alias list; ``per_layer`` says how to fold a per-layer list
    ("max" or "uniform")."""
    name, value, tried = _lookup(config, fields)
    if name is None:
        raise ValueError(f"cannot resolve {what}: none of the fields is set ({', '.join(tried)})")
    if isinstance(value, (list, tuple)):
        values = [v for v in value if v is not None]
        if not values:
            raise ValueError(f"cannot resolve {what}: {name}={value!r} has no values")
        if per_layer == "uniform" and len(set(values)) > 1:
            raise ValueError(
                f"cannot resolve {what}: {name}={value!r} differs between layers; a routing buffer has "
                "one top_k for every layer"
            )
        value = max(values)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"cannot resolve {what}: {name}={value!r} must be a positive int "
            f"(fields tried: {', '.join(tried)})"
        )
    return int(value)


def _int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of layer indices, got {value!r}")
    return [int(v) for v in value]


def _moe_layers(config: Any, num_model_layers: int) -> tuple[list[int], int]:
    """Model-layer indices of the MoE layers, and the model's layer count (some rules define it).

    The first rule whose field is present decides (each mirrors the modeling code of the models
    that use it; docs/shapes.md lists them).
    """
    n = num_model_layers
    mlp_types = _get(config, "mlp_layer_types")
    if mlp_types is not None:
        types = list(mlp_types)
        if len(types) != n:
            raise ValueError(f"mlp_layer_types has {len(types)} entries but num_hidden_layers={n}")
        unknown = sorted({t for t in types if t not in MOE_MLP_TYPES | DENSE_MLP_TYPES})
        if unknown:
            raise ValueError(
                f"mlp_layer_types has unknown entries {unknown}; expected MoE types {sorted(MOE_MLP_TYPES)} "
                f"or dense types {sorted(DENSE_MLP_TYPES)}"
            )
        return [i for i, t in enumerate(types) if t in MOE_MLP_TYPES], n
    block_types = _get(config, "layers_block_type")
    if block_types is not None and "moe" in list(block_types):
        # Nemotron-H style: one entry per layer (mamba / attention / mlp / moe); the list is the model.
        types = list(block_types)
        return [i for i, t in enumerate(types) if t == "moe"], len(types)
    explicit = _get(config, "moe_layers")
    if explicit is not None:
        layers = sorted(set(_int_list("moe_layers", explicit)))
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"moe_layers has indices {bad} outside [0, num_hidden_layers={n})")
        return layers, n
    enable = _get(config, "enable_moe_block")
    if enable is not None:
        return (list(range(n)) if enable else []), n
    first_k = _get(config, "first_k_dense_replace")
    if first_k is not None:
        freq = _get(config, "moe_layer_freq") or 1
        return [i for i in range(n) if i >= first_k and i % freq == 0], n
    step = _get(config, "decoder_sparse_step")
    mlp_only = _get(config, "mlp_only_layers")
    if step is not None or mlp_only is not None:
        step = step or 1
        skip = set(_int_list("mlp_only_layers", mlp_only or []))
        return [i for i in range(n) if i not in skip and (i + 1) % step == 0], n
    start = _get(config, "moe_layer_start_index")
    if start is not None:
        end = _get(config, "moe_layer_end_index")
        end = n - 1 if end is None or end < 0 else end
        interval = _get(config, "moe_layer_interval") or 1
        return [i for i in range(n) if start <= i <= end and (i + 1) % interval == 0], n
    period = _get(config, "expert_layer_period")
    if period is not None:
        offset = _get(config, "expert_layer_offset") or 0
        return [i for i in range(n) if i % period == offset], n
    num_dense = _get(config, "num_dense_layers")
    if num_dense is not None:
        return list(range(num_dense, n)), n
    interleave = _get(config, "interleave_moe_layer_step")
    if interleave is not None:
        return [i for i in range(n) if (i + 1) % interleave == 0], n
    return list(range(n)), n


def resolve_routing_shape(config: Any) -> RoutingShape:
    """The :class:`RoutingShape` of a Hugging Face style model config (an object or a dict).

    - The decoder's config is used: ``get_text_config(decoder=True)`` for transformers configs, a
      nested ``text_config`` for dicts.
    - ``top_k``: first non-None of ``num_experts_per_tok``, ``num_experts_per_token``,
      ``top_k_experts``, ``moe_topk``, ``moe_top_k``, ``moe_k`` (then the same in a DBRX-style
      ``ffn_config``). A per-layer list must be uniform.
    - ``num_experts``: first non-None of ``num_experts``, ``num_local_experts``,
      ``n_routed_experts``, ``moe_num_experts`` (a per-layer list gives its maximum), plus
      ``zero_expert_num`` where set (LongCat-Flash's zero-computation experts are routed ids too).
    - layers: ``num_hidden_layers``; the MoE layers from the first of ``mlp_layer_types``,
      ``layers_block_type``, ``moe_layers``, ``enable_moe_block``, ``first_k_dense_replace`` (with
      ``moe_layer_freq``), ``decoder_sparse_step``/``mlp_only_layers``,
      ``moe_layer_start_index``/``moe_layer_end_index``/``moe_layer_interval``,
      ``expert_layer_period``/``expert_layer_offset``, ``num_dense_layers``,
      ``interleave_moe_layer_step``; with none of them every layer is a MoE layer.

    Raises:
        ValueError: a field is missing or not a positive int (the message names the fields tried and
            the values found), or the model has no MoE layer.
    """
    text = _text_config(config)
    top_k = _positive_field("top_k (ids per token)", text, TOP_K_FIELDS, per_layer="uniform")
    num_experts = _positive_field("num_experts", text, EXPERT_FIELDS, per_layer="max")
    zero_experts = _get(text, "zero_expert_num")
    if zero_experts:
        num_experts += int(zero_experts)
    model_type = _get(text, "model_type")
    layer_fields = (
        (_LAYER_COUNT_FIELD_BY_MODEL_TYPE[model_type],)
        if model_type in (_LAYER_COUNT_FIELD_BY_MODEL_TYPE)
        else LAYER_FIELDS
    )
    block_types = _get(text, "layers_block_type")
    if _get(text, "num_hidden_layers") is None and block_types is not None and "moe" in list(block_types):
        num_model_layers = len(block_types)  # Nemotron-H style: the list is the model
    else:
        num_model_layers = _positive_field("the layer count", text, layer_fields, per_layer="uniform")
    moe_layers, num_model_layers = _moe_layers(text, num_model_layers)
    if not moe_layers:
        raise ValueError(
            f"the config has no MoE layer ({num_model_layers} layers, all dense): nothing to capture"
        )
    if top_k > num_experts:
        raise ValueError(f"cannot resolve top_k: {top_k} ids per token but only {num_experts} experts")
    return RoutingShape(
        num_layers=len(moe_layers),
        num_experts=num_experts,
        top_k=top_k,
        moe_layers=tuple(moe_layers),
        num_model_layers=num_model_layers,
    )
