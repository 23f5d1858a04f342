"""Capture: the routing-replay capture op, its device-side fault counters, what a capturer is
(:class:`Capturer`, :mod:`.protocol`), and the monolithic capture contract (experts kernels that
route inside the kernel, :mod:`.monolithic`)."""

from .errors import CaptureFaultError, capture_error_counter, check_capture_errors
from .monolithic import (
    LayerCapture,
    MoEDispatchConfig,
    RoutingReplayExperts,
    RoutingReplayLayer,
    bind_routing_capture,
    unbind_routing_capture,
)
from .op import capture_routing
from .protocol import Capturer, StepCapturer
from .target import CaptureTarget, LayerIndexError, RoutingCapturerLike

__all__ = [
    "CaptureFaultError",
    "CaptureTarget",
    "Capturer",
    "LayerCapture",
    "LayerIndexError",
    "MoEDispatchConfig",
    "RoutingCapturerLike",
    "RoutingReplayExperts",
    "RoutingReplayLayer",
    "StepCapturer",
    "bind_routing_capture",
    "capture_error_counter",
    "capture_routing",
    "check_capture_errors",
    "unbind_routing_capture",
]
