"""The indexer capture op: ``capture_indexer`` and its registered custom op
``torch.ops.moe_ops.capture_indexer_``.

A sparse-attention indexer (DeepSeek Sparse Attention: DeepSeek-V3.2/V4, GLM-5) picks, per query
token and per indexer layer, the top-k key positions its attention reads. Inference and training
disagree on them as they disagree on experts, so a rollout records them beside the routing. The op
is the routing capture's twin for positions: destination-passing into a persistent
``(max_tokens, num_indexer_layers, k)`` int32 buffer, the same row rule and four batch layouts
(:mod:`moe_ops.capture.window`), the same fault counter and layer stamps
(:class:`~moe_ops.capture.target.CaptureTarget`), a fake implementation, traced by torch.compile
(inductor launches the Triton kernel itself) and safe in CUDA graphs with live counts. What it
checks per position is in :mod:`moe_ops.indexer.kernels`.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .._runtime.library import destination_op, eager_caller, reference_op
from .._runtime.triton import HAS_TRITON
from ..capture.errors import FaultCounter
from ..capture.op import _gather_sequence_parallel, tp_world_size
from ..capture.spec import SPEC_ARGS, Arg, OpArgs
from ..capture.target import CaptureTarget, check_process_group
from ..layout import BatchLayout
from .kernels import capture_positions_torch, capture_positions_triton

if HAS_TRITON:
    from .kernels import _capture_positions_kernel

__all__ = ["CAPTURE_INDEXER_OP", "capture_indexer", "capture_indexer_into", "check_positions"]

POSITION_DTYPES = (torch.int32, torch.int64)

# moe_ops::capture_indexer_: the buffer, the positions, the per-row key counts (a (0,) stand-in
# without them), the rest of the capture spec (its weights buffer and expert map are always the
# empty stand-ins), then whether repeats are checked
CAPTURE_INDEXER_OP = OpArgs(
    (
        SPEC_ARGS[0],
        Arg("positions", "Tensor"),
        Arg("kv_lens", "Tensor"),
        *SPEC_ARGS[1:],
        Arg("check_duplicates", "bool", default="True"),
    )
)
_MUTATES = CAPTURE_INDEXER_OP.mutates
_SCHEMA = CAPTURE_INDEXER_OP.schema()
capture_indexer_op = destination_op(
    "capture_indexer_",
    mutates=_MUTATES,
    cuda=capture_positions_triton if HAS_TRITON else None,
    cpu=capture_positions_torch,
    interpreted=capture_positions_triton if HAS_TRITON else None,
    traceable=capture_positions_triton if HAS_TRITON else None,
    kernels=(_capture_positions_kernel,) if HAS_TRITON else (),
    schema=_SCHEMA,
)
# the twin as an op of its own on every device: the oracle a test compares the kernel op with
capture_indexer_reference_op = reference_op(
    "capture_indexer_", capture_positions_torch, mutates=_MUTATES, schema=_SCHEMA
)
_capture_call = eager_caller(
    "capture_indexer_", checked=CAPTURE_INDEXER_OP.positions("buffer", "positions", "kv_lens")
)
_NO_LENS: dict[torch.device, torch.Tensor] = {}


@torch._dynamo.assume_constant_result
def _persistent_no_lens(device: torch.device) -> torch.Tensor:
    t = _NO_LENS.get(device)
    if t is None:
        t = torch.empty(0, dtype=torch.int32, device=device)
        torch._dynamo.mark_static_address(t)
        t = _NO_LENS.setdefault(device, t)
    return t


def _no_lens(like: torch.Tensor) -> torch.Tensor:
    """The (0,) int32 stand-in for "no kv_lens" on ``like``'s device (never read: HAS_LENS is
    False), cached per device as the capture's other stand-ins (moe_ops.capture.target); a fresh
    fake one while ``like`` is a fake tensor traced outside dynamo."""
    if isinstance(like, FakeTensor):
        return torch.empty(0, dtype=torch.int32, device=like.device)
    return _persistent_no_lens(like.device)


def check_positions(target: CaptureTarget, positions: object, kv_lens: object) -> None:
    """The per-call checks of an indexer capture: ``target``'s buffer int32, ``positions`` (n, k)
    int32/int64 on its device with k its last dimension, ``kv_lens`` None or (n,) int32/int64 on
    its device (any strides). ValueError/TypeError naming the argument; nothing is written."""
    buffer = target.buffer
    if buffer.dtype != torch.int32:
        raise ValueError(
            f"buffer must be int32 for indexer positions (every engine's sparse indices are int32), "
            f"got {buffer.dtype}"
        )
    if target.has_weights or target.has_expert_map:
        raise ValueError(
            "an indexer capture target records positions only: build it without weights_buffer and expert_map"
        )
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dim() != 2:
        raise ValueError(f"positions must be 2-D (n, k), got shape {tuple(positions.shape)}")
    if positions.dtype not in POSITION_DTYPES:
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    if positions.shape[1] != buffer.shape[2]:
        raise ValueError(
            f"positions has k={positions.shape[1]} columns but buffer was sized for k={buffer.shape[2]} "
            f"(buffer shape {tuple(buffer.shape)})"
        )
    if positions.device != buffer.device:
        raise ValueError(f"positions must be on the buffer's device {buffer.device}, got {positions.device}")
    if target.layout == BatchLayout.LOCAL and buffer.shape[0] < positions.shape[0]:
        raise ValueError(
            f"buffer has {buffer.shape[0]} rows but the LOCAL batch has {positions.shape[0]} rows "
            "(padding included): size the buffer for the largest local batch (max_tokens)"
        )
    if kv_lens is None:
        return
    if not isinstance(kv_lens, torch.Tensor):
        raise TypeError(f"kv_lens must be a torch.Tensor or None, got {type(kv_lens).__name__}")
    if kv_lens.dim() != 1 or kv_lens.shape[0] != positions.shape[0]:
        raise ValueError(
            f"kv_lens must be ({positions.shape[0]},): one key count per row of positions, got "
            f"shape {tuple(kv_lens.shape)}"
        )
    if kv_lens.dtype not in POSITION_DTYPES:
        raise ValueError(f"kv_lens must be int32 or int64, got {kv_lens.dtype}")
    if kv_lens.device != buffer.device:
        raise ValueError(f"kv_lens must be on the buffer's device {buffer.device}, got {kv_lens.device}")


def capture_indexer_into(
    target: CaptureTarget,
    positions: torch.Tensor,
    *,
    kv_lens: torch.Tensor | None = None,
    check_duplicates: bool = True,
) -> None:
    """Records this DP rank's rows of ``positions`` (rows in ``target.layout``) into ``target``'s
    buffer (see :func:`capture_indexer` for the arguments). No host reads, no synchronisation, no
    allocation (except the all-gather outputs of SEQUENCE_PARALLEL with tp_size > 1)."""
    check_positions(target, positions, kv_lens)
    if not isinstance(check_duplicates, bool):
        raise TypeError(f"check_duplicates must be a bool, got {type(check_duplicates).__name__}")
    if target.layout == BatchLayout.SEQUENCE_PARALLEL and tp_world_size(target.tp_group) > 1:
        positions = _gather_sequence_parallel(positions, target.tp_group)
        if kv_lens is not None:
            kv_lens = _gather_sequence_parallel(kv_lens, target.tp_group)
    lens = kv_lens if kv_lens is not None else _no_lens(target.buffer)
    _capture_call(*CAPTURE_INDEXER_OP.join((positions, lens, check_duplicates), target.spec))


def capture_indexer(
    buffer: torch.Tensor,
    positions: torch.Tensor,
    layer_id: int,
    *,
    token_counts: torch.Tensor,
    dp_rank: int = 0,
    layout: BatchLayout | int = BatchLayout.LOCAL,
    shard_sizes: torch.Tensor | None = None,
    tp_group=None,
    fault_counter: FaultCounter | None = None,
    kv_lens: torch.Tensor | None = None,
    check_duplicates: bool = True,
) -> None:
    """Records this DP rank's indexer top-k positions of one indexer layer into
    ``buffer[:, layer_id]``.

    Args:
        buffer: (max_tokens, num_indexer_layers, k) int32, no internal overlap - written in place:
            rows ``[0, c)`` of layer ``layer_id``; every other element keeps its value.
        positions: (n, k) int32/int64, any strides, same device - the key positions the indexer
            chose for each query row of ``layout`` (in the indexer's order, which is kept); -1 is
            "no position" (a query that sees fewer than k keys).
        layer_id: indexer layer index in ``[0, num_indexer_layers)`` (IndexError otherwise).
        token_counts, dp_rank, layout, shard_sizes, tp_group, fault_counter: as
            :func:`moe_ops.capture_routing` (the same row rule, read on the device).
        kv_lens: (n,) int32/int64 on the buffer's device, any stride - the keys each source row
            may read (its causal length: a position must be in ``[0, kv_lens[row])``); read on
            the device. None: positions are only checked against the int32 range.
        check_duplicates: find positions repeated within a row (two sorts of the row's keys, see
            :mod:`moe_ops.indexer.kernels`); False for a source that cannot repeat (a top-k
            selection) skips them.

    A position below -1 or outside its row's key range is stored as -1 and counted as
    ``FAULT_BAD_ID``; a repeat of a position earlier in its row as -1, counted as
    ``FAULT_DUPLICATE`` (the first occurrence is kept); counts inconsistent with the tensors are
    clamped and counted, as for routing ids (:func:`moe_ops.check_faults` reports them).

    No host reads, no synchronisation, no allocation (except the all-gather outputs of
    SEQUENCE_PARALLEL with tp_size > 1).
    """
    check_process_group("tp_group", tp_group)
    target = CaptureTarget(
        buffer,
        layer_id,
        token_counts=token_counts,
        dp_rank=dp_rank,
        layout=layout,
        shard_sizes=shard_sizes,
        tp_group=tp_group,
        fault_counter=fault_counter,
    )
    capture_indexer_into(target, positions, kv_lens=kv_lens, check_duplicates=check_duplicates)
