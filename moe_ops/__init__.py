"""moe-ops: rollout routing replay for mixture-of-experts models.

Records which experts a MoE router chose, for every token and every MoE layer, while the model runs
eagerly, under ``torch.compile`` or replayed from CUDA graphs. The data path is the package layout:
route -> capture -> transfer -> store -> wire.
"""

from .capture import (
    CaptureFaultError,
    CaptureTarget,
    LayerCapture,
    MoEDispatchConfig,
    RoutingReplayExperts,
    RoutingReplayLayer,
    bind_routing_capture,
    capture_error_counter,
    capture_routing,
    check_capture_errors,
    unbind_routing_capture,
)
from .capture.capturer import RoutingCapturer
from .guards import UnsupportedConfigError, validate_serving_config
from .layout import BatchLayout, infer_layout
from .replay import RoutingMismatch, replay_routing, routing_mismatch
from .replay.replayer import RoutingReplayer, replay_batch
from .router import RoutingMethod, route
from .shapes import RoutingShape, narrow_dtype, resolve_routing_shape
from .store import FinishedRouting, RoutingLedger, ScheduledStep, SlotStore
from .transfer import RingFullError, SnapshotHandle, TransferPipeline
from .wire import decode_routing, decode_routing_bytes, encode_routing, encode_routing_bytes

__version__ = "0.1.0"

# Optional integrations resolve on first use, so that `import moe_ops` imports neither FlashInfer
# nor transformers and registers no FlashInfer op.
_LAZY = {
    "attach_capture": ("moe_ops.integrations.hf", "attach_capture"),
    "attach_replay": ("moe_ops.integrations.hf", "attach_replay"),
    "backends": ("moe_ops.backend_report", "backends"),
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'moe_ops' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BatchLayout",
    "CaptureFaultError",
    "CaptureTarget",
    "FinishedRouting",
    "LayerCapture",
    "MoEDispatchConfig",
    "RingFullError",
    "RoutingCapturer",
    "RoutingLedger",
    "RoutingMethod",
    "RoutingMismatch",
    "RoutingReplayExperts",
    "RoutingReplayLayer",
    "RoutingReplayer",
    "RoutingShape",
    "ScheduledStep",
    "SlotStore",
    "SnapshotHandle",
    "TransferPipeline",
    "UnsupportedConfigError",
    "attach_capture",
    "attach_replay",
    "backends",
    "bind_routing_capture",
    "capture_error_counter",
    "capture_routing",
    "check_capture_errors",
    "decode_routing",
    "decode_routing_bytes",
    "encode_routing",
    "encode_routing_bytes",
    "infer_layout",
    "narrow_dtype",
    "replay_batch",
    "replay_routing",
    "resolve_routing_shape",
    "route",
    "routing_mismatch",
    "unbind_routing_capture",
    "validate_serving_config",
]
