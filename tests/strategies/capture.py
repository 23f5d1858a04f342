"""Capture (moe_ops.capture_routing, infer_layout): batches in every layout, with padding, and their
expected rows; the shapes infer_layout is told together with the batch they really are; ids near
the buffer dtype's limits.

The expected rows are computed here from first principles (which block of the concatenated batch
belongs to the rank), independently of the library's offset code, so the tests check the library
against the layout definitions rather than against itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from hypothesis import strategies as st

from moe_ops import BatchLayout

from .layouts import BUFFER_VIEWS, COUNT_VIEWS, ID_VIEWS, PAD_ID, POISON, buffer_view, count_view, ids_view

__all__ = [
    "CAPTURE_WEIGHT_DTYPES",
    "EPLB_LOGICAL",
    "EPLB_PHYSICAL",
    "GPU_CASES",
    "MAP_VIEWS",
    "W_POISON",
    "CaptureCase",
    "CaptureWeightsCase",
    "EplbCase",
    "LayoutBatch",
    "capture_cases",
    "capture_weights_cases",
    "eplb_cases",
    "layout_batches",
    "layout_queries",
    "layout_token_id",
    "limit_id_cases",
    "map_view",
    "refused_ids",
    "same_floats",
]


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
    # memory layout of topk_ids: one of ID_VIEWS (same values, other strides)
    ids_view: str = "contiguous"
    # memory layout of token_counts / shard_sizes: one of COUNT_VIEWS
    counts_view: str = "contiguous"
    # memory layout of the buffer: one of BUFFER_VIEWS
    buffer_view: str = "contiguous"

    @property
    def c(self) -> int:
        return self.counts[self.dp_rank]

    @property
    def top_k(self) -> int:
        return self.rows.shape[1]

    def tensors(self, device):
        """(buffer poisoned, topk_ids, token_counts, shard_sizes or None) on ``device``, each in the
        case's memory layout (a strided, sliced or expanded view carries the same values)."""
        shape = (self.max_tokens, self.num_layers, self.top_k)
        buffer = buffer_view(
            torch.full(shape, POISON, dtype=self.buffer_dtype, device=device), self.buffer_view
        )
        topk_ids = ids_view(
            torch.from_numpy(self.rows).to(device=device, dtype=self.ids_dtype), self.ids_view
        )
        counts = count_view(torch.tensor(self.counts, dtype=torch.int32, device=device), self.counts_view)
        sizes = None
        if self.shard_sizes is not None:
            view = "strided" if self.counts_view == "expanded" else self.counts_view
            sizes = count_view(torch.tensor(self.shard_sizes, dtype=torch.int32, device=device), view)
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
    views: bool = True,
):
    """A batch in one of ``layouts`` (SEQUENCE_PARALLEL here means tp_size 1, i.e. no group), its
    tensors in one of the memory layouts of ID_VIEWS / COUNT_VIEWS / BUFFER_VIEWS (``views``).

    On a GPU each distinct (dtype, top_k) pair is a Triton compile, so GPU tests narrow
    ``top_ks`` and the dtypes; the CPU tests (reference and interpreted Triton) take them all.
    """
    layout = draw(st.sampled_from(layouts))
    single_dp = layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL) and draw(st.booleans())
    dp_size = 1 if single_dp else draw(st.integers(1, 8))
    dp_rank = draw(st.integers(0, dp_size - 1))
    counts = draw(st.lists(st.integers(0, max_count), min_size=dp_size, max_size=dp_size))
    counts_kind = draw(st.sampled_from(COUNT_VIEWS)) if views else "contiguous"
    if counts_kind == "expanded":
        counts = [counts[0]] * dp_size
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
        ids_view=draw(st.sampled_from(ID_VIEWS)) if views else "contiguous",
        counts_view=counts_kind,
        buffer_view=draw(st.sampled_from(BUFFER_VIEWS)) if views else "contiguous",
    )


@st.composite
def layout_queries(draw):
    """(token_counts, local_sizes, dp_rank, tp_size) for infer_layout."""
    dp_size = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(0, 64), min_size=dp_size, max_size=dp_size))
    pads = draw(st.lists(st.integers(0, 16), min_size=dp_size, max_size=dp_size))
    local_sizes = [c + p for c, p in zip(counts, pads)] if draw(st.booleans()) else None
    return counts, local_sizes, draw(st.integers(0, dp_size - 1)), draw(st.sampled_from([1, 1, 2, 4]))


# ---------------------------------------------------------------------------------------------------
# routing weights beside the ids: a CaptureCase with a weights buffer and the weights of its rows
# ---------------------------------------------------------------------------------------------------

CAPTURE_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
W_POISON = -7.0  # weights-buffer cells that must not be written (exact in every weight dtype)


def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype and shape, NaN where the other has NaN, and the same bits everywhere else (a
    NaN's payload is not compared: torch's own casts give different NaN bits on CPU and CUDA)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits)[~nan], b.contiguous().view(bits)[~nan])


@dataclass
class CaptureWeightsCase:
    """A capture case (``case``) whose target has a weights buffer: the rows' weights in
    ``source_dtype`` and memory layout ``source_view`` (ID_VIEWS), a ``buffer_dtype`` weights
    buffer in ``buffer_view`` (BUFFER_VIEWS) poisoned with W_POISON."""

    case: CaptureCase
    source_dtype: torch.dtype
    buffer_dtype: torch.dtype
    source_view: str
    buffer_view: str
    seed: int
    # a NaN among this rank's weights (stored as NaN), and a weight beyond float16's range
    special: bool

    def source_rows(self) -> torch.Tensor:
        """(n, top_k) ``source_dtype`` weights of the case's rows (contiguous, on the CPU)."""
        n, k = self.case.rows.shape
        rng = np.random.default_rng(self.seed)
        rows = (rng.standard_normal((n, k)) * rng.choice([0.01, 1.0, 300.0])).astype(np.float32)
        if self.special and self.case.c:
            rows[self.case.start, 0] = np.nan
            rows[self.case.start + self.case.c - 1, -1] = 1e5  # float16: inf
        return torch.from_numpy(rows).to(self.source_dtype)

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights buffer poisoned, topk_weights) on ``device``, in the case's memory layouts."""
        c = self.case
        shape = (c.max_tokens, c.num_layers, c.top_k)
        wbuf = buffer_view(
            torch.full(shape, W_POISON, dtype=self.buffer_dtype, device=device), self.buffer_view
        )
        return wbuf, ids_view(self.source_rows().to(device), self.source_view)

    def expected(self, before: torch.Tensor) -> torch.Tensor:
        """``before`` with this rank's rows of the source weights in the layer, cast by torch."""
        c = self.case
        out = before.clone()
        block = self.source_rows()[c.start : c.start + c.c].to(out.dtype)
        out[: c.c, c.layer_id] = block.to(out.device)
        return out


@st.composite
def capture_weights_cases(
    draw,
    source_dtypes=CAPTURE_WEIGHT_DTYPES,
    buffer_dtypes=CAPTURE_WEIGHT_DTYPES,
    views: bool = True,
    **capture_kw,
):
    """A :class:`CaptureWeightsCase` over ``capture_cases(**capture_kw)``."""
    case = draw(capture_cases(views=views, **capture_kw))
    return CaptureWeightsCase(
        case=case,
        source_dtype=draw(st.sampled_from(source_dtypes)),
        buffer_dtype=draw(st.sampled_from(buffer_dtypes)),
        source_view=draw(st.sampled_from(ID_VIEWS)) if views else "contiguous",
        buffer_view=draw(st.sampled_from(BUFFER_VIEWS)) if views else "contiguous",
        seed=draw(st.integers(0, 2**32 - 1)),
        special=draw(st.booleans()),
    )


# What the GPU property tests draw from: a few compiles, not hundreds (each costs ~0.4 s).
GPU_CASES = dict(
    top_ks=(1, 2, 6, 8), buffer_dtypes=(torch.int32, torch.int16), ids_dtypes=(torch.int32, torch.int64)
)


# ---------------------------------------------------------------------------------------------------
# infer_layout over vLLM-style shard sizes: a step's shapes together with the batch it really is
# ---------------------------------------------------------------------------------------------------


def layout_token_id(dp_rank: int, j: int) -> int:
    """Id of real token ``j`` of DP rank ``dp_rank`` in a LayoutBatch: unique while j < 1000."""
    return 1000 * dp_rank + j


@dataclass
class LayoutBatch:
    """What infer_layout is told (counts, shard sizes, rank, tp) and the arrangement the rows are
    really in. The rows are built here from the layout definitions (blocks, shards, TP slices),
    independently of moe_ops.layout.

    A hypothesis is ``(layout, form)``: form "counts" lays the batch out over the real counts,
    "padded" over each rank's padded size (the sum of its shards), "shards" over ``local_sizes``
    exactly (SHARDED with more than one shard per rank).
    """

    # counts[i] is the number of REAL tokens of DP rank i
    counts: list[int]
    # dp_size * spr shard sizes in DP-then-TP order, padding included; None: no padding (spr 1)
    local_sizes: list[int] | None
    # this rank's index into counts
    dp_rank: int
    # tensor-parallel size; divides spr when spr > 1
    tp_size: int
    # the hypothesis the rows are really in; one of self.hypotheses()
    truth: tuple[BatchLayout, str]

    @property
    def dp_size(self) -> int:
        return len(self.counts)

    @property
    def spr(self) -> int:
        return 1 if self.local_sizes is None else len(self.local_sizes) // self.dp_size

    @property
    def shards(self) -> list[int]:
        return list(self.counts) if self.local_sizes is None else list(self.local_sizes)

    @property
    def padded(self) -> list[int]:
        """Each rank's padded size: the sum of its shards."""
        s = self.spr
        return [sum(self.shards[i * s : (i + 1) * s]) for i in range(self.dp_size)]

    @property
    def c(self) -> int:
        return self.counts[self.dp_rank]

    def real_ids(self) -> np.ndarray:
        """(c, 1) ids of this rank's real tokens: what the buffer must receive."""
        ids = [layout_token_id(self.dp_rank, j) for j in range(self.c)]
        return np.array(ids, dtype=np.int64).reshape(self.c, 1)

    def hypotheses(self) -> list[tuple[BatchLayout, str]]:
        """Every arrangement these shapes allow (the candidates of the layout definitions)."""
        out = [(BatchLayout.LOCAL, "counts"), (BatchLayout.LOCAL, "padded")]
        if self.dp_size > 1:
            out += [(BatchLayout.GATHERED, "counts"), (BatchLayout.GATHERED, "padded")]
            if self.spr > 1:
                out.append((BatchLayout.SHARDED, "shards"))
        if self.tp_size > 1:
            out += [(BatchLayout.SEQUENCE_PARALLEL, "counts"), (BatchLayout.SEQUENCE_PARALLEL, "padded")]
            if self.dp_size > 1:
                out.append((BatchLayout.SHARDED, "counts"))
                if self.spr == 1:
                    out.append((BatchLayout.SHARDED, "padded"))
        return out

    def _batch(self, rank: int, rows: int) -> np.ndarray:
        """DP rank ``rank``'s batch padded to ``rows``: its real tokens first, then PAD_ID."""
        out = np.full((rows, 1), PAD_ID, dtype=np.int64)
        out[: self.counts[rank], 0] = [layout_token_id(rank, j) for j in range(self.counts[rank])]
        return out

    def views(self, hypothesis: tuple[BatchLayout, str]) -> list[np.ndarray]:
        """The (n, 1) rows each TP rank of this DP rank feeds the MoE layer, TP-rank order."""
        layout, form = hypothesis
        tp, r = self.tp_size, self.dp_rank
        xs = self.counts if form == "counts" else self.padded
        if layout == BatchLayout.LOCAL:
            return [self._batch(r, xs[r])] * tp
        if layout == BatchLayout.GATHERED:
            return [np.concatenate([self._batch(i, x) for i, x in enumerate(xs)])] * tp
        if layout == BatchLayout.SEQUENCE_PARALLEL:
            per = -(-xs[r] // tp)  # ceil(X / tp) rows on every TP rank, the tail one padded
            batch = self._batch(r, tp * per)
            return [batch[j * per : (j + 1) * per] for j in range(tp)]
        # SHARDED: every shard of every rank, gathered in DP-then-TP order; a rank's shards are
        # consecutive chunks of its padded batch
        if form == "shards":
            s = self.spr
            per_rank = [self.shards[i * s : (i + 1) * s] for i in range(self.dp_size)]
        else:
            per_rank = [[-(-x // tp)] * tp for x in xs]
        pieces = []
        for i, parts in enumerate(per_rank):
            batch = self._batch(i, sum(parts))
            bounds = np.cumsum([0, *parts])
            pieces += [batch[bounds[k] : bounds[k + 1]] for k in range(len(parts))]
        return [np.concatenate(pieces)] * tp

    def selection(self, hypothesis: tuple[BatchLayout, str]) -> tuple[int, bool]:
        """(row of this rank's first real token, whether the TP shards are gathered first)."""
        if hypothesis[0] == BatchLayout.SEQUENCE_PARALLEL:
            return 0, True
        if self.c == 0:
            return 0, False
        rows = self.views(hypothesis)[0][:, 0]
        return int(np.flatnonzero(rows == layout_token_id(self.dp_rank, 0))[0]), False


@st.composite
def layout_batches(draw, max_dp: int = 5, max_count: int = 10, max_pad: int = 4):
    """A LayoutBatch: counts, CUDA-graph style padding (none, per rank, or every rank to one size),
    ``spr`` shards per rank split SP ceil-div or arbitrarily, and one of its hypotheses as truth."""
    dp_size = draw(st.integers(1, max_dp))
    tp = draw(st.sampled_from([1, 2, 4]))
    spr = draw(st.sampled_from([1, 2, 3] if tp == 1 else [1, tp, 2 * tp]))
    counts = draw(st.lists(st.integers(0, max_count), min_size=dp_size, max_size=dp_size))
    padding = draw(st.sampled_from(["none", "per-rank", "uniform"]))
    if padding == "none":
        totals = list(counts)
    elif padding == "per-rank":
        pads = draw(st.lists(st.integers(0, max_pad), min_size=dp_size, max_size=dp_size))
        totals = [c + p for c, p in zip(counts, pads)]
    else:  # DP padding under CUDA graphs: every rank runs the largest size
        totals = [max(counts) + draw(st.integers(0, max_pad))] * dp_size
    if spr == 1 and totals == counts and draw(st.booleans()):
        local_sizes = None
    else:
        local_sizes = [size for t in totals for size in _split(draw, t, spr)]
    dp_rank = draw(st.integers(0, dp_size - 1))
    probe = LayoutBatch(counts, local_sizes, dp_rank, tp, truth=(BatchLayout.LOCAL, "counts"))
    return replace(probe, truth=draw(st.sampled_from(probe.hypotheses())))


# ---------------------------------------------------------------------------------------------------
# Ids near the dtype limits: values a buffer dtype holds or not, in ids of a wider or narrower dtype.
# ---------------------------------------------------------------------------------------------------


_DTYPE_MAX = {torch.int16: 2**15 - 1, torch.int32: 2**31 - 1, torch.int64: 2**63 - 1}


def refused_ids(case: CaptureCase, buffer_before: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The buffer a capture of ``case`` leaves when ids that do not fit the buffer dtype (or are
    negative) are stored as -1, and how many ids were refused (computed here, from the dtypes)."""
    out = buffer_before.clone()
    block = torch.from_numpy(case.rows[case.start : case.start + case.c]).to(torch.int64)
    bad = (block < 0) | (block > _DTYPE_MAX[case.buffer_dtype])
    out[: case.c, case.layer_id] = torch.where(bad, -1, block).to(out.dtype).to(out.device)
    return out, int(bad.sum())


@st.composite
def limit_id_cases(draw, buffer_dtypes=(torch.int16, torch.int32, torch.int64), views: bool = True):
    """A capture case whose real rows hold ids at and beyond the buffer dtype's limits (and negative
    ones), in ids of a dtype at least as wide as the buffer's."""
    case = draw(capture_cases(buffer_dtypes=buffer_dtypes, ids_dtypes=(torch.int64,), views=views))
    limit = _DTYPE_MAX[case.buffer_dtype]
    ids_dtype = draw(
        st.sampled_from([d for d in (torch.int16, torch.int32, torch.int64) if _DTYPE_MAX[d] >= limit])
    )
    id_max = _DTYPE_MAX[ids_dtype]
    near = [0, 1, limit - 1, limit, -1, -(2**15)]
    if id_max > limit:
        near += [limit + 1, min(id_max, 2 * limit + 1), id_max]
    rows = case.rows.copy()
    real = np.zeros(rows.shape[0], dtype=bool)
    real[case.start : case.start + case.c] = True
    picks = draw(st.lists(st.sampled_from(near), min_size=rows.size, max_size=rows.size))
    values = np.array(picks, dtype=np.int64).reshape(rows.shape)
    rows[real] = values[real]
    case.rows = rows
    case.ids_dtype = ids_dtype
    return case


# EPLB: 16 logical experts on 20 physical slots (4 redundant replicas), as a balancer places them
EPLB_LOGICAL = 16
EPLB_PHYSICAL = 20
# how a (P,) map is handed in: its own tensor, a row of a (num_moe_layers, P) map (vLLM's
# physical_to_logical_map), a column of a wider one (stride 3), a slice, one value expanded (stride 0)
MAP_VIEWS = ("contiguous", "layer_row", "strided", "sliced", "expanded")


def map_view(values: torch.Tensor, kind: str) -> torch.Tensor:
    """``values`` (P,) as a view of kind ``kind`` with the same values (``expanded``: ``values``
    must be constant)."""
    p = values.shape[0]
    if kind == "contiguous":
        return values.clone()
    if kind == "layer_row":
        layers = torch.full((3, p), -5, dtype=values.dtype, device=values.device)  # other layers: poison
        layers[1] = values
        return layers[1]
    if kind == "strided":
        wide = torch.full((p, 3), -5, dtype=values.dtype, device=values.device)
        wide[:, 1] = values
        return wide[:, 1]
    if kind == "sliced":
        longer = torch.full((p + 4,), -5, dtype=values.dtype, device=values.device)
        longer[2 : 2 + p] = values
        return longer[2 : 2 + p]
    assert kind == "expanded" and bool((values == values[0]).all())
    return values[:1].expand(p)


@dataclass
class EplbCase:
    """A capture case whose ids are PHYSICAL slots in [-2, 22) (some outside the 20 slots), and
    the map that sends them to the 16 logical experts (some entries possibly outside)."""

    case: CaptureCase
    # (EPLB_PHYSICAL,) physical slot -> logical expert; entries outside [0, 16) are faults
    map_values: np.ndarray
    map_dtype: torch.dtype
    map_view: str
    # the weights beside the ids (a weights buffer), or None: ids only
    weights: CaptureWeightsCase | None = None

    def expert_map(self, device) -> torch.Tensor:
        values = torch.from_numpy(self.map_values).to(device=device, dtype=self.map_dtype)
        return map_view(values, self.map_view)

    def expected(self, buffer_before: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """(the buffer after the capture, ids outside the physical slots, ids whose entry is outside
        the logical range): numpy indexing, independent of the library."""
        c = self.case
        block = c.rows[c.start : c.start + c.c]
        outside = (block < 0) | (block >= EPLB_PHYSICAL)
        logical = self.map_values[np.clip(block, 0, EPLB_PHYSICAL - 1)]
        bad_map = ~outside & ((logical < 0) | (logical >= EPLB_LOGICAL))
        stored = np.where(outside | bad_map, -1, logical)
        out = buffer_before.clone()
        out[: c.c, c.layer_id] = torch.from_numpy(stored).to(out.dtype).to(out.device)
        return out, int(outside.sum()), int(bad_map.sum())


def eplb_map(draw, broken: bool) -> np.ndarray:
    """A placement of 16 logical experts on 20 slots (each logical expert at least once, 4 replicas
    of drawn experts, slots shuffled); ``broken``: a few entries outside [0, 16)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    values = np.concatenate(
        [np.arange(EPLB_LOGICAL), rng.integers(0, EPLB_LOGICAL, EPLB_PHYSICAL - EPLB_LOGICAL)]
    )
    values = rng.permutation(values).astype(np.int64)
    if broken:
        slots = rng.choice(EPLB_PHYSICAL, size=draw(st.integers(1, 3)), replace=False)
        values[slots] = rng.choice([-1, EPLB_LOGICAL, EPLB_LOGICAL + 3], size=slots.shape[0])
    return values


@st.composite
def eplb_cases(draw, views: bool = True, weighted: bool = False, **capture_kwargs):
    """A :func:`capture_cases` batch (every layout and memory layout) with physical ids drawn in
    [-2, 22) in its real rows (padding keeps PAD_ID), and an EPLB map in one of MAP_VIEWS, int32 or
    int64; ``weighted``: with routing weights beside the ids (any weights dtypes and views)."""
    case = draw(capture_cases(views=views, **capture_kwargs))
    seed = draw(st.integers(0, 2**32 - 1))
    physical = np.random.default_rng(seed).integers(-2, EPLB_PHYSICAL + 2, size=case.rows.shape)
    rows = np.where(case.rows == PAD_ID, PAD_ID, physical)
    kind = draw(st.sampled_from(MAP_VIEWS)) if views else "contiguous"
    if kind == "expanded":
        values = np.full(EPLB_PHYSICAL, draw(st.sampled_from([0, 7, 15, EPLB_LOGICAL])), dtype=np.int64)
    else:
        values = eplb_map(draw, draw(st.booleans()))
    case = replace(case, rows=rows)
    weights = None
    if weighted:
        weights = CaptureWeightsCase(
            case=case,
            source_dtype=draw(st.sampled_from(CAPTURE_WEIGHT_DTYPES)),
            buffer_dtype=draw(st.sampled_from(CAPTURE_WEIGHT_DTYPES)),
            source_view=draw(st.sampled_from(ID_VIEWS)) if views else "contiguous",
            buffer_view=draw(st.sampled_from(BUFFER_VIEWS)) if views else "contiguous",
            seed=draw(st.integers(0, 2**32 - 1)),
            special=draw(st.booleans()),
        )
    return EplbCase(
        case=case,
        map_values=values,
        map_dtype=draw(st.sampled_from((torch.int32, torch.int64))),
        map_view=kind,
        weights=weights,
    )
