"""FlashInfer integration: monolithic MoE kernels and fused routing as compile-safe custom ops.

* :mod:`.ops` - the table of wrapped FlashInfer functions and the ops generated from it
  (``torch.ops.moe_ops.flashinfer_<name>``), with :func:`call`;
* :mod:`.experts` - the monolithic capture contract (experts base, scratch, binding);
* :mod:`.routing` - :func:`route_flashinfer`, DeepSeek-V3 routing with fused capture;
* :mod:`.backends` - which backend runs what on this machine (``moe_ops.backends()``);
* :mod:`.targets` - the capturer / capture-target protocols and the capture step.

FlashInfer itself (``flashinfer-python``, the ``moe-ops[flashinfer]`` extra) is imported lazily, on
the first kernel call or device query: importing this package does not import it.
"""

from .backends import BackendsReport, Support, backends
from .experts import (
    FlashInferExperts,
    LayerCapture,
    MoEDispatchConfig,
    RoutingReplayExperts,
    RoutingReplayLayer,
    bind_routing_capture,
    unbind_routing_capture,
)
from .ops import SPECS, call
from .routing import DEEPSEEK_V3, route_flashinfer
from .targets import CaptureTarget, CaptureTargetLike, RoutingCapturerLike

__all__ = [
    "DEEPSEEK_V3",
    "SPECS",
    "BackendsReport",
    "CaptureTarget",
    "CaptureTargetLike",
    "FlashInferExperts",
    "LayerCapture",
    "MoEDispatchConfig",
    "RoutingCapturerLike",
    "RoutingReplayExperts",
    "RoutingReplayLayer",
    "Support",
    "backends",
    "bind_routing_capture",
    "call",
    "route_flashinfer",
    "unbind_routing_capture",
]
