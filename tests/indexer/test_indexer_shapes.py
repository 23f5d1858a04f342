"""indexer_shape on the real transformers config classes (and hostile dicts)."""

from __future__ import annotations

import pytest

from moe_ops.indexer import indexer_shape

transformers = pytest.importorskip("transformers", reason="the config classes are transformers'")


def _config(name, **kw):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"this transformers has no {name}")
    return cls(**kw)


def test_deepseek_v32_indexes_every_layer():
    s = indexer_shape(_config("DeepseekV32Config", num_hidden_layers=5, index_topk=64))
    assert (s.layers, s.k, s.unit, s.tokens_per_position, dict(s.shared)) == (
        (0, 1, 2, 3, 4),
        64,
        "token",
        1,
        {},
    )
    assert s.record_shape(7) == (7, 5, 64)


def test_deepseek_v4_indexes_its_compressed_sparse_layers():
    cfg = _config("DeepseekV4Config")
    s = indexer_shape(cfg)
    want = tuple(i for i, t in enumerate(cfg.layer_types) if t == "compressed_sparse_attention")
    assert s.layers == want and len(want) > 0
    assert (s.k, s.unit, s.tokens_per_position) == (cfg.index_topk, "compressed entry", 4)


def test_glm_shared_indexer_layers_are_recorded_once():
    cfg = _config("GlmMoeDsaConfig", num_hidden_layers=6, index_topk_pattern="FSSFSF")
    s = indexer_shape(cfg)
    assert s.layers == (0, 3, 5)
    assert dict(s.shared) == {1: 0, 2: 0, 4: 3}


def test_glm5_next_indexes_its_indexed_attention_layers():
    cfg = _config("Glm5NextTextConfig")
    s = indexer_shape(cfg)
    indexed = [i for i, t in enumerate(cfg.layer_types) if t == "indexed_attention"]
    assert set(s.layers) | set(s.shared) == set(indexed)


def test_minimax_m3_blocks():
    cfg = _config(
        "MiniMaxM3VLTextConfig",
        num_hidden_layers=4,
        sparse_attention_config={"sparse_attention_freq": [0, 1, 0, 1]},
    )
    s = indexer_shape(cfg)
    assert (s.layers, s.k, s.unit, s.tokens_per_position) == (
        (1, 3),
        cfg.index_topk_blocks,
        "block",
        cfg.index_block_size,
    )


def test_models_without_an_indexer():
    assert indexer_shape(_config("Qwen3MoeConfig")) is None
    assert indexer_shape({"num_hidden_layers": 2}) is None


@pytest.mark.parametrize(
    "config, match",
    [
        ({"num_hidden_layers": 2, "index_topk": 0}, "index_topk must be an int >= 1"),
        (
            {"num_hidden_layers": 2, "index_topk": 8, "layer_types": ["indexed_attention"]},
            "layer_types has 1 entries",
        ),
        (
            {"num_hidden_layers": 2, "index_topk": 8, "indexer_types": ["shared", "full"]},
            "no 'full' indexer layer",
        ),
        ({"num_hidden_layers": 2, "index_topk": 8, "indexer_types": ["full", "half"]}, "'full' or 'shared'"),
    ],
)
def test_hostile_configs_name_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        indexer_shape(config)
