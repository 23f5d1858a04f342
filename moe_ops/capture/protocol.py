"""``Capturer``: what a capturer is, written once.

A capturer holds a model's capture state and is what a model's MoE layers record into;
:class:`moe_ops.RoutingCapturer` is the one this package builds. Every path that takes a capturer
is typed :class:`Capturer` and reads only its own part of it, checked where it is taken
(:func:`check_capturer` names what is missing)::

    part     members                                           read by
    state    buffer, token_counts, dp_rank, shard_sizes        CaptureTarget.of, bind_routing_capture,
             (+ fault_counter, layer_stamps, step_tensor,      LayerCapture (the monolithic experts)
             weights_buffer, shape: read when present)
    record   target(model_layer, layout), capture(...)         the reference model, DistributedStep,
                                                               attach_capture (transformers, Megatron)
    step     set_step, clear_counts, dp_size, max_num_tokens   StepRunner (StepCapturer)

A state-only object (the four state members, e.g. a dataclass around tensors a serving engine
already has) is enough for the state paths; ``attach_capture`` needs only ``capture`` (a recorder
that keeps every call's ids is one, ``moe_ops.integrations.hf_generate``). The optional state
members are read in one place each: the fault counter, the stamps and the weights buffer by
:meth:`~moe_ops.CaptureTarget.of`, ``shape`` (the MoE-only layer axis) by :func:`buffer_column`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from .step import STEP_CAPTURER_MEMBERS, StepCapturer, check_step_capturer

if TYPE_CHECKING:
    from ..layout import BatchLayout
    from ..shapes import RoutingShape
    from .errors import FaultCounter
    from .target import CaptureTarget

__all__ = [
    "RECORD_MEMBERS",
    "STATE_MEMBERS",
    "STEP_CAPTURER_MEMBERS",
    "Capturer",
    "StepCapturer",
    "buffer_column",
    "check_capturer",
    "check_step_capturer",
]

# the members of each part, in the order errors list them
STATE_MEMBERS = ("buffer", "token_counts", "dp_rank", "shard_sizes")
RECORD_MEMBERS = ("target", "capture")
_METHODS = frozenset({"target", "capture", "set_step", "clear_counts"})


@runtime_checkable
class Capturer(StepCapturer, Protocol):
    """A model's capture state and what its MoE layers record into (see the module docstring).

    State:
        buffer: (max_tokens, num_layers, top_k) int16/int32/int64 - the capture buffer, written in
            place; never reallocated (CUDA graphs bake its address)
        token_counts: (dp_size,) int32 on the buffer's device - real tokens of each DP rank this
            step, updated in place between steps (read on the device)
        dp_rank: int - this rank's index into token_counts
        shard_sizes: (dp_size * shards_per_rank,) int32 or None - rows each rank (shard) occupies
            in a gathered batch; GATHERED and SHARDED read it (:mod:`moe_ops.capture.window`)
        fault_counter: FaultCounter or None - where its captures record faults (None, or absent:
            the device-wide counter)
        layer_stamps: (num_layers,) int32 or None, with step_tensor: (1,) int32 - stale-layer
            stamps (:class:`~moe_ops.CaptureTarget`); absent: no stamps
        weights_buffer: (max_tokens, num_layers, top_k) float32/bfloat16/float16 or None - the
            routing weights beside the ids (:class:`~moe_ops.CaptureTarget`); absent or None: ids
            only
        shape: RoutingShape or None - the MoE-only layer axis, model layer -> buffer column
            (:func:`buffer_column`); absent: the model layer is the column

    Record:
        target(model_layer, layout, *, tp_group) -> CaptureTarget - one MoE layer's target, for
            routers that capture as they route (``route(..., capture=...)``)
        capture(model_layer, topk_ids, layout, weights, *, tp_group) - records one MoE layer's
            ids (and, with a weights buffer, their weights)
    """

    buffer: torch.Tensor
    token_counts: torch.Tensor
    dp_rank: int
    shard_sizes: torch.Tensor | None
    fault_counter: FaultCounter | None
    layer_stamps: torch.Tensor | None
    step_tensor: torch.Tensor | None
    weights_buffer: torch.Tensor | None
    shape: RoutingShape | None

    def target(
        self, model_layer_index: int, layout: BatchLayout | int = ..., *, tp_group: object = None
    ) -> CaptureTarget:
        """The :class:`~moe_ops.CaptureTarget` of one MoE layer (a model layer index)."""
        ...

    def capture(
        self,
        layer_id: int,
        topk_ids: torch.Tensor,
        layout: BatchLayout | int = ...,
        weights: torch.Tensor | None = None,
        *,
        tp_group: object = None,
    ) -> None:
        """Records this rank's rows of one MoE layer's ``topk_ids`` (a model layer index) and,
        with a weights buffer, their ``weights``."""
        ...


def check_capturer(capturer: object, what: str = "capturer", members: Sequence[str] = STATE_MEMBERS) -> None:
    """TypeError naming the missing ``members`` (default: the state part) when ``capturer`` lacks
    them; a method member must be callable. Host attributes only."""
    missing = [
        name
        for name in members
        if not hasattr(capturer, name) or (name in _METHODS and not callable(getattr(capturer, name)))
    ]
    if missing:
        raise TypeError(
            f"{what} must have the attributes {', '.join(members)} (moe_ops.capture.Capturer, e.g. "
            f"moe_ops.RoutingCapturer); {type(capturer).__name__} lacks {', '.join(missing)}"
        )


def buffer_column(capturer: object, layer_id: int) -> int:
    """The capture-buffer column of the MoE layer ``layer_id``.

    A capturer with a ``shape`` (a RoutingShape: ``moe_ops.RoutingCapturer``, whose layer axis
    holds MoE layers only) maps the model layer index with ``shape.buffer_layer`` (IndexError
    outside the model, ValueError for a dense layer); any other takes ``layer_id`` as the column.
    """
    shape = getattr(capturer, "shape", None)
    if shape is not None and hasattr(shape, "buffer_layer"):
        return shape.buffer_layer(layer_id)
    return layer_id
