"""Capture: the routing-replay capture op and its device-side fault counters."""

from .errors import CaptureFaultError, capture_error_counter, check_capture_errors
from .op import capture_routing
from .target import CaptureTarget

__all__ = [
    "CaptureFaultError",
    "CaptureTarget",
    "capture_error_counter",
    "capture_routing",
    "check_capture_errors",
]
