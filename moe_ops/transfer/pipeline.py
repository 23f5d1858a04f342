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
- A slot holds one staging and one host buffer per channel (:mod:`moe_ops.channels`): the ids,
  and the ``extra_channels`` given (e.g. float16 routing weights beside them), each with its own
  source, dtype and row shape. One snapshot moves every channel's leading ``num_rows`` rows under
  the same events: the narrowing graph (or launch) narrows every channel before ``read_done``, one
  D2H copy per channel follows, then ``copy_done``. With the ids alone, a slot's channel list is
  empty and each step runs exactly the ids' calls.

Host cost of one ``snapshot`` (the engine's scheduler thread pays it every step). Measured on the
H200 machine (torch 2.11, triton 3.6, 1,024 tokens, source (8192, 61, 8) int32, us per call): the
Triton launch 25.7-34.9, ``torch.cuda.current_stream()`` behind every ``Event.record()`` 5.9, the
``torch.cuda.stream`` context 10.1, the D2H ``copy_`` 8.3, ``wait_event`` 0.9; the whole call 67-72
us, so at 1,024 tokens (0.5 MB, 12 us of copy) the ring moved 6.5 GB/s against 42 GB/s for a plain
pinned copy. So:

- the narrowing is one CUDA graph per (slot, row bucket), captured at construction and replayed on
  the copy stream (a replay costs about 3 us of host time, a Triton launch 25-35 us). Buckets are
  powers of two capped at ``max_rows``: a graph narrows ``bucket >= num_rows`` rows into the
  slot's staging buffer (at most twice the rows; the 8192-token narrowing takes 3.1 us on the
  device), and the D2H copy after it moves exactly ``num_rows`` rows, outside the graph. The copy
  stays out because ``read_done`` must follow the narrowing only (the next step's
  ``guard_source`` waits for it: 3 us, not the 80 us D2H of an 8192-token step), and because a
  captured ``copy_`` into pinned memory goes through the host allocator's capture path, which
  differs between torch releases;
- streams and events go through the raw calls: the device index is cached, the current stream is
  read with ``torch._C._cuda_getCurrentStream`` (its ``Stream`` object cached per stream id), events
  are recorded on explicit streams, and the copy stream is made current with
  ``torch._C._cuda_setStream`` and the previous stream restored in a ``finally``;
- the D2H copy, the three event records and the copy stream's wait are CUDA runtime calls through
  ctypes on the libcudart torch loaded (:mod:`moe_ops._runtime.cudart`; ``copy_`` alone cost 8.3
  us): one ``cudaMemcpyAsync`` of ``num_rows * row_bytes`` contiguous bytes from staging to the
  pinned slot. Where no libcudart is mapped (a statically linked runtime) torch's ``copy_`` and
  ``Event.record`` run instead; ``TransferPipeline.copy_path`` says which. The events stay torch
  ``Event`` objects (created by a first record through torch at construction), so handles query
  and wait on them as before. The caching host allocator does not see these copies, so such a
  pipeline's finalizer waits for its slots' last copies before the pinned buffers go back.

With the graphs and the runtime copy a 1,024-row snapshot still cost 25-28 us of host time on the
H200 machine's slow host (2,000 snapshots, cProfile): ``CUDAGraph.replay()`` 4.6 us alone, 19.8 us
inside ``torch.cuda.stream(copy)``, the two ``_cuda_setStream`` around it about 1.3 us each, each
of the three ``cudaEventRecord`` about 1.5 us, ``cudaMemcpyAsync`` 4.5 us and the slot bookkeeping
(``_acquire`` 8 us under cProfile, ``_release``, the handle) the rest. So, for the <= 20 us target:

- where the runtime is used and torch's ``CUDAGraph`` has ``raw_cuda_graph_exec`` (torch 2.11 has it),
  each graph's ``cudaGraphExec_t`` is kept at capture and the snapshot launches it with
  ``cudaGraphLaunch(exec, copy_stream)`` (2.76 us through ctypes on that host): no current-stream
  switch at all, since a graph runs on the stream it is launched on. It skips what ``replay()``
  adds around the same ``cudaGraphLaunch``: the current-stream lookup and a device guard (done
  here only where another device is current, with more than one visible) and the RNG prologue of
  the captured generators (the narrowing draws no random numbers). The ``CUDAGraph`` objects stay
  in their slot: they own the execs;
- ``TransferPipeline.narrow_path`` says which narrowing runs (:func:`choose_narrow_path`):
  ``"graph_launch"`` as above; ``"graph_replay"`` (``replay()`` with the copy stream current:
  ``cudart=False``, no libcudart mapped, or a torch without ``raw_cuda_graph_exec``); ``"kernel"``
  (``graphs=False``: the Triton launch); ``"torch"`` (the PyTorch twin, where Triton does not run
  on the device); ``"cpu"`` (a CPU source);
- the per-call Python is cut to what each call needs: the enqueue of the pipeline's path is chosen
  at construction, a slot's graphs are a list indexed by ``(num_rows - 1).bit_length()`` (that is
  ``graph_buckets(max_rows)`` in order, so the index is the bucket's), the compute stream's handle
  comes from one ``torch._C._cuda_getCurrentRawStream`` call, a plain int ``num_rows`` and a float
  ``timeout`` skip the generic type checks (every other value takes them, unchanged), and the ring
  lock is a plain ``threading.Lock`` taken directly (the ``Condition`` on it only waits for slots).
  Measured on a 2-core CPU machine without a GPU (the device calls are not in these numbers): a
  CPU pipeline's ``snapshot`` + ``release`` went from 5.0 to 3.7 us, of which taking a slot from
  0.78 to 0.28 us.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .._runtime.cudart import CudaRuntime, load_cudart
from .._runtime.triton import next_power_of_2, triton_runs_on
from ..channels import IDS, Channel, check_channels, pick_channel
from .narrow import check_narrow as narrow_check
from .narrow import launch_narrow, narrow_rows_torch

__all__ = [
    "DroppedSnapshotWarning",
    "RingFullError",
    "SnapshotHandle",
    "TransferPipeline",
    "choose_copy_path",
    "choose_narrow_path",
    "graph_bucket",
    "graph_buckets",
    "staging_dtype",
]

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


# Host dtype -> staging dtype of a channel: the ids' table and the floats of routing weights (a float
# cast on the device rounds as copy_ does; the host reads the same bits back).
_CHANNEL_STAGING = {
    **_STAGING,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def staging_dtype(host_dtype: np.dtype) -> torch.dtype:
    """The torch dtype a host dtype travels as (same width; uint16 travels as int16 bits)."""
    host_dtype = np.dtype(host_dtype)
    try:
        return _STAGING[host_dtype]
    except KeyError:
        names = ", ".join(str(d) for d in _STAGING)
        raise ValueError(f"out_dtype must be one of {names}, got {host_dtype}") from None


def graph_bucket(num_rows: int, max_rows: int) -> int:
    """Rows the narrowing graph of a ``num_rows`` snapshot narrows: the next power of two, capped
    at ``max_rows`` (0 for 0: no graph runs)."""
    if num_rows <= 0:
        return 0
    return min(next_power_of_2(num_rows), max_rows)


def graph_buckets(max_rows: int) -> list[int]:
    """Every bucket :func:`graph_bucket` returns for ``num_rows`` in ``[1, max_rows]``, ascending:
    ``1, 2, 4, ...`` and ``max_rows`` itself (16 buckets for 32,768 rows, 17 for 32,769)."""
    buckets = []
    rows = 1
    while rows < max_rows:
        buckets.append(rows)
        rows *= 2
    if max_rows > 0:
        buckets.append(max_rows)
    return buckets


# TransferPipeline.copy_path values: how the D2H copy of a snapshot is enqueued
COPY_PATHS = ("cudaMemcpyAsync", "copy_", "cpu")


def choose_copy_path(cuda: bool, cudart: bool | None, runtime_loaded: bool) -> str:
    """The D2H path of a pipeline: ``"cudaMemcpyAsync"`` (one runtime call through ctypes, and the
    event records and the copy stream's wait too), ``"copy_"`` (torch's ``Tensor.copy_``,
    ``Event.record`` and ``Stream.wait_event``) or ``"cpu"`` (a CPU source: a synchronous host copy).

    Args:
        cuda: the source is on a CUDA device.
        cudart: the pipeline's argument; None: the runtime wherever it is loaded, True: required
            (ValueError where it is not), False: torch's calls.
        runtime_loaded: :func:`moe_ops._runtime.cudart.load_cudart` found a libcudart mapped into
            the process (False e.g. for a torch that links the runtime statically).
    """
    if cudart is not None and not isinstance(cudart, bool):
        raise TypeError(f"cudart must be None, True or False, got {type(cudart).__name__}")
    if not cuda:
        if cudart:
            raise ValueError("cudart=True needs a CUDA source, got a CPU one; pass cudart=None")
        return "cpu"
    if cudart is False:
        return "copy_"
    if not runtime_loaded:
        if cudart:
            raise ValueError(
                "cudart=True needs the CUDA runtime library (libcudart) mapped into the process, and "
                "none is (a torch that links it statically?); pass cudart=None to fall back to copy_"
            )
        return "copy_"
    return "cudaMemcpyAsync"


# TransferPipeline.narrow_path values: how a snapshot narrows its rows on the device
NARROW_PATHS = ("graph_launch", "graph_replay", "kernel", "torch", "cpu")

# CUDAGraph.raw_cuda_graph_exec() (torch 2.11 has it) hands out the cudaGraphExec_t a capture made,
# which the pipeline launches itself on the copy stream; without it the graphs replay through torch
_HAS_RAW_GRAPH_EXEC = hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec")


def choose_narrow_path(
    cuda: bool, graphed: bool, triton_narrow: bool, copy_path: str, raw_graph_exec: bool
) -> str:
    """The narrowing path of a pipeline (``TransferPipeline.narrow_path``):

    - ``"graph_launch"``: the slot's bucket graph launched with ``cudaGraphLaunch(exec,
      copy_stream)`` through the runtime (:meth:`CudaRuntime.graph_launch`), with no current-stream
      switch; needs the graphs, the runtime copy path and ``CUDAGraph.raw_cuda_graph_exec``;
    - ``"graph_replay"``: the same graph through ``CUDAGraph.replay()`` with the copy stream made
      current (torch's ``copy_`` path, or a torch without ``raw_cuda_graph_exec``);
    - ``"kernel"``: the Triton kernel launched directly (``graphs=False``);
    - ``"torch"``: the PyTorch twin (a CUDA device Triton does not run on);
    - ``"cpu"``: a CPU source, narrowed by the host copy itself.

    Args:
        cuda: the source is on a CUDA device.
        graphed: the pipeline narrows through CUDA graphs (``TransferPipeline.graphed``).
        triton_narrow: the Triton kernel runs on the source's device.
        copy_path: the pipeline's :func:`choose_copy_path` (one of ``COPY_PATHS``).
        raw_graph_exec: the installed torch's ``CUDAGraph`` has ``raw_cuda_graph_exec``.
    """
    if copy_path not in COPY_PATHS:
        raise ValueError(f"copy_path must be one of {', '.join(COPY_PATHS)}, got {copy_path!r}")
    if graphed and not (cuda and triton_narrow):
        raise ValueError(
            "graphed=True needs cuda=True and triton_narrow=True (the graphs hold the Triton kernel)"
        )
    if not cuda:
        return "cpu"
    if graphed:
        return "graph_launch" if copy_path == "cudaMemcpyAsync" and raw_graph_exec else "graph_replay"
    return "kernel" if triton_narrow else "torch"


def _wait_for_copies(slots: list) -> None:
    """Finalizer of a pipeline whose copies bypass torch: its pinned buffers go back to the caching
    host allocator only after their last copy (the allocator tracks the copies ``copy_`` makes, not
    ours). At most ``depth`` copies are pending, about 0.3 ms each for 16 MB."""
    for slot in slots:
        slot.copy_done.synchronize()


def _check_extra_channels(
    ids: Channel, source: torch.Tensor, extra_channels, layer_stamps: torch.Tensor | None
) -> tuple[tuple[Channel, ...], tuple[torch.Tensor, ...]]:
    """``(ids, *extra)`` with row shapes resolved, and the extra channels' sources, after every
    check: ValueError (TypeError for a wrong type) naming ``extra_channels``, the channel and what
    was expected."""
    pairs = list(extra_channels.items()) if isinstance(extra_channels, Mapping) else extra_channels
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, (Sequence, list)):
        raise TypeError(
            "extra_channels must be (Channel, source tensor) pairs or a mapping, got "
            f"{type(extra_channels).__name__}"
        )
    channels, sources = [], []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"extra_channels must hold (Channel, source tensor) pairs, got {pair!r}")
        channel, src = pair
        check_channels(ids, [*channels, channel], "extra_channels")  # type and unique name
        name = f"extra_channels[{channel.name!r}]"
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"{name}: the source must be a torch.Tensor, got {type(src).__name__}")
        if src.device != source.device:
            raise ValueError(
                f"{name}: the source must be on the ids source's device {source.device}, got {src.device}"
            )
        if src.dim() < 2 or src.shape[0] != source.shape[0]:
            raise ValueError(
                f"{name}: the source must be (max_rows={source.shape[0]}, *row_shape), got shape "
                f"{tuple(src.shape)}"
            )
        row_shape = tuple(src.shape[1:])
        if channel.row_shape is not None and channel.row_shape != row_shape:
            raise ValueError(
                f"{name}: the source's row shape must be the channel's row_shape {channel.row_shape}, "
                f"got {row_shape}"
            )
        if not src.is_contiguous():
            raise ValueError(
                f"{name}: the source must be contiguous (its leading rows are copied as one block)"
            )
        if channel.dtype not in _CHANNEL_STAGING:
            raise ValueError(
                f"{name}: dtype must be one of {', '.join(str(d) for d in _CHANNEL_STAGING)}, "
                f"got {channel.dtype}"
            )
        is_float = channel.dtype.kind == "f"
        if src.dtype in (torch.bool,) or src.dtype.is_complex or src.dtype.is_floating_point != is_float:
            kind = "floating point" if is_float else "integer"
            raise ValueError(
                f"{name}: the source must have a {kind} dtype for a {channel.dtype} channel, got {src.dtype}"
            )
        if layer_stamps is not None and (src.dim() != 3 or src.shape[1] != layer_stamps.shape[0]):
            raise ValueError(
                f"{name}: with layer_stamps the source must be (max_rows, "
                f"num_layers={layer_stamps.shape[0]}, k) so that stale layers are masked, "
                f"got shape {tuple(src.shape)}"
            )
        channels.append(channel.resolved(row_shape))
        sources.append(src)
    return (ids, *channels), tuple(sources)


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


def _check_num_rows_type(value: object) -> int:
    """``num_rows`` that is not exactly an int: an int subclass or numpy integer as an int; a bool
    or anything else raises TypeError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"num_rows must be an int, got {type(value).__name__}")
    return int(value)


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
    # rows copied: each channel's array has shape (num_rows, *row_shape), (num_rows, L, K) for the ids
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

    def result(self, *, copy: bool = True, timeout: float | None = None, channel: str = IDS) -> np.ndarray:
        """The (num_rows, L, K) ids in the pipeline's output dtype, after :meth:`wait` (``timeout``
        as there); with ``channel``, that channel's ``(num_rows, *row_shape)`` rows in its dtype.

        ``copy=True`` returns an owned array. ``copy=False`` returns a read-only view into the pinned
        slot, valid until :meth:`release` (cheaper: no host copy); the view keeps this handle alive.
        ValueError for a channel the pipeline does not carry (before any wait).
        """
        if channel is IDS or channel == IDS:
            host_np = self._slot.host_np
        else:
            host_np = self._slot.lanes[pick_channel(self.pipeline.channels, channel) - 1].host_np
        self.wait(timeout)
        return self._rows(host_np, copy)

    def results(self, *, copy: bool = True, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Every channel's rows, ids first: ``{name: result(channel=name)}`` after one
        :meth:`wait` - what :meth:`SlotStore.write` and :meth:`RoutingLedger.land` take."""
        self.wait(timeout)
        out = {IDS: self._rows(self._slot.host_np, copy)}
        for lane in self._slot.lanes:
            out[lane.channel.name] = self._rows(lane.host_np, copy)
        return out

    def _rows(self, host_np: np.ndarray, copy: bool) -> np.ndarray:
        view = host_np[: self.num_rows]
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
        graphs: narrow through CUDA graphs (see the module docstring). None (default): wherever
            they apply, i.e. a CUDA source with the Triton kernel; True: required (ValueError where
            they do not apply); False: launch the narrowing directly. ``graphed`` says which. The
            graphs (``depth x len(graph_buckets(max_rows))``, 64 for depth 4 and 32,768 rows) are
            captured here, not at first use: a capture in ``snapshot`` would put a capture's host
            cost on one step and would have to keep every other thread's work off the copy
            stream while it runs.
        cudart: enqueue the D2H copy and the event records with one CUDA runtime call each
            (``cudaMemcpyAsync``, ``cudaEventRecord`` through ctypes on the libcudart torch
            loaded; :mod:`moe_ops._runtime.cudart`). None (default): wherever that library is
            mapped into the process; True: required (ValueError where it is not, or on CPU);
            False: torch's ``copy_`` and ``Event.record``. ``copy_path`` says which
            (:func:`choose_copy_path`). The events stay torch ``Event`` objects either way.
        extra_channels: the channels each snapshot carries beside the ids, as ``(Channel,
            source)`` pairs (or a ``{Channel: source}`` mapping): ``source`` is a persistent
            contiguous ``(max_rows, *row_shape)`` tensor on the ids source's device, integer for
            an integer channel and floating point (float16, bfloat16, float32, float64) for a float
            one (float16, float32 or float64 on the host); its rows are cast to the channel's dtype
            as ``copy_`` casts, stale layers (with ``layer_stamps``: a 3-D source of
            ``num_layers`` layers) read the channel's fill (NaN for floats). Empty (default): the
            ids alone. ``channels`` is ``(ids, *extra)``, each with its row shape; every snapshot
            moves all of them under the same events and ``handle.results()`` returns them.

    ``narrow_path`` says how the rows are narrowed on the device (:func:`choose_narrow_path`):
    ``"graph_launch"`` (the default on CUDA with the runtime and a torch whose ``CUDAGraph`` has
    ``raw_cuda_graph_exec``), ``"graph_replay"``, ``"kernel"``, ``"torch"`` or ``"cpu"``.

    Threads: ``snapshot``, ``in_flight``, ``guard_source``, ``synchronize``, handle ``release`` and
    the garbage collection of lost handles may run on different threads at once (one lock guards
    the ring; lost handles are queued without it). Snapshots are numbered in the order their
    ``snapshot`` calls finish enqueueing. A second lock serialises the copy-stream work of
    concurrent snapshots (a few us each), so the event ``guard_source`` waits on is the one
    recorded last and no graph exec is launched from two threads at once (CUDA graph objects are
    not thread-safe); the stream switch of the ``graph_replay``, ``kernel`` and ``torch`` paths is
    per thread and restored before ``snapshot`` returns (``graph_launch`` makes none).
    """

    def __init__(
        self,
        source: torch.Tensor,
        out_dtype: np.dtype | type,
        *,
        depth: int = 2,
        layer_stamps: torch.Tensor | None = None,
        step_tensor: torch.Tensor | None = None,
        graphs: bool | None = None,
        cudart: bool | None = None,
        extra_channels: Sequence[tuple[Channel, torch.Tensor]] | Mapping[Channel, torch.Tensor] = (),
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
        if graphs is not None and not isinstance(graphs, bool):
            raise TypeError(f"graphs must be None, True or False, got {type(graphs).__name__}")
        cuda = source.device.type == "cuda"
        runtime = load_cudart() if cuda and cudart is not False else None
        copy_path = choose_copy_path(cuda, cudart, runtime is not None)  # raises before anything is allocated
        triton_narrow = cuda and triton_runs_on(source.device)
        if graphs and not triton_narrow:
            raise ValueError(
                "graphs=True needs a CUDA source and the Triton narrowing kernel, got a "
                f"{source.device.type} source (Triton runs on it: {triton_narrow}); pass graphs=None "
                "to use them where they apply"
            )
        out_dtype = np.dtype(out_dtype)
        staging = staging_dtype(out_dtype)  # ValueError naming out_dtype for a dtype ids cannot travel as
        # (ids, *extra) with row shapes resolved, and the extra channels' sources: all checked here,
        # before anything is allocated
        self.channels, extra_sources = _check_extra_channels(
            Channel(IDS, out_dtype, tuple(source.shape[1:])), source, extra_channels, layer_stamps
        )
        self._extra_sources = extra_sources
        self.layer_stamps = layer_stamps
        self.step_tensor = step_tensor
        self.out_dtype = out_dtype
        self._staging_dtype = staging
        self.source = source
        self.device = source.device
        self.depth = depth
        self.max_rows = source.shape[0]
        self._cuda = cuda
        self._triton_narrow = triton_narrow
        # True: snapshots narrow through the slots' CUDA graphs
        self.graphed = triton_narrow and graphs is not False
        # "cudaMemcpyAsync", "copy_" or "cpu": how snapshots enqueue their D2H copy (COPY_PATHS)
        self.copy_path = copy_path
        self._cudart = runtime if copy_path == "cudaMemcpyAsync" else None
        # one of NARROW_PATHS: how snapshots narrow on the device (choose_narrow_path)
        self.narrow_path = choose_narrow_path(
            cuda, self.graphed, triton_narrow, copy_path, _HAS_RAW_GRAPH_EXEC
        )
        # the per-call enqueue of this narrow and copy path: a plain function, called with self (a
        # bound method stored here would make a reference cycle, keeping the pinned ring alive
        # until the cycle collector runs)
        if not cuda:
            self._enqueue = TransferPipeline._enqueue_cpu
        elif self.narrow_path == "graph_launch":
            self._enqueue = TransferPipeline._enqueue_graph_launch
        elif self._cudart is not None:
            self._enqueue = TransferPipeline._enqueue_cudart
        else:
            self._enqueue = TransferPipeline._enqueue_torch
        # bytes of one staged row: rows [0, n) of staging and host are n * _row_bytes contiguous bytes
        self._row_bytes = source.shape[1] * source.shape[2] * self.out_dtype.itemsize
        # The ring lock. `with self._mutex` takes it (a C-level lock: Condition.__enter__ is a Python
        # call); self._lock is the condition on it that waits for a slot.
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        # Serialises the copy-stream work of concurrent snapshots, so that _last_read_done is the
        # read_done recorded last on the copy stream (guard_source relies on it).
        self._enqueue_lock = threading.Lock()
        self._seq = 0
        self._last_read_done: torch.cuda.Event | None = None
        self.copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        if self._cuda:
            self._device_index = (
                self.device.index if self.device.index is not None else torch.cuda.current_device()
            )
            # (stream id, Stream) of the last current stream seen; one tuple, so a reader on
            # another thread sees a consistent pair
            self._stream_cache: tuple[int, torch.cuda.Stream | None] = (-1, None)
            # cudaStream_t of the current stream in one call, where this torch has it (the
            # runtime paths need the handle only, not a Stream object)
            self._raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            # with one visible device the current one is always the source's: no device check
            self._multi_device = torch.cuda.device_count() > 1
            # The copy stream reads source and staging: freeing them must wait for its work.
            source.record_stream(self.copy_stream)
            for extra in extra_sources:
                extra.record_stream(self.copy_stream)
        self._slots = [self._make_slot(i) for i in range(depth)]
        if self._cudart is not None:
            self._copy_stream_handle = self.copy_stream.cuda_stream
            for slot in self._slots:
                # torch creates an event at its first record; later records go to the same handle
                for event in (slot.ready, slot.read_done, slot.copy_done):
                    event.record(self.copy_stream)
                slot.ready_handle = slot.ready.cuda_event
                slot.read_done_handle = slot.read_done.cuda_event
                slot.copy_done_handle = slot.copy_done.cuda_event
            finalizer = weakref.finalize(self, _wait_for_copies, self._slots)
            finalizer.atexit = False  # at exit the process and its pinned memory go away together
        if self.graphed:
            self._capture_graphs()
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
            slot.host_ptr, slot.staging_ptr = host.data_ptr(), slot.staging.data_ptr()
            # the narrowing's contract, checked once for every row count (see launch_narrow)
            narrow_check(slot.staging, self.source, 0, self.layer_stamps, self.step_tensor)
            slot.ready = torch.cuda.Event()
            slot.read_done = torch.cuda.Event()
            slot.copy_done = torch.cuda.Event()
        slot.lanes = tuple(
            self._make_lane(channel, src) for channel, src in zip(self.channels[1:], self._extra_sources)
        )
        return slot

    def _make_lane(self, channel: Channel, source: torch.Tensor) -> _Lane:
        """One extra channel's host (and device staging) buffer of one slot."""
        shape = tuple(source.shape)
        dtype = _CHANNEL_STAGING[channel.dtype]
        host = torch.empty(shape, dtype=dtype, pin_memory=self._cuda)
        host_np = host.numpy()
        if host_np.dtype != channel.dtype:
            host_np = host_np.view(channel.dtype)
        row_bytes = math.prod(shape[1:]) * channel.dtype.itemsize
        lane = _Lane(channel, source, host, host_np, None, row_bytes)
        if self._cuda:
            lane.staging = torch.empty(shape, dtype=dtype, device=self.device)
            lane.staging.record_stream(self.copy_stream)
            lane.host_ptr, lane.staging_ptr = host.data_ptr(), lane.staging.data_ptr()
            narrow_check(lane.staging, source, 0, self.layer_stamps, self.step_tensor)
        return lane

    def _capture_graphs(self) -> None:
        """One graph per (slot, bucket), each narrowing ``bucket`` rows into the slot's staging.

        Each graph is the one Triton kernel node of ``launch_narrow`` and nothing else: its
        arguments are pointers (source, staging, stamps, step) and the row count, none of which
        names a stream; the capture runs on the copy stream, so a graph launched on the copy stream
        (``graph_launch``) or replayed with it current (``graph_replay``) runs exactly where it was
        captured. The captures allocate nothing and use no RNG, so skipping ``replay()``'s RNG
        prologue (``graph_launch``) changes nothing.
        """
        stamps, step = self.layer_stamps, self.step_tensor
        buckets = graph_buckets(self.max_rows)
        if not buckets:
            return
        pool = torch.cuda.graph_pool_handle()  # shared: the captures allocate nothing
        previous = self._enter_copy_stream()
        try:
            # The first launch compiles the kernel and loads its module, neither of which a
            # capture allows; later launches of any row count reuse that variant (n_rows is not
            # specialised). It narrows one row into staging only.
            launch_narrow(self._slots[0].staging, self.source, 1, stamps, step)
            for lane in self._slots[0].lanes:  # each channel's dtypes are one more variant
                launch_narrow(lane.staging, lane.source, 1, stamps, step)
            for slot in self._slots:
                for rows in buckets:
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: another thread's CUDA calls (a forward allocating) cannot
                    # invalidate this capture, nor this capture theirs
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        launch_narrow(slot.staging, self.source, rows, stamps, step)
                        # every channel's narrowing in the one graph: one launch per snapshot
                        for lane in slot.lanes:
                            launch_narrow(lane.staging, lane.source, rows, stamps, step)
                    finally:
                        graph.capture_end()
                    slot.graphs[rows] = graph
                    slot.graph_table.append(graph)
                if self.narrow_path == "graph_launch":
                    # the handles stay valid while the graphs live (no instantiate() after capture)
                    slot.graph_execs = [graph.raw_cuda_graph_exec() for graph in slot.graph_table]
        finally:
            self._exit_copy_stream(previous)

    def _current_stream(self) -> torch.cuda.Stream:
        """The current stream of the source's device, without ``torch.cuda.current_stream``: it
        resolves the device through ``_get_device_index`` on every call (3 calls per snapshot were
        the largest Python cost on the H200 machine's profile)."""
        stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(self._device_index)
        cached = self._stream_cache
        if cached[0] != stream_id:
            stream = torch.cuda.Stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
            cached = (stream_id, stream)
            self._stream_cache = cached
        return cached[1]

    def _enter_copy_stream(self) -> tuple[int, tuple[int, int, int]]:
        """Makes the copy stream current on this thread (the Triton launch, the graph replay and
        ``copy_`` enqueue on it) and returns what :meth:`_exit_copy_stream` restores: the current
        device and that device's previous stream. ``torch.cuda.stream(copy)`` does the same in
        10.1 us."""
        device = torch._C._cuda_getDevice()
        previous = torch._C._cuda_getCurrentStream(self._device_index)
        if device != self._device_index:
            torch._C._cuda_setDevice(self._device_index)
        copy = self.copy_stream
        torch._C._cuda_setStream(
            stream_id=copy.stream_id, device_index=copy.device_index, device_type=copy.device_type
        )
        return device, previous

    def _exit_copy_stream(self, saved: tuple[int, tuple[int, int, int]]) -> None:
        device, (stream_id, device_index, device_type) = saved
        torch._C._cuda_setStream(stream_id=stream_id, device_index=device_index, device_type=device_type)
        if device != self._device_index:
            torch._C._cuda_setDevice(device)

    @property
    def in_flight(self) -> int:
        """Slots not free: snapshots taken and not yet released, plus those of lost handles whose
        copy has not finished yet."""
        with self._mutex:
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
        # The checks read the exact type first (a plain int, the engine's case, costs one
        # comparison); every other value takes the full checks, so nothing is weakened.
        if num_rows.__class__ is not int:
            num_rows = _check_num_rows_type(num_rows)
        if not 0 <= num_rows <= self.max_rows:
            raise ValueError(f"num_rows must be in [0, {self.max_rows}] (rows of the source), got {num_rows}")
        if stream is not None and self._cuda:
            if not isinstance(stream, torch.cuda.Stream):
                raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
            if stream.device_index != self._device_index:
                raise ValueError(
                    f"stream must be on the source's device cuda:{self._device_index}, got a stream on "
                    f"cuda:{stream.device_index}"
                )
        slot = self._acquire(timeout)
        try:
            self._enqueue(self, slot, num_rows, stream)
        except BaseException:
            with self._mutex:
                self._free.append(slot.index)
                self._lock.notify()
            raise
        with self._mutex:
            seq = self._seq
            self._seq = seq + 1
            slot.holder_seq = seq
        return SnapshotHandle(self, slot, seq, num_rows)

    def _enqueue_cpu(self, slot: _Slot, num_rows: int, stream: None) -> None:
        """The CPU source's snapshot: a synchronous host copy (the cast narrows)."""
        src = self.source[:num_rows].numpy()
        np.copyto(slot.host_np[:num_rows], src, casting="unsafe")
        stale = None
        if self.layer_stamps is not None and num_rows:
            # CPU tensors: reading the stamps is a host read of host memory
            stale = (self.layer_stamps != self.step_tensor).numpy()
            if stale.any():
                slot.host_np[:num_rows, stale] = np.array(-1).astype(self.out_dtype)
            else:
                stale = None
        for lane in slot.lanes:
            if num_rows:
                # torch's cast: the one the device paths make (and it reads bfloat16, numpy cannot)
                lane.host[:num_rows].copy_(lane.source[:num_rows])
                if stale is not None:
                    lane.host_np[:num_rows, stale] = lane.channel.fill

    def _compute_stream_handle(self, stream: torch.cuda.Stream | None) -> int:
        """cudaStream_t of ``stream``, or of the current stream (one call where torch has it)."""
        if stream is not None:
            return stream.cuda_stream
        raw = self._raw_current_stream
        if raw is not None:
            return raw(self._device_index)
        return self._current_stream().cuda_stream

    def _enqueue_graph_launch(self, slot: _Slot, num_rows: int, stream: torch.cuda.Stream | None) -> None:
        """:meth:`_enqueue_cudart` with the narrowing graph launched by ``cudaGraphLaunch(exec,
        copy_stream)``: the same work on the same streams, in the same order, and no current-stream
        switch at all (a graph runs on the stream it is launched on). On the H200 machine the
        switch around ``replay()`` cost ~2.6 us (two ``_cuda_setStream``) and ``replay()`` 4.6 us,
        against 2.76 us for the launch."""
        runtime = self._cudart
        copy = self._copy_stream_handle
        ready = slot.ready_handle
        runtime.event_record(ready, self._compute_stream_handle(stream))
        with self._enqueue_lock:
            runtime.stream_wait_event(copy, ready)
            if num_rows:
                # graph_execs is graph_buckets(max_rows): bucket 2**b holds n with (n - 1).bit_length() == b
                graph_exec = slot.graph_execs[(num_rows - 1).bit_length()]
                if self._multi_device and torch._C._cuda_getDevice() != self._device_index:
                    self._graph_launch_on_device(runtime, graph_exec, copy)
                else:
                    runtime.graph_launch(graph_exec, copy)
            runtime.event_record(slot.read_done_handle, copy)
            if num_rows:
                runtime.memcpy_d2h_async(slot.host_ptr, slot.staging_ptr, num_rows * self._row_bytes, copy)
                for lane in slot.lanes:
                    runtime.memcpy_d2h_async(lane.host_ptr, lane.staging_ptr, num_rows * lane.row_bytes, copy)
            runtime.event_record(slot.copy_done_handle, copy)
            self._last_read_done = slot.read_done

    def _graph_launch_on_device(self, runtime: CudaRuntime, graph_exec: int, copy: int) -> None:
        """The launch with the source's device made current (and the caller's restored), as
        ``CUDAGraph.replay()``'s device guard does: another device is current on this thread."""
        device = torch._C._cuda_getDevice()
        torch._C._cuda_setDevice(self._device_index)
        try:
            runtime.graph_launch(graph_exec, copy)
        finally:
            torch._C._cuda_setDevice(device)

    def _enqueue_torch(self, slot: _Slot, num_rows: int, stream: torch.cuda.Stream | None) -> None:
        """The snapshot's device work through torch: ``Event.record``, ``wait_event`` and ``copy_``
        (``copy_path`` "copy_")."""
        compute = stream if stream is not None else self._current_stream()
        copy = self.copy_stream
        slot.ready.record(compute)
        with self._enqueue_lock:
            copy.wait_event(slot.ready)
            saved = self._enter_copy_stream()
            try:
                if num_rows:
                    self._narrow(slot, num_rows)
                slot.read_done.record(copy)
                if num_rows:
                    slot.host[:num_rows].copy_(slot.staging[:num_rows], non_blocking=True)
                    for lane in slot.lanes:
                        lane.host[:num_rows].copy_(lane.staging[:num_rows], non_blocking=True)
                slot.copy_done.record(copy)
            finally:
                self._exit_copy_stream(saved)
            self._last_read_done = slot.read_done

    def _enqueue_cudart(self, slot: _Slot, num_rows: int, stream: torch.cuda.Stream | None) -> None:
        """:meth:`_enqueue_torch` with the records and the D2H copy as runtime calls: the same work
        on the same streams, in the same order. Staging and host are contiguous, so rows
        ``[0, num_rows)`` are one byte range in each."""
        runtime = self._cudart
        copy = self._copy_stream_handle
        runtime.event_record(slot.ready_handle, self._compute_stream_handle(stream))
        with self._enqueue_lock:
            runtime.stream_wait_event(copy, slot.ready_handle)
            if num_rows:
                saved = self._enter_copy_stream()  # the graph replay (or launch) runs on it
                try:
                    self._narrow(slot, num_rows)
                finally:
                    self._exit_copy_stream(saved)
            runtime.event_record(slot.read_done_handle, copy)
            if num_rows:
                runtime.memcpy_d2h_async(slot.host_ptr, slot.staging_ptr, num_rows * self._row_bytes, copy)
                for lane in slot.lanes:
                    runtime.memcpy_d2h_async(lane.host_ptr, lane.staging_ptr, num_rows * lane.row_bytes, copy)
            runtime.event_record(slot.copy_done_handle, copy)
            self._last_read_done = slot.read_done

    def _narrow(self, slot: _Slot, num_rows: int) -> None:
        """Narrowing on the device, on the current (copy) stream: one cast kernel per channel, no
        allocation (moe_ops.transfer.narrow). ``num_rows >= 1``."""
        path = self.narrow_path
        if path == "graph_replay":  # the graph narrows every channel
            slot.graph_table[(num_rows - 1).bit_length()].replay()
            return
        stamps, step = self.layer_stamps, self.step_tensor
        if path == "kernel":  # staging and source were checked once, in _make_slot / _make_lane
            launch_narrow(slot.staging, self.source, num_rows, stamps, step)
            for lane in slot.lanes:
                launch_narrow(lane.staging, lane.source, num_rows, stamps, step)
        else:  # "torch": Triton does not run on this device, the PyTorch twin
            narrow_rows_torch(slot.staging, self.source, num_rows, stamps, step)
            for lane in slot.lanes:
                narrow_rows_torch(lane.staging, lane.source, num_rows, stamps, step)

    def guard_source(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes ``stream`` (default: current) wait until every snapshot taken so far has read the
        source, so that work queued next may overwrite it. An event wait on the device, not a host
        sync; a no-op on CPU (snapshots there copy before returning).

        Call it before each step that writes the source (``RoutingCapturer.set_step`` does).
        """
        last = self._last_read_done if self._cuda else None
        if last is not None:
            target = stream if stream is not None else self._current_stream()
            # Copy-stream work is in order, so the last snapshot's event covers every earlier one.
            target.wait_event(last)

    def _acquire(self, timeout: float | None) -> _Slot:
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
                return self._slots[self._free.pop(0)]
            return self._wait_for_slot(seconds)

    def _wait_for_slot(self, seconds: float) -> _Slot:
        """A slot once one is free, waiting up to ``seconds`` (ring lock held, every slot busy)."""
        deadline = time.monotonic() + seconds
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

    def synchronize(self) -> None:
        """Waits until every enqueued copy is done (the copy stream only; host side)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
