"""RoutingShape and resolve_routing_shape: real transformers config classes, dict configs, layer maps.

The MoE layers a config resolves to are checked two ways: against the values written down here for
the settings each case passes, and against the real modeling code of transformers (the model is
built at a tiny size and the decoder layers holding a router/experts module are counted).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import hostile_model_configs, routing_shapes

from moe_ops import RoutingShape, narrow_dtype, resolve_routing_shape
from moe_ops.shapes import MAX_MODEL_LAYERS

try:
    import transformers
except ImportError:  # the hf extra is optional
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed (the hf extra)")

SMALL = dict(
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=64,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)

# (config class, kwargs, expected (moe_layers, num_model_layers, num_experts, top_k) or None).
# None: the expectation comes from the modeling code only (newer models whose layer pattern is a
# default that moved between transformers releases).
CASES = [
    (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=6,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
        ((1, 5), 6, 8, 2),
    ),
    (
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=5,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
            shared_expert_intermediate_size=16,
        ),
        ((1, 2, 3, 4), 5, 8, 2),
    ),
    (
        "MixtralConfig",
        dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2),
        ((0, 1, 2), 3, 8, 2),
    ),
    (
        "DeepseekV3Config",
        dict(
            num_hidden_layers=5,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            **MLA,
        ),
        ((2, 3, 4), 5, 8, 2),
    ),
    (
        "DeepseekV2Config",
        dict(
            num_hidden_layers=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            **MLA,
        ),
        ((1, 2, 3), 4, 8, 2),
    ),
    ("OlmoeConfig", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2), ((0, 1, 2), 3, 8, 2)),
    (
        "GptOssConfig",
        dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2),
        ((0, 1, 2), 3, 8, 2),
    ),
    (
        "Llama4TextConfig",
        dict(
            num_hidden_layers=4,
            num_local_experts=8,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=32,
        ),
        ((1, 3), 4, 8, 1),
    ),
    (
        "Glm4MoeConfig",
        dict(
            num_hidden_layers=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        ((1, 2, 3), 4, 8, 2),
    ),
    (
        "Ernie4_5_MoeConfig",
        dict(
            num_hidden_layers=6,
            moe_num_experts=8,
            moe_k=2,
            moe_layer_start_index=1,
            moe_layer_end_index=4,
            moe_layer_interval=2,
        ),
        ((1, 3), 6, 8, 2),
    ),
    (
        "JambaConfig",
        dict(
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=0,
            mamba_d_state=4,
            mamba_dt_rank=4,
            mamba_expand=1,
            mamba_d_conv=2,
        ),
        ((1, 3), 4, 8, 2),
    ),
    (
        "PhimoeConfig",
        dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2),
        ((0, 1, 2), 3, 8, 2),
    ),
    (
        "Lfm2MoeConfig",
        dict(
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            num_dense_layers=2,
            layer_types=["full_attention", "conv", "full_attention", "conv"],
        ),
        ((2, 3), 4, 8, 2),
    ),
    (
        "Dots1Config",
        dict(
            num_hidden_layers=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
        ),
        ((1, 2, 3), 4, 8, 2),
    ),
    (
        "MiniMaxM2Config",
        dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2),
        ((0, 1, 2), 3, 8, 2),
    ),
    (
        "GraniteMoeConfig",
        dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2),
        ((0, 1, 2), 3, 8, 2),
    ),
    (
        "JetMoeConfig",
        dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2, kv_channels=16),
        ((0, 1, 2), 3, 8, 2),
    ),
    ("HunYuanMoEV1Config", dict(num_hidden_layers=3, num_experts=8, moe_topk=2), ((0, 1, 2), 3, 8, 2)),
    (
        "DbrxConfig",
        dict(
            n_layers=3,
            d_model=32,
            n_heads=2,
            ffn_config=dict(moe_num_experts=8, moe_top_k=2, ffn_hidden_size=16),
            attn_config=dict(kv_n_heads=1, rope_theta=10000.0),
        ),
        ((0, 1, 2), 3, 8, 2),
    ),
    (
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
        ((0, 2, 3), 4, 8, 2),
    ),
    # LongCat-Flash: one MoE per decoder layer (num_layers; num_hidden_layers counts attention
    # sublayers), and the router's ids also cover zero_expert_num zero-computation experts.
    (
        "LongcatFlashConfig",
        dict(num_layers=2, n_routed_experts=8, moe_topk=2, zero_expert_num=2),
        ((0, 1), 2, 10, 2),
    ),
    (
        "DeepseekV32Config",
        dict(num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1),
        None,
    ),
    ("KimiLinearConfig", dict(num_hidden_layers=4, num_experts=8, num_experts_per_token=2), None),
    (
        "GlmMoeDsaConfig",
        dict(num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=2),
        None,
    ),
    ("Glm4MoeLiteConfig", dict(num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2), None),
    ("FlexOlmoConfig", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2), None),
    (
        "Gemma4TextConfig",
        dict(num_hidden_layers=3, enable_moe_block=True, num_experts=8, top_k_experts=2),
        None,
    ),
    (
        "ExaoneMoeConfig",
        dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, first_k_dense_replace=1),
        None,
    ),
    (
        "AfmoeConfig",
        dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, num_dense_layers=1),
        None,
    ),
    (
        "BailingHybridConfig",
        dict(num_hidden_layers=4, num_experts=8, num_experts_per_token=2, first_k_dense_replace=1),
        None,
    ),
    ("Cohere2MoeConfig", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2), None),
    ("SolarOpenConfig", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2), None),
    ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2), None),
    (
        "GraniteMoeSharedConfig",
        dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=16),
        None,
    ),
    (
        "GraniteMoeHybridConfig",
        dict(
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
            mamba_n_heads=2,
            mamba_d_head=16,
            mamba_d_state=4,
            mamba_n_groups=1,
            mamba_expand=1,
        ),
        None,
    ),
    ("DeepseekV4Config", dict(num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2), None),
    ("MiniMaxConfig", dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2), None),
    (
        "NemotronHConfig",
        dict(
            layers_block_type=["mamba", "moe", "attention", "moe"], n_routed_experts=8, num_experts_per_tok=2
        ),
        None,
    ),
]

# A decoder layer is MoE when it holds a module whose class name ends like a router / experts block.
_MOE_MODULE = re.compile(r"(Experts|Router|SparseMoeBlock|MoE|Moe)$")


def _config(name: str, kwargs: dict):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return cls(**{**SMALL, **kwargs})


def _moe_layers_of_model(config) -> tuple[tuple[int, ...], int]:
    """Builds the tiny model with transformers' own modeling code and finds its MoE decoder layers."""
    import torch

    auto = transformers.AutoModelForCausalLM
    try:
        model = auto.from_config(config)
    except ValueError:  # no causal-LM head registered for this config: the bare model
        model = transformers.AutoModel.from_config(config)
    lists = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and re.search("Layer|Block", type(m[0]).__name__)
    ]
    layers = max(lists, key=len)
    moe = tuple(
        i
        for i, layer in enumerate(layers)
        if any(_MOE_MODULE.search(type(sub).__name__) for sub in layer.modules() if sub is not layer)
    )
    return moe, len(layers)


@needs_hf
@pytest.mark.parametrize("name, kwargs, expected", CASES, ids=[c[0] for c in CASES])
def test_real_transformers_configs(name, kwargs, expected):
    config = _config(name, kwargs)
    shape = resolve_routing_shape(config)
    model_moe, model_layers = _moe_layers_of_model(config)
    assert shape.moe_layers == model_moe, (
        f"{name}: resolved {shape.moe_layers}, the model routes in {model_moe}"
    )
    assert shape.num_model_layers == model_layers
    assert shape.num_layers == len(model_moe)
    if expected is not None:
        moe_layers, num_model_layers, num_experts, top_k = expected
        assert (shape.moe_layers, shape.num_model_layers, shape.num_experts, shape.top_k) == (
            moe_layers,
            num_model_layers,
            num_experts,
            top_k,
        )
    else:
        assert (shape.num_experts, shape.top_k) == (8, 2)


@needs_hf
def test_nested_text_config_of_multimodal_configs():
    """Llama-4, Gemma-4 and Qwen3.5-MoE keep the decoder's fields in a nested text_config."""
    if not hasattr(transformers, "Llama4Config"):
        pytest.skip(f"transformers {transformers.__version__} has no Llama4Config")
    text = dict(num_hidden_layers=4, num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=2)
    config = transformers.Llama4Config(text_config={**SMALL, **text})
    shape = resolve_routing_shape(config)
    assert (shape.moe_layers, shape.num_model_layers, shape.num_experts, shape.top_k) == ((1, 3), 4, 16, 1)
    if hasattr(transformers, "Gemma4Config"):
        text = dict(num_hidden_layers=3, enable_moe_block=True, num_experts=128, top_k_experts=8)
        shape = resolve_routing_shape(transformers.Gemma4Config(text_config={**SMALL, **text}))
        assert (shape.moe_layers, shape.num_experts, shape.top_k) == ((0, 1, 2), 128, 8)
    if hasattr(transformers, "Qwen3_5MoeConfig"):
        # Qwen3.5-MoE as released is multimodal: the routers are in model.language_model
        text = dict(num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
        config = transformers.Qwen3_5MoeConfig(text_config={**SMALL, **text})
        shape = resolve_routing_shape(config)
        assert (shape.moe_layers, shape.num_model_layers, shape.num_experts, shape.top_k) == (
            (0, 1, 2, 3),
            4,
            16,
            4,
        )


@needs_hf
def test_deepseek_v3_full_size_layer_axis():
    """The 61-layer DeepSeek-V3 default: 3 dense layers, so the layer axis has 58 MoE layers."""
    shape = resolve_routing_shape(transformers.DeepseekV3Config())
    assert (shape.num_layers, shape.num_model_layers, shape.num_experts, shape.top_k) == (58, 61, 256, 8)
    assert shape.moe_layers == tuple(range(3, 61)) and shape.dense_layers == (0, 1, 2)
    assert shape.id_dtype == np.uint16  # 256 experts: uint8 has no fill left (255 is an id)


@needs_hf
def test_non_moe_and_unset_configs_raise_naming_the_fields():
    with pytest.raises(ValueError, match=r"num_experts_per_tok=None.*moe_top_k=None"):
        resolve_routing_shape(transformers.LlamaConfig(**SMALL, num_hidden_layers=2))
    # DeepSeek-V2's default leaves num_experts_per_tok unset: None counts as missing
    with pytest.raises(ValueError, match="num_experts_per_tok=None"):
        resolve_routing_shape(transformers.DeepseekV2Config())


# Dict configs in the style of models whose classes transformers may not ship.
DICT_CASES = [
    # Kimi (K2 / Linear style): top-k under num_experts_per_token, first layer dense
    (
        dict(num_hidden_layers=27, num_experts=256, num_experts_per_token=8, first_k_dense_replace=1),
        (tuple(range(1, 27)), 27, 256, 8),
    ),
    # Gemma-4 style: top_k_experts, every layer MoE when the block is enabled, nested text_config
    (
        dict(text_config=dict(num_hidden_layers=4, num_experts=128, top_k_experts=8, enable_moe_block=True)),
        ((0, 1, 2, 3), 4, 128, 8),
    ),
    # DeepSeek-V2 style interleaving with moe_layer_freq
    (
        dict(
            num_hidden_layers=8,
            n_routed_experts=64,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            moe_layer_freq=2,
        ),
        ((2, 4, 6), 8, 64, 6),
    ),
    # moe_topk / moe_top_k aliases; per-layer expert counts fold to their maximum
    (dict(num_hidden_layers=2, num_experts=[32, 64], moe_topk=[4, 4]), ((0, 1), 2, 64, 4)),
    (dict(num_hidden_layers=2, moe_num_experts=300, moe_top_k=2), ((0, 1), 2, 300, 2)),
    # a None top-k alias is skipped: the next alias wins
    (
        dict(num_hidden_layers=3, num_experts_per_tok=None, top_k_experts=2, num_experts=4),
        ((0, 1, 2), 3, 4, 2),
    ),
    # Llama-4 explicit moe_layers, Nemotron-H layers_block_type
    (
        dict(num_hidden_layers=6, moe_layers=[5, 1, 3], num_local_experts=16, num_experts_per_tok=1),
        ((1, 3, 5), 6, 16, 1),
    ),
    (
        dict(
            layers_block_type=["mamba", "moe", "attention", "moe", "mlp"],
            n_routed_experts=128,
            num_experts_per_tok=6,
        ),
        ((1, 3), 5, 128, 6),
    ),
    # a GLM-4.7-Flash style config.json: first_k_dense_replace and an MTP layer, no mlp_layer_types
    # (transformers builds mlp_layer_types = dense, then sparse, from it)
    (
        dict(
            model_type="glm4_moe_lite",
            num_hidden_layers=47,
            first_k_dense_replace=1,
            n_routed_experts=64,
            num_experts_per_tok=4,
            num_nextn_predict_layers=1,
        ),
        (tuple(range(1, 47)), 47, 64, 4),
    ),
    # a Qwen3.5-MoE style config.json: the decoder in text_config, attention kinds in layer_types
    # (not MLP kinds: every layer is MoE), an MTP layer, a vision tower with its own depth
    (
        dict(
            model_type="qwen3_5_moe",
            text_config=dict(
                num_hidden_layers=8,
                num_experts=256,
                num_experts_per_tok=8,
                layer_types=["linear_attention"] * 3
                + ["full_attention"]
                + ["linear_attention"] * 3
                + ["full_attention"],
                mtp_num_hidden_layers=1,
            ),
            vision_config=dict(depth=27),
        ),
        (tuple(range(8)), 8, 256, 8),
    ),
]


@pytest.mark.parametrize("config, expected", DICT_CASES)
def test_dict_configs(config, expected):
    shape = resolve_routing_shape(config)
    assert (shape.moe_layers, shape.num_model_layers, shape.num_experts, shape.top_k) == expected


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(num_hidden_layers=4, num_experts=8), r"cannot resolve top_k.*num_experts_per_tok=None"),
        (
            dict(num_hidden_layers=4, num_experts_per_tok=2),
            r"cannot resolve num_experts.*n_routed_experts=None",
        ),
        (dict(num_experts=8, num_experts_per_tok=2), r"layer count.*num_hidden_layers=None"),
        (
            dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=0),
            r"num_experts_per_tok=0 must be a positive",
        ),
        (
            dict(num_hidden_layers=4, num_experts=-8, num_experts_per_tok=2),
            r"num_experts=-8 must be a positive",
        ),
        (dict(num_hidden_layers=0, num_experts=8, num_experts_per_tok=2), r"num_hidden_layers=0"),
        (
            dict(num_hidden_layers=4, num_experts=2, num_experts_per_tok=4),
            r"4 ids per token but only 2 experts",
        ),
        (dict(num_hidden_layers=2, num_experts=8, moe_topk=[2, 4]), r"differs between layers"),
        (
            dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, enable_moe_block=False),
            r"no MoE layer",
        ),
        (
            dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, mlp_layer_types=["dense"]),
            r"1 entries",
        ),
        (
            dict(num_hidden_layers=1, num_experts=8, num_experts_per_tok=2, mlp_layer_types=["weird"]),
            r"unknown",
        ),
        (dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_layers=[2]), r"outside"),
    ],
)
def test_bad_configs_raise_with_fields_and_values(config, match):
    with pytest.raises(ValueError, match=match):
        resolve_routing_shape(config)


def test_object_configs_with_attributes():
    class Cfg:
        num_hidden_layers = 4
        n_routed_experts = 16
        num_experts_per_tok = 4
        first_k_dense_replace = 3

    shape = resolve_routing_shape(Cfg())
    assert shape.moe_layers == (3,) and shape.num_model_layers == 4


# ------------------------------------------------------------------------------------ RoutingShape


@settings(max_examples=200)
@given(shape=routing_shapes())
def test_layer_maps_are_inverse_and_dense_layers_raise(shape):
    for i, layer in enumerate(shape.moe_layers):
        assert shape.buffer_layer(layer) == i and shape.model_layer(i) == layer
        assert shape.is_moe_layer(layer)
    for layer in shape.dense_layers:
        assert not shape.is_moe_layer(layer)
        with pytest.raises(ValueError, match=f"model layer {layer} is dense"):
            shape.buffer_layer(layer)
    assert sorted(shape.dense_layers + shape.moe_layers) == list(range(shape.num_model_layers))
    with pytest.raises(IndexError):
        shape.buffer_layer(shape.num_model_layers)
    with pytest.raises(IndexError):
        shape.buffer_layer(-1)
    with pytest.raises(IndexError):
        shape.model_layer(shape.num_layers)


@settings(max_examples=100)
@given(shape=routing_shapes(), n=st.integers(0, 5), seed=st.integers(0, 2**32 - 1))
def test_to_model_layers_puts_columns_back_and_fills_dense(shape, n, seed):
    from strategies import routing_rows

    rows = routing_rows(np.random.default_rng(seed), n, shape)
    wide = shape.to_model_layers(rows)
    assert wide.shape == (n, shape.num_model_layers, shape.top_k)
    for i, layer in enumerate(shape.moe_layers):
        assert np.array_equal(wide[:, layer], rows[:, i])
    for layer in shape.dense_layers:
        assert (wide[:, layer] == -1).all()
    assert np.array_equal(wide[:, list(shape.moe_layers)].astype(rows.dtype), rows)


@pytest.mark.parametrize(
    "num_experts, dtype",
    [
        (1, np.uint8),
        (8, np.uint8),
        (255, np.uint8),
        (256, np.uint16),
        (257, np.uint16),
        (65535, np.uint16),
        (65536, np.int32),
        (65537, np.int32),
    ],
)
def test_narrow_dtype_thresholds(num_experts, dtype):
    """Every id fits, and the fill (the unsigned maximum, or -1) is never an id: at 256 experts
    uint8's 255 would be one."""
    assert narrow_dtype(num_experts) == dtype
    assert np.iinfo(dtype).max >= num_experts - 1
    fill = np.iinfo(dtype).max if np.dtype(dtype).kind == "u" else -1
    assert not 0 <= fill < num_experts
    assert RoutingShape(1, num_experts, 1).id_dtype == dtype


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=0, num_experts=8, top_k=2), "num_layers must be a positive int"),
        (dict(num_layers=2, num_experts=8, top_k=9), "top_k must be <= num_experts=8"),
        (dict(num_layers=2, num_experts=8, top_k=2, moe_layers=(1,)), "2 entries"),
        (dict(num_layers=2, num_experts=8, top_k=2, moe_layers=(3, 1)), "strictly increasing"),
        (
            dict(num_layers=2, num_experts=8, top_k=2, moe_layers=(1, 3), num_model_layers=3),
            "< num_model_layers=3",
        ),
        (dict(num_layers=2, num_experts=True, top_k=1), "num_experts must be a positive int"),
    ],
)
def test_routing_shape_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoutingShape(**kwargs)


def test_routing_shape_defaults_and_bytes():
    shape = RoutingShape(num_layers=61, num_experts=256, top_k=8)
    assert shape.moe_layers == tuple(range(61)) and shape.num_model_layers == 61 and shape.dense_layers == ()
    assert shape.row_bytes() == 61 * 8 * 2 and shape.row_bytes(np.int32) == 61 * 8 * 4  # uint16 at 256
    assert shape == RoutingShape(61, 256, 8, moe_layers=range(61), num_model_layers=61)


# ------------------------------------------------------------------- the layouts clients expect


@settings(max_examples=150)
@given(shape=routing_shapes(), n=st.integers(0, 6), seed=st.integers(0, 2**32 - 1))
def test_vllm_and_sglang_layouts_put_moe_columns_back_and_zero_the_dense_ones(shape, n, seed):
    from strategies import routing_rows

    rows = routing_rows(np.random.default_rng(seed), n, shape)
    layouts = {"sglang int32": shape.sglang_layout(rows)}
    if shape.num_experts <= 1 << 16:
        layouts["vllm"] = shape.vllm_layout(rows)
        assert layouts["vllm"].dtype == (np.uint8 if shape.num_experts <= 256 else np.uint16)
        # the one call equals the two-step recipe with an explicit fill=0
        assert np.array_equal(
            layouts["vllm"], shape.to_model_layers(rows, fill=0).astype(layouts["vllm"].dtype)
        )
    else:
        with pytest.raises(ValueError, match="uint8 / uint16 ids; num_experts=70000 does not fit"):
            shape.vllm_layout(rows)
    assert layouts["sglang int32"].dtype == np.int32
    for name, wide in layouts.items():
        assert wide.shape == (n, shape.num_model_layers, shape.top_k), name
        assert np.array_equal(wide[:, list(shape.moe_layers)], rows), name
        assert (wide[:, list(shape.dense_layers)] == 0).all(), name


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s, r: s.vllm_layout(r[:, :1]), r"shape \(n, 2, 2\), got \(3, 1, 2\)"),
        (lambda s, r: s.vllm_layout(r.astype(np.float32)), "integer array, got dtype float32"),
        (lambda s, r: s.vllm_layout(r + 300), r"ids in \[300, .*outside \[0, num_experts=300\)"),
        (lambda s, r: s.sglang_layout(r - 1), r"ids in \[-1, "),
        (lambda s, r: s.sglang_layout(r, dtype=np.uint8), "uint8 holds ids up to 255.*num_experts=300"),
        (lambda s, r: s.sglang_layout(r, dtype=np.int64), "int32, uint16 or uint8"),
        (lambda s, r: s.sglang_layout(r, dtype="bogus"), "int32, uint16 or uint8"),
    ],
)
def test_layouts_refuse_what_the_clients_could_not_read(call, match):
    shape = RoutingShape(2, 300, 2, moe_layers=(0, 2), num_model_layers=3)
    rows = np.arange(12, dtype=np.int32).reshape(3, 2, 2)
    with pytest.raises(ValueError, match=match):
        call(shape, rows)


def test_sglang_layout_narrow_dtypes_when_the_ids_fit():
    shape = RoutingShape(1, 256, 1, moe_layers=(1,), num_model_layers=2)
    rows = np.array([[[255]]], dtype=np.int32)
    for dtype in (np.uint8, np.uint16, np.int32):
        out = shape.sglang_layout(rows, dtype=dtype)
        assert out.dtype == dtype and out.tolist() == [[[0], [255]]]


# --------------------------------------------------------- bad values: ValueError naming the field


def _moe(**fields):
    return dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, **fields)


@pytest.mark.parametrize(
    "config, match",
    [
        # each used to escape as ZeroDivisionError
        (_moe(expert_layer_period=0), "expert_layer_period must be an int >= 1, got 0"),
        (_moe(interleave_moe_layer_step=0), "interleave_moe_layer_step must be an int >= 1, got 0"),
        (_moe(decoder_sparse_step=0), "decoder_sparse_step must be an int >= 1, got 0"),
        # ... as TypeError
        (_moe(first_k_dense_replace="1"), "first_k_dense_replace must be an int >= 0, got '1'"),
        (dict(num_hidden_layers=4, num_experts=[8, "a"], num_experts_per_tok=2), r"num_experts=\[8, 'a'\]"),
        (_moe(moe_layers=[None]), r"moe_layers must hold int layer indices, got \[None\]"),
        (_moe(mlp_only_layers=[1.5]), r"mlp_only_layers must hold int layer indices, got \[1.5\]"),
        (_moe(mlp_layer_types=[["sparse"]] * 4), "mlp_layer_types must be a list of str"),
        (_moe(layers_block_type="moe"), "layers_block_type must be a list of str"),
        (dict(num_hidden_layers=4, num_experts=8, moe_topk=[2, [2]]), "entries .* not positive ints"),
        # ... accepted silently
        (_moe(enable_moe_block="false"), "enable_moe_block must be True or False, got 'false'"),
        (_moe(moe_layers=[1.7]), r"moe_layers must hold int layer indices, got \[1.7\]"),
        (_moe(first_k_dense_replace=1, moe_layer_freq=0), "moe_layer_freq must be an int >= 1, got 0"),
        (_moe(moe_layer_start_index=0, moe_layer_interval=0), "moe_layer_interval must be an int >= 1"),
        (_moe(expert_layer_period=2, expert_layer_offset=-1), "expert_layer_offset must be an int >= 0"),
        (_moe(num_dense_layers=1.0), "num_dense_layers must be an int >= 0, got 1.0"),
        (_moe(zero_expert_num=-2), "zero_expert_num must be an int >= 0, got -2"),
        (_moe(zero_expert_num="2"), "zero_expert_num must be an int >= 0, got '2'"),
        (_moe(first_k_dense_replace=0, moe_layer_freq=[1, 0]), "moe_layer_freq as a list must hold"),
        (_moe(moe_layers=[4]), r"moe_layers has indices \[4\] outside \[0, num_hidden_layers=4\)"),
        # layer counts are bounded before anything per layer is built
        (
            dict(num_hidden_layers=10**12, num_experts=8, num_experts_per_tok=2),
            "exceeds MAX_MODEL_LAYERS=4096",
        ),
        (dict(layers_block_type=["moe"] * 5000, num_experts=8, num_experts_per_tok=2), "MAX_MODEL_LAYERS"),
        # an MTP layer appended to a per-layer list says so
        (
            _moe(
                num_nextn_predict_layers=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"]
            ),
            "last 1 entries look like the num_nextn_predict_layers=1 multi-token-prediction layers",
        ),
    ],
)
def test_bad_field_values_raise_value_error_naming_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        resolve_routing_shape(config)


def test_text_config_cycles_and_deep_nesting_raise_value_error():
    a: dict = {"model_type": "a"}
    b = {"text_config": a}
    a["text_config"] = b
    with pytest.raises(ValueError, match="text_config forms a cycle"):
        resolve_routing_shape(a)
    deep: dict = _moe()
    for _ in range(20):
        deep = {"text_config": deep}
    with pytest.raises(ValueError, match="nests more than 8 levels"):
        resolve_routing_shape(deep)
    assert resolve_routing_shape({"text_config": {"text_config": _moe()}}).num_layers == 4


def test_the_layer_bound_and_the_per_layer_freq_list():
    assert RoutingShape(4096, 8, 2).num_model_layers == 4096
    with pytest.raises(ValueError, match="num_model_layers=4097 exceeds MAX_MODEL_LAYERS"):
        RoutingShape(1, 8, 2, num_model_layers=4097)
    with pytest.raises(ValueError, match="num_layers=5000 exceeds"):
        RoutingShape(5000, 8, 2)
    with pytest.raises(ValueError, match=r"moe_layers must be ints .*1.5"):
        RoutingShape(2, 8, 2, moe_layers=(0, 1.5))
    # per-layer 0/1 flags, as dots.llm3-style configs write moe_layer_freq
    shape = resolve_routing_shape(_moe(first_k_dense_replace=1, moe_layer_freq=[1, 1, 0, 1]))
    assert shape.moe_layers == (1, 3)


@settings(max_examples=600)
@given(config=hostile_model_configs())
def test_hostile_configs_raise_value_error_or_resolve_to_a_valid_shape(config):
    try:
        shape = resolve_routing_shape(config)
    except ValueError:
        return
    assert 1 <= shape.num_layers <= shape.num_model_layers <= MAX_MODEL_LAYERS
    assert all(0 <= i < shape.num_model_layers for i in shape.moe_layers)
    assert 1 <= shape.top_k <= shape.num_experts


class _ConfigWhoseCodeRaises:
    """A config whose get_text_config raises (a transformers config with a broken sub-config)."""

    num_hidden_layers = 2

    def get_text_config(self, decoder=False):
        raise RuntimeError("sub-config 'text_config' failed to load")


class _ConfigWhosePropertyRaises:
    num_hidden_layers = 2
    num_local_experts = 8

    @property
    def num_experts_per_tok(self):
        raise KeyError("top_k")


@pytest.mark.parametrize(
    ("config", "raised"),
    [(_ConfigWhoseCodeRaises(), RuntimeError), (_ConfigWhosePropertyRaises(), KeyError)],
)
def test_a_config_whose_own_code_raises_is_a_value_error_naming_it(config, raised):
    """The config's own exception is wrapped as a ValueError (UnreadableConfigError) that names it,
    as validate_serving_config reports it, with the original as its cause."""
    from moe_ops.shapes import UnreadableConfigError

    with pytest.raises(UnreadableConfigError, match=f"the config cannot be read: {raised.__name__}") as info:
        resolve_routing_shape(config)
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, raised)
