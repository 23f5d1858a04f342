"""Model shapes: how many layers, experts and ids per token a MoE model's routing has.

:class:`RoutingShape` fixes the shape of everything downstream (the capture buffer, the snapshots,
the slot store, the wire arrays): ``(tokens, num_layers, top_k)`` ids in ``[0, num_experts)``.

The layer axis holds the MoE layers only, in model order. Dense layers (DeepSeek's first
``first_k_dense_replace`` layers, Qwen's ``decoder_sparse_step``/``mlp_only_layers``, Llama-4's
interleaving, ...) have no router, so they get no column: a 61-layer DeepSeek-V3 with 3 dense layers
has a layer axis of 58. ``moe_layers[i]`` is the model-layer index of buffer layer ``i``;
:meth:`RoutingShape.buffer_layer` maps back and raises for a dense layer, and
:meth:`RoutingShape.to_model_layers` widens an array to all ``num_model_layers`` layers (dense
columns filled with -1), and :meth:`RoutingShape.vllm_layout` / :meth:`RoutingShape.sglang_layout`
give the arrays vLLM's and SGLang's clients expect (every model layer, dense columns 0)::

    model layer:   0      1      2      3      4      5          (first_k_dense_replace = 2)
                 dense  dense   MoE    MoE    MoE    MoE
    buffer layer:   -      -      0      1      2      3          moe_layers = (2, 3, 4, 5)

:func:`resolve_routing_shape` reads Hugging Face style configs (objects with attributes, or dicts);
see docs/shapes.md for every field it reads and the order it tries them in. Every bad value raises a
ValueError naming the field, and a model is refused past :data:`MAX_MODEL_LAYERS` layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

# the engine layouts live with their wire formats; RoutingShape's layout methods delegate to them
# (vllm_dtype is re-exported: it was defined here)
from .wire.npy import vllm_dtype, vllm_layout
from .wire.sglang import sglang_layout

__all__ = [
    "MAX_MODEL_LAYERS",
    "RoutingShape",
    "UnreadableConfigError",
    "narrow_dtype",
    "resolve_routing_shape",
    "vllm_dtype",
]

# Layers a shape may have (MoE or not). The deepest released decoder stacks have ~100-200 layers;
# past this a config is refused before any per-layer list is built, so a hostile
# num_hidden_layers=10**12 costs microseconds instead of exhausting memory.
MAX_MODEL_LAYERS = 4096
# text_config nesting followed at most (multimodal configs nest one level, omni configs two)
_MAX_TEXT_CONFIG_DEPTH = 8

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
# Fields that announce multi-token-prediction (MTP) layers: extra decoder layers a checkpoint ships
# after its num_hidden_layers for speculative decoding (DeepSeek-V3/V3.2/V4, GLM-4.5, Step3p7,
# Nemotron-H, Bailing, Sarvam: num_nextn_predict_layers; transformers 5 names it num_mtp_layers;
# Qwen3-Next / Qwen3.5: mtp_num_hidden_layers). They are never on the routing layer axis.
MTP_LAYER_FIELDS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
# Models whose decoder-layer count is not ``num_hidden_layers``: LongCat-Flash reports two attention
# sublayers per decoder layer in ``num_hidden_layers``; each decoder layer has one MoE.
_LAYER_COUNT_FIELD_BY_MODEL_TYPE = {"longcat_flash": "num_layers"}


def narrow_dtype(num_experts: int) -> np.dtype:
    """The smallest dtype that holds ids in ``[0, num_experts)`` AND a fill value that is no id:
    uint8 up to 255 experts, uint16 up to 65535, int32 beyond. The fill - the unsigned maximum, -1
    for int32 - marks every row without data (a slot never written, a layer not captured in its
    step, a dropped step), so it must never read as an expert: at exactly 256 experts (DeepSeek-V3,
    Kimi-K2, GLM-4.5) uint8's 255 is a valid id, so those models get uint16."""
    if num_experts < 1 << 8:
        return np.dtype(np.uint8)
    if num_experts < 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _is_int(value: Any) -> bool:
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, np.integer))


def _check_positive(name: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_layer_count(name: str, value: int) -> int:
    if value > MAX_MODEL_LAYERS:
        raise ValueError(
            f"{name}={value} exceeds MAX_MODEL_LAYERS={MAX_MODEL_LAYERS} (no released model comes near "
            "it; the per-layer maps would not be built)"
        )
    return value


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
        num_layers = _check_layer_count("num_layers", _check_positive("num_layers", self.num_layers))
        num_experts = _check_positive("num_experts", self.num_experts)
        top_k = _check_positive("top_k", self.top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")
        if self.moe_layers is None:
            moe_layers = tuple(range(num_layers))
        else:
            moe_layers = tuple(self.moe_layers)
            if not all(_is_int(i) for i in moe_layers):
                raise ValueError(f"moe_layers must be ints (model-layer indices), got {_short(moe_layers)}")
            moe_layers = tuple(int(i) for i in moe_layers)
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
            num_model_layers = _check_layer_count(
                "num_model_layers", _check_positive("num_model_layers", self.num_model_layers)
            )
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
        """The narrow dtype of this model's ids and their fill (uint8 / uint16 / int32), see
        :func:`narrow_dtype`."""
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
        out[:, self._moe_columns] = routing
        return out

    def vllm_layout(self, routing: np.ndarray) -> np.ndarray:
        """The array vLLM returns as a choice's ``routed_experts`` (before ``.npy`` + base64).

        vLLM's capturer sizes its layer axis by ``num_hidden_layers`` and never writes a dense
        layer's column, so it holds 0 there; ids are uint8 up to 256 experts, uint16 beyond
        (docs/wire.md cites the source). ``encode_routing(shape.vllm_layout(rows))`` is the text.

        Args:
            routing: (n, num_layers, top_k) integer - ids on this shape's (MoE-only) layer axis,
                each in ``[0, num_experts)``.

        Returns a new (n, num_model_layers, top_k) uint8 / uint16 array.

        Raises ValueError for a wrong shape, a non-integer dtype, ids outside ``[0, num_experts)``,
        or more than 65536 experts (vLLM has no wider id dtype).
        """
        return vllm_layout(self, routing)

    def sglang_layout(self, routing: np.ndarray, dtype: np.dtype | type = np.int32) -> np.ndarray:
        """The array SGLang returns in ``meta_info["routed_experts"]`` (before raw bytes + base64).

        SGLang's capturer sizes its layer axis by ``num_hidden_layers`` (``hf_text_config``) and its
        buffers start at 0, which dense layers' columns keep; ids are int32 unless the server sets
        ``SGLANG_ROUTED_EXPERTS_DTYPE`` to uint16 or uint8. ``encode_routing(shape.sglang_layout(rows),
        format="sglang")`` is the text.

        Args:
            routing: (n, num_layers, top_k) integer - ids on this shape's layer axis, each in
                ``[0, num_experts)``.
            dtype: int32 (SGLang's default), uint16 or uint8 - what the client decodes with.

        Returns a new (n, num_model_layers, top_k) array of ``dtype``.

        Raises ValueError for a wrong shape, a non-integer dtype, ids outside ``[0, num_experts)``,
        a ``dtype`` SGLang does not send, or ids that ``dtype`` cannot hold (SGLang itself falls back
        to int32 then and says so in ``routed_experts_dtype``; here the caller picks).
        """
        return sglang_layout(self, routing, dtype)

    @property
    def _moe_columns(self) -> slice | list[int]:
        """The MoE layers as an index of the model-layer axis: a slice when they are evenly spaced
        (every layer rule but explicit lists), which numpy copies 3-14x faster than a list (32768
        tokens, 61 layers x 8 ids: 1.7 ms vs 24 ms for a run of 58 layers, 6.8 vs 11.3 ms every other)."""
        layers = self.moe_layers
        step = layers[1] - layers[0] if len(layers) > 1 else 1
        if all(b - a == step for a, b in pairwise(layers)):
            return slice(layers[0], layers[-1] + 1, step)
        return list(layers)

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
    ``text_config`` (dicts), else ``config`` itself. A ``text_config`` chain that loops back or nests
    deeper than :data:`_MAX_TEXT_CONFIG_DEPTH` raises ValueError."""
    seen = []
    for _ in range(_MAX_TEXT_CONFIG_DEPTH + 1):
        if not isinstance(config, Mapping):
            getter = getattr(config, "get_text_config", None)
            if callable(getter):
                try:
                    return getter(decoder=True)
                except TypeError:  # older signature without the keyword
                    return getter()
        seen.append(config)
        nested = _get(config, "text_config")
        if nested is None or nested is config:
            return config
        if any(nested is earlier for earlier in seen):
            raise ValueError(f"text_config forms a cycle after {len(seen)} levels: no decoder config in it")
        config = nested
    raise ValueError(f"text_config nests more than {_MAX_TEXT_CONFIG_DEPTH} levels deep")


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
            raise ValueError(f"cannot resolve {what}: {name}={_short_repr(value)} has no values")
        bad = [v for v in values if not _is_int(v) or v < 1]
        if bad:
            raise ValueError(
                f"cannot resolve {what}: {name}={_short_repr(value)} has entries {_short_repr(bad)} that "
                "are not positive ints"
            )
        if per_layer == "uniform" and len(set(values)) > 1:
            raise ValueError(
                f"cannot resolve {what}: {name}={value!r} differs between layers; a routing buffer has "
                "one top_k for every layer"
            )
        value = max(values)
    if not _is_int(value) or value < 1:
        raise ValueError(
            f"cannot resolve {what}: {name}={value!r} must be a positive int "
            f"(fields tried: {', '.join(tried)})"
        )
    return int(value)


def _layer_list(name: str, value: Any, n: int) -> list[int]:
    """A list of model-layer indices, each an int in ``[0, n)``."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of layer indices, got {value!r}")
    not_int = [v for v in value if not _is_int(v)]
    if not_int:
        raise ValueError(f"{name} must hold int layer indices, got {_short_repr(not_int)} in it")
    outside = [v for v in value if not 0 <= v < n]
    if outside:
        raise ValueError(f"{name} has indices {_short_repr(outside)} outside [0, num_hidden_layers={n})")
    return [int(v) for v in value]


def _str_list(name: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{name} must be a list of str (one entry per layer), got {_short_repr(value)}")
    return list(value)


def _int_field(
    config: Any, name: str, *, minimum: int | None, default: int | None = None, meaning: str = ""
) -> int | None:
    """An int field >= ``minimum`` (None: any int); None (missing) gives ``default``. ``meaning``
    follows the expected value in the error message."""
    value = _get(config, name)
    if value is None:
        return default
    if not _is_int(value) or (minimum is not None and value < minimum):
        expected = "an int" if minimum is None else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {expected}{meaning}, got {value!r}")
    return int(value)


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _mtp_note(config: Any, extra: int) -> str:
    """Why a per-layer list may be ``extra`` entries too long: the MTP layers some configs append."""
    for name in MTP_LAYER_FIELDS:
        count = _get(config, name)
        if _is_int(count) and count == extra:
            return (
                f"; its last {extra} entries look like the {name}={count} multi-token-prediction layers, "
                "which are not part of the routing layer axis: drop them from the list"
            )
    return ""


def _moe_layers(config: Any, num_model_layers: int) -> tuple[list[int], int]:
    """Model-layer indices of the MoE layers, and the model's layer count (some rules define it).

    The first rule whose field is present (not None) decides (each mirrors the modeling code of the
    models that use it; docs/shapes.md lists them). Every rule field present is checked first,
    whichever rule decides: a period, step or interval must be a positive int (0 would divide by
    zero in the model's own code), a count or index a non-negative int, a flag a bool, a list one
    entry per layer.
    """
    n = num_model_layers
    mlp_types = _get(config, "mlp_layer_types")
    if mlp_types is not None:
        mlp_types = _str_list("mlp_layer_types", mlp_types)
    block_types = _get(config, "layers_block_type")
    if block_types is not None:
        block_types = _str_list("layers_block_type", block_types)
    explicit = _get(config, "moe_layers")
    if explicit is not None:
        explicit = sorted(set(_layer_list("moe_layers", explicit, n)))
    enable = _get(config, "enable_moe_block")
    if enable is not None and not isinstance(enable, (bool, np.bool_)):
        raise ValueError(f"enable_moe_block must be True or False, got {enable!r}")
    first_k = _int_field(config, "first_k_dense_replace", minimum=0)
    freq = _get(config, "moe_layer_freq")
    if isinstance(freq, (list, tuple)):
        # per-layer 0/1 flags (dots.llm3-style configs; transformers folds them into mlp_layer_types)
        if len(freq) != n or not all(
            isinstance(f, (bool, np.bool_)) or (_is_int(f) and f in (0, 1)) for f in freq
        ):
            raise ValueError(
                f"moe_layer_freq as a list must hold num_hidden_layers={n} flags (0/1), got "
                f"{_short_repr(freq)}"
            )
    else:
        freq = _int_field(config, "moe_layer_freq", minimum=1, default=1)
    step = _int_field(config, "decoder_sparse_step", minimum=1)
    mlp_only = _get(config, "mlp_only_layers")
    if mlp_only is not None:
        mlp_only = set(_layer_list("mlp_only_layers", mlp_only, n))
    start = _int_field(config, "moe_layer_start_index", minimum=0)
    # ERNIE-4.5: a negative (default -1) or missing end index means the last layer
    end = _int_field(
        config, "moe_layer_end_index", minimum=None, meaning=" (a layer index; negative: the last layer)"
    )
    interval = _int_field(config, "moe_layer_interval", minimum=1, default=1)
    period = _int_field(config, "expert_layer_period", minimum=1)
    offset = _int_field(config, "expert_layer_offset", minimum=0, default=0)
    num_dense = _int_field(config, "num_dense_layers", minimum=0)
    interleave = _int_field(config, "interleave_moe_layer_step", minimum=1)

    if mlp_types is not None:
        if len(mlp_types) != n:
            raise ValueError(
                f"mlp_layer_types has {len(mlp_types)} entries but num_hidden_layers={n}"
                + _mtp_note(config, len(mlp_types) - n)
            )
        unknown = sorted({t for t in mlp_types if t not in MOE_MLP_TYPES | DENSE_MLP_TYPES})
        if unknown:
            raise ValueError(
                f"mlp_layer_types has unknown entries {unknown}; expected MoE types {sorted(MOE_MLP_TYPES)} "
                f"or dense types {sorted(DENSE_MLP_TYPES)}"
            )
        return [i for i, t in enumerate(mlp_types) if t in MOE_MLP_TYPES], n
    if block_types is not None and "moe" in block_types:
        # Nemotron-H style: one entry per layer (mamba / attention / mlp / moe); the list is the model.
        _check_layer_count("len(layers_block_type)", len(block_types))
        return [i for i, t in enumerate(block_types) if t == "moe"], len(block_types)
    if explicit is not None:
        return explicit, n
    if enable is not None:
        return (list(range(n)) if enable else []), n
    if first_k is not None:
        if isinstance(freq, (list, tuple)):
            return [i for i in range(n) if i >= first_k and freq[i]], n
        return [i for i in range(n) if i >= first_k and i % freq == 0], n
    if step is not None or mlp_only is not None:
        skip = mlp_only or set()
        step = 1 if step is None else step
        return [i for i in range(n) if i not in skip and (i + 1) % step == 0], n
    if start is not None:
        end = n - 1 if end is None or end < 0 else end
        return [i for i in range(n) if start <= i <= end and (i + 1) % interval == 0], n
    if period is not None:
        return [i for i in range(n) if i % period == offset], n
    if num_dense is not None:
        return list(range(num_dense, n)), n
    if interleave is not None:
        return [i for i in range(n) if (i + 1) % interleave == 0], n
    return list(range(n)), n


class UnreadableConfigError(ValueError):
    """:func:`resolve_routing_shape` could not read the config: its own code raised (a
    ``get_text_config``, a property); the original exception is the ``__cause__``."""


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
        ValueError: a field is missing or has a bad value (the message names the fields tried and
            the values found), the model has more than :data:`MAX_MODEL_LAYERS` layers or no MoE
            layer, or ``text_config`` loops back on itself.
        UnreadableConfigError: (a ValueError) the config's own code raised while it was read (a
            ``get_text_config`` or a property raising RuntimeError, say): the message names the
            exception, which is its ``__cause__``.
    """
    try:
        return _resolve_routing_shape(config)
    except ValueError:
        raise
    except Exception as e:  # the config's own code raised (a get_text_config, a property)
        raised = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise UnreadableConfigError(f"the config cannot be read: {raised}") from e


def _resolve_routing_shape(config: Any) -> RoutingShape:
    text = _text_config(config)
    top_k = _positive_field("top_k (ids per token)", text, TOP_K_FIELDS, per_layer="uniform")
    num_experts = _positive_field("num_experts", text, EXPERT_FIELDS, per_layer="max")
    num_experts += _int_field(text, "zero_expert_num", minimum=0, default=0)
    model_type = _get(text, "model_type")
    layer_fields = (
        (_LAYER_COUNT_FIELD_BY_MODEL_TYPE[model_type],)
        if isinstance(model_type, str) and model_type in _LAYER_COUNT_FIELD_BY_MODEL_TYPE
        else LAYER_FIELDS
    )
    block_types = _get(text, "layers_block_type")
    if (
        _get(text, "num_hidden_layers") is None
        and isinstance(block_types, (list, tuple))
        and "moe" in _str_list("layers_block_type", block_types)
    ):
        num_model_layers = len(block_types)  # Nemotron-H style: the list is the model
    else:
        num_model_layers = _positive_field("the layer count", text, layer_fields, per_layer="uniform")
    _check_layer_count("the layer count", num_model_layers)
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
