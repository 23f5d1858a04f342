"""Replay in training: RoutingReplayer.set_batch and replay_batch (moe_ops.replay.replayer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import strategies as st

from .shapes import routing_shapes

__all__ = [
    "ReplayBatchSequence",
    "ReplayRequests",
    "distinct_rows",
    "replay_batch_sequences",
    "replay_requests",
]


def distinct_rows(rng: np.random.Generator, n: int, shape, live_fraction: float = 0.0) -> np.ndarray:
    """(n, num_layers, top_k) int64 ids, each (token, layer) row distinct experts; about
    ``live_fraction`` of the (token, layer) rows are all -1 (no record)."""
    out = np.empty((n, shape.num_layers, shape.top_k), dtype=np.int64)
    for t in range(n):
        for layer in range(shape.num_layers):
            out[t, layer] = rng.choice(shape.num_experts, size=shape.top_k, replace=False)
    out[rng.random((n, shape.num_layers)) < live_fraction] = -1
    return out


def _small_shapes():
    return routing_shapes(max_layers=4, max_top_k=4, experts=(4, 8, 100, 256, 300))


@dataclass
class ReplayBatchSequence:
    """Batches a trainer sets one after another on one replayer (sizes going up and down)."""

    shape: object
    # rows of the replayer's buffer
    max_num_tokens: int
    # each (n <= max_num_tokens, num_layers, top_k) int64, -1 rows for padding / live tokens
    batches: list[np.ndarray]
    # per batch: "numpy", "tensor" (a CPU tensor) and the integer dtype it is passed in
    kinds: list[tuple[str, np.dtype]]

    def passed(self, i: int):
        """Batch ``i`` as the trainer hands it to set_batch."""
        how, dtype = self.kinds[i]
        array = self.batches[i].astype(dtype)
        return torch.from_numpy(array) if how == "tensor" else array


@st.composite
def replay_batch_sequences(draw, max_batches: int = 5, max_rows: int = 12):
    shape = draw(_small_shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    max_num_tokens = draw(st.integers(1, max_rows))
    sizes = draw(st.lists(st.integers(0, max_num_tokens), min_size=1, max_size=max_batches))
    dtypes = [np.dtype(np.int32), np.dtype(np.int64)]
    if shape.num_experts <= 127:
        dtypes.append(np.dtype(np.int8))
    if shape.num_experts <= 32767:
        dtypes.append(np.dtype(np.int16))
    kinds = [(draw(st.sampled_from(["numpy", "tensor"])), draw(st.sampled_from(dtypes))) for _ in sizes]
    batches = [distinct_rows(rng, n, shape, live_fraction=0.2) for n in sizes]
    return ReplayBatchSequence(shape, max_num_tokens, batches, kinds)


@dataclass
class ReplayRequests:
    """Per-request routing as a client receives it from the rollout, and what it stands for."""

    shape: object
    # per request: (T - 1, num_layers, top_k) int64 ids on the MoE-only axis, -1 where never recorded
    truth: list[np.ndarray]
    # layout of the received arrays: "moe" or "model" (vLLM: a column per decoder layer)
    layer_axis: str
    # each request padded to pad_to rows (None: packed)
    pad_to: int | None
    # dtype of the received arrays: the narrow unsigned dtype (no record = its maximum) or a signed one
    dtype: np.dtype
    seed: int
    # per request: received with T rows (aligned to its tokens: a placeholder row for the last
    # token, verl's convention) instead of T - 1
    aligned: list[bool] = field(default_factory=list)
    # the no-record marker the client uses besides -1 / the fill: -1 (none) or 0 (all-zero rows)
    no_record: int = -1
    # per request: None or a (rows,) bool mask of rows received with a valid-looking id but no
    # record (a dropped step's rows: the store's fill, which can be a valid id)
    missing: list[np.ndarray | None] = field(default_factory=list)
    # pass num_tokens (each request's T) to replay_batch
    with_counts: bool = False

    def num_tokens(self) -> list[int] | None:
        """Each request's token count T, or None when the case does not pass them."""
        return [t.shape[0] + 1 for t in self.truth] if self.with_counts else None

    def masks(self) -> list[np.ndarray | None] | None:
        """What replay_batch's ``missing`` gets: one flag per received row (an aligned request's
        placeholder row is not masked), or None when no request has a mask."""
        if not any(m is not None for m in self.missing):
            return None
        out = []
        for i, mask in enumerate(self.missing):
            if mask is not None and i < len(self.aligned) and self.aligned[i]:
                mask = np.concatenate([mask, [False]])
            out.append(mask)
        return out

    def arrays(self) -> list[np.ndarray]:
        """The received arrays: missing ids as the dtype's fill (or, with no_record=0, some as
        all-zero rows), masked rows holding valid ids, dense columns holding garbage, a
        placeholder row on aligned requests."""
        rng = np.random.default_rng(self.seed)
        fill = np.iinfo(self.dtype).max if self.dtype.kind == "u" else -1
        out = []
        for i, truth in enumerate(self.truth):
            a = np.where(truth == -1, fill, truth)
            if self.no_record == 0:
                live = (truth == -1).all(-1) & (rng.random(truth.shape[:2]) < 0.5)
                a[live] = 0
            mask = self.missing[i] if i < len(self.missing) else None
            if mask is not None:
                a[mask] = rng.integers(0, self.shape.num_experts, size=a[mask].shape)
            if i < len(self.aligned) and self.aligned[i]:
                placeholder = np.full((1, *a.shape[1:]), 0 if self.no_record == 0 else fill)
                a = np.concatenate([a, placeholder])
            a = a.astype(self.dtype)
            if self.layer_axis == "model":
                wide = rng.integers(
                    0, self.shape.num_experts, size=(a.shape[0], self.shape.num_model_layers, a.shape[2])
                )
                wide = wide.astype(self.dtype)
                wide[:, list(self.shape.moe_layers)] = a
                a = wide
            out.append(a)
        return out

    def expected(self) -> np.ndarray:
        """The training rows, from the definition: per request its T - 1 rows (-1 where there is
        no record, masked rows included), a -1 row for its last token, then -1 padding rows up to
        pad_to."""
        rows = []
        empty = np.full((self.shape.num_layers, self.shape.top_k), -1, dtype=np.int64)
        for i, truth in enumerate(self.truth):
            mask = self.missing[i] if i < len(self.missing) else None
            tokens = truth.shape[0] + 1
            for j in range(self.pad_to if self.pad_to is not None else tokens):
                hidden = j < truth.shape[0] and mask is not None and mask[j]
                rows.append(truth[j] if j < truth.shape[0] and not hidden else empty)
        return np.array(rows, dtype=np.int64).reshape(-1, self.shape.num_layers, self.shape.top_k)


@st.composite
def replay_requests(draw, max_requests: int = 4, max_rows: int = 6):
    shape = draw(_small_shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = draw(st.lists(st.integers(0, max_rows), min_size=0, max_size=max_requests))
    truth = [distinct_rows(rng, n, shape, live_fraction=0.15) for n in lengths]
    pad_to = draw(st.none() | st.integers(max(lengths, default=0) + 1, max_rows + 3))
    narrow = shape.id_dtype
    dtypes = [np.dtype(np.int16), np.dtype(np.int32)]
    if np.iinfo(narrow).max >= shape.num_experts:  # its maximum can mark a missing id
        dtypes.append(narrow)
    dtype = draw(st.sampled_from(dtypes))
    with_counts = draw(st.booleans())
    aligned = [draw(st.booleans()) for _ in lengths] if with_counts else []
    no_record = draw(st.sampled_from([-1, 0])) if shape.top_k >= 2 else -1
    missing = [(rng.random(n) < 0.3) if draw(st.booleans()) else None for n in lengths]
    return ReplayRequests(
        shape,
        truth,
        draw(st.sampled_from(["moe", "model"])),
        pad_to,
        dtype,
        draw(st.integers(0, 2**32 - 1)),
        aligned=aligned,
        no_record=no_record,
        missing=missing,
        with_counts=with_counts,
    )
