"""The async device-to-host pipeline: narrow on the device, copy into a ring of pinned host buffers.

One snapshot of the leading ``num_rows`` rows of a persistent ``(max_rows, L, K)`` device buffer::

    compute stream: ... forward writes rows ... [record ready]                   [wait read_done]* ...
                                                       |                               ^
    copy stream:                             [wait ready] narrow -> staging[s] [record read_done]
                                                          D2H staging[s] -> pinned[s] [record copy_done]
    host:           snapshot() returns at once;  handle.result() waits on copy_done only

    * the next :meth:`TransferPipeline.guard_source` (``RoutingCapturer.set_step`` calls it) makes the
      compute stream wait for ``read_done`` before the next step can overwrite the source rows.

- Nothing here synchronises the host with the device except ``SnapshotHandle.wait``/``result``,
  which wait on that snapshot's own event; the copy stream waits on the compute stream through an
  event, never a device-wide sync.
- The ring has ``depth`` slots (device staging + pinned host buffer + events each). A slot is busy
  from ``snapshot`` until its handle's ``release``; when all are busy, ``snapshot`` raises
  :class:`RingFullError` (or waits up to ``timeout`` seconds for another thread to release one).
  A slot is never reused silently.
- A handle garbage collected without ``release`` (a lost handle) gives its slot back too, so it
  cannot wedge the ring: ``__del__`` only queues the slot (it may run on any thread, even inside a
  pipeline call that holds the lock), and the next ``snapshot`` reclaims it once the slot's
  ``copy_done`` event has completed (a non-blocking query: no host sync). The first such drop warns
  with :class:`DroppedSnapshotWarning`. A ``result(copy=False)`` view keeps its handle alive.
- Buffers are allocated once and never move. The caching allocator is told the copy stream uses
  them (``record_stream``), so even freeing the pipeline with copies in flight cannot hand their
  memory to another stream early.
- On a CPU source there is no stream: ``snapshot`` copies synchronously into the slot's host
  buffer. Slots, handles, release and ring exhaustion behave exactly as on CUDA.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .._triton import triton_runs_on
from .narrow import check_narrow as narrow_check
from .narrow import launch_narrow, narrow_rows

__all__ = ["DroppedSnapshotWarning", "RingFullError", "SnapshotHandle", "TransferPipeline", "staging_dtype"]

# Sleep between event queries of a wait with a finite timeout (CUDA events have no timed wait):
# 50 us bounds the added latency well under a step's 1-10 ms.
_EVENT_POLL_S = 5e-5
# Sleep between looks at the ring of a snapshot() that waits for a slot: lost handles are queued
# without the lock (no notify), and an orphaned slot's copy finishes without one.
_RING_POLL_S = 1e-3

# Host dtype -> device staging dtype of the same width. uint16 is staged as int16 (same bits; the host
# reads it back through a uint16 view): int16 casts and copies are supported by every torch build,
# torch.uint16 only partly on CUDA in older releases.
_STAGING = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint16): torch.int16,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
}


def staging_dtype(host_dtype: np.dtype) -> torch.dtype:
    """The torch dtype a host dtype travels as (same width; uint16 travels as int16 bits)."""
    host_dtype = np.dtype(host_dtype)
    try:
        return _STAGING[host_dtype]
    except KeyError:
        names = ", ".join(str(d) for d in _STAGING)
        raise ValueError(f"out_dtype must be one of {names}, got {host_dtype}") from None


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


class _ViewOwner:
    """Base object of a ``result(copy=False)`` view: keeps the handle (so its slot) alive as long as
    the view or any view of it exists."""

    def __init__(self, handle: SnapshotHandle, view: np.ndarray):
        self.handle = handle
        self.__array_interface__ = view.__array_interface__


@dataclass(eq=False)
class SnapshotHandle:
    """One snapshot's rows on their way to the host. Obtain from :meth:`TransferPipeline.snapshot`.

    Ownership: the rows live in the handle's ring slot until :meth:`release`. ``result()`` returns
    an owned copy (safe forever); ``result(copy=False)`` returns a read-only view into the pinned
    slot that is valid only until ``release()`` (after that the slot is refilled by a later snapshot).
    Use it as a context manager to release on exit. A handle garbage collected unreleased gives its
    slot back once its copy finished (see the module docstring); a ``copy=False`` view keeps the
    handle alive.

    Threads: a handle is used by one thread at a time (``release`` of a handle another thread is
    waiting on is not supported); different handles may be used, released and dropped on different
    threads.
    """

    # the pipeline that owns the slot
    pipeline: TransferPipeline
    _slot: _Slot = field(repr=False)
    # position of this snapshot in the pipeline's sequence (0, 1, 2, ...)
    seq: int
    # rows copied: the array has shape (num_rows, L, K)
    num_rows: int
    # True once release() returned the slot; the handle's rows are gone from then on
    released: bool = False

    def ready(self) -> bool:
        """True once the rows are in host memory (a non-blocking event query)."""
        self._check_live()
        event = self._slot.copy_done
        return event is None or event.query()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until this snapshot's copy is done; waits on its own event only (no device sync).

        Args:
            timeout: seconds to wait; None or ``float("inf")`` wait as long as it takes, 0 only looks.

        Raises TimeoutError (naming the snapshot) when a finite ``timeout`` passes first; the handle
        stays usable and a later ``wait`` can succeed.
        """
        seconds = _check_timeout("timeout", timeout)
        self._check_live()
        event = self._slot.copy_done
        if event is None or event.query():
            return
        if math.isinf(seconds):
            event.synchronize()
            return
        deadline = time.monotonic() + seconds
        while not event.query():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"snapshot {self.seq} ({self.num_rows} rows): its copy to the host did not finish "
                    f"within timeout={timeout} s"
                )
            time.sleep(min(remaining, _EVENT_POLL_S))

    def result(self, *, copy: bool = True, timeout: float | None = None) -> np.ndarray:
        """The (num_rows, L, K) rows in the pipeline's output dtype, after :meth:`wait` (``timeout``
        as there).

        ``copy=True`` returns an owned array. ``copy=False`` returns a read-only view into the pinned
        slot, valid until :meth:`release` (cheaper: no host copy); the view keeps this handle alive.
        """
        self.wait(timeout)
        view = self._slot.host_np[: self.num_rows]
        if copy:
            return view.copy()
        view = view.view()
        view.flags.writeable = False
        return np.asarray(_ViewOwner(self, view))

    def release(self) -> None:
        """Returns the slot to the ring. Idempotent; never waits. Views from ``result(copy=False)``
        become invalid.

        Releasing a snapshot whose copy is still in flight (a step whose rows nobody wants) is safe:
        every use of a slot is queued on the one copy stream, so the next snapshot's writes into the
        slot run after this one's.
        """
        self.pipeline._release(self)

    def __enter__(self) -> SnapshotHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # The collector runs this on whatever thread allocates, possibly inside a pipeline call that
        # holds the ring lock: so no lock here, only a queue append; snapshot() reclaims the slot.
        if getattr(self, "released", True) or sys.is_finalizing():
            return
        self.pipeline._orphan(self)

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError(
                f"snapshot {self.seq} was released: its ring slot may already hold another step's rows"
            )


class TransferPipeline:
    """Snapshots of the leading rows of a persistent device buffer into a ring of host buffers.

    Args:
        source: (max_rows, L, K) integer tensor - the persistent buffer to copy from (e.g. a
            capture buffer). It must not be reallocated while the pipeline lives.
        out_dtype: numpy dtype of the host arrays (uint8, int8, uint16, int16, int32, int64).
            Narrowing happens on the device on the copy stream, so only ``itemsize`` bytes per id
            cross PCIe; ids that do not fit wrap (the caller sizes the dtype, e.g. with
            ``RoutingShape.id_dtype``).
        depth: ring slots, i.e. snapshots that may be unreleased at once (>= 1).
        layer_stamps, step_tensor: optional (L,) and (1,) int32 tensors on the source's device
            (``RoutingCapturer``'s): a snapshot reads the rows of layer ``l`` as the fill value
            (-1 cast to ``out_dtype``) unless ``layer_stamps[l] == step_tensor[0]`` when the copy
            runs - a layer not captured in the current step never delivers stale ids.

    Threads: ``snapshot``, ``in_flight``, ``guard_source``, ``synchronize``, handle ``release`` and the
    garbage collection of lost handles may run on different threads at once (one lock guards the
    ring; lost handles are queued without it). Snapshots are numbered in the order ``snapshot``
    takes slots.
    """

    def __init__(
        self,
        source: torch.Tensor,
        out_dtype: np.dtype | type,
        *,
        depth: int = 2,
        layer_stamps: torch.Tensor | None = None,
        step_tensor: torch.Tensor | None = None,
    ):
        if not isinstance(source, torch.Tensor):
            raise TypeError(f"source must be a torch.Tensor, got {type(source).__name__}")
        if source.dim() != 3:
            raise ValueError(
                f"source must be 3-D (max_rows, num_layers, top_k), got shape {tuple(source.shape)}"
            )
        if source.dtype.is_floating_point or source.dtype.is_complex or source.dtype == torch.bool:
            raise ValueError(f"source must have an integer dtype, got {source.dtype}")
        if not source.is_contiguous():
            raise ValueError("source must be contiguous (its leading rows are copied as one block)")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (ring slots), got {depth!r}")
        if (layer_stamps is None) != (step_tensor is None):
            raise ValueError("layer_stamps and step_tensor go together: pass both or neither")
        if layer_stamps is not None and (
            layer_stamps.shape != (source.shape[1],)
            or step_tensor.shape != (1,)
            or layer_stamps.device != source.device
            or step_tensor.device != source.device
        ):
            raise ValueError(
                f"layer_stamps must be ({source.shape[1]},) and step_tensor (1,) on {source.device}, got "
                f"{tuple(layer_stamps.shape)} on {layer_stamps.device} and {tuple(step_tensor.shape)}"
            )
        self.layer_stamps = layer_stamps
        self.step_tensor = step_tensor
        self.out_dtype = np.dtype(out_dtype)
        self._staging_dtype = staging_dtype(self.out_dtype)
        self.source = source
        self.device = source.device
        self.depth = depth
        self.max_rows = source.shape[0]
        self._cuda = source.device.type == "cuda"
        self._triton_narrow = self._cuda and triton_runs_on(source.device)
        self._lock = threading.Condition()
        self._seq = 0
        self._last_read_done: torch.cuda.Event | None = None
        self.copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        if self._cuda:
            # The copy stream reads source and staging: freeing them must wait for its work.
            source.record_stream(self.copy_stream)
        self._slots = [self._make_slot(i) for i in range(depth)]
        self._free = list(range(depth))
        # (slot, seq) of handles collected unreleased: appended by __del__ without the lock (a deque
        # append is atomic), drained into _orphans under it
        self._dropped: deque[tuple[_Slot, int]] = deque()
        # slots of collected handles whose copy may still be in flight (under the lock)
        self._orphans: list[tuple[_Slot, int]] = []
        self._drops = itertools.count()  # next() is atomic: exactly one drop sees 0 and warns

    def _make_slot(self, index: int) -> _Slot:
        shape = tuple(self.source.shape)
        host = torch.empty(shape, dtype=self._staging_dtype, pin_memory=self._cuda)
        host_np = host.numpy()
        if host_np.dtype != self.out_dtype:
            host_np = host_np.view(self.out_dtype)
        staging = None
        slot = _Slot(index=index, host=host, host_np=host_np, staging=staging)
        if self._cuda:
            slot.staging = torch.empty(shape, dtype=self._staging_dtype, device=self.device)
            slot.staging.record_stream(self.copy_stream)
            # the narrowing's contract, checked once for every row count (see launch_narrow)
            narrow_check(slot.staging, self.source, 0, self.layer_stamps, self.step_tensor)
            slot.ready = torch.cuda.Event()
            slot.read_done = torch.cuda.Event()
            slot.copy_done = torch.cuda.Event()
        return slot

    @property
    def in_flight(self) -> int:
        """Slots not free: snapshots taken and not yet released, plus those of lost handles whose
        copy has not finished yet."""
        with self._lock:
            self._reclaim()
            return self.depth - len(self._free)

    def snapshot(
        self, num_rows: int, *, stream: torch.cuda.Stream | None = None, timeout: float = 0.0
    ) -> SnapshotHandle:
        """Enqueues the copy of rows ``[0, num_rows)`` of the source and returns at once.

        Args:
            num_rows: rows to copy, in ``[0, max_rows]`` (a host int: the step's real token count).
            stream: the stream whose queued work wrote the rows (default: the current stream).
            timeout: seconds to wait for a free ring slot when all are held (another thread must
                release one, or a lost handle's copy finish); 0 raises :class:`RingFullError` at
                once, None or ``float("inf")`` wait as long as it takes.

        On CUDA this records an event on ``stream``, makes the copy stream wait on it, and enqueues
        the narrowing and the non-blocking copy there; the host does not wait for the device. On CPU
        the copy happens before it returns.
        """
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)):
            raise TypeError(f"num_rows must be an int, got {type(num_rows).__name__}")
        if not 0 <= num_rows <= self.max_rows:
            raise ValueError(f"num_rows must be in [0, {self.max_rows}] (rows of the source), got {num_rows}")
        num_rows = int(num_rows)
        slot = self._acquire(timeout)
        try:
            if self._cuda:
                self._enqueue_cuda(slot, num_rows, stream)
            else:
                src = self.source[:num_rows].numpy()
                np.copyto(slot.host_np[:num_rows], src, casting="unsafe")
                if self.layer_stamps is not None and num_rows:
                    # CPU tensors: reading the stamps is a host read of host memory
                    stale = (self.layer_stamps != self.step_tensor).numpy()
                    if stale.any():
                        slot.host_np[:num_rows, stale] = np.array(-1).astype(self.out_dtype)
        except BaseException:
            with self._lock:
                self._free.append(slot.index)
                self._lock.notify()
            raise
        with self._lock:
            handle = SnapshotHandle(pipeline=self, _slot=slot, seq=self._seq, num_rows=num_rows)
            self._seq += 1
            slot.holder_seq = handle.seq
        return handle

    def _enqueue_cuda(self, slot: _Slot, num_rows: int, stream: torch.cuda.Stream | None) -> None:
        compute = stream if stream is not None else torch.cuda.current_stream(self.device)
        slot.ready.record(compute)
        copy = self.copy_stream
        copy.wait_event(slot.ready)
        with torch.cuda.stream(copy):
            if num_rows:
                # Narrowing on the device: one cast kernel, no allocation (moe_ops.transfer.narrow).
                if self._triton_narrow:  # staging and source were checked once, in _make_slot
                    launch_narrow(slot.staging, self.source, num_rows, self.layer_stamps, self.step_tensor)
                else:
                    narrow_rows(slot.staging, self.source, num_rows, self.layer_stamps, self.step_tensor)
            slot.read_done.record(copy)
            if num_rows:
                slot.host[:num_rows].copy_(slot.staging[:num_rows], non_blocking=True)
            slot.copy_done.record(copy)
        self._last_read_done = slot.read_done

    def guard_source(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes ``stream`` (default: current) wait until every snapshot taken so far has read the
        source, so that work queued next may overwrite it. An event wait on the device, not a host
        sync; a no-op on CPU (snapshots there copy before returning).

        Call it before each step that writes the source (``RoutingCapturer.set_step`` does).
        """
        if self._cuda and self._last_read_done is not None:
            target = stream if stream is not None else torch.cuda.current_stream(self.device)
            # Copy-stream work is in order, so the last snapshot's event covers every earlier one.
            target.wait_event(self._last_read_done)

    def _acquire(self, timeout: float | None) -> _Slot:
        seconds = _check_timeout("timeout", timeout)
        deadline = time.monotonic() + seconds
        with self._lock:
            self._reclaim()
            while not self._free:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    lost = sorted(seq for _, seq in self._orphans)
                    held = sorted(s.holder_seq for s in self._slots if s.holder_seq is not None)
                    held = [seq for seq in held if seq not in lost]
                    detail = f"seq {held}" + (f"; lost handles seq {lost} still copying" if lost else "")
                    raise RingFullError(
                        f"all {self.depth} ring slots hold unreleased snapshots ({detail}); release "
                        "a handle (SnapshotHandle.release) or create the pipeline with a larger depth"
                    )
                # bounded waits: a lost handle's slot frees itself without a notify
                self._lock.wait(min(remaining, _RING_POLL_S))
                self._reclaim()
            return self._slots[self._free.pop(0)]

    def _orphan(self, handle: SnapshotHandle) -> None:
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

    def _release(self, handle: SnapshotHandle) -> None:
        with self._lock:
            if handle.released:
                return
            slot = handle._slot
            if slot.holder_seq != handle.seq:
                raise RuntimeError(f"snapshot {handle.seq} does not hold its ring slot any more")
            handle.released = True
            slot.holder_seq = None
            self._free.append(slot.index)
            self._lock.notify()

    def synchronize(self) -> None:
        """Waits until every enqueued copy is done (the copy stream only; host side)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
