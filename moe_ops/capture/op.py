"""The capture op: ``capture_routing`` and its registered custom op ``torch.ops.moe_ops.capture_routing_``.

Destination-passing: the op writes into the caller's persistent buffer and returns nothing. It
declares ``buffer`` (and the device fault counter) as mutated and has a fake implementation, so
``torch.compile(fullgraph=True)`` sees the write without a graph break and CUDA graphs can capture it
after one warm-up call (the warm-up compiles the Triton kernel and allocates the fault counter).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .._triton import triton_runs_on
from ..layout import BatchLayout, layout_from_value
from .errors import capture_error_counter
from .kernels import capture_rows_torch, capture_rows_triton, window_first_size

__all__ = ["capture_routing", "tp_world_size", "validate_capture_args"]

BUFFER_DTYPES = (torch.int16, torch.int32, torch.int64)


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_index_tensor(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on the buffer's device {device}, got {t.device}")


def validate_capture_args(
    buffer: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_id: int,
    token_counts: torch.Tensor,
    dp_rank: int,
    layout: BatchLayout | int,
    shard_sizes: torch.Tensor | None,
) -> tuple[BatchLayout, int]:
    """Checks everything that is known without reading device values.

    Returns ``(layout, shards_per_rank)``. Raises ValueError (IndexError for ``layer_id``) naming
    the argument and what was expected; nothing is written when it raises.
    """
    layout = layout_from_value(layout)
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if buffer.dim() != 3:
        raise ValueError(
            f"buffer must be 3-D (max_tokens, num_layers, top_k), got shape {tuple(buffer.shape)}"
        )
    if buffer.dtype not in BUFFER_DTYPES:
        raise ValueError(f"buffer must be int16, int32 or int64, got {buffer.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D (n, top_k), got shape {tuple(topk_ids.shape)}")
    if not _is_integer_dtype(topk_ids.dtype):
        raise ValueError(f"topk_ids must have an integer dtype, got {topk_ids.dtype}")
    if topk_ids.shape[1] != buffer.shape[2]:
        raise ValueError(
            f"topk_ids has top_k={topk_ids.shape[1]} columns but buffer was sized for "
            f"top_k={buffer.shape[2]} (buffer shape {tuple(buffer.shape)})"
        )
    if topk_ids.device != buffer.device:
        raise ValueError(f"topk_ids must be on the buffer's device {buffer.device}, got {topk_ids.device}")
    if isinstance(layer_id, bool) or not isinstance(layer_id, int):
        raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
    if not 0 <= layer_id < buffer.shape[1]:
        raise IndexError(f"layer_id must be in [0, {buffer.shape[1]}) for this buffer, got {layer_id}")
    _check_index_tensor("token_counts", token_counts, buffer.device)
    dp_size = token_counts.shape[0]
    if dp_size < 1:
        raise ValueError("token_counts must have one entry per DP rank (dp_size >= 1), got 0 entries")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"dp_rank must be an int in [0, {dp_size}) (dp_size from token_counts), got {dp_rank}"
        )

    shards_per_rank = 1
    if layout == BatchLayout.SHARDED:
        if shard_sizes is None:
            raise ValueError(
                "SHARDED needs shard_sizes: an int32 tensor of dp_size * shards_per_rank shard sizes"
            )
        _check_index_tensor("shard_sizes", shard_sizes, buffer.device)
        n = shard_sizes.shape[0]
        if n == 0 or n % dp_size:
            raise ValueError(
                f"shard_sizes must have a positive multiple of dp_size={dp_size} entries "
                f"(dp_size * shards_per_rank), got {n}"
            )
        shards_per_rank = n // dp_size
    elif layout == BatchLayout.GATHERED:
        if shard_sizes is not None:
            _check_index_tensor("shard_sizes", shard_sizes, buffer.device)
            if shard_sizes.shape[0] != dp_size:
                raise ValueError(
                    f"GATHERED shard_sizes must have dp_size={dp_size} entries (rows each rank "
                    f"occupies), got {shard_sizes.shape[0]}"
                )
    elif shard_sizes is not None:
        raise ValueError(f"shard_sizes is only used by GATHERED and SHARDED, not {layout.name}; pass None")

    if layout == BatchLayout.LOCAL and buffer.shape[0] < topk_ids.shape[0]:
        raise ValueError(
            f"buffer has {buffer.shape[0]} rows but the LOCAL batch has {topk_ids.shape[0]} rows "
            "(padding included): size the buffer for the largest local batch (max_tokens)"
        )
    return layout, shards_per_rank


@torch.library.custom_op("moe_ops::capture_routing_", mutates_args=("buffer", "errors"))
def capture_routing_op(
    buffer: torch.Tensor,
    topk_ids: torch.Tensor,
    token_counts: torch.Tensor,
    sizes: torch.Tensor,
    errors: torch.Tensor,
    layer_id: int,
    dp_rank: int,
    layout: int,
    shards_per_rank: int,
) -> None:
    """Writes this rank's rows of ``topk_ids`` into ``buffer[:, layer_id]`` (see kernels.py).

    ``sizes`` is ``shard_sizes`` (GATHERED/SHARDED) or ``token_counts``; ``layout`` is never
    SEQUENCE_PARALLEL here (the public wrapper gathers first and passes LOCAL).
    """
    n_first = window_first_size(layout, dp_rank, shards_per_rank)
    if triton_runs_on(buffer.device):
        capture_rows_triton(buffer, topk_ids, token_counts, sizes, errors, layer_id, dp_rank, n_first)
    else:
        capture_rows_torch(buffer, topk_ids, token_counts, sizes, errors, layer_id, dp_rank, n_first)


@capture_routing_op.register_fake
def _(buffer, topk_ids, token_counts, sizes, errors, layer_id, dp_rank, layout, shards_per_rank) -> None:
    return None


def tp_world_size(tp_group) -> int:
    """Size of ``tp_group`` (1 for None). Host metadata only; reads no device values."""
    if tp_group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(tp_group)


def _gather_sequence_parallel(topk_ids: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gathers the TP shards of ``topk_ids`` along dim 0 (TP-rank order).

    The one allocation of the capture path: the gathered (tp * n, top_k) tensor. Uses functional
    collectives so torch.compile traces it; NCCL all-gathers are CUDA-graph capturable.
    """
    from torch.distributed import _functional_collectives as funcol

    # all_gather_single replaces all_gather_tensor in torch 2.13; 2.11 only has the latter.
    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    gathered = all_gather(topk_ids.contiguous(), gather_dim=0, group=tp_group)
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = gathered.wait()
    return gathered


def capture_routing(
    buffer: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_id: int,
    *,
    token_counts: torch.Tensor,
    dp_rank: int = 0,
    layout: BatchLayout | int = BatchLayout.LOCAL,
    shard_sizes: torch.Tensor | None = None,
    tp_group=None,
) -> None:
    """Records this DP rank's routed expert ids of one MoE layer into ``buffer[:, layer_id]``.

    Args:
        buffer: (max_tokens, num_layers, top_k) int32 (int16/int64 allowed) - written in place:
            rows ``[0, c)`` of layer ``layer_id``; every other element keeps its value.
        topk_ids: (n, top_k) integer, same device - the router's choices for the rows of ``layout``.
        layer_id: layer index in ``[0, num_layers)`` (IndexError otherwise).
        token_counts: (dp_size,) int32 on the buffer's device - REAL (unpadded) tokens of each DP
            rank this step. Read on the device: update it in place between CUDA-graph replays.
        dp_rank: this rank's index into ``token_counts``.
        layout: how the rows of ``topk_ids`` are arranged (:class:`BatchLayout`, diagrams in
            :mod:`moe_ops.layout`).
        shard_sizes: (dp_size,) int32 for GATHERED - rows each rank occupies in a padded all-gather
            (None: ``token_counts``); (dp_size * shards_per_rank,) int32 for SHARDED - shard sizes
            including padding. Read on the device.
        tp_group: SEQUENCE_PARALLEL only - the torch.distributed group to all-gather over (None:
            tp_size 1, which is LOCAL).

    Row selection with ``c = token_counts[dp_rank]``: LOCAL/SEQUENCE_PARALLEL (after the gather)
    rows ``[0, c)``; GATHERED from ``sum(sizes[:dp_rank])``; SHARDED from
    ``sum(shard_sizes[:dp_rank * shards_per_rank])``. Counts inconsistent with the tensors are
    clamped on the device and recorded for :func:`moe_ops.check_capture_errors`.

    No host reads, no synchronisation, no allocation (except the all-gather output of
    SEQUENCE_PARALLEL with tp_size > 1).
    """
    layout, shards_per_rank = validate_capture_args(
        buffer, topk_ids, layer_id, token_counts, dp_rank, layout, shard_sizes
    )
    if layout == BatchLayout.SEQUENCE_PARALLEL:
        if tp_world_size(tp_group) > 1:
            topk_ids = _gather_sequence_parallel(topk_ids, tp_group)
        layout = BatchLayout.LOCAL
    elif tp_group is not None:
        raise ValueError(f"tp_group is only used by SEQUENCE_PARALLEL, not {layout.name}; pass None")
    sizes = token_counts if shard_sizes is None else shard_sizes
    errors = capture_error_counter(buffer.device)
    if isinstance(buffer, FakeTensor):
        # Traced outside dynamo (FakeTensorMode, make_fx): a fake stand-in for the real counter.
        errors = torch.empty(2, dtype=torch.int32, device=buffer.device)
    torch.ops.moe_ops.capture_routing_(
        buffer,
        topk_ids,
        token_counts,
        sizes,
        errors,
        layer_id,
        dp_rank,
        int(layout),
        shards_per_rank,
    )
