"""The async device-to-host pipeline: narrow on the device, copy into a ring of pinned host buffers.

One snapshot of the leading ``num_rows`` rows of a persistent ``(max_rows, L, K)`` device buffer::

    compute stream: ... forward writes rows ... [record ready]                   [wait read_done]* ...
                                                       |                               ^
    copy stream:                             [wait ready] narrow -> staging[s] [record read_done]
                                                          D2H staging[s] -> pinned[s] [record copy_done]
    host:           snapshot() returns at once;  handle.result() waits on copy_done only

    * the next :meth:`TransferPipeline.guard_source` (``RoutingCapturer.set_step`` calls it) makes the
      compute stream wait for ``read_done`` before the next step can overwrite the source rows.

:meth:`TransferPipeline.snapshot` takes a free slot ``s`` of the ring, runs the pipeline's path on
it (the copy-stream half of the diagram: narrow, then copy) and returns a :class:`SnapshotHandle`.
The path is one of four functions at the end of this module, picked once at construction by
:func:`_enqueue_for` from the pipeline's ``copy_path`` and ``narrow_path``::

    _enqueue_cpu            "cpu": a synchronous host copy, whose cast narrows
    _enqueue_torch          "copy_": the narrowing, torch's copy_, Event.record and wait_event
    _enqueue_cudart         "cudaMemcpyAsync": the same work, the copy and records as runtime calls
    _enqueue_graph_launch   "cudaMemcpyAsync" with narrow_path "graph_launch": the narrowing graph
                            launched on the copy stream, no current-stream switch

The transfer room, by concern:

- ``paths.py``: the choice of path (:func:`choose_copy_path`, :func:`choose_narrow_path`), the
  staging dtypes and the narrowing graphs' row buckets, with the measurements behind each path;
- ``narrow.py``: the narrowing cast, a Triton kernel beside its PyTorch twin;
- ``ring.py``: the ring's slots (per channel a staging and a pinned host buffer, and three events)
  and who holds them: taking, releasing, reclaiming the slots of lost handles, :class:`RingFullError`;
- ``handle.py``: :class:`SnapshotHandle`, waiting on one snapshot's copy and reading its rows;
- ``pipeline.py`` (here): :class:`TransferPipeline` (checks, construction, the copy stream,
  ``snapshot``, ``guard_source``, ``synchronize``) and the four paths.

- Nothing here synchronises the host with the device except ``SnapshotHandle.wait``/``result``,
  which wait on that snapshot's own event; the copy stream waits on the compute stream through an
  event, never a device-wide sync.
- The ring has ``depth`` slots (device staging + pinned host buffer + events each). A slot is busy
  from ``snapshot`` until its handle's ``release``; when all are busy, ``snapshot`` raises
  :class:`RingFullError` (or waits up to ``timeout`` seconds for another thread to release one). A
  lost handle (garbage collected without ``release``) gives its slot back once its copy finished,
  warning once with :class:`DroppedSnapshotWarning` (:mod:`moe_ops.transfer.ring`).
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

Host cost: the paths exist to cut a snapshot's host time (:mod:`moe_ops.transfer.paths` has the
H200 profile: 67-72 us per call through torch's helpers, 25-28 us with graphs and runtime copies,
then the graph launch). What this module adds on every path:

- streams and events go through the raw calls: the device index is cached, the current stream is
  read with ``torch._C._cuda_getCurrentStream`` (its ``Stream`` object cached per stream id), events
  are recorded on explicit streams, and the copy stream is made current with
  ``torch._C._cuda_setStream`` and the previous stream restored in a ``finally`` (on the H200
  machine ``torch.cuda.current_stream()`` behind every ``Event.record()`` cost 5.9 us, the
  ``torch.cuda.stream`` context 10.1 us);
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

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from .._runtime.cudart import CudaRuntime, load_cudart
from .._runtime.triton import triton_runs_on
from ..channels import IDS, Channel, check_channels
from .handle import SnapshotHandle
from .narrow import launch_narrow, narrow_rows_torch
from .paths import (
    _CHANNEL_STAGING,
    _HAS_RAW_GRAPH_EXEC,
    COPY_PATHS,
    NARROW_PATHS,
    choose_copy_path,
    choose_narrow_path,
    graph_bucket,
    graph_buckets,
    staging_dtype,
)
from .ring import DroppedSnapshotWarning, RingFullError, _Ring, _Slot

__all__ = [
    "COPY_PATHS",
    "NARROW_PATHS",
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


def _check_num_rows_type(value: object) -> int:
    """``num_rows`` that is not exactly an int: an int subclass or numpy integer as an int; a bool
    or anything else raises TypeError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"num_rows must be an int, got {type(value).__name__}")
    return int(value)


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
        graphs: narrow through CUDA graphs (see :mod:`moe_ops.transfer.paths`). None (default): wherever
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
    the ring, :mod:`moe_ops.transfer.ring`; lost handles are queued without it). Snapshots are
    numbered in the order their ``snapshot`` calls finish enqueueing. A second lock serialises the
    copy-stream work of concurrent snapshots (a few us each), so the event ``guard_source`` waits
    on is the one recorded last and no graph exec is launched from two threads at once (CUDA graph
    objects are not thread-safe); the stream switch of the ``graph_replay``, ``kernel`` and
    ``torch`` paths is per thread and restored before ``snapshot`` returns (``graph_launch`` makes
    none).
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
        self.layer_stamps = layer_stamps
        self.step_tensor = step_tensor
        self.out_dtype = out_dtype
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
        # the per-call enqueue of this narrow and copy path (one of the _enqueue_* functions at the
        # end of this module): a plain function, called with self (a bound method stored here would
        # make a reference cycle, keeping the pinned ring alive until the cycle collector runs)
        self._enqueue = _enqueue_for(copy_path, self.narrow_path)
        # bytes of one staged row: rows [0, n) of staging and host are n * _row_bytes contiguous bytes
        self._row_bytes = source.shape[1] * source.shape[2] * self.out_dtype.itemsize
        # Serialises the copy-stream work of concurrent snapshots, so that _last_read_done is the
        # read_done recorded last on the copy stream (guard_source relies on it).
        self._enqueue_lock = threading.Lock()
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
        # the slots' buffers and events, and who holds each slot (moe_ops.transfer.ring)
        self._ring = _Ring(
            depth,
            source,
            out_dtype,
            staging,
            tuple(zip(self.channels[1:], extra_sources)),
            self.copy_stream,
            layer_stamps,
            step_tensor,
        )
        if self._cudart is not None:
            self._copy_stream_handle = self.copy_stream.cuda_stream
            for slot in self._ring.slots:
                # torch creates an event at its first record; later records go to the same handle
                for event in (slot.ready, slot.read_done, slot.copy_done):
                    event.record(self.copy_stream)
                slot.ready_handle = slot.ready.cuda_event
                slot.read_done_handle = slot.read_done.cuda_event
                slot.copy_done_handle = slot.copy_done.cuda_event
            finalizer = weakref.finalize(self, _wait_for_copies, self._ring.slots)
            finalizer.atexit = False  # at exit the process and its pinned memory go away together
        if self.graphed:
            self._capture_graphs()

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
        slots = self._ring.slots
        pool = torch.cuda.graph_pool_handle()  # shared: the captures allocate nothing
        previous = self._enter_copy_stream()
        try:
            # The first launch compiles the kernel and loads its module, neither of which a
            # capture allows; later launches of any row count reuse that variant (n_rows is not
            # specialised). It narrows one row into staging only.
            launch_narrow(slots[0].staging, self.source, 1, stamps, step)
            for lane in slots[0].lanes:  # each channel's dtypes are one more variant
                launch_narrow(lane.staging, lane.source, 1, stamps, step)
            for slot in slots:
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
        return self._ring.in_flight

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
        ring = self._ring
        slot = ring.acquire(timeout)
        try:
            # narrow, then copy, by the path chosen at construction (one of the _enqueue_* below)
            self._enqueue(self, slot, num_rows, stream)
        except BaseException:
            ring.cancel(slot)
            raise
        return SnapshotHandle(self, slot, ring.hold(slot), num_rows)

    def _compute_stream_handle(self, stream: torch.cuda.Stream | None) -> int:
        """cudaStream_t of ``stream``, or of the current stream (one call where torch has it)."""
        if stream is not None:
            return stream.cuda_stream
        raw = self._raw_current_stream
        if raw is not None:
            return raw(self._device_index)
        return self._current_stream().cuda_stream

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

    def synchronize(self) -> None:
        """Waits until every enqueued copy is done (the copy stream only; host side)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()


# The snapshot's device work, one function per path (see the table in moe_ops/transfer/paths.py),
# each called with the pipeline as ``pipe``: the pipeline stores the plain function, since a bound
# method stored on it would make a reference cycle, keeping the pinned ring alive until the cycle
# collector runs. The "graph_replay", "kernel" and "torch" narrowings share _narrow_on_copy_stream.

_Enqueue = Callable[[TransferPipeline, _Slot, int, torch.cuda.Stream | None], None]


def _enqueue_for(copy_path: str, narrow_path: str) -> _Enqueue:
    """The enqueue function of a pipeline's paths (:func:`choose_copy_path`,
    :func:`choose_narrow_path`), called once at construction."""
    if copy_path == "cpu":
        return _enqueue_cpu
    if narrow_path == "graph_launch":
        return _enqueue_graph_launch
    if copy_path == "cudaMemcpyAsync":
        return _enqueue_cudart
    return _enqueue_torch


def _enqueue_cpu(pipe: TransferPipeline, slot: _Slot, num_rows: int, stream: None) -> None:
    """The CPU source's snapshot: a synchronous host copy (the cast narrows)."""
    src = pipe.source[:num_rows].numpy()
    np.copyto(slot.host_np[:num_rows], src, casting="unsafe")
    stale = None
    if pipe.layer_stamps is not None and num_rows:
        # CPU tensors: reading the stamps is a host read of host memory
        stale = (pipe.layer_stamps != pipe.step_tensor).numpy()
        if stale.any():
            slot.host_np[:num_rows, stale] = np.array(-1).astype(pipe.out_dtype)
        else:
            stale = None
    for lane in slot.lanes:
        if num_rows:
            # torch's cast: the one the device paths make (and it reads bfloat16, numpy cannot)
            lane.host[:num_rows].copy_(lane.source[:num_rows])
            if stale is not None:
                lane.host_np[:num_rows, stale] = lane.channel.fill


def _narrow_on_copy_stream(pipe: TransferPipeline, slot: _Slot, num_rows: int) -> None:
    """Narrowing on the device, on the current (copy) stream, for the ``graph_replay``, ``kernel`` and
    ``torch`` narrow paths of :func:`_enqueue_torch` and :func:`_enqueue_cudart`: one cast kernel per
    channel, no allocation (moe_ops.transfer.narrow). ``num_rows >= 1``."""
    path = pipe.narrow_path
    if path == "graph_replay":  # the graph narrows every channel
        slot.graph_table[(num_rows - 1).bit_length()].replay()
        return
    stamps, step = pipe.layer_stamps, pipe.step_tensor
    if path == "kernel":  # staging and source were checked once, in ring._make_slot / _make_lane
        launch_narrow(slot.staging, pipe.source, num_rows, stamps, step)
        for lane in slot.lanes:
            launch_narrow(lane.staging, lane.source, num_rows, stamps, step)
    else:  # "torch": Triton does not run on this device, the PyTorch twin
        narrow_rows_torch(slot.staging, pipe.source, num_rows, stamps, step)
        for lane in slot.lanes:
            narrow_rows_torch(lane.staging, lane.source, num_rows, stamps, step)


def _enqueue_torch(
    pipe: TransferPipeline, slot: _Slot, num_rows: int, stream: torch.cuda.Stream | None
) -> None:
    """The snapshot's device work through torch: ``Event.record``, ``wait_event`` and ``copy_``
    (``copy_path`` "copy_")."""
    compute = stream if stream is not None else pipe._current_stream()
    copy = pipe.copy_stream
    slot.ready.record(compute)
    with pipe._enqueue_lock:
        copy.wait_event(slot.ready)
        saved = pipe._enter_copy_stream()
        try:
            if num_rows:
                _narrow_on_copy_stream(pipe, slot, num_rows)
            slot.read_done.record(copy)
            if num_rows:
                slot.host[:num_rows].copy_(slot.staging[:num_rows], non_blocking=True)
                for lane in slot.lanes:
                    lane.host[:num_rows].copy_(lane.staging[:num_rows], non_blocking=True)
            slot.copy_done.record(copy)
        finally:
            pipe._exit_copy_stream(saved)
        pipe._last_read_done = slot.read_done


def _enqueue_cudart(
    pipe: TransferPipeline, slot: _Slot, num_rows: int, stream: torch.cuda.Stream | None
) -> None:
    """:func:`_enqueue_torch` with the records and the D2H copy as runtime calls: the same work
    on the same streams, in the same order. Staging and host are contiguous, so rows
    ``[0, num_rows)`` are one byte range in each."""
    runtime = pipe._cudart
    copy = pipe._copy_stream_handle
    runtime.event_record(slot.ready_handle, pipe._compute_stream_handle(stream))
    with pipe._enqueue_lock:
        runtime.stream_wait_event(copy, slot.ready_handle)
        if num_rows:
            saved = pipe._enter_copy_stream()  # the graph replay (or launch) runs on it
            try:
                _narrow_on_copy_stream(pipe, slot, num_rows)
            finally:
                pipe._exit_copy_stream(saved)
        runtime.event_record(slot.read_done_handle, copy)
        if num_rows:
            runtime.memcpy_d2h_async(slot.host_ptr, slot.staging_ptr, num_rows * pipe._row_bytes, copy)
            for lane in slot.lanes:
                runtime.memcpy_d2h_async(lane.host_ptr, lane.staging_ptr, num_rows * lane.row_bytes, copy)
        runtime.event_record(slot.copy_done_handle, copy)
        pipe._last_read_done = slot.read_done


def _enqueue_graph_launch(
    pipe: TransferPipeline, slot: _Slot, num_rows: int, stream: torch.cuda.Stream | None
) -> None:
    """:func:`_enqueue_cudart` with the narrowing graph launched by ``cudaGraphLaunch(exec,
    copy_stream)``: the same work on the same streams, in the same order, and no current-stream
    switch at all (a graph runs on the stream it is launched on). On the H200 machine the
    switch around ``replay()`` cost ~2.6 us (two ``_cuda_setStream``) and ``replay()`` 4.6 us,
    against 2.76 us for the launch."""
    runtime = pipe._cudart
    copy = pipe._copy_stream_handle
    ready = slot.ready_handle
    runtime.event_record(ready, pipe._compute_stream_handle(stream))
    with pipe._enqueue_lock:
        runtime.stream_wait_event(copy, ready)
        if num_rows:
            # graph_execs is graph_buckets(max_rows): bucket 2**b holds n with (n - 1).bit_length() == b
            graph_exec = slot.graph_execs[(num_rows - 1).bit_length()]
            if pipe._multi_device and torch._C._cuda_getDevice() != pipe._device_index:
                _graph_launch_on_device(pipe, runtime, graph_exec, copy)
            else:
                runtime.graph_launch(graph_exec, copy)
        runtime.event_record(slot.read_done_handle, copy)
        if num_rows:
            runtime.memcpy_d2h_async(slot.host_ptr, slot.staging_ptr, num_rows * pipe._row_bytes, copy)
            for lane in slot.lanes:
                runtime.memcpy_d2h_async(lane.host_ptr, lane.staging_ptr, num_rows * lane.row_bytes, copy)
        runtime.event_record(slot.copy_done_handle, copy)
        pipe._last_read_done = slot.read_done


def _graph_launch_on_device(pipe: TransferPipeline, runtime: CudaRuntime, graph_exec: int, copy: int) -> None:
    """The launch with the source's device made current (and the caller's restored), as
    ``CUDAGraph.replay()``'s device guard does: another device is current on this thread."""
    device = torch._C._cuda_getDevice()
    torch._C._cuda_setDevice(pipe._device_index)
    try:
        runtime.graph_launch(graph_exec, copy)
    finally:
        torch._C._cuda_setDevice(device)
