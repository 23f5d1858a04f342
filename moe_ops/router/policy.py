"""Which backend ``route(..., backend="auto")`` runs for each routing method, and why.

The policy of the router, kept with it: FlashInfer's device support (:mod:`moe_ops.flashinfer.backends`)
says where its ``fused_topk_deepseek`` can run; this module decides whether ``auto`` uses it there.
``moe_ops.backends()`` reports the same decision (:func:`routing_backend`), so the report says exactly
what a call would do. FlashInfer's modules are imported inside the functions only: importing
``moe_ops.route`` imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import HAS_TRITON
from .methods import RoutingMethod

__all__ = ["PREFER_FLASHINFER_ROUTING", "BackendLine", "auto_uses_flashinfer", "routing_backend"]

# backend="auto" for DEEPSEEK_V3 on an H200 (bf16 logits, 256 experts, k 8, 8 groups keep 4; us per
# call inside a 61-call CUDA graph, benchmarks/bench_routing.py). The first Triton router lost to
# FlashInfer's fused_topk_deepseek without capture (6.25 / 6.48 / 18.4 us at n = 1 / 128 / 4096
# against 3.98 / 4.47 / 13.8, single-call graphs), so auto used FlashInfer then. The current one
# routes in 2.99 / 3.28 / 9.13 us; the bare FlashInfer kernel takes 2.65 / 2.99 / 12.2, and
# route(backend="flashinfer") - that kernel plus the cast of its bf16 weights to float32 - 4.65 /
# 5.97 / 15.7 (a 32-call graph). With capture the Triton router's fused capture wins by more (2.98 /
# 3.27 / 9.43 against 5.65 / 7.85 / 17.3 for the kernel's replay rows + the capture op). So auto
# uses the Triton router; backend="flashinfer" still runs the FlashInfer kernel on request.
PREFER_FLASHINFER_ROUTING = False


@dataclass(frozen=True)
class BackendLine:
    """One row of the report: a routing method or a kernel, the backend it uses, and why."""

    # a routing method name (DEEPSEEK_V3) or a FlashInfer function name (trtllm_bf16_moe)
    subject: str
    # "flashinfer", "triton", "torch" or "unavailable"
    backend: str
    # one line: what runs, or what is missing
    reason: str


def _cuda_available(device: torch.device | str | int | None) -> bool:
    """A CUDA device is asked about (or, for None, exists)."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available()


def _triton_line(method_name: str, device: torch.device | str | int | None, why_not: str) -> BackendLine:
    if _cuda_available(device) and HAS_TRITON:
        return BackendLine(method_name, "triton", f"Triton router ({why_not})")
    return BackendLine(method_name, "torch", f"PyTorch reference router ({why_not}; Triton needs CUDA)")


def routing_backend(
    method: RoutingMethod | int, device: torch.device | str | int | None = None, *, capture: bool = False
) -> BackendLine:
    """The backend ``route(..., backend="auto")`` uses for ``method`` on ``device``, and why.

    ``capture``: whether the call records ids (then the Triton router's fused capture is used).
    """
    method = RoutingMethod(int(method))
    if method != RoutingMethod.DEEPSEEK_V3:
        return _triton_line(method.name, device, "FlashInfer's fused routing covers DEEPSEEK_V3 only")
    from ..flashinfer.backends import fused_topk_support

    support = fused_topk_support(device)
    if not support.ok:
        return _triton_line(method.name, device, support.reason)
    if capture:
        return _triton_line(
            method.name + " +capture",
            device,
            "its fused capture measured faster than fused_topk_deepseek + capture op",
        )
    if not PREFER_FLASHINFER_ROUTING:
        return _triton_line(method.name, device, "measured faster than route(backend='flashinfer')")
    return BackendLine(
        method.name, "flashinfer", support.reason + "; with capture: Triton (fused capture is faster)"
    )


@torch._dynamo.assume_constant_result
def auto_uses_flashinfer(
    device: torch.device, method: int, num_experts: int, top_k: int, n_group, topk_group
) -> bool:
    """backend="auto" without capture: FlashInfer's fused_topk_deepseek where it runs, takes these
    arguments and ``PREFER_FLASHINFER_ROUTING`` says it is faster (currently not: the Triton router
    measured faster on the H200, see the numbers above it). Host-only checks, evaluated once at
    trace time under torch.compile."""
    if device.type != "cuda" or method != RoutingMethod.DEEPSEEK_V3:
        return False
    try:
        from ..flashinfer.routing import check_grouping
    except ImportError:
        return False
    if routing_backend(method, device).backend != "flashinfer":
        return False
    try:
        check_grouping(
            num_experts, top_k, 1 if n_group is None else n_group, 1 if topk_group is None else topk_group
        )
    except ValueError:
        return False
    return True
