"""``RoutingReplayer``: the recorded ids of a training batch, read by every MoE router of a model.

The trainer's half of the data path. A client receives each request's routing from the rollout
(``decode_routing``), :func:`replay_batch` packs or pads the requests into the rows of one training
batch, :meth:`RoutingReplayer.set_batch` copies them into a persistent device buffer, and every
MoE router wrapped by ``attach_replay`` reads its own layer's slice of that buffer::

    replayer = RoutingReplayer(shape, max_num_tokens, "cuda")
    with attach_replay(model, replayer):
        routing = replay_batch(rows, shape, num_tokens=lengths, pad_to=seq_len)
        replayer.set_batch(routing)          # copied in place: no recompile, no re-capture
        loss = loss_fn(model(input_ids).logits)
        loss.backward()                      # checkpointed layers re-read the same slice

A router reads ``buffer[:n, column(layer)]``: a view of the static buffer, so a compiled or
CUDA-graphed step replays whatever batch was set last, and a layer that runs twice (activation
recomputation in backward, a second forward over the same micro-batch) reads the same ids both
times: nothing is consumed from a queue. ``n`` must be the rows of the batch that was set: a router
that reads a different number of rows than the batch holds is refused (``layer_ids``).

Pipeline schedules (1F1B, interleaved 1F1B) run the forward of micro-batch B before the backward,
and the activation recompute, of micro-batch A. With ``num_slots=N`` the replayer holds N batches:
``set_batch(routing, slot=i)`` fills slot ``i`` and ``select(i)`` makes it the one the routers
read::

    replayer = RoutingReplayer(shape, max_num_tokens, "cuda", num_slots=4)
    replayer.set_batch(routing_of[mb], slot=mb % 4)
    replayer.select(mb % 4)                                   # this forward reads slot mb % 4
    loss = loss_fn(model(x))                                  # ... and so does its recompute

A recompute reads the slot its forward read, whichever slot is selected when it runs: an eager
router call inside a backward (an activation checkpoint recomputing) finds the forward it
recomputes by the autograd node that runs it (nodes are numbered as the forward creates them) and
reads the batch that forward read, from that slot's own storage; a batch replaced since (its slot
filled again) raises instead of replaying another batch's ids (:meth:`RoutingReplayer.layer_ids`).
``select_in_backward`` still selects a slot when a backward starts, for what cannot find its
forward (a compiled step's recompute).

Multi-token-prediction layers have their own columns (``num_mtp_layers``, ``mtp_routing``): an MTP
layer never reads a decoder layer's rows (``layer_ids(i, n, kind="mtp")``).

The router wrappers that read it (``ReplayRule``, ``replaying_forward``, ``ReplayHandle``) are in
:mod:`moe_ops.attach.replaying`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .._runtime.faults import cpu_counter_lock
from .._runtime.library import destination_op
from ..shapes import RoutingShape
from ..wire import check_layer_axis
from .kernels import REPLAY_FAULT_ROW_COUNT, add_count
from .op import replay_fault_counter

__all__ = [
    "LAYER_KINDS",
    "NO_RECORD_MARKERS",
    "WEIGHT_DTYPES",
    "ReplayRows",
    "RoutingReplayer",
    "replay_batch",
]

# "decoder": a layer of the model's decoder stack (model-layer index, mapped to the MoE-only axis);
# "mtp": a multi-token-prediction layer (its own index from 0, its own columns)
LAYER_KINDS = ("decoder", "mtp")
# What marks a (token, layer) row without a record, besides moe-ops' own -1: verl's aligned
# placeholder and slime's padding are all-zero rows (NeMo-RL's current codec uses -1, as moe-ops
# does). An all-zero row is never a routing when top_k >= 2 (expert 0 twice).
NO_RECORD_MARKERS = (-1, 0)
_INT32_MAX = (1 << 31) - 1
# the most slots a replayer holds: each slot is a full buffer of max_num_tokens rows, so this bounds
# a typo (2**40) before any allocation; pipeline depths and micro-batches in flight are far below it
MAX_SLOTS = 1 << 16
# selections remembered for recomputes (one per set_batch of the selected slot and per select): a
# recompute whose forward is older than all of them raises (never reads another batch); 1F1B on a
# 64-stage pipeline keeps 64 micro-batches in flight
_HISTORY = 4096
# the next autograd sequence number of the calling thread (torch 2.1+): nodes are numbered in the
# order a forward creates them
_next_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)
_current_node = getattr(torch._C, "_current_autograd_node", None)


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


# the dtypes a replayer's recorded weights are kept in (replay_routing's recorded_weights takes them)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _host_weights(name: str, value: Any, dtype: torch.dtype) -> torch.Tensor:
    """``value`` (a float numpy array or CPU tensor) as a CPU tensor of ``dtype``; ValueError where a
    value would change in the cast (NaN stays NaN: a row without recorded weights)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind != "f":
            raise ValueError(f"{name} must hold floating-point weights, got dtype {value.dtype}")
        value = torch.from_numpy(value)
    elif not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a numpy array or a torch.Tensor, got {type(value).__name__}")
    elif value.device.type != "cpu":
        raise ValueError(f"{name} must be on the replayer's device or the host, got {value.device}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"{name} must hold floating-point weights, got dtype {value.dtype}")
    out = value.to(dtype)
    if value.dtype != dtype and value.numel():
        wide, back = value.to(torch.float64), out.to(torch.float64)
        changed = (wide != back) & ~(wide.isnan() & back.isnan())
        if changed.any():
            where = [int(i) for i in changed.nonzero()[0]]
            raise ValueError(
                f"{name} holds {int(changed.sum())} weight(s) that {dtype} cannot hold exactly, the first "
                f"at [row, layer, k] = {where}: {float(wide[tuple(where)])!r}; build the replayer with "
                f"weights_dtype={value.dtype} (or round the weights first)"
            )
    return out


# ---------------------------------------------------------------------------------------------------
# The batch builder
# ---------------------------------------------------------------------------------------------------


def check_no_record(no_record: Any, top_k: int) -> int:
    """``no_record`` as an int in :data:`NO_RECORD_MARKERS`; ValueError otherwise, and for marker 0
    with ``top_k == 1`` (there a row ``[0]`` is expert 0, a valid single choice)."""
    is_int = isinstance(no_record, (int, np.integer)) and not isinstance(no_record, bool)
    if not is_int or no_record not in NO_RECORD_MARKERS:
        raise ValueError(f"no_record must be -1 (moe-ops' marker) or 0 (all-zero rows), got {no_record!r}")
    if no_record == 0 and top_k == 1:
        raise ValueError(
            "no_record=0 needs top_k >= 2: with top_k == 1 the row [0] is expert 0, a valid choice, "
            "not a missing record; mark rows without a record with -1"
        )
    return int(no_record)


def _mark_no_record(ids: np.ndarray, no_record: int) -> np.ndarray:
    """``ids`` (int32, [..., top_k]) with every row that is all ``no_record`` set to -1, in place."""
    if no_record != -1 and ids.size:
        ids[(ids == no_record).all(axis=-1)] = -1
    return ids


def _check_lengths(name: str, value: Any, count: int) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence with one entry per request, got {type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"{name} must have one entry per request ({count}), got {len(value)}")
    return list(value)


def replay_batch(
    requests: Sequence[np.ndarray | torch.Tensor],
    shape: RoutingShape,
    *,
    layer_axis: str = "moe",
    pad_to: int | None = None,
    num_tokens: Sequence[int] | None = None,
    no_record: int = -1,
    missing: Sequence[np.ndarray | None] | None = None,
) -> np.ndarray:
    """The routing rows of one training batch, built from the routing each request came back with.

    Args:
        requests: per request, the routing the rollout returned for it (``decode_routing`` of its
            ``routed_experts``): ``(R, A, top_k)`` integer, where row ``j`` holds the experts
            token ``j`` was routed to. A request of ``T`` tokens (prompt + generated) comes with
            ``R = T - 1`` rows from vLLM, SGLang and moe-ops' ledger (the last token was sampled
            but never run through the model), or ``R = T`` when already aligned to the tokens
            (verl's ``align_r3_router_replay_data`` appends an all-zero placeholder row for the
            last token). ``A`` is ``shape.num_layers`` (``layer_axis="moe"``, what
            ``RoutingCapturer`` and the ledger produce) or ``shape.num_model_layers``
            (``layer_axis="model"``: vLLM's ``routed_experts``, a column per decoder layer; the
            dense layers' columns are dropped whatever they hold). Any integer dtype.
        shape: the model's :class:`~moe_ops.RoutingShape`.
        layer_axis: ``"moe"`` or ``"model"`` (``moe_ops.wire.LAYER_AXES``), see ``requests``; a
            format's ``moe_ops.wire.FORMATS[name].layer_axes`` say which its clients read.
        pad_to: None: requests packed back to back (``sum(T)`` rows, e.g. for packed sequences
            with per-sequence positions); an int: each request right-padded to ``pad_to`` rows
            (``len(requests) * pad_to`` rows, a ``(batch, pad_to)`` batch flattened row-major, as
            transformers' routers see it). Every ``T <= pad_to``.
        num_tokens: per request, its token count ``T`` (prompt + generated: the tokens of the
            training sequence). Each request must then have ``T - 1`` or ``T`` rows, else
            ValueError naming the request and both lengths; a request with ``T`` rows keeps its
            last row (a placeholder reads as no record only if it is one: -1, or all zero with
            ``no_record=0``). None: every request is taken to have ``T - 1`` rows, unchecked - pass
            the counts: a request a row short or long shifts every later request of a packed
            batch.
        no_record: what marks a row without a record in ``requests``, besides -1: -1 (only -1) or
            0 (an all-zero row too, what verl and slime send; needs ``top_k >= 2``).
        missing: per request, None or an ``(R,)`` bool mask of rows that hold no record whatever
            their values (``FinishedRouting.missing`` of the ledger: a dropped step's rows hold the
            store's fill value, which at 256 experts in uint8 is the valid id 255).

    Returns:
        routing: (num_tokens, shape.num_layers, top_k) int32 - what
        :meth:`RoutingReplayer.set_batch` takes: request ``i``'s rows, then a row of -1 for its
        last token (when it came with ``T - 1`` rows), then (padded) rows of -1 for padding. -1
        rows - and every row without a record (``no_record``, ``missing``, an unsigned dtype's
        maximum where it cannot be an id) - are routed live by the replay and never counted as
        faults::

            request 0: T = 4, rows r0 r1 r2        request 1: T = 3, rows s0 s1
            pad_to=None:  r0 r1 r2 -1 | s0 s1 -1                  7 rows
            pad_to=5:     r0 r1 r2 -1 -1 | s0 s1 -1 -1 -1        10 rows

    Raises ValueError (naming the request) for a wrong shape, dtype or length, an id outside
    ``[0, num_experts)`` other than the no-record values, or a request longer than ``pad_to``;
    TypeError for wire text (decode it first). A pure function of its arguments: thread-safe.
    """
    if not isinstance(shape, RoutingShape):
        raise TypeError(f"shape must be a RoutingShape, got {type(shape).__name__}")
    layer_axis = check_layer_axis(layer_axis)
    if pad_to is not None:
        pad_to = _check_int("pad_to", pad_to, 1)
    no_record = check_no_record(no_record, shape.top_k)
    if isinstance(requests, (str, bytes, np.ndarray, torch.Tensor)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of per-request arrays, got {type(requests).__name__}")
    lengths = _check_lengths("num_tokens", num_tokens, len(requests))
    masks = _check_lengths("missing", missing, len(requests))
    width = shape.num_layers if layer_axis == "moe" else shape.num_model_layers
    rows: list[np.ndarray] = []
    per_request: list[int] = []
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
                f"{name} must have shape (rows, {width}, {shape.top_k}) on the {layer_axis} "
                f"layer axis, got {array.shape}{hint}"
            )
        num_rows = array.shape[0]
        if lengths is None:
            tokens = num_rows + 1
        else:
            tokens = _check_int(f"num_tokens[{i}]", lengths[i], 1)
            if num_rows not in (tokens - 1, tokens):
                raise ValueError(
                    f"{name} has {num_rows} rows for num_tokens[{i}]={tokens} tokens: expected "
                    f"{tokens - 1} (a row per token but the last, as vLLM, SGLang and moe-ops return "
                    f"it) or {tokens} (aligned to the tokens)"
                )
        if pad_to is not None and tokens > pad_to:
            raise ValueError(f"{name} has {tokens} tokens ({num_rows} rows), more than pad_to={pad_to}")
        if layer_axis == "model":
            array = array[:, list(shape.moe_layers)]
        ids = _mark_no_record(_host_ids(name, array, shape.num_experts, unsigned_fill=True), no_record)
        if masks is not None and masks[i] is not None:
            mask = masks[i]
            if isinstance(mask, torch.Tensor):
                mask = mask.numpy() if mask.device.type == "cpu" else mask
            if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != (num_rows,):
                raise ValueError(
                    f"missing[{i}] must be a ({num_rows},) bool array (one flag per row of {name}), got "
                    f"{getattr(mask, 'dtype', type(mask).__name__)} {getattr(mask, 'shape', '')}"
                )
            ids[mask] = -1
        rows.append(ids)
        per_request.append(pad_to if pad_to is not None else tokens)
    out = np.full((sum(per_request), shape.num_layers, shape.top_k), -1, dtype=np.int32)
    start = 0
    for r, size in zip(rows, per_request):
        out[start : start + r.shape[0]] = r
        start += size
    return out


# ---------------------------------------------------------------------------------------------------
# The row-count check of a compiled or captured step
# ---------------------------------------------------------------------------------------------------


def _check_rows(row_count: torch.Tensor, num_rows: int, errors: torch.Tensor) -> None:
    """One faulty call (``errors[0] += 1``, ``errors[1] |= REPLAY_FAULT_ROW_COUNT``) in the replay
    fault counter when ``row_count[0] != num_rows``: a router reads ``num_rows`` rows of a batch
    that holds ``row_count[0]``. On the device, no host read (one small kernel per term; the count
    an atomic add on CUDA, as the twin's); the CPU counters' lock held as the replay twins hold it."""
    bad = (row_count != num_rows).to(torch.int32)
    with cpu_counter_lock(errors.device):
        add_count(errors, bad)
        errors[1:2].bitwise_or_(bad * REPLAY_FAULT_ROW_COUNT)


# one device-neutral body (registered for CUDA, and for the CPU through cpu=None)
replay_check_rows_op = destination_op("replay_check_rows_", mutates=("errors",), cuda=_check_rows)


# ---------------------------------------------------------------------------------------------------
# Which batch a recompute reads: the selections the forwards read
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Selection:
    """What the routers read from one selection on (a ``select``, or a ``set_batch`` of the
    selected slot) until the next: one slot's batch."""

    # the slot, in [0, num_slots)
    slot: int
    # that slot's set_batch count then: a later set_batch replaces the batch (and counts one more)
    generation: int
    # the thread that selected, and its next autograd sequence number then
    thread: int
    requested_at: int
    # the sequence number from which this selection's forwards numbered their autograd nodes:
    # requested_at when the first eager router call under it ran on the selecting thread (every node
    # the forward made came after the selection), else that call's own next number (a selection made
    # on another thread numbers nothing of the forward's); None until an eager router call read it
    start: int | None = None


# ---------------------------------------------------------------------------------------------------
# The replayer
# ---------------------------------------------------------------------------------------------------


class ReplayRows(NamedTuple):
    """One router call's rows from :meth:`RoutingReplayer.rows`."""

    # (n, top_k) int32 view: the recorded ids (-1: no record)
    ids: torch.Tensor
    # (1,) int32 for replay_routing's device check, or None where the host checked
    row_count: torch.Tensor | None
    # (n, top_k) weights_dtype view: the recorded weights (NaN: none), or None when not asked for
    weights: torch.Tensor | None


class RoutingReplayer:
    """The recorded ids of a training batch (or of ``num_slots`` micro-batches), on the device, for
    every MoE layer of one model.

    Args:
        shape: the model's :class:`~moe_ops.RoutingShape` (the layer axis holds MoE layers only).
        max_num_tokens: rows of the buffer: the most router rows one forward has (a padded batch
            of ``(batch, seq)`` has ``batch * seq``).
        device: where the buffer lives (``"cuda"``, ``"cuda:1"``, ``"cpu"``): the model's device.
        num_slots: micro-batches held at once (pipeline schedules: the micro-batches in flight
            between a forward and its backward, e.g. the pipeline depth for 1F1B). Slot ``i`` is
            filled by ``set_batch(..., slot=i)`` and read after ``select(i)``.
        num_mtp_layers: multi-token-prediction layers with a router (their own columns, read with
            ``layer_ids(i, n, kind="mtp")``; 0: none).
        no_record: what marks a row without a record in the batches given to :meth:`set_batch`
            besides -1: -1 (only -1) or 0 (all-zero rows too, as verl and slime send them;
            needs ``top_k >= 2``). Such rows are routed live and never counted as faults.
        record_live: keep what each router chose live during a replayed forward in
            ``live_buffer`` (the routers wrapped by ``attach_replay`` write it), for
            ``routing_mismatch`` without a second forward. Costs one small device copy per router
            call.
        weights_dtype: keep the rollout's routing weights beside the ids (float32, bfloat16 or
            float16; None: ids only), for ``attach_replay(..., weights="recorded")``: each batch's
            weights come with :meth:`set_batch` (``weights=``), and a router reads its layer's
            with :meth:`rows`. A row without recorded weights holds NaN (the computed weights are
            used there).

    Attributes:
        buffer: (max_num_tokens, shape.num_layers, shape.top_k) int32 on ``device`` - the rows
            the routers read: the selected slot's batch in rows ``[0, num_tokens)``, -1 everywhere
            else; allocated once, never reallocated, marked as a static address (CUDA graphs and
            inductor's CUDA-graph trees keep reading it).
        mtp_buffer: (max_num_tokens, num_mtp_layers, shape.top_k) int32 on ``device`` - the same
            for the MTP layers; -1 where the batch came without MTP rows.
        row_count: (1,) int32 on ``device`` - ``num_tokens`` on the device, what a compiled or
            CUDA-graphed router checks its row count against.
        live_buffer: (max_num_tokens, shape.num_layers, shape.top_k) int32 on ``device``, only
            with ``record_live`` (else None) - rows ``[0, n)`` of each layer: the ids that layer's
            router chose itself in the last replayed forward (n = its rows), -1 before the first.
        mtp_live_buffer: the same for the MTP layers (None without ``record_live``).
        weights_buffer: (max_num_tokens, shape.num_layers, shape.top_k) ``weights_dtype`` on
            ``device``, only with ``weights_dtype`` (else None) - the selected slot's recorded
            weights, column for column with ``buffer``; NaN where none were given.
        mtp_weights_buffer: the same for the MTP layers (None without ``weights_dtype``).
        num_tokens: host int, the rows of the selected slot's batch (0 before its first
            :meth:`set_batch`).
        slot: host int, the selected slot (0 until :meth:`select`).

    With ``num_slots > 1`` every slot has its own storage beside ``buffer`` (``num_slots + 1``
    buffers in all) and :meth:`select` copies the selected slot's rows into ``buffer`` on the
    device: the routers keep reading one static address, so selecting costs one device copy per
    micro-batch and nothing per router call. With one slot, ``set_batch`` writes ``buffer``.

    Thread safety: :meth:`set_batch` and :meth:`select` are serialised by a lock (the backward
    hook of :meth:`select_in_backward` runs on autograd's thread), so concurrent calls leave every
    slot holding exactly one of their batches (never a mix) and ``buffer``, ``num_tokens`` and
    ``row_count`` matching the selected slot. Which batch a forward reads is the caller's ordering:
    select the slot, then run the forward that uses it, on the stream the copies were enqueued on.
    :meth:`layer_ids` only slices and checks host values (no lock: it runs inside compiled graphs).
    """

    def __init__(
        self,
        shape: RoutingShape,
        max_num_tokens: int,
        device: torch.device | str,
        *,
        num_slots: int = 1,
        num_mtp_layers: int = 0,
        no_record: int = -1,
        record_live: bool = False,
        weights_dtype: torch.dtype | None = None,
    ):
        if not isinstance(shape, RoutingShape):
            raise TypeError(f"shape must be a RoutingShape, got {type(shape).__name__}")
        max_num_tokens = _check_int("max_num_tokens", max_num_tokens, 1)
        if max_num_tokens > _INT32_MAX:
            raise ValueError(f"max_num_tokens must be < 2**31 (row_count is int32), got {max_num_tokens}")
        num_slots = _check_int("num_slots", num_slots, 1)
        if num_slots > MAX_SLOTS:
            raise ValueError(
                f"num_slots must be at most {MAX_SLOTS} (each slot holds a batch of max_num_tokens rows; "
                f"the micro-batches in flight at once), got {num_slots}"
            )
        num_mtp_layers = _check_int("num_mtp_layers", num_mtp_layers, 0)
        self.no_record = check_no_record(no_record, shape.top_k)
        if not isinstance(record_live, bool):
            raise TypeError(f"record_live must be True or False, got {record_live!r}")
        self.record_live = record_live
        if weights_dtype is not None and weights_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weights_dtype must be None or one of {WEIGHT_DTYPES}, got {weights_dtype!r}")
        self.weights_dtype = weights_dtype
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.shape = shape
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.num_slots = num_slots
        self.num_mtp_layers = num_mtp_layers
        self.num_tokens = 0
        self.slot = 0
        # rows of each slot's batch (host ints); the selected one is num_tokens
        self._slot_tokens = [0] * num_slots
        # whether each slot was ever set (an empty batch is a batch; a never-set slot is a mistake)
        self._slot_set = [False] * num_slots
        # model layer -> buffer column, looked up at every router call (also while tracing)
        self._columns = {layer: i for i, layer in enumerate(shape.moe_layers)}
        self._lock = threading.Lock()
        # each selection the routers read from, for recomputes (_recompute_slot): set_batch counts of
        # each slot, the current selection (None before the first batch), the selections eager
        # forwards read, oldest first
        self._generation = [0] * num_slots
        self._selection: _Selection | None = None
        self._history: collections.deque[_Selection] = collections.deque(maxlen=_HISTORY)
        self._history_lock = threading.Lock()
        rows = (max_num_tokens, shape.num_layers, shape.top_k)
        mtp_rows = (max_num_tokens, num_mtp_layers, shape.top_k)
        try:
            self.buffer = torch.full(rows, -1, dtype=torch.int32, device=device)
            self.mtp_buffer = torch.full(mtp_rows, -1, dtype=torch.int32, device=device)
            self.row_count = torch.zeros(1, dtype=torch.int32, device=device)
            self.live_buffer = self.mtp_live_buffer = None
            if record_live:
                self.live_buffer = torch.full(rows, -1, dtype=torch.int32, device=device)
                self.mtp_live_buffer = torch.full(mtp_rows, -1, dtype=torch.int32, device=device)
            self.weights_buffer = self.mtp_weights_buffer = None
            if weights_dtype is not None:
                self.weights_buffer = torch.full(rows, float("nan"), dtype=weights_dtype, device=device)
                self.mtp_weights_buffer = torch.full(
                    mtp_rows, float("nan"), dtype=weights_dtype, device=device
                )
            # each slot's storage (num_slots > 1): select() copies one into buffer / mtp_buffer (and
            # the weights buffers)
            self._slots = self._mtp_slots = self._weight_slots = self._mtp_weight_slots = None
            if num_slots > 1:
                self._slots = torch.full((num_slots, *rows), -1, dtype=torch.int32, device=device)
                self._mtp_slots = torch.full((num_slots, *mtp_rows), -1, dtype=torch.int32, device=device)
                if weights_dtype is not None:
                    nan = float("nan")
                    self._weight_slots = torch.full(
                        (num_slots, *rows), nan, dtype=weights_dtype, device=device
                    )
                    self._mtp_weight_slots = torch.full(
                        (num_slots, *mtp_rows), nan, dtype=weights_dtype, device=device
                    )
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            per_batch = max_num_tokens * (shape.num_layers + num_mtp_layers) * shape.top_k * 4
            if weights_dtype is not None:
                per_batch += per_batch // 4 * weights_dtype.itemsize
            buffers = (num_slots + 1 if num_slots > 1 else 1) + (1 if record_live else 0)
            raise ValueError(
                f"RoutingReplayer(max_num_tokens={max_num_tokens}, num_slots={num_slots}) needs "
                f"{buffers} buffers of {per_batch} bytes on {device} ({buffers * per_batch} bytes), which "
                f"could not be allocated ({type(exc).__name__}: {exc}); lower num_slots or max_num_tokens"
            ) from exc
        for t in (
            self.buffer, self.mtp_buffer, self.row_count, self.live_buffer, self.mtp_live_buffer,
            self.weights_buffer, self.mtp_weights_buffer,
        ):  # fmt: skip
            if t is not None:
                torch._dynamo.mark_static_address(t)

    def __repr__(self) -> str:
        s = self.shape
        return (
            f"RoutingReplayer(layers={s.num_layers}, experts={s.num_experts}, top_k={s.top_k}, "
            f"max_num_tokens={self.max_num_tokens}, device={self.device}, num_slots={self.num_slots}, "
            f"num_mtp_layers={self.num_mtp_layers}, slot={self.slot}, num_tokens={self.num_tokens})"
        )

    # -- filling a slot -------------------------------------------------------------------------

    def set_batch(
        self,
        routing: np.ndarray | torch.Tensor,
        *,
        slot: int = 0,
        mtp_routing: np.ndarray | torch.Tensor | None = None,
        weights: np.ndarray | torch.Tensor | None = None,
        mtp_weights: np.ndarray | torch.Tensor | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Copies one batch's ids (and weights) into slot ``slot`` in place; rows past them read as -1
        (weights NaN).

        Args:
            routing: (num_tokens, shape.num_layers, top_k) integer - the ids of every router row
                of the forward on the MoE-only layer axis (what :func:`replay_batch` builds),
                ``num_tokens <= max_num_tokens``: the routers of that forward must have exactly
                ``num_tokens`` rows (:meth:`layer_ids`). A row of -1 (a padding token, a last
                token, a token to route live), or of the ``no_record`` marker, keeps the router's
                live routing. Either a host array (numpy or a CPU tensor) or a tensor on the
                replayer's device.
            slot: which slot to fill, in ``[0, num_slots)``; when it is the selected slot the
                routers read the new batch from the next forward on.
            mtp_routing: (num_tokens, num_mtp_layers, top_k) integer - the MTP layers' ids for
                the same tokens, as ``routing``; None: the MTP layers route live.
            weights: routing's shape, floating point - the rollout's weights of ``routing``, column
                for column (its weights channel), for ``attach_replay(..., weights="recorded")``;
                only for a replayer built with ``weights_dtype``. A host array is cast to
                ``weights_dtype`` and refused (ValueError) where a value would change; a device
                tensor must have ``weights_dtype`` already (it is not read on the host). NaN marks a
                row without recorded weights (the computed ones are used). None: every row NaN.
            mtp_weights: the same for ``mtp_routing``.
            stream: the stream the step runs on (default: the current stream).

        Host arrays are checked here: every id must be in ``[0, num_experts)`` or -1, else
        ValueError naming the first bad id, and nothing is written. A device tensor is not read on
        the host (no sync): an id outside ``[-1, num_experts)`` is stored as ``num_experts``, so its
        row is faulty for ``replay_routing`` (routed live and counted for
        ``check_replay_errors``), never wrapped into range. Shapes, dtypes, devices and the slot
        raise ValueError (TypeError for a non-array) before anything changes.

        Ordering: enqueued on ``stream`` as non-blocking copies (from freshly pinned host memory,
        which the caching host allocator keeps until the copy ran). Filling the selected slot:
        call it after the previous batch's backward was enqueued (checkpointed layers read the
        buffer again in backward); filling another slot never touches what the routers read.
        """
        slot = self._check_slot(slot)
        src = self._rows("routing", routing, self.shape.num_layers, stream)
        n = src.shape[0]
        mtp = None
        if mtp_routing is not None:
            if self.num_mtp_layers == 0:
                raise ValueError("mtp_routing given, but this replayer has num_mtp_layers=0 (no MTP columns)")
            mtp = self._rows("mtp_routing", mtp_routing, self.num_mtp_layers, stream)
            if mtp.shape[0] != n:
                raise ValueError(f"mtp_routing must have routing's {n} rows, got {mtp.shape[0]}")
        if mtp_weights is not None and mtp_routing is None:
            raise ValueError("mtp_weights given without mtp_routing: the weights of which MTP ids?")
        w = self._weights("weights", weights, tuple(src.shape), stream)
        mtp_w = None if mtp is None else self._weights("mtp_weights", mtp_weights, tuple(mtp.shape), stream)
        with self._lock:
            stale = self._slot_tokens[slot]
            self._generation[slot] += 1
            if self._slots is None:
                self._write(self.buffer, src, stale, stream)
                self._write(self.mtp_buffer, mtp, stale, stream)
            else:
                self._write(self._slots[slot], src, stale, stream)
                self._write(self._mtp_slots[slot], mtp, stale, stream)
            if self.weights_dtype is not None:
                one = self._weight_slots is None
                self._write_weights(
                    self.weights_buffer if one else self._weight_slots[slot], w, n, stale, stream
                )
                mtp_dst = self.mtp_weights_buffer if one else self._mtp_weight_slots[slot]
                self._write_weights(mtp_dst, mtp_w, n, stale, stream)
            self._slot_tokens[slot] = n
            self._slot_set[slot] = True
            if slot == self.slot:
                self._load(slot, stale, stream)

    def _check_slot(self, slot: Any) -> int:
        is_int = isinstance(slot, (int, np.integer)) and not isinstance(slot, bool)
        if not is_int or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, num_slots={self.num_slots}), got {slot!r}")
        return int(slot)

    def _rows(self, name: str, routing: Any, width: int, stream) -> np.ndarray | torch.Tensor:
        """``routing`` checked and converted: int32 host rows, or int32 device rows (the rule's
        kernels enqueued on ``stream``), no-record rows set to -1."""
        if isinstance(routing, torch.Tensor) and routing.device.type != "cpu":
            with self._on(stream):
                return self._device_rows(name, routing, width)
        array = _as_host_array(name, routing)
        self._check_shape(name, array.shape, width)
        return _mark_no_record(
            _host_ids(name, array, self.shape.num_experts, unsigned_fill=False), self.no_record
        )

    def _check_shape(self, name: str, shape: tuple[int, ...], width: int) -> None:
        s = self.shape
        axis = "MoE-only layer axis" if name == "routing" else "MTP layer axis"
        if len(shape) != 3 or tuple(shape[1:]) != (width, s.top_k):
            hint = ""
            if name == "routing" and len(shape) == 3 and tuple(shape[1:]) == (s.num_model_layers, s.top_k):
                hint = "; a column per model layer (vLLM's axis): use replay_batch(..., layer_axis='model')"
            raise ValueError(
                f"{name} must have shape (num_tokens, {width}, {s.top_k}) on the {axis}, got "
                f"{tuple(shape)}{hint}"
            )
        if shape[0] > self.max_num_tokens:
            raise ValueError(
                f"{name} has {shape[0]} rows, more than max_num_tokens={self.max_num_tokens} "
                "(the rows of the replay buffer)"
            )

    def _device_rows(self, name: str, routing: torch.Tensor, width: int) -> torch.Tensor:
        if routing.device != self.device:
            raise ValueError(
                f"{name} must be on the replayer's device {self.device} or the host, got {routing.device}"
            )
        if routing.dtype.is_floating_point or routing.dtype.is_complex or routing.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer expert ids, got dtype {routing.dtype}")
        self._check_shape(name, tuple(routing.shape), width)
        wide = routing.to(torch.int64)
        num_experts = self.shape.num_experts
        # out of [-1, num_experts) -> num_experts: the row stays faulty, nothing wraps into range
        wide = torch.where((wide < -1) | (wide >= num_experts), num_experts, wide)
        if self.no_record != -1:
            wide = torch.where((wide == self.no_record).all(-1, keepdim=True), -1, wide)
        return wide.to(torch.int32)

    def _weights(self, name: str, value: Any, shape: tuple[int, ...], stream) -> torch.Tensor | None:
        """``value`` checked: a host tensor or a device tensor of ``weights_dtype`` with the ids'
        ``shape``; None for None."""
        if value is None:
            return None
        if self.weights_dtype is None:
            raise ValueError(
                f"{name} given, but this replayer keeps no weights: build it with "
                "RoutingReplayer(..., weights_dtype=torch.float32) (or the rollout's weights dtype)"
            )
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            if value.device != self.device:
                raise ValueError(
                    f"{name} must be on the replayer's device {self.device} or the host, got {value.device}"
                )
            if value.dtype != self.weights_dtype:
                raise ValueError(
                    f"{name} on the device must have weights_dtype={self.weights_dtype} (a device tensor is "
                    f"not cast: its values cannot be checked without a host read), got {value.dtype}"
                )
        else:
            value = _host_weights(name, value, self.weights_dtype)
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} must have the ids' shape {shape}, got {tuple(value.shape)}")
        # a record, not part of any graph: copying a tensor that requires grad would make the
        # persistent buffer a node of its graph
        return value.detach()

    def _write_weights(self, dst: torch.Tensor, src: torch.Tensor | None, n: int, stale: int, stream) -> None:
        """``dst[:n] = src`` (NaN for None), ``dst[n:stale] = NaN``."""
        rows = max(n, stale)
        if dst.shape[1] == 0 or rows == 0:
            return
        if src is None or src.device.type == "cpu":
            host = torch.full((rows, *dst.shape[1:]), float("nan"), dtype=dst.dtype)
            if src is not None:
                host[:n] = src
            self._copy(dst[:rows], host, stream)
        else:
            with self._on(stream):
                dst[:n].copy_(src)
                if stale > n:
                    dst[n:stale].fill_(float("nan"))

    def _write(self, dst: torch.Tensor, src: Any, stale: int, stream) -> None:
        """``dst[:n] = src``, ``dst[n:stale] = -1`` (``src`` None: ``n = 0``)."""
        if dst.shape[1] == 0:
            return
        n = 0 if src is None else src.shape[0]
        if src is None or isinstance(src, np.ndarray):
            rows = np.full((max(n, stale), *dst.shape[1:]), -1, dtype=np.int32)
            if n:
                rows[:n] = src
            if rows.shape[0]:
                self._copy(dst[: rows.shape[0]], torch.from_numpy(rows), stream)
        else:
            with self._on(stream):
                dst[:n].copy_(src)
                if stale > n:
                    dst[n:stale].fill_(-1)

    # -- selecting a slot -----------------------------------------------------------------------

    def select(self, slot: int, *, stream: torch.cuda.Stream | None = None) -> None:
        """Makes slot ``slot`` the batch the routers read from the next forward (or recompute) on.

        With one slot there is nothing to select (``slot`` must be 0). With more, the slot's rows
        are copied into ``buffer`` / ``mtp_buffer`` on ``stream`` (a device copy of the rows of
        the previously and newly selected batches, no host sync) and ``num_tokens`` / ``row_count``
        follow; selecting the selected slot again does nothing. Call it between forwards (never
        inside a compiled function or a CUDA-graph capture: a host method, like ``set_batch``).
        ValueError for a slot outside ``[0, num_slots)``.
        """
        slot = self._check_slot(slot)
        with self._lock:
            if slot != self.slot:
                self._load(slot, self.num_tokens, stream)

    def _load(self, slot: int, stale: int, stream) -> None:
        """``buffer`` and ``mtp_buffer`` (rows ``[0, max(n, stale))``) from slot ``slot``'s storage,
        and the host and device row counts; the lock is held."""
        n = self._slot_tokens[slot]
        rows = max(n, stale)
        if self._slots is not None and rows:
            with self._on(stream):
                self.buffer[:rows].copy_(self._slots[slot, :rows])
                if self.num_mtp_layers:
                    self.mtp_buffer[:rows].copy_(self._mtp_slots[slot, :rows])
                if self._weight_slots is not None:
                    self.weights_buffer[:rows].copy_(self._weight_slots[slot, :rows])
                    if self.num_mtp_layers:
                        self.mtp_weights_buffer[:rows].copy_(self._mtp_weight_slots[slot, :rows])
        with self._on(stream):
            # a fill kernel with n as its argument: no pinned staging copy (about 20 us of host time
            # per select on the H200 host against a few for the launch)
            self.row_count.fill_(n)
        self.slot, self.num_tokens = slot, n
        sequence_nr = _next_sequence_nr() if _next_sequence_nr is not None else 0
        self._selection = _Selection(slot, self._generation[slot], threading.get_ident(), sequence_nr)

    def select_in_backward(self, tensor: torch.Tensor, slot: int) -> torch.Tensor:
        """Returns ``tensor`` itself, with a gradient hook that selects slot ``slot`` when the
        backward reaches it, before the gradient flows on into the layers that produced it.

        Eager recomputes need none of it: a router call recomputing in a backward reads the slot
        its forward read, whatever is selected then (:meth:`layer_ids`). It is what makes the
        selected slot follow the backward where Python does not run per call - a recompute inside a
        compiled step reads the selected slot - and what keeps ``buffer`` (and ``num_tokens``) the
        backward's micro-batch for code that reads them. Put it on a micro-batch's output (a
        pipeline stage's output, or the loss): the backward of that micro-batch starts there, so
        the slot is selected before its checkpointed layers recompute. The hook runs
        on autograd's thread and enqueues the copy on the stream the backward runs on (autograd
        runs a node's backward on its forward's stream). No copy of ``tensor``, no view: a
        schedule may free the output's storage after sending it (Megatron's
        ``deallocate_output_tensor``), the hook lives on its ``grad_fn``. A tensor that does not
        require grad is returned as is (no backward reaches it). Call it outside compiled regions.
        """
        slot = self._check_slot(slot)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.requires_grad:

            def reselect(grad: torch.Tensor) -> None:
                self.select(slot)

            tensor.register_hook(reselect)
        return tensor

    def slot_tokens(self, slot: int) -> int:
        """Rows of slot ``slot``'s batch (host int; 0 before its first :meth:`set_batch`)."""
        return self._slot_tokens[self._check_slot(slot)]

    # -- reading ----------------------------------------------------------------------------------

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

    def layer_ids(
        self, model_layer_index: int, num_tokens: int, *, kind: str = "decoder", device_check: bool = True
    ) -> torch.Tensor:
        """(num_tokens, top_k) int32 view of one MoE layer's rows of the batch this call reads:
        ``buffer[:num_tokens, column]`` (the selected slot's), or, for a recompute, its forward's.

        Args:
            model_layer_index: ``kind="decoder"``: the MODEL layer index of the router (mapped to
                the buffer's MoE-only layer axis; IndexError outside the model, ValueError for a
                dense layer). ``kind="mtp"``: the MTP layer's own index in
                ``[0, num_mtp_layers)`` (IndexError outside), a column of ``mtp_buffer``.
            num_tokens: the router's row count this call: it must equal the rows of the batch it
                reads, else the router would read another batch's rows or a prefix of this one.
            kind: ``"decoder"`` or ``"mtp"`` (:data:`LAYER_KINDS`).
            device_check: False when the caller checks the row count on the device itself, fused
                into its kernel (``replay_routing(..., row_count=...)``: :meth:`rows` gives it);
                the eager host check runs either way.

        Which batch. A forward reads the selected slot. An eager call inside a backward - an
        activation checkpoint recomputing the forward (``torch.utils.checkpoint``, reentrant or
        not; Megatron's ``CheckpointFunction``) - reads the batch its forward read: the autograd
        node running it was numbered when that forward ran (each thread numbers its nodes in
        order), so the selection in force then is known, and its slot's own storage is read
        (``num_slots > 1``) whatever slot is selected now. No ``select_in_backward`` is needed, and
        micro-batches of equal size can no longer be confused. If that slot was filled again since
        (``set_batch``), the batch is gone: ValueError, never another batch's ids. Selections made
        on a thread other than the forwards' (a data loader's) take effect from the first router
        call of the forward after them; select on the thread that runs the forwards. Inside a
        compiled function the recompute is the graph's own and reads the selected slot (use
        ``select_in_backward`` there).

        The row count is checked on the host where that is exact: an eager call raises ValueError
        (also when no batch was set). Inside a compiled function (where ``num_tokens`` may be
        symbolic and the host count is not part of the graph) and inside a CUDA-graph capture
        (where later replays run with later batches), the check is on the device: a mismatch counts
        one faulty call (``REPLAY_FAULT_ROW_COUNT``) for ``check_replay_errors``, without a host
        read, a graph break or a recompile - here a small op of its own, inside ``replay_routing``'s
        forward kernel when the caller passes ``row_count`` there (``device_check=False``). No
        copies: safe inside torch.compile and CUDA graphs.
        """
        return self._read(model_layer_index, num_tokens, kind, device_check, False)[0]

    def _read(
        self, model_layer_index: int, num_tokens: int, kind: str, device_check: bool, weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ids, weights or None) views of one layer's rows of the batch this call reads (see
        :meth:`layer_ids`); ``weights``: also the recorded weights' view."""
        column, source, what = self._column(model_layer_index, kind)
        if num_tokens < 0:
            raise ValueError(f"{what} asks for {num_tokens} rows: num_tokens must be >= 0")
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"{what} has {num_tokens} rows, more than the replayer's max_num_tokens={self.max_num_tokens}"
            )
        wsource = None
        if weights:
            if self.weights_dtype is None:
                raise ValueError(
                    f"{what} asks for recorded weights, but this replayer keeps none: build it with "
                    "RoutingReplayer(..., weights_dtype=...) and pass set_batch(..., weights=...)"
                )
            wsource = self.weights_buffer if kind == "decoder" else self.mtp_weights_buffer
        if torch.compiler.is_compiling():
            if device_check:
                self._check_rows_on_device(num_tokens)
            return source[:num_tokens, column], None if wsource is None else wsource[:num_tokens, column]
        slot = self._eager_slot()
        if slot is not None:  # a recompute whose forward read another slot: that slot's storage
            if num_tokens != self._slot_tokens[slot]:
                raise ValueError(self._row_message(what, num_tokens, slot))
            storage = self._slots if kind == "decoder" else self._mtp_slots
            wstorage = self._weight_slots if kind == "decoder" else self._mtp_weight_slots
            recorded = None if wsource is None else wstorage[slot, :num_tokens, column]
            return storage[slot, :num_tokens, column], recorded
        if num_tokens != self.num_tokens:
            raise ValueError(self._row_message(what, num_tokens, self.slot))
        if device_check and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._check_rows_on_device(num_tokens)
        return source[:num_tokens, column], None if wsource is None else wsource[:num_tokens, column]

    def rows(
        self, model_layer_index: int, num_tokens: int, *, kind: str = "decoder", weights: bool = False
    ) -> ReplayRows:
        """:class:`ReplayRows` ``(ids, row_count, weights)``: :meth:`layer_ids`' rows; what
        ``replay_routing``'s ``row_count`` should check them against on the device - the (1,)
        ``row_count`` where only the device can check (inside a compiled function or a CUDA-graph
        capture), None where the host checked exactly (an eager call: a mismatch raised already);
        and with ``weights=True`` the same rows of the recorded weights (``(num_tokens, top_k)``
        ``weights_dtype``, NaN where none were recorded; ValueError for a replayer without
        ``weights_dtype``), else None. What the wrappers of ``attach_replay`` call."""
        ids, recorded = self._read(model_layer_index, num_tokens, kind, False, weights)
        on_device = torch.compiler.is_compiling() or (
            self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        )
        return ReplayRows(ids, self.row_count if on_device else None, recorded)

    def _column(self, model_layer_index: int, kind: str) -> tuple[int, torch.Tensor, str]:
        """(column, the selected buffer it is in, the router in words) of a router's layer."""
        if kind == "decoder":
            column = self._columns.get(model_layer_index)
            if column is None:
                column = self.shape.buffer_layer(model_layer_index)  # raises the precise error
            return column, self.buffer, f"the router of layer {model_layer_index}"
        if kind == "mtp":
            if (
                isinstance(model_layer_index, bool)
                or not isinstance(model_layer_index, int)
                or not 0 <= model_layer_index < self.num_mtp_layers
            ):
                raise IndexError(
                    f"MTP layer index must be an int in [0, num_mtp_layers={self.num_mtp_layers}), "
                    f"got {model_layer_index!r}"
                )
            return model_layer_index, self.mtp_buffer, f"the router of MTP layer {model_layer_index}"
        raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")

    def _eager_slot(self) -> int | None:
        """The slot an eager router call reads when it is not the selected one: a recompute's
        forward's (None: the selected slot's batch, in ``buffer``). A forward's first call under a
        selection marks where that selection's autograd nodes begin (_Selection.start)."""
        if _current_node is None or _next_sequence_nr is None:  # a torch without node numbers
            return None
        node = _current_node()
        if node is None:  # a forward, not inside a backward
            selection = self._selection
            if selection is not None and selection.start is None:
                same_thread = selection.thread == threading.get_ident()
                selection.start = selection.requested_at if same_thread else _next_sequence_nr()
                with self._history_lock:
                    self._history.append(selection)
            return None
        return self._recompute_slot(node._sequence_nr())

    def _recompute_slot(self, sequence_nr: int) -> int | None:
        """The slot of the forward that created autograd node ``sequence_nr``, for a recompute in
        its backward; None where that is the selected batch (or no eager forward was seen)."""
        with self._history_lock:
            if not self._history:
                return None  # forwards that never ran eagerly here: nothing to tell them apart
            forward = next((s for s in reversed(self._history) if s.start <= sequence_nr), None)
        if forward is None:
            raise ValueError(
                f"a router recomputing in backward belongs to a forward older than the replayer's last "
                f"{_HISTORY} selections: its batch is unknown; run each micro-batch's backward sooner"
            )
        if forward.generation != self._generation[forward.slot]:
            raise ValueError(
                f"a router recomputing in backward (activation checkpointing) belongs to a forward that "
                f"read slot {forward.slot}, but that slot was filled again (set_batch) before this "
                "backward: its batch is gone. Fill a slot after its micro-batch's backward, or give each "
                "micro-batch in flight its own slot (num_slots)"
            )
        return None if forward.slot == self.slot else forward.slot

    def write_live(self, model_layer_index: int, live_ids: torch.Tensor, *, kind: str = "decoder") -> None:
        """Copies a router's own choice ``live_ids`` ``(n, top_k)`` into rows ``[0, n)`` of its
        layer's column of ``live_buffer`` (``kind="mtp"``: ``mtp_live_buffer``); nothing without
        ``record_live``. What the wrappers of ``attach_replay`` call on every router call, after
        :meth:`layer_ids` (which checked ``n``). A device copy, no host read: safe inside compiled
        functions and CUDA graphs."""
        if not self.record_live:
            return
        if kind == "mtp":
            column, target = model_layer_index, self.mtp_live_buffer
        else:
            column = self._columns.get(model_layer_index)
            if column is None:
                column = self.shape.buffer_layer(model_layer_index)
            target = self.live_buffer
        target[: live_ids.shape[0], column].copy_(live_ids)

    def _check_rows_on_device(self, num_tokens: int) -> None:
        torch.ops.moe_ops.replay_check_rows_(self.row_count, num_tokens, replay_fault_counter(self.device))

    def _row_message(self, what: str, num_tokens: int, slot: int) -> str:
        if not self._slot_set[slot]:
            return (
                f"{what} has {num_tokens} rows but no batch was set for slot {slot}: call "
                "replayer.set_batch(routing) before the forward (without a batch the routers would "
                "route live, as if no replay were attached)"
            )
        return (
            f"{what} has {num_tokens} rows but the batch set for slot {slot} has {self._slot_tokens[slot]}: "
            "the routers would read another batch's rows or part of this one. Build the batch with "
            "the forward's token layout (replay_batch(..., num_tokens=..., pad_to=...) for a padded "
            "batch, packed otherwise) or select the micro-batch's slot"
        )
