"""The capture op: ``capture_routing`` and its registered custom op ``torch.ops.moe_ops.capture_routing_``.

Destination-passing: the op writes into the caller's persistent buffer (and, with a weights target,
its weights buffer) and returns nothing. It declares ``buffer``, ``weights_buffer``, the fault
counter and the layer stamps as mutated and has a fake implementation,
so ``torch.compile(fullgraph=True)`` sees the writes without a graph break and CUDA graphs can capture
it after one warm-up call (the warm-up compiles the Triton kernel and allocates the device-wide fault
counter).
"""

from __future__ import annotations

import torch

from .._runtime.library import destination_op, eager_caller, reference_op
from .._runtime.triton import HAS_TRITON
from ..layout import BatchLayout
from .errors import FaultCounter
from .kernels import capture_rows_torch, capture_rows_triton
from .spec import CAPTURE_OP

if HAS_TRITON:
    from .kernels import _capture_rows_kernel as capture_kernel
from .target import CaptureTarget, check_process_group, no_weights

__all__ = ["capture_into", "capture_routing", "check_process_group", "target_tensors", "tp_world_size"]


# generated from CaptureSpec (moe_ops.capture.spec): the buffer, the ids, then the spec's other fields
_MUTATES = CAPTURE_OP.mutates
_SCHEMA = CAPTURE_OP.schema()
# CUDA: the Triton kernel (inductor launches it from its own code under torch.compile); CPU: the
# PyTorch twin, or the kernel itself where Triton is interpreted on the CPU (the test suite).
capture_routing_op = destination_op(
    "capture_routing_",
    mutates=_MUTATES,
    cuda=capture_rows_triton if HAS_TRITON else None,
    cpu=capture_rows_torch,
    interpreted=capture_rows_triton if HAS_TRITON else None,
    traceable=capture_rows_triton if HAS_TRITON else None,
    kernels=(capture_kernel,) if HAS_TRITON else (),
    schema=_SCHEMA,
)
# the twin as an op of its own on every device (``capture_routing_reference_``), as route has: the
# oracle a test or a user compares the kernel op with on the same device
capture_routing_reference_op = reference_op(
    "capture_routing_", capture_rows_torch, mutates=_MUTATES, schema=_SCHEMA
)
# eager CUDA calls skip the dispatcher where it would do nothing else (moe_ops._runtime.library); the
# buffers, the ids and the weights are checked, the target validated the rest on the buffer's device
_capture_call = eager_caller(
    "capture_routing_",
    checked=CAPTURE_OP.positions("buffer", "topk_ids", "topk_weights", "weights_buffer"),
)


def target_tensors(target: CaptureTarget) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(errors, stamps, step) tensors a kernel writing for ``target`` takes (``target.spec``'s):
    its counter's (or the device-wide one), its stamps and step (or empty stand-ins)."""
    spec = target.spec
    return spec.errors, spec.stamps, spec.step


def tp_world_size(tp_group) -> int:
    """Size of ``tp_group`` (1 for None); TypeError naming ``tp_group`` when it is not a
    ``ProcessGroup``. Host metadata only; reads no device values."""
    check_process_group("tp_group", tp_group)
    if tp_group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(tp_group)


def _gather_sequence_parallel(topk_ids: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gathers the TP shards of ``topk_ids`` (or of their weights) along dim 0 (TP-rank order).

    The one allocation of the capture path: the gathered (tp * n, top_k) tensor (two with
    weights). Uses functional collectives so torch.compile traces it; NCCL all-gathers are
    CUDA-graph capturable.
    """
    from torch.distributed import _functional_collectives as funcol

    # all_gather_single replaces all_gather_tensor in torch 2.13; 2.11 only has the latter.
    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    gathered = all_gather(topk_ids.contiguous(), gather_dim=0, group=tp_group)
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = gathered.wait()
    return gathered


def capture_into(
    target: CaptureTarget, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None
) -> None:
    """Records this DP rank's rows of ``topk_ids`` (rows in ``target.layout``) into the target, and
    the same rows of ``topk_weights`` into its ``weights_buffer``.

    topk_ids: (n, top_k) integer on the buffer's device, any strides.
    topk_weights: (n, top_k) float32/bfloat16/float16 on the buffer's device, any strides - the
        routing weights of ``topk_ids``, column for column; required by a target with a
        ``weights_buffer`` (cast to its dtype, round to nearest even; a NaN is stored as NaN, not
        faulted; a row whose id is stored as -1 keeps its weight), refused (ValueError) by one
        without.

    The target was validated when it was built; this checks the ids and the weights (ValueError
    before anything is written). No host reads, no synchronisation, no allocation (except the
    all-gather outputs of SEQUENCE_PARALLEL with tp_size > 1, which gathers the weights too).
    """
    target.check_ids(topk_ids)
    target.check_weights(topk_weights, topk_ids)
    if topk_weights is not None and topk_weights.requires_grad:
        topk_weights = topk_weights.detach()  # a record, not part of the graph autograd sees
    layout = target.layout
    if layout == BatchLayout.SEQUENCE_PARALLEL and tp_world_size(target.tp_group) > 1:
        topk_ids = _gather_sequence_parallel(topk_ids, target.tp_group)
        if topk_weights is not None:
            topk_weights = _gather_sequence_parallel(topk_weights, target.tp_group)
        target.check_ids(topk_ids)
    if topk_weights is None:
        topk_weights = no_weights(target.buffer)
    _capture_call(*CAPTURE_OP.join((topk_ids, topk_weights), target.spec))


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
    fault_counter: FaultCounter | None = None,
    weights_buffer: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    num_logical_experts: int | None = None,
) -> None:
    """Records this DP rank's routed expert ids of one MoE layer into ``buffer[:, layer_id]`` (and
    their routing weights into ``weights_buffer[:, layer_id]``).

    Args:
        buffer: (max_tokens, num_layers, top_k) int32 (int16/int64 allowed), no internal overlap -
            written in place: rows ``[0, c)`` of layer ``layer_id``; every other element keeps its
            value.
        topk_ids: (n, top_k) integer (uint8/int8/int16/int32/int64, any strides), same device -
            the router's choices for the rows of ``layout``.
        layer_id: layer index in ``[0, num_layers)`` (IndexError otherwise).
        token_counts: (dp_size,) int32 on the buffer's device, any stride - REAL (unpadded)
            tokens of each DP rank this step. Read on the device: update it in place between
            CUDA-graph replays.
        dp_rank: this rank's index into ``token_counts``.
        layout: how the rows of ``topk_ids`` are arranged (:class:`BatchLayout` or its int value;
            diagrams in :mod:`moe_ops.layout`).
        shard_sizes: GATHERED/SHARDED only - (dp_size * shards_per_rank,) int32, any stride: rows
            each rank (shards_per_rank 1) or each shard occupies in the gathered batch, padding
            included (GATHERED without it reads ``token_counts``). Read on the device.
        tp_group: SEQUENCE_PARALLEL only - the ``torch.distributed.ProcessGroup`` to all-gather
            over (None: tp_size 1, which is LOCAL); anything else is a TypeError.
        fault_counter: where faults are recorded (None: the device-wide counter that
            :func:`moe_ops.check_capture_errors` reads).
        weights_buffer: (max_tokens, num_layers, top_k) float32/bfloat16/float16 on the buffer's
            device, no internal overlap, not overlapping ``buffer`` - written in place: the same
            rows of layer ``layer_id`` as ``buffer``, from ``topk_weights`` cast to its dtype (round
            to nearest even); None: no weights.
        topk_weights: (n, top_k) float32/bfloat16/float16, any strides, same device - the
            weights of ``topk_ids``, column for column; required with ``weights_buffer``, refused
            without it. Weights are not checked: a NaN is stored as NaN, and a row whose id is
            stored as -1 keeps its weight.
        expert_map: (P,) int32/int64 on the buffer's device, any stride - EPLB's physical ->
            logical expert map, for ids that are physical slots (taken after the balancer's
            mapping: a monolithic kernel, an engine's own router): ``buffer`` gets
            ``expert_map[id]``. Read on the device at every call: update it in place between
            CUDA-graph replays. An id outside ``[0, P)`` is stored as -1 (FAULT_BAD_ID), an entry
            outside ``[0, num_logical_experts)`` as -1 (FAULT_BAD_MAP). None: ids as given.
        num_logical_experts: the logical experts (>= 1, fitting the buffer dtype); required with
            ``expert_map``, refused without it.

    Row selection: :mod:`moe_ops.capture.window`. Counts inconsistent with the tensors are clamped
    on the device, and ids that are negative or do not fit the buffer dtype are stored as -1; both
    are recorded in the fault counter.

    No host reads, no synchronisation, no allocation (except the all-gather output of
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
        weights_buffer=weights_buffer,
        expert_map=expert_map,
        num_logical_experts=num_logical_experts,
    )
    capture_into(target, topk_ids, topk_weights)
