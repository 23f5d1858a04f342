"""Pipeline schedules: one replay slot per micro-batch, in its forward and in its backward's
recompute (:func:`replaying_forward_step`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["replaying_forward_step"]


def _current_microbatch(model: nn.Module) -> int:
    """The micro-batch Megatron's schedule runs: what ``set_current_microbatch`` stored on the
    decoder's (or, on a stage without decoder layers, the MTP block's) transformer layers."""
    from megatron.core.utils import get_attr_wrapped_model

    layers: list[Any] = []
    for attr, pick in (
        ("decoder", lambda m: m.layers),
        ("mtp", lambda m: [x.transformer_layer for x in m.layers]),
    ):
        try:
            owner = get_attr_wrapped_model(model, attr, allow_none=False, return_model_obj=True)
        except RuntimeError:
            continue
        layers = list(pick(getattr(owner, attr)))
        if layers:
            break
    microbatch = getattr(layers[0], "current_microbatch", None) if layers else None
    if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 0:
        raise ValueError(
            "replaying_forward_step reads the micro-batch that Megatron's schedule runs from "
            "model.decoder.layers[0].current_microbatch (set by forward_backward_func before each "
            f"forward step), got {microbatch!r}: call the wrapped function through Megatron's schedule"
        )
    return microbatch


def _hook_outputs(replayer: Any, output: Any, slot: int) -> Any:
    if isinstance(output, torch.Tensor):
        return replayer.select_in_backward(output, slot)
    if isinstance(output, (list, tuple)):
        hooked = [_hook_outputs(replayer, o, slot) for o in output]
        return type(output)(hooked) if isinstance(output, list) else tuple(hooked)
    return output


def replaying_forward_step(forward_step_func: Callable, replayer: Any) -> Callable:
    """Wraps a Megatron ``forward_step_func(data_iterator, model[, ...])`` so that micro-batch ``m``
    routes with replay slot ``m % replayer.num_slots``, in its forward and in the activation
    recompute of its backward.

    Before calling ``forward_step_func`` the wrapper selects that slot (``replayer.select``), the
    micro-batch number being what Megatron's schedule (``forward_backward_func``: no pipelining,
    1F1B, interleaved) stored on the model's layers for this forward step; after it, it puts
    ``replayer.select_in_backward`` on the returned output tensor(s), so the slot is selected again
    when that micro-batch's backward starts, even after later micro-batches' forwards (1F1B). Fill
    the slots before the step (``replayer.set_batch(routing_of[m], slot=m)`` for every micro-batch,
    with ``num_slots >= num_microbatches``), or inside ``forward_step_func`` from the batch it reads
    (``replayer.set_batch(batch_routing, slot=replayer.slot)``; then ``num_slots`` must be at least
    the micro-batches in flight at once). The signature is ``forward_step_func``'s
    (``functools.wraps``), so Megatron passes the same arguments. ValueError (at the forward step)
    when no schedule set the micro-batch.
    """
    if not callable(forward_step_func):
        raise TypeError(f"forward_step_func must be callable, got {type(forward_step_func).__name__}")
    for name in ("select", "select_in_backward", "num_slots"):
        if not hasattr(replayer, name):
            raise TypeError(
                f"replayer must be a moe_ops.RoutingReplayer (no {name!r}), got {type(replayer).__name__}"
            )

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator: Any, model: nn.Module, *args: Any, **kwargs: Any):
        slot = _current_microbatch(model) % replayer.num_slots
        replayer.select(slot)
        output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
        return _hook_outputs(replayer, output, slot), loss_func

    return forward_step
