"""``RoutingCapturer``: the persistent capture buffer of one model, its live counts, and its snapshots.

One capturer per model replica (per DP rank). Per step::

    capturer.set_step(token_counts)              # host ints; copied in place, no host sync
    ... forward: each MoE layer calls capturer.capture(layer_idx, topk_ids, layout=...) ...
    ...   or routes and records in one kernel: route(..., capture=capturer.target(layer_idx)) ...
    handle = capturer.snapshot()                 # async D2H of this rank's rows, returns at once
    ... later (1..depth steps later) ...
    rows = handle.result(copy=False)             # (num_tokens, num_layers, top_k), narrow dtype
    store.write(slot_mapping, rows); handle.release()

With ``weights_dtype`` the capturer also holds ``weights_buffer``, the routing weights beside the ids
(every target it builds carries it: ``capture(layer, ids, layout, weights=...)``, or
``route(..., capture=capturer.target(layer))``, which records the router's weights), and each
snapshot carries them as the channel ``"weights"`` (``handle.result(channel="weights")``).

Everything the capture op reads on the device (the buffer, ``token_counts``, ``shard_sizes``) is
allocated once in ``__init__`` and updated in place, never reallocated: CUDA graphs bake these
addresses, and they are marked as static addresses so that inductor's CUDA-graph trees
(``mode="reduce-overhead"``) accept the op's mutation of the buffer.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..channels import Channel
from ..layout import BatchLayout
from ..shapes import RoutingShape
from ..transfer.pipeline import SnapshotHandle, TransferPipeline
from .errors import FaultCounter
from .kernels import id_limit
from .op import capture_into
from .target import BUFFER_DTYPES, WEIGHT_DTYPES, CaptureTarget

__all__ = ["WEIGHTS_CHANNEL", "MissingSetStepWarning", "RoutingCapturer", "weights_channel"]

# the name of the routing weights' channel of a capturer's snapshots
WEIGHTS_CHANNEL = "weights"
# weights_dtype -> the host dtype its snapshot channel carries. bfloat16 has no numpy dtype; it
# travels as its 16 bits in a uint16 channel (2 bytes an entry across PCIe and in the store, as in
# moe-ops' own formats; float32 host rows would be exact too, at twice the bytes). A stale layer's
# fill there is 0xFFFF, a bfloat16 NaN, as the float channels' fill is NaN.
_WEIGHTS_HOST = {
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(np.uint16),
}


def weights_channel(num_layers: int, top_k: int, weights_dtype: torch.dtype) -> Channel:
    """The ``"weights"`` :class:`~moe_ops.channels.Channel` of a capturer whose weights buffer is
    ``weights_dtype``: ``(num_layers, top_k)`` rows of float32, float16, or bfloat16's bits as
    uint16 (read them back with ``torch.from_numpy(rows).view(torch.bfloat16)``). ValueError for
    another ``weights_dtype``."""
    host = _WEIGHTS_HOST.get(weights_dtype) if isinstance(weights_dtype, torch.dtype) else None
    if host is None:
        raise ValueError(f"weights_dtype must be one of {tuple(_WEIGHTS_HOST)}, got {weights_dtype!r}")
    return Channel(WEIGHTS_CHANNEL, host, (num_layers, top_k))


class MissingSetStepWarning(UserWarning):
    """A snapshot was taken with no ``set_step`` since the previous one: the step's captures read
    the counts (and stamps) of an earlier step, so its rows are not this step's."""


_INT32_MAX = (1 << 31) - 1
# layout values a cached target is looked up by: a bool or a float equal to a layout's int would
# hash alike, and is refused by the uncached path instead
_LAYOUT_TYPES = (int, BatchLayout)
# the step stamp cycles through [1, _INT32_MAX]; 0 is the step before the first set_step
_STEP_PERIOD = _INT32_MAX


def _host_ints(name: str, values: Sequence[int] | np.ndarray | torch.Tensor, length: int) -> list[int]:
    """Host integers in [0, 2**31): ValueError naming ``name`` for anything else (floats, bools,
    wrong length, out of int32 range); no value is truncated or wrapped."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"{name} must be host ints here (a CPU tensor, list or array), got {values.device}"
            )
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got a {values.dtype} tensor")
        values = values.reshape(-1).tolist()
    elif isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold integers, got a {values.dtype} array")
        values = values.reshape(-1).tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, (float, np.floating, bool, np.bool_)):
            raise ValueError(f"{name} must hold integers, got {v!r} ({type(v).__name__}) in {list(values)!r}")
        if not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be a sequence of ints, got {v!r} ({type(v).__name__}) in it")
        out.append(int(v))
    if len(out) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(out)}: {out}")
    bad = [v for v in out if not 0 <= v <= _INT32_MAX]
    if bad:
        raise ValueError(f"{name} must be in [0, 2**31 - 1] (int32, non-negative), got {bad} in {out}")
    return out


class RoutingCapturer:
    """Owns the capture buffer ``(max_num_tokens, shape.num_layers, shape.top_k)`` of one DP rank.

    Args:
        shape: the model's :class:`~moe_ops.RoutingShape` (the layer axis holds MoE layers only).
        max_num_tokens: rows of the buffer: the most real tokens this rank runs in one step
            (LOCAL: also the padded local batch, see ``capture_routing``).
        device: where the buffer lives (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
        dtype: buffer dtype, int16/int32/int64; it must hold ids up to ``num_experts - 1``.
        dp_size: data-parallel ranks whose counts ``token_counts`` holds.
        dp_rank: this rank's index in ``[0, dp_size)``.
        shards_per_rank: allocate ``shard_sizes`` with ``dp_size * shards_per_rank`` entries
            (1 for a padded GATHERED all-gather, the TP size for SHARDED); None: no shard sizes.
        ring_depth: snapshots that may be unreleased at once (see :class:`TransferPipeline`).
        out_dtype: host dtype of the snapshots (default: ``shape.id_dtype``, uint8 for <= 256
            experts, uint16 up to 65536, int32 beyond).
        weights_dtype: None (default): ids only. torch.float32, torch.float16 or torch.bfloat16:
            also record the routing weights beside the ids, in ``weights_buffer`` of that dtype
            (the weights a capture is given are cast to it, round to nearest even), and carry them
            in every snapshot as the channel ``"weights"`` (:func:`weights_channel`: float32 and
            float16 rows as they are, bfloat16 as its uint16 bits; stale layers read NaN).

    Attributes:
        buffer: (max_num_tokens, num_layers, top_k) ``dtype`` on ``device`` - never reallocated.
        weights_buffer: (max_num_tokens, num_layers, top_k) ``weights_dtype`` on ``device``,
            NaN-filled at construction, never reallocated; None without ``weights_dtype``.
        token_counts: (dp_size,) int32 on ``device`` - real tokens of each DP rank this step.
        shard_sizes: (dp_size * shards_per_rank,) int32 on ``device``, or None.
        num_tokens: host int, this rank's count of the last :meth:`set_step` (None after a
            :meth:`set_step` with device tensors).
        step: host int, the number of the current step (0 before the first :meth:`set_step`,
            then 1, 2, ... cycling below 2**31).
        step_tensor: (1,) int32 on ``device`` - ``step``, written by :meth:`set_step`.
        layer_stamps: (num_layers,) int32 on ``device`` - the step in which each layer was last
            captured (-1: never). A snapshot reads the rows of a layer whose stamp is not the
            current step as the fill value (-1; the narrow dtype's maximum for unsigned): a layer
            whose capture did not run this step never delivers an earlier step's ids.
        fault_counter: this capturer's :class:`~moe_ops.capture.errors.FaultCounter`; its
            captures and targets record here, and :meth:`check_errors` reads only it.
        pipeline: the :class:`TransferPipeline` that :meth:`snapshot` uses.
        channels: (read-only) the channels each snapshot carries, ids first (:attr:`channels`).

    Thread safety: one thread drives a capturer's steps (``set_step``, the forward,
    ``snapshot``); :meth:`check_errors` may run on any thread at any time.
    """

    def __init__(
        self,
        shape: RoutingShape,
        max_num_tokens: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.int32,
        *,
        dp_size: int = 1,
        dp_rank: int = 0,
        shards_per_rank: int | None = None,
        ring_depth: int = 2,
        out_dtype: np.dtype | type | None = None,
        weights_dtype: torch.dtype | None = None,
    ):
        if not isinstance(shape, RoutingShape):
            raise TypeError(f"shape must be a RoutingShape, got {type(shape).__name__}")
        if isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be an int >= 1, got {max_num_tokens!r}")
        if dtype not in BUFFER_DTYPES:
            raise ValueError(f"dtype must be torch.int16, torch.int32 or torch.int64, got {dtype}")
        if shape.num_experts - 1 > id_limit(dtype):
            raise ValueError(
                f"dtype {dtype} cannot hold expert ids up to {shape.num_experts - 1} "
                f"(num_experts={shape.num_experts}); use torch.int32"
            )
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be an int in [0, {dp_size}) (dp_size={dp_size}), got {dp_rank!r}")
        if weights_dtype is not None and weights_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                "weights_dtype must be None, torch.float32, torch.float16 or torch.bfloat16, got "
                f"{weights_dtype!r}"
            )
        if shards_per_rank is not None and (
            isinstance(shards_per_rank, bool) or not isinstance(shards_per_rank, int) or shards_per_rank < 1
        ):
            raise ValueError(f"shards_per_rank must be None or an int >= 1, got {shards_per_rank!r}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.shape = shape
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.dtype = dtype
        self.weights_dtype = weights_dtype
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.shards_per_rank = shards_per_rank
        self.num_tokens: int | None = 0
        # set_step ran since the last snapshot; a snapshot without one warns (once per capturer)
        self._stepped = False
        self._warned_missing_step = False
        # model layer -> buffer layer, looked up when a target is built (also while tracing)
        self._buffer_index = {layer: i for i, layer in enumerate(shape.moe_layers)}
        # (model layer, layout, tp_group) -> its CaptureTarget, built and validated on first use
        self._targets: dict[tuple[int, int, object], CaptureTarget] = {}

        self.buffer = torch.full(
            (max_num_tokens, shape.num_layers, shape.top_k), -1, dtype=dtype, device=device
        )
        # NaN: no weight (a row never written reads as "none", as -1 does for an id)
        self.weights_buffer = None
        extra_channels = ()
        if weights_dtype is not None:
            self.weights_buffer = torch.full(
                self.buffer.shape, float("nan"), dtype=weights_dtype, device=device
            )
            channel = weights_channel(shape.num_layers, shape.top_k, weights_dtype)
            source = self.weights_buffer
            if weights_dtype == torch.bfloat16:
                source = source.view(torch.int16)  # its bits, as the uint16 channel's staging
            extra_channels = ((channel, source),)
        # One int32 tensor holds what set_step writes, so a step's host values travel in one copy:
        # [token_counts (dp_size) | shard_sizes (dp_size * shards_per_rank, optional) | step (1)].
        n_sizes = 0 if shards_per_rank is None else dp_size * shards_per_rank
        self._step_inputs = torch.zeros(dp_size + n_sizes + 1, dtype=torch.int32, device=device)
        self.token_counts = self._step_inputs[:dp_size]
        self.shard_sizes = None if shards_per_rank is None else self._step_inputs[dp_size : dp_size + n_sizes]
        self.step_tensor = self._step_inputs[dp_size + n_sizes :]
        # stamps[l] == step_tensor[0] once layer l was captured this step; -1: never captured
        self.layer_stamps = torch.full((shape.num_layers,), -1, dtype=torch.int32, device=device)
        self.fault_counter = FaultCounter(device)
        self.step = 0
        for t in (
            self.buffer,
            self.weights_buffer,
            self.token_counts,
            self.shard_sizes,
            self.step_tensor,
            self.layer_stamps,
        ):
            if t is not None:
                torch._dynamo.mark_static_address(t)
        self.pipeline = TransferPipeline(
            self.buffer,
            shape.id_dtype if out_dtype is None else out_dtype,
            depth=ring_depth,
            layer_stamps=self.layer_stamps,
            step_tensor=self.step_tensor,
            extra_channels=extra_channels,
        )

    def set_step(
        self,
        token_counts: Sequence[int] | np.ndarray | torch.Tensor,
        shard_sizes: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Starts a step: writes its counts into ``token_counts`` / ``shard_sizes`` and the next
        step number into ``step_tensor``, in place.

        Args:
            token_counts: (dp_size,) real tokens of each DP rank: host ints in [0, 2**31) (list,
                numpy integer array, CPU integer tensor), checked here; or an int32 tensor on the
                capturer's device, copied as is (device values are not checked, and
                ``num_tokens`` becomes unknown).
            shard_sizes: (dp_size * shards_per_rank,) - required when the capturer has
                ``shard_sizes``, rejected otherwise; host ints or a device tensor as above.
            stream: the stream the step's forward runs on (default: the current stream).

        Ordering: call it on the forward's stream, before the forward. It enqueues (1) a wait for
        the last snapshot to have read the buffer (so this step's captures cannot overwrite rows a
        queued snapshot still has to copy; an event wait, not a host sync) and (2) one
        non-blocking copy of the step's host values from freshly pinned host memory (the caching
        host allocator keeps that memory until the copy ran, so the next ``set_step`` cannot
        overwrite values still queued). Nothing waits on the host.

        Everything is validated before anything changes: bad input raises ValueError (TypeError
        for a non-sequence) naming the argument, and leaves the counts, the step and
        ``num_tokens`` as they were.
        """
        counts, num_tokens = self._step_counts(token_counts)
        sizes = self._step_sizes(shard_sizes)
        step = self.step % _STEP_PERIOD + 1

        self.pipeline.guard_source(stream)
        dp, n_sizes = self.dp_size, 0 if self.shard_sizes is None else self.shard_sizes.shape[0]
        if not isinstance(counts, torch.Tensor) and (sizes is None or not isinstance(sizes, torch.Tensor)):
            self._write(self._step_inputs, counts + (sizes or []) + [step], stream)
        else:
            self._write(self.token_counts, counts, stream)
            if sizes is not None:
                self._write(self._step_inputs[dp : dp + n_sizes], sizes, stream)
            self._write(self.step_tensor, [step], stream)
        self.step = step
        self.num_tokens = num_tokens
        self._stepped = True

    def clear_counts(self, *, stream: torch.cuda.Stream | None = None) -> None:
        """Zeroes ``token_counts`` in place: until the next :meth:`set_step` every capture records
        nothing (a count of 0 selects no row in any layout), e.g. for warm-up and CUDA-graph
        capture runs on padding rows. ``num_tokens`` becomes 0; the step number, the stamps and
        ``shard_sizes`` stay as they are.

        Args:
            stream: the stream the next forward runs on (default: the current stream); the zeroing
                is enqueued there, with no host sync.
        """
        if self.device.type == "cuda":
            with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(self.device)):
                self.token_counts.zero_()
        else:
            self.token_counts.zero_()
        self.num_tokens = 0

    def _step_counts(self, token_counts) -> tuple[list[int] | torch.Tensor, int | None]:
        if (
            isinstance(token_counts, torch.Tensor)
            and token_counts.device == self.device
            and self.device.type != "cpu"
        ):
            self._check_device_tensor("token_counts", token_counts, self.dp_size)
            return token_counts, None
        values = _host_ints("token_counts", token_counts, self.dp_size)
        if values[self.dp_rank] > self.max_num_tokens:
            raise ValueError(
                f"token_counts[{self.dp_rank}]={values[self.dp_rank]} (this rank) exceeds "
                f"max_num_tokens={self.max_num_tokens}, the rows of the capture buffer"
            )
        return values, values[self.dp_rank]

    def _step_sizes(self, shard_sizes) -> list[int] | torch.Tensor | None:
        if self.shard_sizes is None:
            if shard_sizes is not None:
                raise ValueError(
                    "shard_sizes given but this capturer has none: create it with shards_per_rank"
                )
            return None
        n = self.shard_sizes.shape[0]
        if shard_sizes is None:
            raise ValueError(
                f"shard_sizes is required every step: this capturer has {n} shard sizes "
                f"(dp_size={self.dp_size} x shards_per_rank={self.shards_per_rank})"
            )
        if (
            isinstance(shard_sizes, torch.Tensor)
            and shard_sizes.device == self.device
            and self.device.type != "cpu"
        ):
            self._check_device_tensor("shard_sizes", shard_sizes, n)
            return shard_sizes
        return _host_ints("shard_sizes", shard_sizes, n)

    def _check_device_tensor(self, name: str, t: torch.Tensor, length: int) -> None:
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != length:
            raise ValueError(
                f"{name} as a device tensor must be ({length},) int32, got {tuple(t.shape)} {t.dtype}"
            )

    def _write(self, dst: torch.Tensor, values: list[int] | torch.Tensor, stream) -> None:
        if isinstance(values, torch.Tensor):
            src = values
        elif self.device.type == "cuda":
            src = torch.tensor(values, dtype=torch.int32, pin_memory=True)
        else:
            src = torch.tensor(values, dtype=torch.int32)
        if self.device.type == "cuda":
            with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(self.device)):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def capture(
        self,
        layer_id: int,
        topk_ids: torch.Tensor,
        layout: BatchLayout | int = BatchLayout.LOCAL,
        weights: torch.Tensor | None = None,
        *,
        tp_group=None,
        expert_map: torch.Tensor | None = None,
        num_logical_experts: int | None = None,
    ) -> None:
        """Records this rank's rows of one MoE layer: ``capture_into(self.target(...), topk_ids,
        weights)``.

        Args:
            layer_id: the MODEL layer index (what the MoE layer knows as its ``layer_idx``); it is
                mapped to the buffer's MoE-only layer axis. IndexError outside the model,
                ValueError for a dense layer.
            topk_ids: (n, top_k) integer on the capturer's device - the router's choices, rows in
                ``layout``.
            layout: the :class:`BatchLayout` of ``topk_ids``. GATHERED reads ``shard_sizes`` when
                the capturer has them (a padded all-gather: each rank's block is the sum of its
                shards), else ``token_counts``; SHARDED needs ``shard_sizes``
                (:mod:`moe_ops.capture.window`).
            weights: (n, top_k) float32/bfloat16/float16 on the capturer's device - the routing
                weights of ``topk_ids``; required when the capturer has ``weights_dtype``, refused
                (ValueError) when it has not.
            tp_group: SEQUENCE_PARALLEL only, the group to all-gather over.
            expert_map: EPLB - (P,) int32/int64 on the capturer's device, any stride: this layer's
                physical -> logical map (e.g. ``physical_to_logical_map[moe_layer]``), for
                ``topk_ids`` taken after the balancer's mapping; the buffer gets
                ``expert_map[id]``, read on the device (see ``CaptureTarget``). With it the target
                is built per call (about 5 us of host time eagerly, not kept).
            num_logical_experts: required with ``expert_map``: the logical experts.

        No host reads, no synchronisation: safe inside torch.compile and CUDA graphs.
        """
        if expert_map is None and num_logical_experts is None:
            target = self.target(layer_id, layout, tp_group=tp_group)
        else:
            target = CaptureTarget.of(
                self,
                self._column(layer_id),
                layout,
                tp_group=tp_group,
                expert_map=expert_map,
                num_logical_experts=num_logical_experts,
            )
        capture_into(target, topk_ids, weights)

    def target(
        self,
        model_layer_index: int,
        layout: BatchLayout | int = BatchLayout.LOCAL,
        *,
        tp_group=None,
    ) -> CaptureTarget:
        """The :class:`~moe_ops.CaptureTarget` of one MoE layer, for routers that capture themselves.

        ``route(logits, top_k, method, capture=capturer.target(layer_idx))`` records the ids in the
        router's kernel exactly as ``capturer.capture(layer_idx, ids, layout)`` would after it.

        Args:
            model_layer_index: the MODEL layer index, mapped to the buffer's MoE-only layer axis as
                in :meth:`capture` (IndexError outside the model, ValueError for a dense layer).
            layout: the :class:`BatchLayout` of the router's rows; sizes as in :meth:`capture`.
            tp_group: SEQUENCE_PARALLEL only, the group to all-gather over.

        Built and validated on the first call for a ``(model_layer_index, layout, tp_group)`` and
        kept: a target holds this capturer's tensors, which ``set_step`` and ``clear_counts``
        update in place and never replace, so the same target is right for every later step
        (the ids, which change per call, are checked by the capture itself). Eager CPU host time
        of ``target(layer)``, median of 12,000 calls on the 2-core development host at load 4-7:
        5.0-6.1 us built per call, 0.25 us kept (``capture(layer, ids)`` there: 185-300 us
        either way, its CPU kernel - the PyTorch twin - dominating). Under ``torch.compile`` the
        target is built in the trace as before (the compiled step runs no Python for it), so the
        cache adds no guard and no recompile. No device reads.
        """
        key = None
        if (
            not torch.compiler.is_compiling()
            and type(model_layer_index) is int
            and type(layout) in _LAYOUT_TYPES
            and (tp_group is None or isinstance(tp_group, Hashable))
        ):
            key = (model_layer_index, layout, tp_group)
            target = self._targets.get(key)
            if target is not None:
                return target
        target = CaptureTarget.of(self, self._column(model_layer_index), layout, tp_group=tp_group)
        if key is not None:
            self._targets[key] = target
        return target

    @property
    def channels(self) -> tuple[Channel, ...]:
        """The channels every snapshot of this capturer carries, ids first: ``Channel("ids",
        out_dtype, (num_layers, top_k))``, then with ``weights_dtype`` the ``"weights"`` channel
        (:func:`weights_channel`). Read-only: what a :class:`~moe_ops.SlotStore` that stores these
        snapshots takes, ``SlotStore(n, shape, capturer.channels[0].dtype,
        extra_channels=capturer.channels[1:])``, so an engine never rebuilds them by hand."""
        return self.pipeline.channels

    def _column(self, model_layer: int) -> int:
        """Buffer layer of a model layer (raises for dense layers and layers outside the model)."""
        index = self._buffer_index.get(model_layer)
        if index is None:
            index = self.shape.buffer_layer(model_layer)  # raises the precise error
        return index

    def snapshot(
        self,
        num_rows: int | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
        timeout: float = 0.0,
    ) -> SnapshotHandle:
        """Enqueues the async copy of buffer rows ``[0, num_rows)`` to the host; see
        :meth:`TransferPipeline.snapshot`.

        ``num_rows`` defaults to ``num_tokens`` (this rank's count from the last :meth:`set_step`).
        Returns at once on CUDA (no host sync); the handle's ``result()`` waits for this copy only.
        Warns once (:class:`MissingSetStepWarning`) when no :meth:`set_step` ran since the last
        snapshot: that step's captures read an earlier step's counts.
        """
        if num_rows is None:
            if self.num_tokens is None:
                raise ValueError(
                    "num_rows is required: the last set_step took device counts, so this rank's token "
                    "count is not known on the host"
                )
            num_rows = self.num_tokens
        if not self._stepped and not self._warned_missing_step:
            self._warned_missing_step = True
            warnings.warn(
                "RoutingCapturer.snapshot() without a set_step() since the last snapshot: the step's "
                "captures used an earlier step's counts, and its layers read as not captured (fill); "
                "call set_step(token_counts) before each forward (warned once per capturer)",
                MissingSetStepWarning,
                stacklevel=2,
            )
        handle = self.pipeline.snapshot(num_rows, stream=stream, timeout=timeout)
        self._stepped = False
        return handle

    def check_errors(self, *, raise_error: bool = True) -> int:
        """Reads and resets THIS capturer's fault counter (its captures and targets only); returns
        the number of faults since the last check, raising :class:`~moe_ops.CaptureFaultError`
        when there were any and ``raise_error``.

        HOST SYNC: copies 32 bytes from the device. Thread-safe and lossless (see
        :mod:`moe_ops.capture.errors`).
        """
        return self.fault_counter.check(raise_error=raise_error)
