"""Where captured ids go: the small protocols this package needs from a capturer, and the capture step.

Two shapes of object, both plain attribute protocols so that the classes other modules define
(``moe_ops.RoutingCapturer`` of issue 5, ``moe_ops.capture.target.CaptureTarget`` of issue 3)
satisfy them without importing anything from here:

* :class:`RoutingCapturerLike` - the per-model capture state: ``buffer``, ``token_counts``,
  ``dp_rank``, ``shard_sizes``. The binding (:mod:`moe_ops.flashinfer.experts`) hands one to every
  MoE layer.
* :class:`CaptureTargetLike` - one layer's destination: the capturer fields plus ``layer_id`` and
  ``layout``. :func:`moe_ops.flashinfer.route_flashinfer` takes one as ``capture``.

:func:`capture_ids` is the step both use after a kernel wrote ids: one ``capture_routing`` call (a
registered custom op, so it is traced by ``torch.compile`` and recorded by CUDA graphs; no Python
callback and no host read runs per step).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..capture import capture_routing
from ..capture.target import CaptureTarget
from ..layout import BatchLayout, layout_from_value

__all__ = [
    "CaptureTarget",
    "CaptureTargetLike",
    "RoutingCapturerLike",
    "buffer_column",
    "capture_ids",
    "check_capturer",
]


@runtime_checkable
class RoutingCapturerLike(Protocol):
    """The capture state of a model, as this package reads it (satisfied by issue 5's RoutingCapturer).

    buffer: (max_tokens, num_layers, top_k) int16/int32/int64 - the capture buffer, written in place
    token_counts: (dp_size,) int32, on the buffer's device - real tokens of each DP rank this step,
        updated in place between steps (read on the device)
    dp_rank: int - this rank's index into token_counts
    shard_sizes: (dp_size,) or (dp_size * shards_per_rank,) int32, or None - rows each rank (shard)
        occupies in a padded gather; only GATHERED and SHARDED batches use it (None: token_counts)
    """

    buffer: torch.Tensor
    token_counts: torch.Tensor
    dp_rank: int
    shard_sizes: torch.Tensor | None


@runtime_checkable
class CaptureTargetLike(RoutingCapturerLike, Protocol):
    """One layer's destination (satisfied by issue 3's ``CaptureTarget``).

    layer_id: int - index into buffer's layer dimension
    layout: BatchLayout - how the rows of the ids handed to the capture are arranged
    """

    layer_id: int
    layout: BatchLayout


_CAPTURER_FIELDS = ("buffer", "token_counts", "dp_rank", "shard_sizes")


def buffer_column(capturer: object, layer_id: int) -> int:
    """The capture-buffer column of a MoE layer.

    A capturer with a ``RoutingShape`` (``moe_ops.RoutingCapturer``, whose layer axis holds MoE
    layers only) maps the model layer index ``layer_id`` with ``shape.buffer_layer`` (ValueError for
    a dense layer); any other capturer takes ``layer_id`` as the column.
    """
    shape = getattr(capturer, "shape", None)
    if shape is not None and hasattr(shape, "buffer_layer"):
        return shape.buffer_layer(layer_id)
    return layer_id


def check_capturer(capturer: object, what: str = "capturer") -> None:
    """TypeError naming the missing attributes when ``capturer`` is not :class:`RoutingCapturerLike`."""
    missing = [name for name in _CAPTURER_FIELDS if not hasattr(capturer, name)]
    if missing:
        raise TypeError(
            f"{what} must have the attributes {', '.join(_CAPTURER_FIELDS)} (RoutingCapturerLike); "
            f"{type(capturer).__name__} lacks {', '.join(missing)}"
        )


def capture_ids(
    capturer: RoutingCapturerLike,
    layer_id: int,
    topk_ids: torch.Tensor,
    layout: BatchLayout | int,
    tp_group=None,
) -> None:
    """Records this DP rank's rows of ``topk_ids`` into ``capturer.buffer[:, layer_id]``.

    topk_ids: (n, top_k) integer, on the buffer's device - ids in the rows of ``layout`` (for a
        kernel's ``routing_replay_out``, exactly the first ``num_tokens`` rows it wrote)

    ``shard_sizes`` is passed only to the layouts that use it (GATHERED, SHARDED). Raises what
    :func:`moe_ops.capture_routing` raises for bad arguments, before anything is written.
    """
    layout = layout_from_value(layout)
    shard_sizes = capturer.shard_sizes if layout in (BatchLayout.GATHERED, BatchLayout.SHARDED) else None
    capture_routing(
        capturer.buffer,
        topk_ids,
        layer_id,
        token_counts=capturer.token_counts,
        dp_rank=capturer.dp_rank,
        layout=layout,
        shard_sizes=shard_sizes,
        tp_group=tp_group,
    )
