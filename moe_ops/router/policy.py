"""What ``route(..., backend="auto")`` runs: the Triton router where it runs, else the PyTorch reference.

:func:`auto_runs_triton` is the rule ``route`` and ``replay_routing`` apply (beside the width limit of
the kernel's tile, :data:`~moe_ops.router.args.TRITON_MAX_TILE`); :func:`routing_backend` is the
line ``moe_ops.backends()`` prints for it. FlashInfer's ``fused_topk_deepseek`` runs only when a
caller asks for it (``backend="flashinfer"``); docs/routing.md gives the H200 times behind that.
Nothing here imports ``moe_ops.flashinfer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._runtime.triton import HAS_TRITON, triton_runs_on
from .args import TRITON_MAX_TILE
from .methods import RoutingMethod

__all__ = ["BackendLine", "auto_runs_triton", "routing_backend"]


@dataclass(frozen=True)
class BackendLine:
    """One row of the report: a routing method or a kernel, the backend it uses, and why."""

    # a routing method name (DEEPSEEK_V3) or a FlashInfer function name (trtllm_bf16_moe)
    subject: str
    # "flashinfer", "triton", "torch" or "unavailable"
    backend: str
    # one line: what runs, or what is missing
    reason: str


def auto_runs_triton(device: torch.device) -> bool:
    """Whether ``backend="auto"`` runs the Triton router on tensors of ``device`` (for rows that fit
    its tile): on CUDA, with Triton compiling there. CPU tensors take the PyTorch reference, also
    where TRITON_INTERPRET=1 lets the kernel run on them (the interpreter is for tests)."""
    return device.type == "cuda" and triton_runs_on(device)


def _why_not_triton(device: torch.device) -> str:
    if device.type != "cuda":
        return f"the Triton router needs a CUDA device, asked about {device}"
    if not torch.cuda.is_available():
        return "no CUDA device; the Triton router needs one"
    if not HAS_TRITON:
        return "Triton is not installed"
    return "TRITON_INTERPRET=1 is set: Triton kernels are interpreted in this process"


def routing_backend(
    method: RoutingMethod | int, device: torch.device | str | int | None = None
) -> BackendLine:
    """The backend ``route(..., backend="auto")`` uses for ``method`` on ``device``, and why.

    ``device``: the device to describe (default: the current CUDA device, if any). Host-only:
    reads no tensor.
    """
    method = RoutingMethod(int(method))
    asked = torch.device("cuda") if device is None else torch.device(device)
    if not (torch.cuda.is_available() and auto_runs_triton(asked)):
        return BackendLine(method.name, "torch", f"PyTorch reference router ({_why_not_triton(asked)})")
    reason = f"Triton router; rows over {TRITON_MAX_TILE} padded experts: the PyTorch reference"
    if method == RoutingMethod.DEEPSEEK_V3:
        reason += "; measured faster than fused_topk_deepseek (backend='flashinfer')"
    return BackendLine(method.name, "triton", reason)
