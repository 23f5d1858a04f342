"""Indexer records (moe_ops.indexer): top-k key-position rows in every batch layout (a capture case
whose rows are positions), with -1 padding, per-row key counts and injected faults, and the rows the
capture must store, computed here from the contract (walk each row left to right: -1 stays, a
position outside its row's range or a repeat of an earlier one is a fault, and a row with a fault is
stored as all -1), independently of the library's sort."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from hypothesis import strategies as st

from .capture import CaptureCase, capture_cases
from .layouts import PAD_ID, count_view

__all__ = ["INDEXER_GPU_CASES", "IndexerCase", "expected_positions", "indexer_cases", "position_rows"]

# on a GPU each distinct k is a Triton compile: a few k's, both id dtypes
INDEXER_GPU_CASES = dict(top_ks=(8, 64, 512), ids_dtypes=(torch.int32, torch.int64))


def position_rows(rng: np.random.Generator, n: int, k: int, context: np.ndarray) -> np.ndarray:
    """(n, k) int64 rows of distinct positions, row i drawn from ``[0, context[i])`` (at most
    ``min(k, context[i])`` of them, the rest -1, shuffled in)."""
    rows = np.full((n, k), -1, dtype=np.int64)
    for i in range(n):
        m = int(min(k, context[i], rng.integers(0, k + 1)))
        chosen = rng.choice(int(context[i]), size=m, replace=False) if m else np.empty(0, np.int64)
        rows[i, :m] = chosen
        rng.shuffle(rows[i])
    return rows


def expected_positions(rows: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(the stored rows, out-of-range count, repeat count) of ``rows`` under the contract."""
    out = rows.copy()
    bad = dup = 0
    for i in range(rows.shape[0]):
        seen = set()
        faulty = False
        bound = min(int(bounds[i]), 1 << 31)
        for j in range(rows.shape[1]):
            p = int(rows[i, j])
            if p == -1:
                continue
            if p < -1 or p >= bound:
                bad += 1
                faulty = True
            elif p in seen:
                dup += 1
                faulty = True
            else:
                seen.add(p)
        if faulty:  # no record rather than a shorter set
            out[i] = -1
    return out, bad, dup


@dataclass
class IndexerCase:
    """A capture case (``case``, int32 buffer) whose rows are key positions; ``kv_lens`` each
    source row's key count (None: the int32 range bounds them); ``faulty`` when rows of this rank
    hold out-of-range positions and repeats."""

    case: CaptureCase
    kv_lens: list[int] | None
    lens_view: str
    faulty: bool

    def tensors(self, device):
        """(buffer poisoned, positions, token_counts, shard_sizes, kv_lens or None) on ``device``."""
        buffer, positions, counts, sizes = self.case.tensors(device)
        lens = None
        if self.kv_lens is not None:
            lens = count_view(torch.tensor(self.kv_lens, dtype=torch.int32, device=device), self.lens_view)
        return buffer, positions, counts, sizes, lens

    def expected(self, buffer_before: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """(the buffer after the capture, out-of-range count, repeat count)."""
        c = self.case
        block = c.rows[c.start : c.start + c.c]
        bounds = np.full(block.shape[0], 1 << 31, dtype=np.int64)
        if self.kv_lens is not None:
            bounds = np.asarray(self.kv_lens[c.start : c.start + c.c], dtype=np.int64)
        stored, bad, dup = expected_positions(block, bounds)
        out = buffer_before.clone()
        out[: c.c, c.layer_id] = torch.from_numpy(stored).to(device=out.device, dtype=out.dtype)
        return out, bad, dup


@st.composite
def indexer_cases(draw, top_ks=(1, 2, 3, 8, 16, 33, 64), ids_dtypes=(torch.int32, torch.int64), **kw):
    """An :class:`IndexerCase` in any layout and memory layout (see ``capture_cases``)."""
    case = draw(capture_cases(top_ks=top_ks, buffer_dtypes=(torch.int32,), ids_dtypes=ids_dtypes, **kw))
    n, k = case.rows.shape
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    use_lens = draw(st.booleans())
    context = rng.integers(1, draw(st.sampled_from([4, 64, 5000, 200_000])) + 1, size=n)
    rows = position_rows(rng, n, k, context)
    rows[case.rows[:, 0] == PAD_ID] = PAD_ID  # padding rows: never read
    faulty = draw(st.booleans())
    if faulty:
        mine = np.arange(case.start, case.start + case.c)
        for i in mine[: 1 + len(mine) // 2]:
            j = int(rng.integers(0, k))
            rows[i, j] = int(rng.choice([-2, -(2**31), context[i], context[i] + 7] if use_lens else [-2, -5]))
            if k > 1:
                a, b = rng.choice(k, size=2, replace=False)
                rows[i, b] = rows[i, a]  # a repeat (or two -1s, which stay)
    if case.ids_dtype == torch.int32:
        rows = np.clip(rows, -(2**31), 2**31 - 1)
    return IndexerCase(
        case=replace(case, rows=rows),
        kv_lens=[int(x) for x in context] if use_lens else None,
        lens_view=draw(st.sampled_from(("contiguous", "strided"))),
        faulty=faulty,
    )
