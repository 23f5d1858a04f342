"""The ring: ``depth`` slots of pinned host and device staging buffers, taken and given back.

A slot holds, for every channel of the pipeline (:mod:`moe_ops.channels`: the ids, then the extra
channels in order), a device staging buffer the narrowing writes into and a host buffer (pinned on
CUDA) the D2H copy fills, and three events: ``ready`` (the compute stream wrote the source rows),
``read_done`` (the copy stream read them), ``copy_done`` (the host buffer holds them). Buffers and
events are allocated once, when the pipeline is built, and never move.

- A slot is busy from ``snapshot`` until its handle's ``release``; when all are busy, ``snapshot``
  raises :class:`RingFullError` (or waits up to ``timeout`` seconds for another thread to release
  one). A slot is never reused silently.
- A handle garbage collected without ``release`` (a lost handle) gives its slot back too, so it
  cannot wedge the ring: ``__del__`` only queues the slot (it may run on any thread, even inside a
  pipeline call that holds the lock), and the next ``snapshot`` reclaims it once the slot's
  ``copy_done`` event has completed (a non-blocking query: no host sync). The first such drop warns
  with :class:`DroppedSnapshotWarning`. A ``result(copy=False)`` view keeps its handle alive.
- A released slot may still have its copy in flight: every use of a slot is queued on the one copy
  stream, so the next snapshot's writes into it run after the previous one's.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..channels import Channel
from .narrow import check_narrow as narrow_check
from .paths import _CHANNEL_STAGING

if TYPE_CHECKING:
    from .handle import SnapshotHandle

__all__ = ["DroppedSnapshotWarning", "RingFullError"]

# Sleep between looks at the ring of a snapshot() that waits for a slot: lost handles are queued
# without the lock (no notify), and an orphaned slot's copy finishes without one.
_RING_POLL_S = 1e-3


class RingFullError(RuntimeError):
    """Every ring slot holds an unreleased snapshot: release handles (or deepen the ring)."""


class DroppedSnapshotWarning(RuntimeWarning):
    """A :class:`SnapshotHandle` was garbage collected without ``release()``; its slot returns to the
    ring once its copy has finished. Warned once per pipeline: release handles (or use them as
    context managers) so the ring never waits on the collector."""


def _check_timeout(name: str, value: object) -> float:
    """Seconds to wait: None or ``float("inf")`` wait as long as it takes (returns inf)."""
    if value is None:
        return math.inf
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be None or a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(
            f"{name} must be None or seconds >= 0 (inf: wait as long as it takes), got {value!r}"
        )
    return seconds


@dataclass(eq=False)
class _Lane:
    """One extra channel's buffers in one ring slot (the ids' live on the :class:`_Slot` itself)."""

    # the channel (row_shape resolved) and its persistent (max_rows, *row_shape) device source
    channel: Channel
    source: torch.Tensor
    # (max_rows, *row_shape) host buffer in the staging dtype: pinned on CUDA
    host: torch.Tensor
    # host viewed as numpy in the channel's dtype
    host_np: np.ndarray
    # (max_rows, *row_shape) device buffer the narrowing writes into (None on CPU)
    staging: torch.Tensor | None
    # bytes of one row: rows [0, n) of staging and host are n * row_bytes contiguous bytes
    row_bytes: int
    # host.data_ptr() and staging.data_ptr() (0 on CPU): the buffers never move
    host_ptr: int = 0
    staging_ptr: int = 0


@dataclass(eq=False)
class _Slot:
    # position in the ring, 0 <= index < depth
    index: int
    # (max_rows, L, K) host buffer: pinned on CUDA; the handle's array views it
    host: torch.Tensor
    # host viewed as numpy in the output dtype (uint16 through a view of the int16 bits)
    host_np: np.ndarray
    # (max_rows, L, K) device buffer the narrowing writes into (None on CPU)
    staging: torch.Tensor | None
    # recorded on the compute stream at snapshot(); the copy stream waits on it
    ready: torch.cuda.Event | None = None
    # recorded on the copy stream once the source rows were read (narrowed into staging)
    read_done: torch.cuda.Event | None = None
    # recorded on the copy stream once the host buffer holds the rows
    copy_done: torch.cuda.Event | None = None
    # seq of the unreleased handle holding this slot (None: free); no reference to the handle, so a
    # lost handle can be garbage collected and its slot reclaimed
    holder_seq: int | None = None
    # bucket rows -> CUDA graph narrowing that many source rows into staging (empty: no graphs); the
    # graphs own the execs in graph_execs, so they live as long as the slot
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    # graph_table[(n - 1).bit_length()] is graphs[graph_bucket(n, max_rows)] for n in [1, max_rows]
    # (the table is graph_buckets(max_rows) in order; empty: no graphs)
    graph_table: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    # graph_execs[i] is graph_table[i].raw_cuda_graph_exec() (empty unless narrow_path is
    # "graph_launch")
    graph_execs: list[int] = field(default_factory=list)
    # host.data_ptr() and staging.data_ptr() (0 on CPU): the buffers never move
    host_ptr: int = 0
    staging_ptr: int = 0
    # cudaEvent_t handles of ready, read_done, copy_done (0 unless copy_path is "cudaMemcpyAsync";
    # torch created the events with their first record, so query/synchronize/wait see every record)
    ready_handle: int = 0
    read_done_handle: int = 0
    copy_done_handle: int = 0
    # the buffers of the extra channels, in the pipeline's channel order after the ids (empty: ids only)
    lanes: tuple[_Lane, ...] = ()


def _make_slot(
    index: int,
    source: torch.Tensor,
    out_dtype: np.dtype,
    staging_dtype: torch.dtype,
    extra: Sequence[tuple[Channel, torch.Tensor]],
    copy_stream: torch.cuda.Stream | None,
    layer_stamps: torch.Tensor | None,
    step_tensor: torch.Tensor | None,
) -> _Slot:
    """Slot ``index``: the ids' host (and, with a copy stream, device staging) buffer and events,
    and a lane per extra channel. ``copy_stream`` is None exactly for a CPU source."""
    cuda = copy_stream is not None
    shape = tuple(source.shape)
    host = torch.empty(shape, dtype=staging_dtype, pin_memory=cuda)
    host_np = host.numpy()
    if host_np.dtype != out_dtype:
        host_np = host_np.view(out_dtype)
    staging = None
    slot = _Slot(index=index, host=host, host_np=host_np, staging=staging)
    if cuda:
        slot.staging = torch.empty(shape, dtype=staging_dtype, device=source.device)
        slot.staging.record_stream(copy_stream)
        slot.host_ptr, slot.staging_ptr = host.data_ptr(), slot.staging.data_ptr()
        # the narrowing's contract, checked once for every row count (see launch_narrow)
        narrow_check(slot.staging, source, 0, layer_stamps, step_tensor)
        slot.ready = torch.cuda.Event()
        slot.read_done = torch.cuda.Event()
        slot.copy_done = torch.cuda.Event()
    slot.lanes = tuple(
        _make_lane(channel, src, copy_stream, layer_stamps, step_tensor) for channel, src in extra
    )
    return slot


def _make_lane(
    channel: Channel,
    source: torch.Tensor,
    copy_stream: torch.cuda.Stream | None,
    layer_stamps: torch.Tensor | None,
    step_tensor: torch.Tensor | None,
) -> _Lane:
    """One extra channel's host (and device staging) buffer of one slot."""
    cuda = copy_stream is not None
    shape = tuple(source.shape)
    dtype = _CHANNEL_STAGING[channel.dtype]
    host = torch.empty(shape, dtype=dtype, pin_memory=cuda)
    host_np = host.numpy()
    if host_np.dtype != channel.dtype:
        host_np = host_np.view(channel.dtype)
    row_bytes = math.prod(shape[1:]) * channel.dtype.itemsize
    lane = _Lane(channel, source, host, host_np, None, row_bytes)
    if cuda:
        lane.staging = torch.empty(shape, dtype=dtype, device=source.device)
        lane.staging.record_stream(copy_stream)
        lane.host_ptr, lane.staging_ptr = host.data_ptr(), lane.staging.data_ptr()
        narrow_check(lane.staging, source, 0, layer_stamps, step_tensor)
    return lane


class _Ring:
    """A pipeline's slots and who holds them: free, held by the seq of an unreleased snapshot, or
    lost (its handle collected unreleased) until its copy has finished.

    Threads: every public method may run on any thread at once. :meth:`orphan` (from
    ``SnapshotHandle.__del__``, which the collector may run inside a call that holds the ring lock)
    takes no lock: it appends to a deque (atomic) and counts drops with ``itertools.count`` (its
    ``next`` is atomic); every other method takes the ring lock and never blocks while holding it
    (:meth:`acquire` waits for a slot on the lock's condition, which releases the lock meanwhile;
    a lost handle's copy is polled with a non-blocking event query).

    Args:
        depth: the number of slots (>= 1, checked by the pipeline).
        source: the ids' persistent ``(max_rows, L, K)`` source: its shape is each slot's.
        out_dtype, staging_dtype: the ids' host dtype and the torch dtype they are staged as
            (:func:`moe_ops.transfer.paths.staging_dtype`).
        extra: ``(channel, source)`` of every extra channel, in the pipeline's order.
        copy_stream: the pipeline's copy stream, which reads the staging buffers (None on CPU: no
            staging buffers, no events, host buffers not pinned).
        layer_stamps, step_tensor: the pipeline's, for the narrowing's contract check.
    """

    def __init__(
        self,
        depth: int,
        source: torch.Tensor,
        out_dtype: np.dtype,
        staging_dtype: torch.dtype,
        extra: Sequence[tuple[Channel, torch.Tensor]],
        copy_stream: torch.cuda.Stream | None,
        layer_stamps: torch.Tensor | None,
        step_tensor: torch.Tensor | None,
    ):
        self.depth = depth
        # slots[i].index == i; allocated here, once
        self.slots = [
            _make_slot(i, source, out_dtype, staging_dtype, extra, copy_stream, layer_stamps, step_tensor)
            for i in range(depth)
        ]
        # The ring lock. `with self._mutex` takes it (a C-level lock: Condition.__enter__ is a Python
        # call); self._lock is the condition on it that waits for a slot.
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        # seq of the next snapshot (under the lock)
        self._seq = 0
        # indices of the free slots, taken from the front (under the lock)
        self._free = list(range(depth))
        # (slot, seq) of handles collected unreleased: appended by __del__ without the lock (a deque
        # append is atomic), drained into _orphans under it
        self._dropped: deque[tuple[_Slot, int]] = deque()
        # slots of collected handles whose copy may still be in flight (under the lock)
        self._orphans: list[tuple[_Slot, int]] = []
        self._drops = itertools.count()  # next() is atomic: exactly one drop sees 0 and warns

    @property
    def in_flight(self) -> int:
        """Slots not free: snapshots taken and not yet released, plus those of lost handles whose
        copy has not finished yet."""
        with self._mutex:
            self._reclaim()
            return self.depth - len(self._free)

    def acquire(self, timeout: float | None) -> _Slot:
        """A free slot, waiting up to ``timeout`` seconds for one (None: as long as it takes);
        :class:`RingFullError` once that has passed."""
        # a float >= 0 (the default 0.0) needs none of _check_timeout's type checks; NaN fails the
        # comparison and takes them (and raises there)
        if timeout.__class__ is float and timeout >= 0.0:
            seconds = timeout
        else:
            seconds = _check_timeout("timeout", timeout)
        with self._mutex:
            if self._dropped or self._orphans:
                self._reclaim()
            if self._free:
                return self.slots[self._free.pop(0)]
            return self._wait_for_slot(seconds)

    def _wait_for_slot(self, seconds: float) -> _Slot:
        """A slot once one is free, waiting up to ``seconds`` (ring lock held, every slot busy)."""
        deadline = time.monotonic() + seconds
        while not self._free:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                lost = sorted(seq for _, seq in self._orphans)
                held = sorted(s.holder_seq for s in self.slots if s.holder_seq is not None)
                held = [seq for seq in held if seq not in lost]
                detail = f"seq {held}" + (f"; lost handles seq {lost} still copying" if lost else "")
                raise RingFullError(
                    f"all {self.depth} ring slots hold unreleased snapshots ({detail}); release "
                    "a handle (SnapshotHandle.release) or create the pipeline with a larger depth"
                )
            # bounded waits: a lost handle's slot frees itself without a notify
            self._lock.wait(min(remaining, _RING_POLL_S))
            self._reclaim()
        return self.slots[self._free.pop(0)]

    def hold(self, slot: _Slot) -> int:
        """Numbers the snapshot whose work on ``slot`` was just enqueued: its seq, which now holds
        the slot (snapshots are numbered in the order they finish enqueueing)."""
        with self._mutex:
            seq = self._seq
            self._seq = seq + 1
            slot.holder_seq = seq
        return seq

    def cancel(self, slot: _Slot) -> None:
        """Gives back a slot from :meth:`acquire` whose snapshot failed before :meth:`hold`."""
        with self._mutex:
            self._free.append(slot.index)
            self._lock.notify()

    def release(self, handle: SnapshotHandle) -> None:
        """Frees the handle's slot (``SnapshotHandle.release``); idempotent, never waits."""
        with self._mutex:
            if handle.released:
                return
            slot = handle._slot
            if slot.holder_seq != handle.seq:
                raise RuntimeError(f"snapshot {handle.seq} does not hold its ring slot any more")
            handle.released = True
            slot.holder_seq = None
            self._free.append(slot.index)
            self._lock.notify()

    def orphan(self, handle: SnapshotHandle) -> None:
        """Queues the slot of a handle collected unreleased (called from ``__del__``: no lock)."""
        self._dropped.append((handle._slot, handle.seq))
        if next(self._drops) == 0:
            warnings.warn(
                f"snapshot {handle.seq} was garbage collected without release(): its ring slot returns "
                "once its copy finished; release handles (or use them as context managers) so the ring "
                "never waits on the garbage collector (warned once per pipeline)",
                DroppedSnapshotWarning,
                stacklevel=2,
            )

    def _reclaim(self) -> None:
        """Frees the slots of lost handles whose copy has finished (lock held; never blocks)."""
        while self._dropped:
            self._orphans.append(self._dropped.popleft())
        waiting = []
        for slot, seq in self._orphans:
            if slot.holder_seq != seq:
                continue
            if slot.copy_done is None or slot.copy_done.query():
                slot.holder_seq = None
                self._free.append(slot.index)
                self._lock.notify()
            else:
                waiting.append((slot, seq))
        self._orphans = waiting
