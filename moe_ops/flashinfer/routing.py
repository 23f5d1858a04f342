"""DeepSeek-V3 routing with FlashInfer's ``fused_topk_deepseek``; fused capture through its replay output.

``route(..., backend="flashinfer")`` (``moe_ops.route``) calls :func:`route_flashinfer`.
With a capture target, the kernel also writes the chosen ids into an int16 ``routing_replay_out``
scratch and one ``capture_routing`` op copies this rank's rows of it into the capture buffer::

    router_logits (n, E) --fused_topk_deepseek--> weights (n, k) f32, ids (n, k) i32
                                        \\--routing_replay_out--> scratch[:n] (n, k) i16
                                                 \\--capture_routing(layout, counts)--> buffer[:c, layer]

Both ops are registered custom ops, so the path traces under ``torch.compile(fullgraph=True)`` and
is recorded by CUDA graphs; no host read happens per call.
"""

from __future__ import annotations

import torch

from ..capture.op import capture_into, tp_world_size
from ..capture.target import CaptureTarget
from ..layout import BatchLayout
from . import ops
from .backends import DEEPSEEK_V3, fused_topk_support

__all__ = ["DEEPSEEK_V3", "route_flashinfer"]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# device -> top_k -> (capacity, top_k) int16 scratch for routing_replay_out, shared by all layers:
# each call's kernel writes it and the capture reads it, in stream order, before the next call.
_replay_scratch: dict[tuple[torch.device, int], torch.Tensor] = {}


def _scratch(device: torch.device, top_k: int, rows: int) -> torch.Tensor:
    """(rows, top_k) int16 rows of the persistent replay scratch (grown to a power of two, eager only).

    Inside a CUDA-graph capture a scratch that is too small is not replaced (that would free memory
    the graph may still use): the call gets a fresh tensor from the graph's pool instead. Warm up
    eagerly at the largest batch to keep one persistent scratch.
    """
    key = (device, top_k)
    scratch = _replay_scratch.get(key)
    if scratch is None or scratch.shape[0] < rows:
        capacity = 1 << max(rows - 1, 0).bit_length()
        fresh = torch.empty((capacity, top_k), dtype=torch.int16, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return fresh[:rows]
        _replay_scratch[key] = scratch = fresh
    return scratch[:rows]


def check_grouping(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """fused_topk_deepseek's limits (FlashInfer 0.7.2 checks these too, but only when it runs)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(8, num_experts):
        raise ValueError(
            f"top_k must be an int in [1, min(8, num_experts={num_experts})] for fused_topk_deepseek, "
            f"got {top_k!r}"
        )
    if not 1 <= n_group <= 32 or num_experts % n_group:
        raise ValueError(f"n_group must divide num_experts={num_experts} and be in [1, 32], got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    per_group = num_experts // n_group
    if topk_group * per_group < top_k:
        raise ValueError(
            f"topk_group={topk_group} groups of {per_group} experts cannot hold top_k={top_k} experts"
        )
    if n_group > 1 and (per_group > 32 or per_group * topk_group > 128):
        raise ValueError(
            f"fused_topk_deepseek needs num_experts / n_group <= 32 and that times topk_group <= 128, "
            f"got {per_group} and {per_group * topk_group}; use backend='triton'"
        )
    if n_group == 1 and num_experts > 384:
        raise ValueError(
            f"fused_topk_deepseek needs num_experts <= 384 without groups, got {num_experts}; "
            "use backend='triton'"
        )


def _check_capture(capture: CaptureTarget, replay: torch.Tensor) -> None:
    """Checks the capture target against the replay rows before the kernel runs (shapes only)."""
    if not isinstance(capture, CaptureTarget):
        raise TypeError(f"capture must be a CaptureTarget or None, got {type(capture).__name__}")
    capture.check_router_capture()
    if capture.layout == BatchLayout.SEQUENCE_PARALLEL and tp_world_size(capture.tp_group) > 1:
        return  # capture_into checks the gathered rows
    capture.check_ids(replay)


def route_flashinfer(
    router_logits: torch.Tensor,
    top_k: int,
    method: int,
    *,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    capture: CaptureTarget | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing with FlashInfer's ``fused_topk_deepseek``; optionally captures the ids.

    Args:
        router_logits: (n, num_experts) float32/bfloat16/float16, CUDA (meta for shape tracing) -
            the gate's logits, before the sigmoid.
        top_k: experts per token, in [1, 8].
        method: the routing method; only DEEPSEEK_V3 (2) runs here.
        bias: (num_experts,) float - DeepSeek's score-correction bias added to the sigmoid scores
            for selection only (None: zeros, one small allocation per call).
        n_group: expert groups (None: 1); topk_group: groups kept per token (None: 1).
        routed_scaling_factor: multiplies the normalised weights (None: 1.0).
        capture: where to record the ids (a ``CaptureTarget``: buffer, layer_id, token_counts,
            dp_rank, layout, shard_sizes; optional tp_group for SEQUENCE_PARALLEL), or None. The
            kernel writes them into a persistent int16 ``routing_replay_out`` scratch and one
            ``capture_routing`` op copies this rank's rows into ``capture.buffer[:, layer_id]``.

    Returns:
        weights: (n, top_k) float32 - ``sigmoid(logit) / sum * routed_scaling_factor`` per chosen expert
        ids: (n, top_k) int32 - chosen expert ids; the column order is the kernel's, compare rows
            as sets

    Raises ValueError (TypeError for a capture object lacking fields) before any kernel runs: another
    method, logits not on a CUDA device (use backend="triton"), a device FlashInfer does not
    support, limits of the kernel (top_k <= 8, group sizes), a bad capture target.
    """
    if int(method) != DEEPSEEK_V3:
        name = getattr(method, "name", method)
        raise ValueError(
            f"route_flashinfer runs FlashInfer's fused_topk_deepseek, which implements DEEPSEEK_V3 "
            f"({DEEPSEEK_V3}) only; got method {name}. Use backend='triton' for it."
        )
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        shape = tuple(router_logits.shape) if isinstance(router_logits, torch.Tensor) else type(router_logits)
        raise ValueError(f"router_logits must be a 2-D (n, num_experts) tensor, got {shape}")
    if router_logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"router_logits must be float32, bfloat16 or float16, got {router_logits.dtype}")
    device = router_logits.device
    if device.type not in ("cuda", "meta"):
        raise ValueError(
            f"route_flashinfer needs a CUDA device (fused_topk_deepseek is a CUDA kernel); router_logits "
            f"is on {device}. Use backend='triton'."
        )
    if device.type == "cuda" and not torch.compiler.is_compiling():
        support = fused_topk_support(device)
        if not support.ok:
            raise ValueError(
                f"route_flashinfer cannot run on {device}: {support.reason}. Use backend='triton'."
            )
    n, num_experts = router_logits.shape
    n_group = 1 if n_group is None else int(n_group)
    topk_group = 1 if topk_group is None else int(topk_group)
    check_grouping(num_experts, top_k, n_group, topk_group)
    if bias is None:
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
    elif bias.shape != (num_experts,) or bias.dtype not in _LOGIT_DTYPES or bias.device != device:
        raise ValueError(
            f"bias must be a ({num_experts},) float tensor on {device}, got {tuple(bias.shape)} "
            f"{bias.dtype} on {bias.device}"
        )
    scaling = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)

    replay = None
    if capture is not None:
        if torch.compiler.is_compiling():
            # compiled graphs allocate from their own (reused, CUDA-graph-static) pool
            replay = torch.empty((n, top_k), dtype=torch.int16, device=device)
        else:
            replay = _scratch(device, top_k, n)
        _check_capture(capture, replay)

    topk_values = torch.empty((n, top_k), dtype=router_logits.dtype, device=device)
    topk_indices = torch.empty((n, top_k), dtype=torch.int32, device=device)
    if n > 0:  # the kernel launches one block per token: a zero-block grid is an invalid launch
        ops.call(
            "fused_topk_deepseek",
            scores=router_logits.contiguous(),
            bias=bias.contiguous(),
            n_group=n_group,
            topk_group=topk_group,
            topk=top_k,
            routed_scaling_factor=scaling,
            topk_values=topk_values,
            topk_indices=topk_indices,
            routing_replay_out=replay,
        )
    weights = topk_values if topk_values.dtype == torch.float32 else topk_values.float()
    if capture is not None:
        # the weights route returns, column for column with the replay ids (the kernel writes both
        # in its own order, one row at a time)
        capture_into(capture, replay, weights if capture.has_weights else None)
    return weights, topk_indices
