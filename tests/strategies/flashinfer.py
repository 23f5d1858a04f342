"""FlashInfer's monolithic capture contract (moe_ops.flashinfer): the batch a monolithic kernel sees
and the dispatch config that sized its routing-replay scratch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from moe_ops import BatchLayout

from .capture import CaptureCase, capture_cases

__all__ = [
    "DISPATCH_LAYOUTS",
    "ReplayCase",
    "replay_cases",
]


# the layouts a kernel's batch can have after dispatch (SEQUENCE_PARALLEL is gathered before routing)
DISPATCH_LAYOUTS = (BatchLayout.LOCAL, BatchLayout.GATHERED, BatchLayout.SHARDED)


@dataclass
class ReplayCase:
    # the batch: rows are what the kernel writes into routing_replay_out (padding rows hold PAD_ID)
    case: CaptureCase
    # MoEDispatchConfig arguments that size the scratch for this batch
    max_num_tokens: int
    dp_size: int
    ep_size: int
    use_ep: bool


@st.composite
def replay_cases(draw, top_ks=(1, 2, 6, 8), buffer_dtypes=(torch.int32, torch.int16)):
    """A batch in one of the dispatch layouts, with a dispatch config whose scratch holds it.

    LOCAL: no gather (dp_size ranks, scratch sized for dp_size of them anyway); GATHERED: the DP
    group, with or without EP (ep_size == dp_size then); SHARDED: an EP group of dp_size *
    shards_per_rank ranks that gathered sequence-parallel shards.
    """
    case = draw(
        capture_cases(
            layouts=DISPATCH_LAYOUTS,
            max_count=12,
            top_ks=top_ks,
            buffer_dtypes=buffer_dtypes,
            ids_dtypes=(torch.int16,),
        )
    )
    n = case.rows.shape[0]
    dp_size = len(case.counts)
    if case.layout == BatchLayout.LOCAL:
        # a LOCAL buffer must hold max_num_tokens rows: size the config for this batch exactly
        case.max_tokens = max(case.max_tokens, n, 1)
        return ReplayCase(case, max(n, 1), dp_size, 1, False)
    if case.layout == BatchLayout.GATHERED:
        use_ep = draw(st.booleans())
        per_rank = max(case.shard_sizes or case.counts)
        return ReplayCase(case, max(per_rank, 1), dp_size, dp_size if use_ep else 1, use_ep)
    spr = len(case.shard_sizes) // dp_size
    per_rank = max(sum(case.shard_sizes[i * spr : (i + 1) * spr]) for i in range(dp_size))
    return ReplayCase(case, max(per_rank, 1), dp_size, dp_size * spr, True)
