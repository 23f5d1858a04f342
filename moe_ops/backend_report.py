"""``moe_ops.backends()`` and ``moe-ops backends``: which backend each routing method and each wrapped
FlashInfer kernel uses on this machine, and why.

The routing lines are the router's own rule (:func:`moe_ops.router.policy.routing_backend`: what
``route(..., backend="auto")`` runs); the kernel lines are FlashInfer's device checks
(:func:`moe_ops.flashinfer.backends.kernel_support`, which its ops ask before a launch). So the
report says exactly what a call would do.

``moe_ops.flashinfer`` is imported by :func:`backends` (that registers its ops), never by importing
this module. The module is not called ``backends``: a submodule of that name would replace the
function ``moe_ops.backends`` on the package as soon as anything imported it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .router.methods import RoutingMethod
from .router.policy import BackendLine, routing_backend

__all__ = ["BackendLine", "BackendsReport", "backends"]


@dataclass(frozen=True)
class BackendsReport:
    """What :func:`backends` found; ``str(report)`` is the text ``moe-ops backends`` prints."""

    # the device described, e.g. "NVIDIA H200 (SM90)" or "no CUDA device"
    device: str
    # installed flashinfer-python version, or "not installed"
    flashinfer: str
    # one line per routing method, for route(..., backend="auto")
    routing: tuple[BackendLine, ...]
    # one line per wrapped FlashInfer function (torch.ops.moe_ops.flashinfer_<name>)
    kernels: tuple[BackendLine, ...]

    def format(self) -> str:
        width = max(len(line.subject) for line in (*self.routing, *self.kernels))
        lines = [
            f"moe-ops backends on {self.device}; flashinfer {self.flashinfer}",
            'routing (backend="auto"):',
        ]
        lines += [f"  {ln.subject:<{width}}  {ln.backend:<11}  {ln.reason}" for ln in self.routing]
        lines.append("FlashInfer kernels (torch.ops.moe_ops.flashinfer_<name>):")
        lines += [f"  {ln.subject:<{width}}  {ln.backend:<11}  {ln.reason}" for ln in self.kernels]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def backends(device: torch.device | str | int | None = None) -> BackendsReport:
    """Reports which backend each routing method and each wrapped FlashInfer kernel uses, and why.

    Args:
        device: the device to describe (default: the current CUDA device, if any).
    """
    from .flashinfer.backends import device_description, flashinfer_version, kernel_support
    from .flashinfer.ops import SPECS

    routing = tuple(routing_backend(m, device) for m in RoutingMethod)
    kernels = []
    for spec in SPECS.values():
        support = kernel_support(spec.name, device)
        reason = support.reason
        if not spec.writes_replay:
            reason += "; precomputed top-k: leaves routing_replay_out untouched"
        kernels.append(BackendLine(spec.name, "flashinfer" if support.ok else "unavailable", reason))
    return BackendsReport(
        device=device_description(device),
        flashinfer=flashinfer_version() or "not installed",
        routing=routing,
        kernels=tuple(kernels),
    )
