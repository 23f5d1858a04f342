"""``CaptureTarget``: where one MoE layer's ids go - the one capture contract every path takes.

``capture_routing``, ``route(..., capture=...)``, ``RoutingCapturer.capture`` / ``target`` and the
monolithic experts all build a :class:`CaptureTarget` and hand it the ids; the target is validated
once, on construction, and the ids once, by :meth:`CaptureTarget.check_ids`. The rows a target
selects come from :mod:`moe_ops.capture.window`, the one row rule.

A capturer is described once, by :class:`~moe_ops.capture.protocol.Capturer`;
:meth:`CaptureTarget.of` is the one mapping from its state and a buffer column to a target, and
``RoutingCapturer.target`` keeps the targets it built (one per layer and layout).

A target resolves to a :class:`~moe_ops.capture.spec.CaptureSpec` (``target.spec``): the device
arguments the ops and kernels take, generated from one place (:mod:`moe_ops.capture.spec`).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..layout import BatchLayout, layout_from_value
from .errors import FAULT_SLOTS, FaultCounter, capture_error_counter
from .kernels import id_limit
from .protocol import Capturer, check_capturer
from .spec import CaptureSpec
from .window import plan_window

__all__ = [
    "BUFFER_DTYPES",
    "ID_DTYPES",
    "MAP_DTYPES",
    "WEIGHT_DTYPES",
    "CaptureTarget",
    "LayerIndexError",
    "RoutingCapturerLike",
    "check_buffer",
    "check_capturer",
    "check_expert_map",
    "check_layer_id",
    "check_process_group",
    "check_weights_buffer",
    "no_expert_map",
    "no_weights",
]

BUFFER_DTYPES = (torch.int16, torch.int32, torch.int64)
# Integer dtypes the kernels read ids in. Quantised, bit-packed and sub-byte integer dtypes
# (quint8, qint32, bits8, uint1, int4, ...) are not ids; unsigned wider than 8 bits has partial
# CUDA support in the torch releases this package runs on.
ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# dtypes of a weights buffer (and of the weights a capture records into it, cast on the way)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# dtypes of an expert map (vLLM's physical_to_logical_map is int64; int32 halves its reads)
MAP_DTYPES = (torch.int32, torch.int64)


def _has_internal_overlap(t: torch.Tensor) -> bool:
    """True unless the strides prove that no two indices of ``t`` address one element.

    Sorted by stride, each stride must exceed the span of the dims below it: exact for expanded
    (stride-0) views, permutations and slices of a dense tensor, conservative beyond. Pure Python
    on shapes and strides, so torch.compile traces it as constants.
    """
    if t.is_contiguous():
        return False
    dims = [(s, n) for s, n in zip(t.stride(), t.shape) if n > 1]
    span = 0
    while dims:
        # smallest stride first (a selection loop: torch.compile cannot trace sorted() here)
        i = 0
        for j in range(1, len(dims)):
            if dims[j][0] < dims[i][0]:
                i = j
        stride, size = dims.pop(i)
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def check_buffer(buffer: object) -> None:
    """ValueError/TypeError unless ``buffer`` is a 3-D int16/int32/int64 tensor without overlap."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dim() != 3:
        raise ValueError(
            f"buffer must be 3-D (max_tokens, num_layers, top_k), got shape {tuple(buffer.shape)}"
        )
    if buffer.dtype not in BUFFER_DTYPES:
        raise ValueError(f"buffer must be int16, int32 or int64, got {buffer.dtype}")
    if _has_internal_overlap(buffer):
        raise ValueError(
            f"buffer must not overlap itself (an expanded or overlapping view, strides "
            f"{tuple(buffer.stride())} for shape {tuple(buffer.shape)}): rows would be written over "
            "each other; allocate it with torch.full or torch.empty"
        )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes of ``t``'s elements in its storage's address space."""
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the byte ranges ``a`` and ``b`` span in memory intersect (conservative: two
    interleaved views that share no element also count). Reads addresses, not device values."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.data_ptr() == 0 or b.data_ptr() == 0:
        return False  # meta tensors: no memory
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def check_weights_buffer(weights_buffer: object, buffer: torch.Tensor) -> None:
    """ValueError/TypeError unless ``weights_buffer`` is a float32/bfloat16/float16 tensor of
    ``buffer``'s shape on its device, without internal overlap and not overlapping ``buffer``.

    The overlap with ``buffer`` is checked on concrete tensors (eagerly); traced
    (``torch.compile``, fake tensors) there are no addresses to compare, and the eager build of the
    same target - a capturer's first call, a warm-up - is the one that checks."""
    if not isinstance(weights_buffer, torch.Tensor):
        raise TypeError(f"weights_buffer must be a torch.Tensor or None, got {type(weights_buffer).__name__}")
    if weights_buffer.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weights_buffer must be float32, bfloat16 or float16, got {weights_buffer.dtype}")
    if weights_buffer.shape != buffer.shape:
        raise ValueError(
            f"weights_buffer must have the buffer's shape {tuple(buffer.shape)} (max_tokens, num_layers, "
            f"top_k), got {tuple(weights_buffer.shape)}"
        )
    if weights_buffer.device != buffer.device:
        raise ValueError(
            f"weights_buffer must be on the buffer's device {buffer.device}, got {weights_buffer.device}"
        )
    if _has_internal_overlap(weights_buffer):
        raise ValueError(
            f"weights_buffer must not overlap itself (strides {tuple(weights_buffer.stride())} for shape "
            f"{tuple(weights_buffer.shape)}): rows would be written over each other"
        )
    if (
        not torch.compiler.is_compiling()
        and not isinstance(weights_buffer, FakeTensor)
        and not isinstance(buffer, FakeTensor)
        and _may_overlap(weights_buffer, buffer)
    ):
        raise ValueError(
            "weights_buffer must not overlap buffer (they share memory): the ids and the weights would "
            "be written over each other; allocate it with its own torch.full or torch.empty"
        )


def check_expert_map(expert_map: object, num_logical_experts: object, buffer: torch.Tensor) -> None:
    """ValueError/TypeError naming the argument unless ``expert_map`` is None (then
    ``num_logical_experts`` must be None too) or a (P,) int32/int64 tensor on ``buffer``'s device,
    P >= 1, any stride (a row of a (num_moe_layers, P) map is one), with ``num_logical_experts`` an
    int >= 1 whose largest id fits ``buffer``'s dtype. The map's VALUES are not read (they live on
    the device and change in place): an entry outside ``[0, num_logical_experts)`` is a fault
    recorded on the device (FAULT_BAD_MAP)."""
    if expert_map is None:
        if num_logical_experts is not None:
            raise ValueError(
                f"num_logical_experts={num_logical_experts!r} given without expert_map: it is the range of "
                "the map's values; pass expert_map too, or neither"
            )
        return
    if not isinstance(expert_map, torch.Tensor):
        raise TypeError(f"expert_map must be a torch.Tensor or None, got {type(expert_map).__name__}")
    if expert_map.dim() != 1 or expert_map.shape[0] < 1:
        raise ValueError(
            "expert_map must be 1-D (P,) with P >= 1 physical expert slots (a row of a (num_moe_layers, P) "
            f"map), got shape {tuple(expert_map.shape)}"
        )
    if expert_map.dtype not in MAP_DTYPES:
        raise ValueError(f"expert_map must be int32 or int64, got {expert_map.dtype}")
    if expert_map.device != buffer.device:
        raise ValueError(
            f"expert_map must be on the buffer's device {buffer.device}, got {expert_map.device}"
        )
    if num_logical_experts is None:
        raise ValueError(
            "num_logical_experts is required with expert_map: the logical experts its values index "
            "(an entry outside [0, num_logical_experts) is a fault)"
        )
    if isinstance(num_logical_experts, bool) or not isinstance(num_logical_experts, int):
        raise TypeError(f"num_logical_experts must be an int, got {type(num_logical_experts).__name__}")
    if num_logical_experts < 1:
        raise ValueError(f"num_logical_experts must be >= 1, got {num_logical_experts}")
    if num_logical_experts - 1 > id_limit(buffer.dtype):
        raise ValueError(
            f"num_logical_experts={num_logical_experts} does not fit the buffer dtype {buffer.dtype} "
            f"(largest id {id_limit(buffer.dtype)}); use an int32 buffer"
        )


@torch._dynamo.assume_constant_result
def _no_map(device: torch.device) -> torch.Tensor:
    """A persistent (0,) int32 tensor per device: the expert map of a target without one (never
    read: the kernels' EXPERT_MAP is False). Its own tensor, not the empty stamps: a stand-in the
    op reads must not alias one it writes."""
    t = _EMPTY_MAP.get(device)
    if t is None:
        t = torch.empty(0, dtype=torch.int32, device=device)
        torch._dynamo.mark_static_address(t)
        t = _EMPTY_MAP.setdefault(device, t)
    return t


_EMPTY_MAP: dict[torch.device, torch.Tensor] = {}


def no_expert_map(like: torch.Tensor) -> torch.Tensor:
    """The (0,) int32 stand-in for "no expert map" on ``like``'s device (cached per device; a fresh
    fake one while ``like`` is a fake tensor traced outside dynamo)."""
    if isinstance(like, FakeTensor):
        return torch.empty(0, dtype=torch.int32, device=like.device)
    return _no_map(like.device)


@torch._dynamo.assume_constant_result
def _no_weights(device: torch.device) -> torch.Tensor:
    """A persistent (0,) float32 tensor per device: the weights buffer of a target without one,
    and the weights a capture without weights passes (never read: the kernels' WEIGHTS is False)."""
    t = _EMPTY_WEIGHTS.get(device)
    if t is None:
        t = torch.empty(0, dtype=torch.float32, device=device)
        torch._dynamo.mark_static_address(t)
        t = _EMPTY_WEIGHTS.setdefault(device, t)
    return t


_EMPTY_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def no_weights(like: torch.Tensor) -> torch.Tensor:
    """The (0,) float32 stand-in for "no weights" on ``like``'s device (cached per device; a fresh
    fake one while ``like`` is a fake tensor traced outside dynamo)."""
    if isinstance(like, FakeTensor):
        return torch.empty(0, dtype=torch.float32, device=like.device)
    return _no_weights(like.device)


# The capture state a target is built from; the one protocol of a capturer is
# moe_ops.capture.protocol.Capturer, this name stays for code written against it.
RoutingCapturerLike = Capturer


class LayerIndexError(IndexError, ValueError):
    """``layer_id`` outside the buffer's layer axis: an IndexError (an index out of range) that is
    also a ValueError (a bad argument), so that the target and the checks made before one is built
    (``RoutingReplayExperts.check_capture_fn``) raise the same error for the same check."""


def check_layer_id(layer_id: object, num_layers: int) -> None:
    """TypeError unless ``layer_id`` is an int (not a bool); :class:`LayerIndexError` unless it is
    in ``[0, num_layers)``."""
    if isinstance(layer_id, bool) or not isinstance(layer_id, int):
        raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
    if not 0 <= layer_id < num_layers:
        raise LayerIndexError(f"layer_id must be in [0, {num_layers}) for this buffer, got {layer_id}")


def check_process_group(name: str, group: object, *, optional: bool = True) -> None:
    """TypeError naming ``name`` unless ``group`` is a ``torch.distributed.ProcessGroup`` (or None
    when ``optional``). Host metadata only; it creates and joins nothing."""
    if group is None and optional:
        return
    import torch.distributed as dist

    # a torch built without distributed has no ProcessGroup: no object can be one there
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        allowed = "a torch.distributed.ProcessGroup" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {allowed}, got {type(group).__name__}")


@torch._dynamo.assume_constant_result
def _no_stamps(device: torch.device) -> torch.Tensor:
    """A persistent empty int32 tensor per device: the stamps of a target without stamps."""
    t = _EMPTY.get(device)
    if t is None:
        t = torch.empty(0, dtype=torch.int32, device=device)
        torch._dynamo.mark_static_address(t)
        t = _EMPTY.setdefault(device, t)
    return t


_EMPTY: dict[torch.device, torch.Tensor] = {}


def _device_tensors(
    buffer: torch.Tensor,
    fault_counter: FaultCounter | None,
    layer_stamps: torch.Tensor | None,
    step_tensor: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(errors, stamps, step) of a spec: the counter's tensor (or the device-wide one), the stamps
    and step (or empty stand-ins)."""
    if isinstance(buffer, FakeTensor):
        # Traced outside dynamo (FakeTensorMode, make_fx): fake stand-ins for persistent tensors.
        empty = torch.empty(0, dtype=torch.int32, device=buffer.device)
        errors = torch.empty(FAULT_SLOTS, dtype=torch.int32, device=buffer.device)
        if layer_stamps is None:
            return errors, empty, empty
        return errors, layer_stamps, step_tensor
    errors = fault_counter.tensor if fault_counter is not None else capture_error_counter(buffer.device)
    if layer_stamps is None:
        empty = _no_stamps(buffer.device)
        return errors, empty, empty
    return errors, layer_stamps, step_tensor


@dataclass(frozen=True)
class CaptureTarget:
    """Where a router or capture call records one layer's ids: exactly what
    :func:`moe_ops.capture_routing` takes.

    Validated on construction (ValueError naming the argument, TypeError for wrong types,
    :class:`LayerIndexError` - an IndexError and a ValueError - for ``layer_id``); the checks that
    need the ids run in :meth:`check_ids`, per call. A target holds the capturer's tensors, not
    their values: the counts, stamps and step it points at change in place between steps, so one
    target serves every step.
    """

    # (max_tokens, num_layers, top_k) int16/int32/int64 - the replay buffer; a static address
    buffer: torch.Tensor
    # layer index in [0, num_layers)
    layer_id: int
    _: KW_ONLY
    # (dp_size,) int32 on the buffer's device (any stride) - real tokens of each DP rank
    token_counts: torch.Tensor
    # index into token_counts, in [0, dp_size)
    dp_rank: int = 0
    # how the router's rows are arranged (BatchLayout or its int value; stored as BatchLayout)
    layout: BatchLayout | int = BatchLayout.LOCAL
    # GATHERED/SHARDED: (dp_size * shards_per_rank,) int32 row counts (any stride); None otherwise
    shard_sizes: torch.Tensor | None = None
    # SEQUENCE_PARALLEL only: the torch.distributed group to all-gather over (None: tp_size 1)
    tp_group: object = None
    # where faults are recorded; None: the device-wide counter of the buffer's device
    fault_counter: FaultCounter | None = None
    # (max_tokens, num_layers, top_k) float32/bfloat16/float16 on the buffer's device, no internal
    # overlap, not overlapping buffer: the routing weights of the rows whose ids go to buffer, cast
    # to its dtype; None: no weights (a capture then refuses topk_weights)
    weights_buffer: torch.Tensor | None = None
    # (num_layers,) int32 on the buffer's device: stamps[layer_id] = step_tensor[0] once captured;
    # None: no stamp (a bare capture outside a capturer)
    layer_stamps: torch.Tensor | None = None
    # (1,) int32 on the buffer's device: the capturer's current step; set with layer_stamps
    step_tensor: torch.Tensor | None = None
    # (P,) int32/int64 on the buffer's device, any stride (a row view of vLLM's (num_moe_layers, P)
    # physical_to_logical_map works): EPLB's physical -> logical map, applied by the capture kernel
    # (ids handed in are physical slots, the buffer gets logical ids); read on the device at every
    # call, so the balancer updates it in place; None: ids are recorded as given
    expert_map: torch.Tensor | None = None
    # with expert_map (required there): the logical experts, >= 1, largest id fitting the buffer
    # dtype; a map entry outside [0, num_logical_experts) is a fault (FAULT_BAD_MAP)
    num_logical_experts: int | None = None
    # derived, on construction: the sizes tensor the layout reads (shard_sizes or token_counts)
    sizes: torch.Tensor = field(init=False, repr=False, compare=False)
    # derived: leading entries of sizes that precede this rank's rows
    n_first: int = field(init=False, repr=False, compare=False)
    # derived: what the ops and kernels take (the fault counter's tensor, or the device-wide
    # counter's, allocated on first use; empty stamps and step without stamps)
    spec: CaptureSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layout = layout_from_value(self.layout)
        check_buffer(self.buffer)
        if self.weights_buffer is not None:
            check_weights_buffer(self.weights_buffer, self.buffer)
        check_layer_id(self.layer_id, self.buffer.shape[1])
        check_expert_map(self.expert_map, self.num_logical_experts, self.buffer)
        device = self.buffer.device
        sizes, n_first = plan_window(layout, self.token_counts, self.dp_rank, self.shard_sizes, device)
        check_process_group("tp_group", self.tp_group)
        if self.tp_group is not None and layout != BatchLayout.SEQUENCE_PARALLEL:
            raise ValueError(f"tp_group is only used by SEQUENCE_PARALLEL, not {layout.name}; pass None")
        if self.fault_counter is not None:
            if not isinstance(self.fault_counter, FaultCounter):
                raise TypeError(
                    f"fault_counter must be a FaultCounter or None, got {type(self.fault_counter).__name__}"
                )
            if self.fault_counter.device != device:
                raise ValueError(
                    f"fault_counter must be on the buffer's device {device}, got {self.fault_counter.device}"
                )
        if (self.layer_stamps is None) != (self.step_tensor is None):
            raise ValueError("layer_stamps and step_tensor go together: pass both or neither")
        if self.layer_stamps is not None:
            stamps, step = self.layer_stamps, self.step_tensor
            if (
                stamps.shape != (self.buffer.shape[1],)
                or stamps.dtype != torch.int32
                or stamps.device != device
            ):
                raise ValueError(
                    f"layer_stamps must be ({self.buffer.shape[1]},) int32 on {device}, got "
                    f"{tuple(stamps.shape)} {stamps.dtype} on {stamps.device}"
                )
            if step.shape != (1,) or step.dtype != torch.int32 or step.device != device:
                raise ValueError(
                    f"step_tensor must be (1,) int32 on {device}, got {tuple(step.shape)} {step.dtype} "
                    f"on {step.device}"
                )
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "n_first", n_first)
        errors, stamps, step = _device_tensors(
            self.buffer, self.fault_counter, self.layer_stamps, self.step_tensor
        )
        weights = self.weights_buffer if self.weights_buffer is not None else no_weights(self.buffer)
        expert_map = self.expert_map if self.expert_map is not None else no_expert_map(self.buffer)
        spec = CaptureSpec(
            self.buffer,
            weights,
            self.token_counts,
            sizes,
            errors,
            stamps,
            step,
            expert_map,
            self.layer_id,
            self.dp_rank,
            n_first,
            self.num_logical_experts or 0,
        )
        object.__setattr__(self, "spec", spec)

    @classmethod
    def of(
        cls,
        capturer: Capturer,
        layer_id: int,
        layout: BatchLayout | int = BatchLayout.LOCAL,
        *,
        tp_group: object = None,
        expert_map: torch.Tensor | None = None,
        num_logical_experts: int | None = None,
    ) -> CaptureTarget:
        """The target of buffer layer ``layer_id`` of ``capturer`` (its state members, see
        :class:`~moe_ops.capture.protocol.Capturer`) for rows in ``layout``.

        ``shard_sizes`` is passed to GATHERED and SHARDED when the capturer has them (the window
        rule reads them; see :mod:`moe_ops.capture.window`), never to the other layouts; the
        capturer's fault counter, stamps and weights buffer, when it has them, come along.
        ``expert_map`` / ``num_logical_experts``: this layer's EPLB map, for a caller that hands
        physical ids (see :class:`CaptureTarget`).
        """
        check_capturer(capturer)
        layout = layout_from_value(layout)
        uses_sizes = layout in (BatchLayout.GATHERED, BatchLayout.SHARDED)
        return cls(
            capturer.buffer,
            layer_id,
            token_counts=capturer.token_counts,
            dp_rank=capturer.dp_rank,
            layout=layout,
            shard_sizes=capturer.shard_sizes if uses_sizes else None,
            tp_group=tp_group,
            fault_counter=getattr(capturer, "fault_counter", None),
            layer_stamps=getattr(capturer, "layer_stamps", None),
            step_tensor=getattr(capturer, "step_tensor", None),
            weights_buffer=getattr(capturer, "weights_buffer", None),
            expert_map=expert_map,
            num_logical_experts=num_logical_experts,
        )

    @property
    def has_expert_map(self) -> bool:
        """True when this target maps physical ids to logical ones (``expert_map``)."""
        return self.expert_map is not None

    def check_router_capture(self) -> None:
        """ValueError when this target has an ``expert_map``: a router that captures itself (``route``,
        its hash path, FlashInfer's routing) records the logical ids it chooses - the EPLB mapping
        to physical slots comes after it - so a map would be applied to ids that are not physical."""
        if self.expert_map is not None:
            raise ValueError(
                "route records the logical ids it chooses; expert_map maps physical ids handed to "
                "capture_routing: build the router's capture target without expert_map"
            )

    @property
    def has_weights(self) -> bool:
        """True when this target records routing weights beside the ids (``weights_buffer``)."""
        return self.weights_buffer is not None

    def check_ids(self, topk_ids: torch.Tensor) -> None:
        """The checks that need the ids: ``topk_ids`` (n, top_k) integer on the buffer's device
        (any strides) whose rows are in this target's layout. Raises ValueError/TypeError."""
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
        if topk_ids.dim() != 2:
            raise ValueError(f"topk_ids must be 2-D (n, top_k), got shape {tuple(topk_ids.shape)}")
        if topk_ids.dtype not in ID_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in ID_DTYPES)
            raise ValueError(f"topk_ids must have an integer dtype ({names}), got {topk_ids.dtype}")
        if topk_ids.shape[1] != self.buffer.shape[2]:
            raise ValueError(
                f"topk_ids has top_k={topk_ids.shape[1]} columns but buffer was sized for "
                f"top_k={self.buffer.shape[2]} (buffer shape {tuple(self.buffer.shape)})"
            )
        if topk_ids.device != self.buffer.device:
            raise ValueError(
                f"topk_ids must be on the buffer's device {self.buffer.device}, got {topk_ids.device}"
            )
        if self.layout == BatchLayout.LOCAL and self.buffer.shape[0] < topk_ids.shape[0]:
            raise ValueError(
                f"buffer has {self.buffer.shape[0]} rows but the LOCAL batch has {topk_ids.shape[0]} rows "
                "(padding included): size the buffer for the largest local batch (max_tokens)"
            )

    def check_weights(self, topk_weights: torch.Tensor | None, topk_ids: torch.Tensor) -> None:
        """The checks of a call's weights: a target with a ``weights_buffer`` needs
        ``topk_weights`` (the ids' shape, float32/bfloat16/float16, the buffer's device, any
        strides; float64 is refused: the kernel would round it twice, through float32); a target
        without one refuses them. Raises ValueError/TypeError."""
        if self.weights_buffer is None:
            if topk_weights is not None:
                raise ValueError(
                    "topk_weights given but this target has no weights_buffer: build the target (or "
                    "the capturer, weights_dtype=...) with a weights buffer, or pass topk_weights=None"
                )
            return
        if topk_weights is None:
            raise ValueError(
                "topk_weights is required: this target records routing weights beside the ids "
                f"(weights_buffer {self.weights_buffer.dtype}); pass the router's (n, top_k) weights"
            )
        if not isinstance(topk_weights, torch.Tensor):
            raise TypeError(f"topk_weights must be a torch.Tensor or None, got {type(topk_weights).__name__}")
        if topk_weights.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"topk_weights must be float32, bfloat16 or float16, got {topk_weights.dtype}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_weights must have the ids' shape {tuple(topk_ids.shape)} (n, top_k), got "
                f"{tuple(topk_weights.shape)}"
            )
        if topk_weights.device != self.buffer.device:
            raise ValueError(
                f"topk_weights must be on the buffer's device {self.buffer.device}, got {topk_weights.device}"
            )

    def check_num_experts(self, num_experts: int) -> None:
        """ValueError when the buffer dtype cannot hold expert ids up to ``num_experts - 1``."""
        if int(num_experts) - 1 > id_limit(self.buffer.dtype):
            raise ValueError(
                f"capture buffer dtype {self.buffer.dtype} cannot hold expert ids up to "
                f"{num_experts - 1} (num_experts={num_experts}); use an int32 buffer"
            )
