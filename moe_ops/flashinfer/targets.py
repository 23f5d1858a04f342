"""How the FlashInfer paths reach a capturer: the capture contract of :mod:`moe_ops.capture.target`.

* :class:`RoutingCapturerLike` - the per-model capture state (``moe_ops.RoutingCapturer``); the
  binding (:mod:`moe_ops.flashinfer.experts`) hands one to every MoE layer.
* :class:`CaptureTarget` - one layer's destination; :func:`moe_ops.flashinfer.route_flashinfer`
  takes one as ``capture``.

:func:`capture_ids` is the step both use after a kernel wrote ids: one ``capture_routing`` op on a
target built by :meth:`CaptureTarget.of` (a registered custom op, so it is traced by
``torch.compile`` and recorded by CUDA graphs; no Python callback and no host read runs per step).
"""

from __future__ import annotations

import torch

from ..capture.op import capture_into
from ..capture.target import CaptureTarget, RoutingCapturerLike
from ..layout import BatchLayout

__all__ = [
    "CaptureTarget",
    "CaptureTargetLike",
    "RoutingCapturerLike",
    "buffer_column",
    "capture_ids",
    "check_capturer",
]

# The one target type; the name is kept for callers of the earlier protocol.
CaptureTargetLike = CaptureTarget

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

    The rows are selected by :meth:`CaptureTarget.of` (the capture contract), exactly as
    ``RoutingCapturer.capture`` selects them. Raises what ``capture_routing`` raises for bad
    arguments, before anything is written.
    """
    capture_into(CaptureTarget.of(capturer, layer_id, layout, tp_group=tp_group), topk_ids)
