"""``StepCapturer``: what a step driver (``moe_ops.graphs.StepRunner``) may call on a capturer.

A driver that pads batches to CUDA-graph sizes owns the capturer's live counts around each step:
it writes the step's real counts before the forward and zeroes them before warm-up and capture
runs on padding rows (count 0 records nothing in any layout, :mod:`moe_ops.capture.window`). It
reads two sizes and calls two methods, nothing else; :class:`moe_ops.RoutingCapturer` is one.

It is the step part of :class:`~moe_ops.capture.protocol.Capturer` (which extends it), kept in its
own module so that a step driver depends on these four members only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["STEP_CAPTURER_MEMBERS", "StepCapturer", "check_step_capturer"]

# the members of StepCapturer, in the order errors list them
STEP_CAPTURER_MEMBERS = ("set_step", "clear_counts", "dp_size", "max_num_tokens")


@runtime_checkable
class StepCapturer(Protocol):
    """The step part of a :class:`~moe_ops.capture.protocol.Capturer` (see the module docstring).

    dp_size: int - DP ranks whose counts a step sets (a driver asks for them when > 1)
    max_num_tokens: int - rows of the capture buffer; a driver's padded sizes must fit it
    """

    dp_size: int
    max_num_tokens: int

    def set_step(
        self,
        token_counts: Sequence[int] | np.ndarray | torch.Tensor,
        shard_sizes: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Starts a step: writes its real counts (one per DP rank) into the live counts, in place."""
        ...

    def clear_counts(self, *, stream: torch.cuda.Stream | None = None) -> None:
        """Zeroes the live counts in place, so that the next forward records nothing."""
        ...


def check_step_capturer(capturer: object, what: str = "capturer") -> None:
    """TypeError naming the missing members when ``capturer`` is not a :class:`StepCapturer`."""
    if not isinstance(capturer, StepCapturer):
        missing = [name for name in STEP_CAPTURER_MEMBERS if not hasattr(capturer, name)]
        raise TypeError(
            f"{what} must be a StepCapturer ({', '.join(STEP_CAPTURER_MEMBERS)}); "
            f"{type(capturer).__name__} lacks {', '.join(missing)}"
        )
