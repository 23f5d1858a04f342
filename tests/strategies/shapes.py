"""Routing shapes and routing arrays (capturer, transfer, store, wire, replayer), and the hostile model
configs resolve_routing_shape and the config guards must refuse."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

__all__ = [
    "CONFIG_FIELDS",
    "HOSTILE_CONFIG_VALUES",
    "hostile_model_configs",
    "routing_rows",
    "routing_shapes",
]


@st.composite
def routing_shapes(draw, max_layers: int = 6, max_top_k: int = 8, experts=(8, 64, 256, 257, 4096, 70000)):
    """A RoutingShape with some dense layers mixed in (moe_layers a random subset of the model)."""
    from moe_ops import RoutingShape

    num_model_layers = draw(st.integers(1, max_layers))
    moe = draw(st.lists(st.booleans(), min_size=num_model_layers, max_size=num_model_layers))
    moe_layers = [i for i, m in enumerate(moe) if m] or [num_model_layers - 1]
    num_experts = draw(st.sampled_from(experts))
    top_k = draw(st.integers(1, min(max_top_k, num_experts)))
    return RoutingShape(
        num_layers=len(moe_layers),
        num_experts=num_experts,
        top_k=top_k,
        moe_layers=tuple(moe_layers),
        num_model_layers=num_model_layers,
    )


def routing_rows(rng: np.random.Generator, n: int, shape, dtype=None) -> np.ndarray:
    """(n, num_layers, top_k) ids in [0, num_experts) in ``dtype`` (default: the shape's narrow dtype)."""
    dtype = shape.id_dtype if dtype is None else dtype
    return rng.integers(0, shape.num_experts, size=(n, shape.num_layers, shape.top_k)).astype(dtype)


# a value of every kind a config field may hold by mistake
HOSTILE_CONFIG_VALUES = (
    0, -1, 1, 2, 3, 10**12, True, False, None, 1.7, float("nan"), "1", "false", "moe", [], [None],
    [1.7], [8, "a"], [0, 1], [True], {}, (2,), ["moe", "dense"], ["sparse"], [[1]],
)  # fmt: skip
# every field resolve_routing_shape reads (docs/shapes.md), plus the MTP fields the guard reads
CONFIG_FIELDS = (
    "num_hidden_layers", "num_layers", "num_experts_per_tok", "num_experts_per_token", "top_k_experts",
    "moe_topk", "moe_top_k", "moe_k", "num_experts", "num_local_experts", "n_routed_experts",
    "moe_num_experts", "zero_expert_num", "model_type", "mlp_layer_types", "layers_block_type",
    "moe_layers", "enable_moe_block", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
    "mlp_only_layers", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
    "expert_layer_period", "expert_layer_offset", "num_dense_layers", "interleave_moe_layer_step",
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_layers_block_type", "mtp_mlp_layer_types",
)  # fmt: skip


@st.composite
def hostile_model_configs(draw) -> dict:
    """A dict config: a valid MoE base with a few fields overwritten by hostile values, sometimes
    nested under text_config / ffn_config, sometimes with a text_config cycle."""
    config = dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
    for name in draw(st.lists(st.sampled_from(CONFIG_FIELDS), max_size=4, unique=True)):
        value = draw(st.sampled_from(HOSTILE_CONFIG_VALUES))
        config[name] = list(value) if isinstance(value, list) else value
    shape = draw(st.sampled_from(["flat", "nested", "ffn", "cycle"]))
    if shape == "nested":
        return {"text_config": config}
    if shape == "ffn":
        return {**config, "ffn_config": {"moe_top_k": draw(st.sampled_from(HOSTILE_CONFIG_VALUES))}}
    if shape == "cycle":
        outer = {"text_config": config}
        config["text_config"] = outer
        return outer
    return config
