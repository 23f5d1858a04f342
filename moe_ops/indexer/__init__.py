"""Sparse-attention indexer records: the top-k key positions an indexer (DeepSeek Sparse
Attention) chose, captured beside the routing (:mod:`moe_ops.indexer.op`). See docs/indexer.md."""

from .op import capture_indexer, capture_indexer_into
from .replay import IndexerMismatch, indexer_mask, indexer_mismatch, replay_indexer
from .select import select_indexer_topk
from .shapes import IndexerShape, indexer_shape
from .wire import INDEXER_FORMATS, decode_positions, encode_positions

__all__ = [
    "INDEXER_FORMATS",
    "IndexerMismatch",
    "IndexerShape",
    "capture_indexer",
    "capture_indexer_into",
    "decode_positions",
    "encode_positions",
    "indexer_mask",
    "indexer_mismatch",
    "indexer_shape",
    "replay_indexer",
    "select_indexer_topk",
]
