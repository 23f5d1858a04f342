"""Which layers of a model run a sparse-attention indexer, and the shape of its record, read from
the model's config the way :mod:`moe_ops.shapes` reads the router's fields.

Transformers spells the indexer four ways (the configs of transformers 5.x):

========================  ======================================  ===============  ==================
model_type                layers with an indexer that runs        k                a position is
========================  ======================================  ===============  ==================
deepseek_v32              ``layer_types`` "indexed_attention"     ``index_topk``   a token
                          (every layer)
glm_moe_dsa, glm5_next    "indexed_attention" layers whose         ``index_topk``   a token
                          ``indexer_types`` entry is "full"; a
                          "shared" layer reuses the last full
                          layer's top-k (recorded once)
deepseek_v4               "compressed_sparse_attention" layers     ``index_topk``   a compressed entry
                                                                                   (``compress_rates``
                                                                                   tokens; 4 in V4)
minimax_m3_vl (text)      "minimax_m3_sparse" layers               ``index_topk_``  a block of
                                                                   ``blocks``       ``index_block_size``
                                                                                   tokens
========================  ======================================  ===============  ==================

A config without any of these has no indexer (:func:`indexer_shape` returns None). A config that
names an indexer but whose fields disagree (a ``layer_types`` of the wrong length, a k below 1) is a
ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..shapes import _get, _text_config

__all__ = ["IndexerShape", "indexer_shape"]


@dataclass(frozen=True)
class IndexerShape:
    """The indexer record of one model: ``(n, num_indexer_layers, k)`` positions a token."""

    # model layer index of each recorded indexer layer, ascending (the record's layer axis)
    layers: tuple[int, ...]
    # positions chosen per query token and indexer layer (the top-k)
    k: int
    # model layers in all (num_hidden_layers)
    num_model_layers: int
    # what one position counts: "token", or "compressed entry" / "block" of `tokens_per_position`
    unit: str
    # tokens one position stands for (1 for "token")
    tokens_per_position: int
    # indexer heads and head dim (the scoring cost), 0 where the config does not say
    n_heads: int
    head_dim: int
    # layer -> the recorded layer whose top-k it reuses (GLM-5's "shared" indexer layers)
    shared: Mapping[int, int]

    @property
    def num_indexer_layers(self) -> int:
        return len(self.layers)

    def record_shape(self, n: int) -> tuple[int, int, int]:
        """The shape of ``n`` tokens' record: (n, num_indexer_layers, k)."""
        return (n, len(self.layers), self.k)


def _positive(config: Any, name: str) -> int:
    value = _get(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.{name} must be an int >= 1 for an indexer, got {value!r}")
    return value


def _layer_types(config: Any, n_layers: int) -> list[str]:
    types = _get(config, "layer_types")
    if types is None:
        return []
    types = list(types)
    if len(types) != n_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries, num_hidden_layers is {n_layers}")
    return types


def indexer_shape(config: Any) -> IndexerShape | None:
    """The :class:`IndexerShape` of a transformers config (or a dict of its fields; a multimodal
    config's text config is followed), None for a model without an indexer. ValueError naming the
    field for a config whose indexer fields disagree."""
    config = _text_config(config)
    n_layers = _get(config, "num_hidden_layers")
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        return None
    model_type = _get(config, "model_type") or ""
    types = _layer_types(config, n_layers)
    heads = _get(config, "index_n_heads") or 0
    head_dim = _get(config, "index_head_dim") or 0
    if _get(config, "index_topk_blocks") is not None and "minimax_m3_sparse" in types:
        layers = tuple(i for i, t in enumerate(types) if t == "minimax_m3_sparse")
        block = _positive(config, "index_block_size")
        return IndexerShape(
            layers, _positive(config, "index_topk_blocks"), n_layers, "block", block, heads, head_dim, {}
        )
    if _get(config, "index_topk") is None:
        return None
    k = _positive(config, "index_topk")
    if "compressed_sparse_attention" in types or model_type == "deepseek_v4":
        rates = _get(config, "compress_rates") or {"compressed_sparse_attention": 4}
        layers = tuple(i for i, t in enumerate(types) if t == "compressed_sparse_attention")
        rate = rates.get("compressed_sparse_attention", 4) if isinstance(rates, Mapping) else 4
        return IndexerShape(layers, k, n_layers, "compressed entry", int(rate), heads, head_dim, {})
    indexed = [i for i, t in enumerate(types) if t == "indexed_attention"] if types else list(range(n_layers))
    modes = _get(config, "indexer_types")
    shared: dict[int, int] = {}
    if modes is not None:
        modes = list(modes)
        if len(modes) != n_layers:
            raise ValueError(
                f"config.indexer_types has {len(modes)} entries, num_hidden_layers is {n_layers}"
            )
        bad = sorted({m for m in modes if m not in ("full", "shared")})
        if bad:
            raise ValueError(f"config.indexer_types entries must be 'full' or 'shared', got {bad}")
        runs, last = [], None
        for i in indexed:
            if modes[i] == "full":
                runs.append(i)
                last = i
            elif last is None:
                raise ValueError(
                    f"config.indexer_types: layer {i} is 'shared' but no 'full' indexer layer precedes it"
                )
            else:
                shared[i] = last
        indexed = runs
    return IndexerShape(tuple(indexed), k, n_layers, "token", 1, heads, head_dim, shared)
