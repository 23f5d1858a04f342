"""moe-ops: rollout routing replay for mixture-of-experts models.

Records which experts a MoE router chose, for every token and every MoE layer, while the model runs
eagerly, under ``torch.compile`` or replayed from CUDA graphs. The data path is the package layout:
route -> capture -> transfer -> store -> wire.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Every public name resolves on first use (PEP 562), from the submodule that defines it: `import
# moe_ops` imports no torch, so `moe-ops --help` and `--version` answer at once (they took 6-7 s of
# CPU importing torch and torch._dynamo), and the optional integrations (FlashInfer, transformers)
# load only when their names are used, registering no op before. Any attribute access loads its
# submodule, whose import registers that module's custom ops.
_EXPORTS = {
    "moe_ops.capture": (
        "CaptureFaultError",
        "CaptureTarget",
        "LayerCapture",
        "MoEDispatchConfig",
        "RoutingReplayExperts",
        "RoutingReplayLayer",
        "bind_routing_capture",
        "capture_error_counter",
        "capture_routing",
        "check_capture_errors",
        "unbind_routing_capture",
    ),
    "moe_ops.capture.capturer": ("RoutingCapturer",),
    "moe_ops.faults": ("FaultSummary", "FaultsError", "check_faults"),
    "moe_ops.guards": ("UnsupportedConfigError", "validate_serving_config"),
    "moe_ops.layout": ("BatchLayout", "infer_layout"),
    "moe_ops.replay": ("RoutingMismatch", "replay_routing", "routing_mismatch"),
    "moe_ops.replay.replayer": ("RoutingReplayer", "replay_batch"),
    "moe_ops.router": ("GroupScore", "NonFiniteRowsError", "RoutingMethod", "check_nonfinite_rows", "route"),
    "moe_ops.shapes": ("RoutingShape", "narrow_dtype", "resolve_routing_shape"),
    "moe_ops.store": ("FinishedRouting", "RoutingLedger", "ScheduledStep", "SlotStore"),
    "moe_ops.transfer": ("RingFullError", "SnapshotHandle", "TransferPipeline"),
    "moe_ops.wire": (
        "decode_routing",
        "decode_routing_bytes",
        "decode_routing_weights",
        "encode_routing",
        "encode_routing_bytes",
        "encode_routing_weights",
    ),
    # optional integrations
    "moe_ops.integrations.hf": ("attach_capture", "attach_replay"),
    "moe_ops.backend_report": ("backends",),
}
_LAZY = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # what static tools read; at run time __getattr__ resolves these
    from .backend_report import backends
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
    from .faults import FaultsError, FaultSummary, check_faults
    from .guards import UnsupportedConfigError, validate_serving_config
    from .integrations.hf import attach_capture, attach_replay
    from .layout import BatchLayout, infer_layout
    from .replay import RoutingMismatch, replay_routing, routing_mismatch
    from .replay.replayer import RoutingReplayer, replay_batch
    from .router import GroupScore, NonFiniteRowsError, RoutingMethod, check_nonfinite_rows, route
    from .shapes import RoutingShape, narrow_dtype, resolve_routing_shape
    from .store import FinishedRouting, RoutingLedger, ScheduledStep, SlotStore
    from .transfer import RingFullError, SnapshotHandle, TransferPipeline
    from .wire import (
        decode_routing,
        decode_routing_bytes,
        decode_routing_weights,
        encode_routing,
        encode_routing_bytes,
        encode_routing_weights,
    )


# the modules an eager `import moe_ops` used to import: the first public name used loads them all, so
# that from then on the package is what it always was (every core op registered, every subpackage bound)
_CORE = tuple(m for m in _EXPORTS if m not in ("moe_ops.integrations.hf", "moe_ops.backend_report"))


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None and (name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is None):
        raise AttributeError(f"module 'moe_ops' has no attribute {name!r}")
    if module is not None:
        for core in _CORE:  # a public name loads the core, as the eager root did (its ops registered)
            importlib.import_module(core)
        value = getattr(importlib.import_module(module), name)
    else:  # a submodule (moe_ops.replay, moe_ops.cli, ...): that module alone, on first use
        value = importlib.import_module(f"{__name__}.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BatchLayout",
    "CaptureFaultError",
    "CaptureTarget",
    "FaultSummary",
    "FaultsError",
    "FinishedRouting",
    "GroupScore",
    "LayerCapture",
    "MoEDispatchConfig",
    "NonFiniteRowsError",
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
    "check_faults",
    "check_nonfinite_rows",
    "decode_routing",
    "decode_routing_bytes",
    "decode_routing_weights",
    "encode_routing",
    "encode_routing_bytes",
    "encode_routing_weights",
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
