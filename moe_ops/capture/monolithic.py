"""The monolithic capture contract: MoE kernels that route inside the kernel, and how their ids are captured.

Backend-agnostic: any experts kernel that chooses the experts itself and can write the chosen ids
into an int16 ``routing_replay_out`` buffer fits it. FlashInfer's ``trtllm_*_moe`` from logits is
one (:class:`moe_ops.flashinfer.experts.FlashInferExperts`); nothing here imports FlashInfer.

A monolithic kernel chooses the experts itself, so a capture hooked on the router sees nothing and,
in serving engines before ``routing_replay_out``, silently recorded all-zero routing. The contract,
as in those engines but graph-safe:

* :class:`RoutingReplayExperts` - the experts base. ``supports_routing_replay_capture()`` is False
  by default; monolithic experts whose kernel writes replay ids (FlashInfer's from logits) say True,
  routed variants (precomputed top-k, the router captures) say False.
* ``set_capture_fn(fn)`` pre-allocates ONE int16 scratch of ``(max_num_tokens *
  dispatch_group_size, top_k)`` rows (``dispatch_group_size`` is ``ep_size`` with expert
  parallelism, else ``dp_size``: the kernel sees the gathered batch of the whole dispatch group),
  and frees it when ``fn`` is None.
* per call, :meth:`RoutingReplayExperts.routing_replay_out` returns the scratch rows for the call
  (None when capture is off: no allocation, no write) or raises ValueError (too many tokens,
  another device); the kernel writes rows ``[0, num_tokens)``; then
  :meth:`RoutingReplayExperts.capture_routing_replay` issues one ``capture_routing`` on them with
  the layout dispatch produced (LOCAL, GATHERED or SHARDED). Padding rows are in the scratch but
  never reach the capture buffer: the capture op takes only this rank's real rows, on the device.
* :func:`bind_routing_capture` walks a model and binds a capturer to every MoE layer
  (:class:`RoutingReplayLayer`), failing fast on monolithic kernels that cannot write replay ids
  and on a model with no MoE layer at all.
* rebinding survives kernel rebuilds: a layer keeps its capturer, and assigning a new experts object
  to ``layer.experts`` (a weight reload that rebuilds the kernel) moves the binding to it and frees
  the old scratch. Serving engines lost the capture on exactly that path.

The capture step is one ``capture_routing`` op on the target that ``set_capture_fn`` built and
validated once, from :meth:`CaptureTarget.of` (a registered custom op, so ``torch.compile`` traces
it and CUDA graphs record it; no Python callback and no host read runs per step, and per call only
the ids are checked).

EPLB: where the capture sits relative to the expert-parallel balancer's mapping. FlashInfer's
monolithic kernels write into ``routing_replay_out`` the column of ``routing_logits`` they chose
(``noAuxTcKernels.cu``: ``routingReplayOut[token * topk + k] = expertIdx``; no EPLB map exists
inside the kernel): logical ids when the logits are over logical experts. A kernel that routes over
physical slots (replicas) writes physical ids; its :class:`MoEDispatchConfig` then carries the
layer's ``expert_map`` (physical -> logical) and ``num_logical_experts``, and the capture op
records ``expert_map[id]`` - the map is read on the device at every call, so a balancer that
rewrites it in place between CUDA-graph replays needs nothing else.

Routing weights: a monolithic kernel's ``routing_replay_out`` holds ids only, so experts whose
kernel writes it refuse a capturer with a ``weights_buffer`` (ValueError from
:meth:`RoutingReplayExperts.check_capture_fn`, before anything is allocated) rather than leave the
weights unwritten; routed variants, whose router captures, record the router's weights through
``route(..., capture=LayerCapture.target(layout))``.

The scratch is shared by every call of one experts object and is written and read on the current
stream, in order; one experts object must not run on two streams at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout import BatchLayout, layout_from_value
from .op import capture_into
from .protocol import Capturer, buffer_column, check_capturer
from .target import CaptureTarget

__all__ = [
    "LayerCapture",
    "MoEDispatchConfig",
    "RoutingReplayExperts",
    "RoutingReplayLayer",
    "bind_routing_capture",
    "buffer_column",
    "capture_ids",
    "unbind_routing_capture",
]

_DISPATCH_LAYOUTS = (BatchLayout.LOCAL, BatchLayout.GATHERED, BatchLayout.SHARDED)


def capture_ids(
    capturer: Capturer,
    layer_id: int,
    topk_ids: torch.Tensor,
    layout: BatchLayout | int,
    tp_group=None,
) -> None:
    """Records this DP rank's rows of ``topk_ids`` into ``capturer.buffer[:, layer_id]``.

    topk_ids: (n, top_k) integer, on the buffer's device - ids in the rows of ``layout`` (for a
        kernel's ``routing_replay_out``, exactly the first ``num_tokens`` rows it wrote)

    The rows are selected by :meth:`CaptureTarget.of` (the capture contract), exactly as
    ``RoutingCapturer.capture`` selects them. Raises what ``capture_routing`` raises for bad
    arguments, before anything is written.
    """
    capture_into(CaptureTarget.of(capturer, layer_id, layout, tp_group=tp_group), topk_ids)


@dataclass(frozen=True)
class MoEDispatchConfig:
    """How many tokens an experts kernel sees per call, and how dispatch arranged them."""

    # most tokens ONE rank feeds the layer per step, padding included (largest CUDA-graph size)
    max_num_tokens: int
    # experts per token: the scratch's width
    top_k: int
    # data-parallel ranks (>= 1)
    dp_size: int = 1
    # expert-parallel ranks (>= 1)
    ep_size: int = 1
    # expert parallelism on: dispatch gathers over the EP group (ep_size ranks), else the DP group
    use_ep: bool = False
    # rows the kernel sees: LOCAL (no gather), GATHERED (naive all-gather), SHARDED (SP shards gathered)
    layout: BatchLayout = BatchLayout.LOCAL
    # EPLB: (P,) int32/int64 on the capture buffer's device, any stride (this layer's row of the
    # engine's (num_moe_layers, P) physical_to_logical map) - for a kernel whose routing_replay_out
    # holds PHYSICAL slots (it routes over replicas): the capture records expert_map[id]. Read on
    # the device at every call (update it in place). None: the kernel's ids are recorded as given
    expert_map: torch.Tensor | None = field(default=None, compare=False)
    # with expert_map (required there): the logical experts the map's values index
    num_logical_experts: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_tokens", "top_k", "dp_size", "ep_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEDispatchConfig.{name} must be an int >= 1, got {value!r}")
        layout = layout_from_value(self.layout)
        if layout not in _DISPATCH_LAYOUTS:
            raise ValueError(
                f"MoEDispatchConfig.layout must be LOCAL, GATHERED or SHARDED (the batch a kernel sees), "
                f"got {layout.name}"
            )
        object.__setattr__(self, "layout", layout)

    @property
    def dispatch_group_size(self) -> int:
        """Ranks whose batches the kernel sees at once: ``ep_size`` with EP, else ``dp_size``."""
        return self.ep_size if self.use_ep else self.dp_size

    @property
    def scratch_rows(self) -> int:
        """Rows of the routing-replay scratch: ``max_num_tokens * dispatch_group_size``."""
        return self.max_num_tokens * self.dispatch_group_size


@dataclass(frozen=True)
class LayerCapture:
    """The ``fn`` of ``set_capture_fn``: one MoE layer's slot in a capturer.

    Not a Python callback: the experts read its fields and issue one ``capture_routing`` op.
    """

    # the model's capture state (buffer, token_counts, dp_rank, shard_sizes)
    capturer: Capturer
    # this layer's index into capturer.buffer's layer dimension
    layer_id: int

    @property
    def device(self) -> torch.device:
        return self.capturer.buffer.device

    def target(self, layout: BatchLayout | int = BatchLayout.LOCAL) -> CaptureTarget:
        """This slot as a capture target for a router (``route(..., capture=...)``) seeing ``layout`` rows.

        For layers whose experts take precomputed top-k: their router, not the kernel, captures.
        """
        return CaptureTarget.of(self.capturer, self.layer_id, layout)


class RoutingReplayExperts:
    """Experts base for the monolithic capture contract (see the module docstring).

    Subclasses set ``kernel_name`` and ``monolithic`` and override
    :meth:`supports_routing_replay_capture` when their kernel writes replay ids.
    """

    # the kernel this experts object runs; binding errors name it
    kernel_name: str = "unknown"
    # True when the kernel routes internally (from logits): a router-side capture sees nothing
    monolithic: bool = False

    def __init__(self, config: MoEDispatchConfig):
        if not isinstance(config, MoEDispatchConfig):
            raise TypeError(f"config must be a MoEDispatchConfig, got {type(config).__name__}")
        self.config = config
        self._capture_fn: LayerCapture | None = None
        # the target of _capture_fn in config.layout, built and validated by set_capture_fn
        self._capture_target: CaptureTarget | None = None
        # (config.scratch_rows, top_k) int16 while capture is on with a replay-writing kernel, else None
        self._replay_scratch: torch.Tensor | None = None

    def supports_routing_replay_capture(self) -> bool:
        """True when the kernel writes the chosen expert ids into ``routing_replay_out``."""
        return False

    @property
    def capture_fn(self) -> LayerCapture | None:
        return self._capture_fn

    @property
    def replay_scratch(self) -> torch.Tensor | None:
        """The pre-allocated (scratch_rows, top_k) int16 scratch, or None when none is held."""
        return self._replay_scratch

    def cannot_capture_message(self) -> str:
        return (
            f"MoE kernel {self.kernel_name} routes inside the kernel but cannot write routing replay "
            "ids (supports_routing_replay_capture() is False): routed expert ids would be silently "
            "all-zero. Use a kernel that fills routing_replay_out, or a router + experts path."
        )

    def check_capture_fn(self, fn: LayerCapture) -> CaptureTarget:
        """Everything ``set_capture_fn(fn)`` checks, without allocating; returns the target the
        experts will capture into (ValueError/TypeError; the layer check is the target's own,
        a :class:`~moe_ops.capture.target.LayerIndexError`, a ValueError too)."""
        if not isinstance(fn, LayerCapture):
            raise TypeError(f"set_capture_fn needs a LayerCapture or None, got {type(fn).__name__}")
        check_capturer(fn.capturer)
        if self.monolithic and not self.supports_routing_replay_capture():
            raise ValueError(self.cannot_capture_message())
        if self.config.layout == BatchLayout.SHARDED and fn.capturer.shard_sizes is None:
            raise ValueError(
                "a SHARDED dispatch needs capturer.shard_sizes (dp_size * shards_per_rank entries)"
            )
        # the buffer, the layer, the counts; the kernel's ids through the config's expert map (the
        # target checks it): a routed variant's router records logical ids and takes no map
        mapped = self.supports_routing_replay_capture() and self.config.expert_map is not None
        target = CaptureTarget.of(
            fn.capturer,
            fn.layer_id,
            self.config.layout,
            expert_map=self.config.expert_map if mapped else None,
            num_logical_experts=self.config.num_logical_experts if mapped else None,
        )
        if target.has_weights and self.supports_routing_replay_capture():
            raise ValueError(
                f"MoE kernel {self.kernel_name} records expert ids only (routing_replay_out is int16 ids, "
                "it has no weights output), but the capturer has a weights_buffer: its weights would "
                "stay unwritten (NaN). Use a capturer without weights_dtype, or a router + experts path "
                "(route(..., capture=...) records the router's weights)"
            )
        buffer = target.buffer
        if buffer.shape[2] != self.config.top_k:
            raise ValueError(
                f"capturer.buffer has top_k={buffer.shape[2]} columns but {self.kernel_name} routes "
                f"top_k={self.config.top_k} experts per token"
            )
        if self.config.layout == BatchLayout.LOCAL and buffer.shape[0] < self.config.max_num_tokens:
            raise ValueError(
                f"capturer.buffer has {buffer.shape[0]} rows but a LOCAL batch may have "
                f"max_num_tokens={self.config.max_num_tokens} rows"
            )
        return target

    def set_capture_fn(self, fn: LayerCapture | None) -> None:
        """Turns capture on (``fn``) or off (None).

        On: checks ``fn`` (:meth:`check_capture_fn`), keeps the target it built for every later
        call and, when the kernel writes replay ids, allocates the ``(max_num_tokens *
        dispatch_group_size, top_k)`` int16 scratch on the capture buffer's device (kept when one of
        that shape and device is already held). Off: drops ``fn`` and frees the scratch. Raises
        before changing anything.
        """
        if fn is None:
            self._capture_fn = None
            self._capture_target = None
            self._replay_scratch = None
            return
        target = self.check_capture_fn(fn)
        scratch = None
        if self.supports_routing_replay_capture():
            shape = (self.config.scratch_rows, self.config.top_k)
            scratch = self._replay_scratch
            if scratch is None or tuple(scratch.shape) != shape or scratch.device != fn.device:
                # -1 is no expert id: rows the kernel has not written read as "none", not as expert 0
                scratch = torch.full(shape, -1, dtype=torch.int16, device=fn.device)
                # a fixed address: inductor's CUDA-graph trees keep graphs that mutate it
                torch._dynamo.mark_static_address(scratch)
        self._capture_fn = fn
        self._capture_target = target
        self._replay_scratch = scratch

    def routing_replay_out(self, num_tokens: int, device: torch.device) -> torch.Tensor | None:
        """The ``routing_replay_out`` for one kernel call of ``num_tokens`` rows, or None.

        Returns ``scratch[:num_tokens]`` ((num_tokens, top_k) int16, contiguous) when capture is on
        for a replay-writing kernel, else None (capture off: nothing is allocated or written).

        Raises:
            ValueError: ``num_tokens`` exceeds the scratch (``max_num_tokens * dispatch_group_size``
                rows), or ``device`` is not the scratch's device.
        """
        scratch = self._replay_scratch
        if scratch is None:
            return None
        if num_tokens > scratch.shape[0]:
            raise ValueError(
                f"{self.kernel_name}: this call has {num_tokens} tokens but the routing-replay scratch "
                f"holds {scratch.shape[0]} rows (max_num_tokens={self.config.max_num_tokens} x "
                f"dispatch_group_size={self.config.dispatch_group_size}); raise max_num_tokens"
            )
        if torch.device(device) != scratch.device:
            raise ValueError(
                f"{self.kernel_name}: this call runs on {torch.device(device)} but the routing-replay "
                f"scratch (and the capture buffer) is on {scratch.device}"
            )
        return scratch[:num_tokens]

    def capture_routing_replay(self, replay_out: torch.Tensor | None) -> None:
        """After the kernel: records this rank's rows of ``replay_out`` (None: capture off, no-op).

        replay_out: (num_tokens, top_k) int16 - what :meth:`routing_replay_out` returned for this
            call, filled by the kernel; rows are in ``config.layout`` order.
        """
        if replay_out is None:
            return
        capture_into(self._capture_target, replay_out)


class RoutingReplayLayer:
    """Mixin for an MoE layer (an ``nn.Module``) whose capture binding survives kernel rebuilds.

    The layer holds ``layer_id`` (its model layer index; a capturer with a RoutingShape, such as
    ``moe_ops.RoutingCapturer``, maps it to its buffer column, any other capturer takes it as the
    column itself - see :func:`buffer_column`) and ``experts`` (a
    :class:`RoutingReplayExperts`). Assigning a new experts object to ``layer.experts`` while a
    capturer is bound moves the binding to it (checked first, so a new kernel that cannot capture
    raises and the old one stays) and frees the old scratch.
    """

    layer_id: int
    experts: RoutingReplayExperts

    @property
    def routing_capturer(self) -> Capturer | None:
        return self.__dict__.get("_routing_capturer")

    def _capture_fn_for(self, capturer: Capturer) -> LayerCapture:
        return LayerCapture(capturer=capturer, layer_id=buffer_column(capturer, self.layer_id))

    def __setattr__(self, name: str, value: Any) -> None:
        capturer = self.__dict__.get("_routing_capturer")
        if name != "experts" or capturer is None:
            super().__setattr__(name, value)
            return
        old = getattr(self, "experts", None)
        if value is not old:
            value.check_capture_fn(self._capture_fn_for(capturer))
        super().__setattr__(name, value)
        if value is not old:
            if old is not None:
                old.set_capture_fn(None)
            value.set_capture_fn(self._capture_fn_for(capturer))

    def bind_routing_capture(self, capturer: Capturer) -> None:
        """Binds ``capturer`` to this layer (and its current experts); raises before changing anything."""
        fn = self._capture_fn_for(capturer)
        self.experts.set_capture_fn(fn)
        self.__dict__["_routing_capturer"] = capturer

    def unbind_routing_capture(self) -> None:
        self.__dict__["_routing_capturer"] = None
        self.experts.set_capture_fn(None)


def _moe_layers(model: torch.nn.Module) -> list[RoutingReplayLayer]:
    return [m for m in model.modules() if isinstance(m, RoutingReplayLayer)]


def bind_routing_capture(model: torch.nn.Module, capturer: Capturer) -> list[int]:
    """Binds ``capturer`` to every MoE layer (:class:`RoutingReplayLayer`) of ``model``.

    Everything is checked before any layer is bound, so a failure leaves the model as it was.
    Returns the bound layer ids, sorted.

    Raises:
        TypeError: ``capturer`` lacks the :class:`Capturer` attributes.
        ValueError: ``model`` has no MoE layer ("nothing would be captured"); a monolithic layer's
            kernel cannot write replay ids (the message names the kernel and the layer: "routed
            expert ids would be silently all-zero"); two layers share a layer_id; a layer's
            layer_id or top_k does not fit the capture buffer.
    """
    check_capturer(capturer)
    layers = _moe_layers(model)
    if not layers:
        raise ValueError(
            f"bind_routing_capture found no MoE layer (RoutingReplayLayer) in {type(model).__name__}: "
            "nothing would be captured"
        )
    blind = [
        layer
        for layer in layers
        if layer.experts.monolithic and not layer.experts.supports_routing_replay_capture()
    ]
    if blind:
        names = ", ".join(f"layer {layer.layer_id}: {layer.experts.kernel_name}" for layer in blind)
        raise ValueError(
            f"monolithic MoE kernel(s) that cannot write routing replay ids ({names}): routed expert "
            "ids would be silently all-zero. Use a kernel that fills routing_replay_out, or a "
            "router + experts path."
        )
    seen: dict[int, int] = {}
    for layer in layers:
        if layer.layer_id in seen:
            raise ValueError(f"two MoE layers have layer_id {layer.layer_id}: each needs its own buffer slot")
        seen[layer.layer_id] = 1
        layer.experts.check_capture_fn(layer._capture_fn_for(capturer))
    for layer in layers:
        layer.bind_routing_capture(capturer)
    return sorted(seen)


def unbind_routing_capture(model: torch.nn.Module) -> int:
    """Turns capture off in every MoE layer of ``model`` (scratches freed); returns how many."""
    layers = _moe_layers(model)
    for layer in layers:
        layer.unbind_routing_capture()
    return len(layers)
