"""The device-to-host transfer (moe_ops.transfer): the snapshot's narrowing cast, snapshot row
counts around the narrowing graphs' buckets (TransferPipeline), and a second channel beside the ids
(routing weights: float rows drawn as bit patterns)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

__all__ = [
    "NARROW_SOURCES",
    "NARROW_TARGETS",
    "WEIGHT_DTYPES",
    "WEIGHT_SOURCES",
    "NarrowCase",
    "WeightsCase",
    "bucket_row_counts",
    "narrow_cases",
    "weight_rows",
    "weights_cases",
]


# ---------------------------------------------------------------------------------------------------
# The snapshot's narrowing cast
# ---------------------------------------------------------------------------------------------------


NARROW_SOURCES = (torch.int16, torch.int32, torch.int64)
NARROW_TARGETS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class NarrowCase:
    # (max_rows, L, K) source rows and the number of leading rows to cast
    max_rows: int
    num_layers: int
    top_k: int
    num_rows: int
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    # ids drawn from [low, high]: past the target's range too, so truncation is exercised
    low: int
    high: int
    seed: int

    def source(self, device) -> torch.Tensor:
        info = torch.iinfo(self.src_dtype)
        low, high = max(self.low, info.min), min(self.high, info.max)
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.max_rows, self.num_layers, self.top_k)
        return torch.randint(low, high + 1, shape, generator=g, dtype=torch.int64).to(device, self.src_dtype)


@st.composite
def narrow_cases(draw, max_rows: int = 40):
    rows = draw(st.integers(1, max_rows))
    ranges = [(0, 255), (-1, 300), (0, 65535), (-70000, 70000), (-(2**31), 2**31 - 1)]
    low, high = draw(st.sampled_from(ranges))
    return NarrowCase(
        max_rows=rows,
        num_layers=draw(st.integers(1, 7)),
        top_k=draw(st.sampled_from([1, 2, 6, 8, 9])),
        num_rows=draw(st.integers(0, rows)),
        src_dtype=draw(st.sampled_from(NARROW_SOURCES)),
        dst_dtype=draw(st.sampled_from(NARROW_TARGETS)),
        low=low,
        high=high,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ---------------------------------------------------------------------------------------------------
# Snapshot row counts around the narrowing graphs' buckets (TransferPipeline)
# ---------------------------------------------------------------------------------------------------


@st.composite
def bucket_row_counts(draw, max_rows: int):
    """A row count in ``[0, max_rows]``, half the time at a bucket edge (0, 1, a power of two or
    one off it, ``max_rows`` or one below)."""
    edges = {0, 1, max_rows - 1, max_rows}
    for k in range(max_rows.bit_length()):
        edges |= {2**k - 1, 2**k, 2**k + 1}
    edges = sorted(e for e in edges if 0 <= e <= max_rows)
    if draw(st.booleans()):
        return draw(st.sampled_from(edges))
    return draw(st.integers(0, max_rows))


# ---------------------------------------------------------------------------------------------------
# A second channel: routing weights beside the ids
# ---------------------------------------------------------------------------------------------------

# host dtypes of a weights channel, and the device dtypes its source may have
WEIGHT_DTYPES = (np.float16, np.float32)
WEIGHT_SOURCES = (torch.float16, torch.bfloat16, torch.float32)


def weight_rows(rng: np.random.Generator, shape: tuple[int, ...], dtype, nan: bool = False) -> np.ndarray:
    """Floats of ``dtype`` drawn as raw bit patterns: subnormals, -0.0, +-inf and the extremes, so a
    rounding, flushing or canonicalising copy shows. NaNs (any payload) only with ``nan``: a device
    cast may canonicalise a NaN's payload, the bits then differ for no fault of the copy."""
    dtype = np.dtype(dtype)
    bits = np.dtype(f"u{dtype.itemsize}")
    out = rng.integers(0, 2 ** (8 * dtype.itemsize), size=shape, dtype=np.uint64).astype(bits).view(dtype)
    if not nan:
        out[np.isnan(out)] = -0.0
    return out


@dataclass(frozen=True)
class WeightsCase:
    # (max_rows, num_layers, top_k) buffers of ids and weights, and the rows one snapshot moves
    max_rows: int
    num_layers: int
    top_k: int
    num_rows: int
    # the weights' host dtype and the source's device dtype
    dtype: np.dtype
    source_dtype: torch.dtype
    seed: int

    def weights(self, device) -> torch.Tensor:
        """The weights source: bit patterns of the source dtype, no NaN (bfloat16: float32 bit
        patterns rounded to it)."""
        rng = np.random.default_rng(self.seed)
        shape = (self.max_rows, self.num_layers, self.top_k)
        if self.source_dtype == torch.bfloat16:
            f32 = weight_rows(rng, shape, np.float32)
            values = torch.from_numpy(f32).to(torch.bfloat16)  # every bfloat16 is a float32
            return values.to(device)
        np_dtype = torch.empty(0, dtype=self.source_dtype).numpy().dtype
        return torch.from_numpy(weight_rows(rng, shape, np_dtype)).to(device)


@st.composite
def weights_cases(draw, max_rows: int = 24):
    rows = draw(st.integers(1, max_rows))
    return WeightsCase(
        max_rows=rows,
        num_layers=draw(st.integers(1, 6)),
        top_k=draw(st.sampled_from([1, 2, 6, 8])),
        num_rows=draw(st.integers(0, rows)),
        dtype=np.dtype(draw(st.sampled_from(WEIGHT_DTYPES))),
        source_dtype=draw(st.sampled_from(WEIGHT_SOURCES)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
