"""Model-library integrations (moe_ops.integrations): the batches a transformers model runs with
attach_capture, and Megatron-Core router configurations with a recorded routing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from moe_ops import BatchLayout

__all__ = [
    "MEGATRON_FAULTY_KINDS",
    "MEGATRON_ROUTER_DTYPES",
    "MEGATRON_ROW_KINDS",
    "HFBatch",
    "MegatronRouterCase",
    "hf_batches",
    "megatron_router_cases",
]


# ---------------------------------------------------------------------------------------------------
# Batches a transformers model runs with attach_capture (moe_ops.integrations.hf)
# ---------------------------------------------------------------------------------------------------


@dataclass
class HFBatch:
    """A (batch, seq) batch of token ids; the router sees its batch * seq rows flattened, row-major."""

    # sequences in the batch, >= 1
    batch: int
    # tokens per sequence (transformers pads a batch to one length), >= 1
    seq: int
    # LOCAL (one rank) or GATHERED (the rows are every DP rank's blocks, concatenated)
    layout: BatchLayout
    # real tokens of each DP rank; LOCAL: counts[0] <= rows; GATHERED: sum(counts) <= rows
    counts: list[int]
    # this rank's index into counts
    dp_rank: int
    # seed of the token ids
    seed: int

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    @property
    def start(self) -> int:
        """First row of this rank's block: 0 for LOCAL, the blocks of the ranks before it for GATHERED."""
        return sum(self.counts[: self.dp_rank]) if self.layout == BatchLayout.GATHERED else 0

    @property
    def c(self) -> int:
        return self.counts[self.dp_rank]


@st.composite
def hf_batches(draw, max_batch: int = 3, max_seq: int = 6) -> HFBatch:
    """A padded batch and the token counts the capture must honour (padding rows never recorded)."""
    batch = draw(st.integers(1, max_batch))
    seq = draw(st.integers(1, max_seq))
    rows = batch * seq
    seed = draw(st.integers(0, 2**31 - 1))
    if draw(st.booleans()):
        return HFBatch(batch, seq, BatchLayout.LOCAL, [draw(st.integers(0, rows))], 0, seed)
    first = draw(st.integers(0, rows))
    second = draw(st.integers(0, rows - first))
    return HFBatch(batch, seq, BatchLayout.GATHERED, [first, second], draw(st.integers(0, 1)), seed)


# ---------------------------------------------------------------------------------------------------
# Megatron-Core routers (moe_ops.integrations.megatron)
# ---------------------------------------------------------------------------------------------------


# Row kinds of a Megatron replay batch: distinct recorded experts, a row of -1 (route live), and two
# faulty kinds a host array can carry (an expert twice, a row partly -1): routed live and counted.
MEGATRON_ROW_KINDS = ("recorded", "live", "repeated", "partial")
MEGATRON_FAULTY_KINDS = ("repeated", "partial")
# moe_router_dtype: None routes in the activations' dtype (bf16 here, as in bf16 training)
MEGATRON_ROUTER_DTYPES = ("fp32", "fp64", None)


@dataclass
class MegatronRouterCase:
    """One TopKRouter configuration (every score-function branch of Megatron's routing) and a batch
    of ``[seq_len, batch]`` tokens with a recorded routing, row kind by row kind."""

    score_function: str
    pre_softmax: bool
    top_k: int
    num_experts: int
    # moe_router_topk_scaling_factor (None: no scaling)
    scaling: float | None
    # moe_router_enable_expert_bias (sigmoid only); the bias values are drawn from ``seed``
    expert_bias: bool
    # moe_router_num_groups / moe_router_group_topk (None: no grouping)
    num_groups: int | None
    group_topk: int | None
    # moe_router_dtype
    router_dtype: str | None
    seq_len: int
    batch: int
    # kinds[t] in MEGATRON_ROW_KINDS, t a row in Megatron's [s, b] order
    kinds: list[str]
    seed: int

    @property
    def n(self) -> int:
        return self.seq_len * self.batch

    def config_kwargs(self) -> dict:
        """TransformerConfig fields of the router."""
        return dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.top_k,
            moe_router_score_function=self.score_function,
            moe_router_pre_softmax=self.pre_softmax,
            moe_router_topk_scaling_factor=self.scaling,
            moe_router_enable_expert_bias=self.expert_bias,
            moe_router_num_groups=self.num_groups,
            moe_router_group_topk=self.group_topk,
            moe_router_dtype=self.router_dtype,
        )

    def recorded(self) -> np.ndarray:
        """(n, top_k) int32 host rows by kind: ``recorded`` rows hold ``top_k`` random distinct
        experts (rarely the router's own choice), ``live`` rows -1, faulty rows as their kind says."""
        rng = np.random.default_rng(self.seed)
        rows = np.empty((self.n, self.top_k), dtype=np.int32)
        for t, kind in enumerate(self.kinds):
            row = rng.permutation(self.num_experts)[: self.top_k]
            if kind == "live":
                row = np.full(self.top_k, -1)
            elif kind == "repeated":
                i, j = rng.choice(self.top_k, size=2, replace=False)
                row[j] = row[i]
            elif kind == "partial":
                row[rng.choice(self.top_k, size=rng.integers(1, self.top_k), replace=False)] = -1
            rows[t] = row
        return rows

    def replayed_rows(self) -> torch.Tensor:
        """(n,) bool: rows whose record the router must return (the others keep its own output)."""
        return torch.tensor([kind == "recorded" for kind in self.kinds])

    @property
    def faulty_rows(self) -> int:
        return sum(kind in MEGATRON_FAULTY_KINDS for kind in self.kinds)


@st.composite
def megatron_router_cases(draw, max_tokens: int = 12, dtypes=MEGATRON_ROUTER_DTYPES) -> MegatronRouterCase:
    """Every branch of Megatron's ``topk_routing_with_score_function``: softmax after / before top-k
    (top-1 only before, as TransformerConfig requires), sigmoid with or without expert bias, with
    or without a scale, grouped (group-limited top-k) or not, in each router dtype; rows of every
    MEGATRON_ROW_KINDS kind the top-k can express."""
    score_function = draw(st.sampled_from(("softmax", "sigmoid")))
    num_experts = draw(st.sampled_from((4, 6, 8, 16)))
    top_k = draw(st.integers(1, min(4, num_experts - 1)))
    pre_softmax = top_k == 1 or draw(st.booleans()) if score_function == "softmax" else draw(st.booleans())
    expert_bias = score_function == "sigmoid" and draw(st.booleans())
    scaling = draw(st.sampled_from((None, 2.5)))
    num_groups = group_topk = None
    divisors = [g for g in range(2, num_experts + 1) if num_experts % g == 0]
    if draw(st.booleans()):
        g = draw(st.sampled_from(divisors))
        size = num_experts // g
        # group_limited_topk takes top_k // group_topk experts per group and top_k from the kept groups
        options = [t for t in range(1, g + 1) if t <= top_k and top_k // t <= size and top_k <= t * size]
        if options:
            num_groups, group_topk = g, draw(st.sampled_from(options))
    router_dtype = draw(st.sampled_from(dtypes))
    seq_len, batch = draw(st.integers(1, max_tokens)), draw(st.integers(1, 2))
    allowed = ["recorded", "live"] + (["repeated", "partial"] if top_k >= 2 else [])
    kinds = draw(st.lists(st.sampled_from(allowed), min_size=seq_len * batch, max_size=seq_len * batch))
    return MegatronRouterCase(
        score_function,
        pre_softmax,
        top_k,
        num_experts,
        scaling,
        expert_bias,
        num_groups,
        group_topk,
        router_dtype,
        seq_len,
        batch,
        kinds,
        draw(st.integers(0, 2**32 - 1)),
    )
