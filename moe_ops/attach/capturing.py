"""The capturing router wrapper: a router's forward whose ids also go to a capturer.

:func:`capturing_forward` runs the router, hands the one integer tensor of its output (the expert
ids the experts consume next, :func:`routed_ids`) to ``capturer.capture(layer, ids,
layout=layout)`` and returns the output unchanged; :func:`check_capture_sites` refuses a router
that already captures; :class:`CaptureHandle` is what ``attach_capture`` returns. The mirror of
:mod:`moe_ops.attach.replaying`, on the plumbing of :mod:`moe_ops.attach.sites`; nothing here
imports replay.

Order with a replay: attached before ``attach_replay`` the capture sits under the replaying
wrapper and records the router's own (live) ids; attached after it, on top, it records the
replayed ids the experts get.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..capture.protocol import Capturer
from ..layout import BatchLayout
from .sites import CAPTURE_MARK, AttachHandle, RouterSite, check_unwrapped, describe_output, mark_wrapper

__all__ = ["CaptureHandle", "capturing_forward", "check_capture_sites", "routed_ids"]


class CaptureHandle(AttachHandle):
    """What ``attach_capture`` attached; ``remove()`` (or leaving a ``with`` block) undoes it.
    See :class:`~moe_ops.attach.sites.AttachHandle` (``rules`` is ``()``)."""


def routed_ids(output: Any) -> torch.Tensor:
    """The integer tensor of a router's output tuple: ``(n_tokens, top_k)`` expert ids.

    Whatever its position (GraniteMoE's router returned ``(ids, weights, logits)`` up to
    transformers 5.17, ``(logits, weights, ids)`` since), reshaped to 2-D. Reads dtypes and shapes
    only (trace-time metadata under torch.compile), never values. TypeError describing the output
    when it has no integer tensor or more than one.
    """
    if isinstance(output, (tuple, list)):
        ints = [
            t
            for t in output
            if isinstance(t, torch.Tensor)
            and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
        ]
        if len(ints) == 1:
            ids = ints[0]
            return ids if ids.dim() == 2 else ids.reshape(-1, ids.shape[-1])
    raise TypeError(
        "a router's forward must return (router_logits, weights, ids) with exactly one integer tensor "
        f"(the expert ids); got {describe_output(output)}"
    )


def capturing_forward(original: Callable, capturer: Capturer, layer: int, layout: BatchLayout) -> Callable:
    """``original`` followed by ``capturer.capture(layer, ids, layout=layout)``; returns its output.

    Dynamo inlines it (a closure over plain Python values and the registered capture op).
    """

    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        capturer.capture(layer, routed_ids(output), layout=layout)
        return output

    return mark_wrapper(forward, CAPTURE_MARK, original)


def check_capture_sites(sites: Sequence[RouterSite]) -> None:
    """ValueError for a router that already captures (its capture outermost, or under a replay
    attached on top of it): one capture per router. A replay attached before is no error: the
    capture goes on top of it and records the replayed ids."""
    check_unwrapped(sites, CAPTURE_MARK, "capture")
