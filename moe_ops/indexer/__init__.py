"""Sparse-attention indexer records: the top-k key positions an indexer (DeepSeek Sparse
Attention) chose, captured beside the routing (:mod:`moe_ops.indexer.op`). See docs/indexer.md."""

from .op import capture_indexer, capture_indexer_into

__all__ = ["capture_indexer", "capture_indexer_into"]
