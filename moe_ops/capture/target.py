"""``CaptureTarget``: the arguments of ``capture_routing`` bundled, for routers that capture themselves.

``moe_ops.route(..., capture=CaptureTarget(buffer, layer_id, token_counts=counts))`` records the ids
it chooses into ``buffer[:, layer_id]`` exactly as ``capture_routing(buffer, ids, layer_id,
token_counts=counts)`` would, in the router's own kernel where the layout allows it.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from ..layout import BatchLayout
from .op import validate_capture_args

__all__ = ["CaptureTarget"]


def _stand_in_ids(buffer: object) -> torch.Tensor:
    """A (0, top_k) int32 tensor on the buffer's device: lets the capture checks run before routing.

    Zero elements, so nothing is allocated; a LOCAL buffer of any size holds 0 rows.
    """
    if isinstance(buffer, torch.Tensor) and buffer.dim() == 3:
        return torch.empty((0, buffer.shape[2]), dtype=torch.int32, device=buffer.device)
    return torch.empty((0, 0), dtype=torch.int32)  # never inspected: the buffer check fails first


@dataclass(frozen=True)
class CaptureTarget:
    """Where a router records its ids: exactly what :func:`moe_ops.capture_routing` takes.

    Checked on construction with the capture op's own validation (same errors as
    ``capture_routing``); the checks that need the routed ids (their ``top_k`` and, for LOCAL, the
    buffer's rows against the padded batch) run again when the router has them.
    """

    # (max_tokens, num_layers, top_k) int16/int32/int64 - the replay buffer; a static address
    buffer: torch.Tensor
    # layer index in [0, num_layers)
    layer_id: int
    _: KW_ONLY
    # (dp_size,) int32 on the buffer's device - real tokens of each DP rank; updated in place
    token_counts: torch.Tensor
    # index into token_counts, in [0, dp_size)
    dp_rank: int = 0
    # how the router's rows are arranged (BatchLayout or its int value)
    layout: BatchLayout | int = BatchLayout.LOCAL
    # GATHERED (dp_size,) / SHARDED (dp_size * shards_per_rank,) int32 row counts; None otherwise
    shard_sizes: torch.Tensor | None = None
    # SEQUENCE_PARALLEL only: the torch.distributed group to all-gather over (None: tp_size 1)
    tp_group: object = None

    def __post_init__(self) -> None:
        self.validate(_stand_in_ids(self.buffer))

    def validate(self, topk_ids: torch.Tensor) -> tuple[BatchLayout, int]:
        """Runs ``capture_routing``'s checks for ids ``topk_ids``; returns (layout, shards_per_rank).

        topk_ids: (n, top_k) integer - the routed ids (or a stand-in of their shape and device)
        """
        layout, shards_per_rank = validate_capture_args(
            self.buffer,
            topk_ids,
            self.layer_id,
            self.token_counts,
            self.dp_rank,
            self.layout,
            self.shard_sizes,
        )
        if self.tp_group is not None and layout != BatchLayout.SEQUENCE_PARALLEL:
            raise ValueError(f"tp_group is only used by SEQUENCE_PARALLEL, not {layout.name}; pass None")
        return layout, shards_per_rank
