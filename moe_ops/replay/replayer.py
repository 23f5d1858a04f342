"""``RoutingReplayer``: the recorded ids of one training batch, read by every MoE router of a model.

The trainer's half of the data path. A client receives each request's routing from the rollout
(``decode_routing``), :func:`replay_batch` packs or pads the requests into the rows of one training
batch, :meth:`RoutingReplayer.set_batch` copies them into a persistent device buffer, and every
MoE router wrapped by ``attach_replay`` reads its own layer's slice of that buffer::

    replayer = RoutingReplayer(shape, max_num_tokens, "cuda")
    with attach_replay(model, replayer):
        routing = replay_batch([decode_routing(s) for s in routed_experts], shape, pad_to=seq_len)
        replayer.set_batch(routing)          # copied in place: no recompile, no re-capture
        loss = loss_fn(model(input_ids).logits)
        loss.backward()                      # checkpointed layers re-read the same slice

A router reads ``buffer[:n, column(layer)]`` (``n`` = its row count this call): a view of the
static buffer, so a compiled or CUDA-graphed step replays whatever batch was set last, and a layer
that runs twice (activation recomputation in backward, a second forward over the same micro-batch)
reads the same ids both times: nothing is consumed from a queue.

The router wrappers that read it (``ReplayRule``, ``replaying_forward``, ``ReplayHandle``) are in
:mod:`moe_ops.replay.attach`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..shapes import RoutingShape

__all__ = ["RoutingReplayer", "replay_batch"]

LAYER_AXES = ("moe", "model")
_INT32_MAX = (1 << 31) - 1


# ---------------------------------------------------------------------------------------------------
# Host arrays: checks shared by set_batch and replay_batch
# ---------------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _first_bad(bad: np.ndarray, values: np.ndarray) -> str:
    """'N ids, the first at [row, layer, k] = value' for a boolean mask over a 3-D array."""
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return f"{int(bad.sum())} id(s), the first at [row, layer, k] = {list(where)}: {values[where]!r}"


def _host_ids(name: str, array: np.ndarray, num_experts: int, *, unsigned_fill: bool) -> np.ndarray:
    """``array`` as int32 with every id in [-1, num_experts); ValueError naming ``name`` otherwise.

    ``unsigned_fill``: an unsigned array's maximum value reads as -1 where it cannot be an id
    (``num_experts <= max``): it is what ``SlotStore`` and the snapshots write for rows that were
    never recorded (unsigned dtypes cannot hold -1).
    """
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer expert ids, got dtype {array.dtype}")
    missing = None
    if unsigned_fill and array.dtype.kind == "u" and np.iinfo(array.dtype).max >= num_experts:
        missing = array == np.iinfo(array.dtype).max
    if array.size:
        low = -1 if array.dtype.kind == "i" else 0
        bad = (array < low) | (array >= num_experts)
        if missing is not None:
            bad &= ~missing
        if bad.any():
            raise ValueError(
                f"{name} must hold expert ids in [0, num_experts={num_experts}) or -1 (no record), "
                f"got {_first_bad(bad, array)}"
            )
    out = array.astype(np.int32)
    if missing is not None:
        out[missing] = -1
    return out


def _as_host_array(name: str, value: Any) -> np.ndarray:
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"{name} must be an integer array; decode wire data first (moe_ops.decode_routing), "
            f"got {type(value).__name__}"
        )
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(
                f"{name} must be a host array (numpy or a CPU tensor), got a tensor on {value.device}"
            )
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer expert ids, got dtype {value.dtype}")
        return value.numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or a torch.Tensor, got {type(value).__name__}")
    if value.dtype == np.bool_:
        raise ValueError(f"{name} must hold integer expert ids, got dtype bool")
    return value


# ---------------------------------------------------------------------------------------------------
# The batch builder
# ---------------------------------------------------------------------------------------------------


def replay_batch(
    requests: Sequence[np.ndarray | torch.Tensor],
    shape: RoutingShape,
    *,
    layer_axis: str = "moe",
    pad_to: int | None = None,
) -> np.ndarray:
    """The routing rows of one training batch, built from the routing each request came back with.

    Args:
        requests: per request, the routing the rollout returned for it (``decode_routing`` of its
            ``routed_experts``): ``(T - 1, A, top_k)`` integer, where ``T`` is the request's
            tokens (prompt + generated) and row ``j`` holds the experts token ``j`` was routed to.
            The last token was sampled but never run through the model, so it has no row.
            ``A`` is ``shape.num_layers`` (``layer_axis="moe"``, what ``RoutingCapturer`` and the
            ledger produce) or ``shape.num_model_layers`` (``layer_axis="model"``: vLLM's
            ``routed_experts``, a column per decoder layer; the dense layers' columns are dropped
            whatever they hold). Any integer dtype: -1, or an unsigned dtype's maximum where it
            cannot be an id (the fill of rows never recorded), means "no record".
        shape: the model's :class:`~moe_ops.RoutingShape`.
        layer_axis: ``"moe"`` or ``"model"``, see ``requests``.
        pad_to: None: requests packed back to back (``sum(T)`` rows, e.g. for packed sequences
            with per-sequence positions); an int: each request right-padded to ``pad_to`` rows
            (``len(requests) * pad_to`` rows, a ``(batch, pad_to)`` batch flattened row-major, as
            transformers' routers see it). Every ``T <= pad_to``.

    Returns:
        routing: (num_tokens, shape.num_layers, top_k) int32 - what
        :meth:`RoutingReplayer.set_batch` takes: request ``i``'s rows, then a row of -1 for its
        last token, then (padded) rows of -1 for padding. -1 rows are routed live by the replay::

            request 0: T = 4, rows r0 r1 r2        request 1: T = 3, rows s0 s1
            pad_to=None:  r0 r1 r2 -1 | s0 s1 -1                  7 rows
            pad_to=5:     r0 r1 r2 -1 -1 | s0 s1 -1 -1 -1        10 rows

    Raises ValueError (naming the request) for a wrong shape or dtype, an id outside
    ``[0, num_experts)`` other than the no-record values, or a request longer than ``pad_to``;
    TypeError for wire text (decode it first). A pure function of its arguments: thread-safe.
    """
    if not isinstance(shape, RoutingShape):
        raise TypeError(f"shape must be a RoutingShape, got {type(shape).__name__}")
    if layer_axis not in LAYER_AXES:
        raise ValueError(f"layer_axis must be 'moe' or 'model', got {layer_axis!r}")
    if pad_to is not None:
        pad_to = _check_int("pad_to", pad_to, 1)
    if isinstance(requests, (str, bytes, np.ndarray, torch.Tensor)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of per-request arrays, got {type(requests).__name__}")
    width = shape.num_layers if layer_axis == "moe" else shape.num_model_layers
    rows: list[np.ndarray] = []
    for i, request in enumerate(requests):
        name = f"requests[{i}]"
        array = _as_host_array(name, request)
        if array.ndim != 3 or array.shape[1:] != (width, shape.top_k):
            hint = ""
            if array.ndim == 3 and array.shape[1:] == (shape.num_model_layers, shape.top_k):
                hint = " (a column per model layer: pass layer_axis='model')"
            elif array.ndim == 3 and array.shape[1:] == (shape.num_layers, shape.top_k):
                hint = " (the MoE-only layer axis: pass layer_axis='moe')"
            raise ValueError(
                f"{name} must have shape (num_tokens - 1, {width}, {shape.top_k}) on the {layer_axis} "
                f"layer axis, got {array.shape}{hint}"
            )
        if layer_axis == "model":
            array = array[:, list(shape.moe_layers)]
        tokens = array.shape[0] + 1
        if pad_to is not None and tokens > pad_to:
            raise ValueError(
                f"{name} has {array.shape[0]} rows, so {tokens} tokens (the last one without a row), "
                f"more than pad_to={pad_to}"
            )
        rows.append(_host_ids(name, array, shape.num_experts, unsigned_fill=True))
    per_request = [pad_to if pad_to is not None else r.shape[0] + 1 for r in rows]
    out = np.full((sum(per_request), shape.num_layers, shape.top_k), -1, dtype=np.int32)
    start = 0
    for r, size in zip(rows, per_request):
        out[start : start + r.shape[0]] = r
        start += size
    return out


# ---------------------------------------------------------------------------------------------------
# The replayer
# ---------------------------------------------------------------------------------------------------


class RoutingReplayer:
    """The recorded ids of one training batch, on the device, for every MoE layer of one model.

    Args:
        shape: the model's :class:`~moe_ops.RoutingShape` (the layer axis holds MoE layers only).
        max_num_tokens: rows of the buffer: the most router rows one forward has (a padded batch
            of ``(batch, seq)`` has ``batch * seq``).
        device: where the buffer lives (``"cuda"``, ``"cuda:1"``, ``"cpu"``): the model's device.

    Attributes:
        buffer: (max_num_tokens, shape.num_layers, shape.top_k) int32 on ``device`` - the current
            batch's ids in rows ``[0, num_tokens)``, -1 everywhere else; allocated once, never
            reallocated, marked as a static address (CUDA graphs and inductor's CUDA-graph trees
            keep reading it).
        row_count: (1,) int32 on ``device`` - ``num_tokens`` on the device (for a graphed step
            that masks its padding rows; the routers do not need it, the rows past it are -1).
        num_tokens: host int, the rows of the last :meth:`set_batch` (0 before the first).

    Thread safety: :meth:`set_batch` is serialised by a lock, so concurrent calls leave the buffer
    holding exactly one of their batches (never a mix), with ``num_tokens`` and ``row_count``
    matching it. Which batch a forward reads is the caller's ordering: set the batch, then run the
    forward and backward that use it, on the stream the copy was enqueued on. :meth:`layer_ids`
    only slices (no lock: it runs inside compiled graphs).
    """

    def __init__(self, shape: RoutingShape, max_num_tokens: int, device: torch.device | str):
        if not isinstance(shape, RoutingShape):
            raise TypeError(f"shape must be a RoutingShape, got {type(shape).__name__}")
        max_num_tokens = _check_int("max_num_tokens", max_num_tokens, 1)
        if max_num_tokens > _INT32_MAX:
            raise ValueError(f"max_num_tokens must be < 2**31 (row_count is int32), got {max_num_tokens}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.shape = shape
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.num_tokens = 0
        # model layer -> buffer column, looked up at every router call (also while tracing)
        self._column = {layer: i for i, layer in enumerate(shape.moe_layers)}
        self._lock = threading.Lock()
        self.buffer = torch.full(
            (max_num_tokens, shape.num_layers, shape.top_k), -1, dtype=torch.int32, device=device
        )
        self.row_count = torch.zeros(1, dtype=torch.int32, device=device)
        for t in (self.buffer, self.row_count):
            torch._dynamo.mark_static_address(t)

    def __repr__(self) -> str:
        s = self.shape
        return (
            f"RoutingReplayer(layers={s.num_layers}, experts={s.num_experts}, top_k={s.top_k}, "
            f"max_num_tokens={self.max_num_tokens}, device={self.device}, num_tokens={self.num_tokens})"
        )

    def set_batch(
        self, routing: np.ndarray | torch.Tensor, *, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Copies one batch's ids into ``buffer`` in place; rows past them read as -1.

        Args:
            routing: (num_tokens, shape.num_layers, top_k) integer - the ids of every router row
                of the next forward on the MoE-only layer axis (what :func:`replay_batch` builds),
                ``num_tokens <= max_num_tokens``; a row of -1 (a padding token, a last token, a
                token to route live) keeps the router's live routing. Either a host array (numpy
                or a CPU tensor) or a tensor on the replayer's device.
            stream: the stream the step runs on (default: the current stream).

        Host arrays are checked here: every id must be in ``[0, num_experts)`` or -1, else
        ValueError naming the first bad id, and nothing is written. A device tensor is not read on
        the host (no sync): an id outside ``[-1, num_experts)`` is stored as ``num_experts``, so its
        row is faulty for ``replay_routing`` (routed live and counted for
        ``check_replay_errors``), never wrapped into range. Shapes, dtypes and devices raise
        ValueError (TypeError for a non-array) before anything changes.

        Ordering: enqueued on ``stream`` as non-blocking copies (from freshly pinned host memory,
        which the caching host allocator keeps until the copy ran). Call it after the previous
        batch's backward was enqueued: checkpointed layers read the buffer again in backward.
        """
        if isinstance(routing, torch.Tensor) and routing.device.type != "cpu":
            with self._on(stream):  # the rule's kernels run where the copy will
                src = self._device_rows(routing)
            n = src.shape[0]
        else:
            array = _as_host_array("routing", routing)
            self._check_shape(array.shape)
            src = _host_ids("routing", array, self.shape.num_experts, unsigned_fill=False)
            n = src.shape[0]
        with self._lock:
            # rows [0, num_tokens) may hold the last batch; rows past it are -1 already
            stale = self.num_tokens
            if isinstance(src, np.ndarray):
                rows = np.full((max(n, stale), *self.buffer.shape[1:]), -1, dtype=np.int32)
                rows[:n] = src
                self._copy(self.buffer[: rows.shape[0]], torch.from_numpy(rows), stream)
            else:
                with self._on(stream):
                    self.buffer[:n].copy_(src)
                    if stale > n:
                        self.buffer[n:stale].fill_(-1)
            self._copy(self.row_count, torch.tensor([n], dtype=torch.int32), stream)
            self.num_tokens = n

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        s = self.shape
        if len(shape) != 3 or tuple(shape[1:]) != (s.num_layers, s.top_k):
            hint = ""
            if len(shape) == 3 and tuple(shape[1:]) == (s.num_model_layers, s.top_k):
                hint = "; a column per model layer (vLLM's axis): use replay_batch(..., layer_axis='model')"
            raise ValueError(
                f"routing must have shape (num_tokens, {s.num_layers}, {s.top_k}) on the MoE-only layer "
                f"axis, got {tuple(shape)}{hint}"
            )
        if shape[0] > self.max_num_tokens:
            raise ValueError(
                f"routing has {shape[0]} rows, more than max_num_tokens={self.max_num_tokens} "
                "(the rows of the replay buffer)"
            )

    def _device_rows(self, routing: torch.Tensor) -> torch.Tensor:
        if routing.device != self.device:
            raise ValueError(
                f"routing must be on the replayer's device {self.device} or the host, got {routing.device}"
            )
        if routing.dtype.is_floating_point or routing.dtype.is_complex or routing.dtype == torch.bool:
            raise ValueError(f"routing must hold integer expert ids, got dtype {routing.dtype}")
        self._check_shape(tuple(routing.shape))
        wide = routing.to(torch.int64)
        num_experts = self.shape.num_experts
        # out of [-1, num_experts) -> num_experts: the row stays faulty, nothing wraps into range
        return torch.where((wide < -1) | (wide >= num_experts), num_experts, wide).to(torch.int32)

    def _on(self, stream):
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(self.device))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        if self.device.type == "cuda":
            src = src.pin_memory()
            with self._on(stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def layer_ids(self, model_layer_index: int, num_tokens: int) -> torch.Tensor:
        """(num_tokens, top_k) int32 view ``buffer[:num_tokens, column]`` of one MoE layer.

        Args:
            model_layer_index: the MODEL layer index of the router (mapped to the buffer's MoE-only
                layer axis; IndexError outside the model, ValueError for a dense layer).
            num_tokens: the router's row count this call; ValueError above ``max_num_tokens``.

        No host reads of device values and no copies: safe inside torch.compile and CUDA graphs.
        """
        column = self._column.get(model_layer_index)
        if column is None:
            column = self.shape.buffer_layer(model_layer_index)  # raises the precise error
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"the router of layer {model_layer_index} has {num_tokens} rows, more than the "
                f"replayer's max_num_tokens={self.max_num_tokens}"
            )
        return self.buffer[:num_tokens, column]
