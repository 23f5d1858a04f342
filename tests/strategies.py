"""Shared hypothesis strategies: batches in every layout, with padding, and their expected rows.

The expected rows are computed here from first principles (which block of the concatenated batch
belongs to the rank), independently of the library's offset code, so the tests check the library
against the layout definitions rather than against itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from moe_ops import BatchLayout

POISON = -7  # buffer cells that must not be written
PAD_ID = -99  # ids in padding rows of topk_ids: must never reach the buffer


@dataclass
class CaptureCase:
    layout: BatchLayout
    # counts[i] is the number of REAL tokens of DP rank i
    counts: list[int]
    dp_rank: int
    # GATHERED: rows each rank occupies (None: counts, no padding); SHARDED: dp * spr shard sizes
    shard_sizes: list[int] | None
    # (n, top_k) ids in the layout's row order; padding rows hold PAD_ID
    rows: np.ndarray
    # first row of this rank's block; rows [start, start + c) are expected in the buffer
    start: int
    max_tokens: int
    num_layers: int
    layer_id: int
    buffer_dtype: torch.dtype
    ids_dtype: torch.dtype

    @property
    def c(self) -> int:
        return self.counts[self.dp_rank]

    @property
    def top_k(self) -> int:
        return self.rows.shape[1]

    def tensors(self, device):
        """(buffer poisoned, topk_ids, token_counts, shard_sizes or None) on ``device``."""
        buffer = torch.full(
            (self.max_tokens, self.num_layers, self.top_k), POISON, dtype=self.buffer_dtype, device=device
        )
        topk_ids = torch.from_numpy(self.rows).to(device=device, dtype=self.ids_dtype)
        counts = torch.tensor(self.counts, dtype=torch.int32, device=device)
        sizes = None
        if self.shard_sizes is not None:
            sizes = torch.tensor(self.shard_sizes, dtype=torch.int32, device=device)
        return buffer, topk_ids, counts, sizes

    def expected(self, buffer_before: torch.Tensor) -> torch.Tensor:
        out = buffer_before.clone()
        block = torch.from_numpy(self.rows[self.start : self.start + self.c]).to(out.dtype)
        out[: self.c, self.layer_id] = block.to(out.device)
        return out


def _ids(draw, n_rows: int, top_k: int, n_experts: int) -> np.ndarray:
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).integers(0, n_experts, size=(n_rows, top_k), dtype=np.int64)


def _block(draw, real: int, padded: int, top_k: int, n_experts: int) -> np.ndarray:
    rows = np.full((padded, top_k), PAD_ID, dtype=np.int64)
    rows[:real] = _ids(draw, real, top_k, n_experts)
    return rows


def _split(draw, total: int, parts: int) -> list[int]:
    """Splits ``total`` padded rows into ``parts`` contiguous shards: SP ceil-div or arbitrary."""
    if draw(st.booleans()):
        per = -(-total // parts)  # sequence-parallel: ceil(total / parts), the tail shard padded
        return [per] * parts
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


@st.composite
def capture_cases(
    draw,
    layouts=tuple(BatchLayout),
    max_count: int = 24,
    top_ks=tuple(range(1, 17)),
    buffer_dtypes=(torch.int32, torch.int16, torch.int64),
    ids_dtypes=(torch.int32, torch.int64, torch.int16),
):
    """A batch in one of ``layouts`` (SEQUENCE_PARALLEL here means tp_size 1, i.e. no group).

    On a GPU each distinct (dtype, top_k) pair is a Triton compile, so GPU tests narrow
    ``top_ks`` and the dtypes; the CPU tests (reference and interpreted Triton) take them all.
    """
    layout = draw(st.sampled_from(layouts))
    single_dp = layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL) and draw(st.booleans())
    dp_size = 1 if single_dp else draw(st.integers(1, 8))
    dp_rank = draw(st.integers(0, dp_size - 1))
    counts = draw(st.lists(st.integers(0, max_count), min_size=dp_size, max_size=dp_size))
    top_k = draw(st.sampled_from(top_ks))
    n_experts = draw(st.sampled_from([8, 64, 256, 512]))
    # CUDA-graph style padding of each rank's batch up to a captured size
    pads = draw(st.lists(st.integers(0, 9), min_size=dp_size, max_size=dp_size))
    padded = [c + p for c, p in zip(counts, pads)]
    shard_sizes = None

    if layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL):
        rows = _block(draw, counts[dp_rank], padded[dp_rank], top_k, n_experts)
        start = 0
        min_rows = rows.shape[0]  # LOCAL: the buffer holds the whole padded local batch
    elif layout == BatchLayout.GATHERED:
        if draw(st.booleans()):
            shard_sizes = padded  # padded all-gather: sizes passed explicitly
        else:
            padded = list(counts)  # unpadded gather: sizes default to token_counts
        blocks = [_block(draw, c, p, top_k, n_experts) for c, p in zip(counts, padded)]
        rows = np.concatenate(blocks, axis=0)
        start = sum(padded[:dp_rank])
        min_rows = counts[dp_rank]
    else:  # SHARDED
        spr = draw(st.integers(1, 4))
        shard_sizes = []
        blocks = []
        for c, p in zip(counts, padded):
            parts = _split(draw, p, spr)
            shard_sizes += parts
            blocks.append(_block(draw, c, sum(parts), top_k, n_experts))
        rows = np.concatenate(blocks, axis=0)
        start = sum(shard_sizes[: dp_rank * spr])
        min_rows = counts[dp_rank]

    num_layers = draw(st.integers(1, 6))
    return CaptureCase(
        layout=layout,
        counts=counts,
        dp_rank=dp_rank,
        shard_sizes=shard_sizes,
        rows=rows,
        start=start,
        max_tokens=min_rows + draw(st.integers(0, 5)),
        num_layers=num_layers,
        layer_id=draw(st.integers(0, num_layers - 1)),
        buffer_dtype=draw(st.sampled_from(buffer_dtypes)),
        ids_dtype=draw(st.sampled_from(ids_dtypes)),
    )


@st.composite
def layout_queries(draw):
    """(token_counts, local_sizes, dp_rank, tp_size) for infer_layout."""
    dp_size = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(0, 64), min_size=dp_size, max_size=dp_size))
    pads = draw(st.lists(st.integers(0, 16), min_size=dp_size, max_size=dp_size))
    local_sizes = [c + p for c, p in zip(counts, pads)] if draw(st.booleans()) else None
    return counts, local_sizes, draw(st.integers(0, dp_size - 1)), draw(st.sampled_from([1, 1, 2, 4]))


# What the GPU property tests draw from: a few compiles, not hundreds (each costs ~0.4 s).
GPU_CASES = dict(
    top_ks=(1, 2, 6, 8), buffer_dtypes=(torch.int32, torch.int16), ids_dtypes=(torch.int32, torch.int64)
)


# ---------------------------------------------------------------------------------------------------
# Issue 5: routing shapes and routing arrays (capturer, transfer, store, wire)
# ---------------------------------------------------------------------------------------------------


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
