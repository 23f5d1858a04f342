"""Which path a snapshot takes: how it narrows on the device and how its rows cross to the host.

A :class:`~moe_ops.transfer.pipeline.TransferPipeline` chooses both once, at construction, from its
source's device, its ``graphs`` and ``cudart`` arguments and what the process offers (a mapped
libcudart, Triton on the device, ``CUDAGraph.raw_cuda_graph_exec``); each pair runs one of the
pipeline's four enqueue functions (``moe_ops/transfer/pipeline.py``)::

    copy_path          narrow_path                         a snapshot's device work
    "cpu"              "cpu"                               _enqueue_cpu: a host copy whose cast narrows
    "cudaMemcpyAsync"  "graph_launch"                      _enqueue_graph_launch: cudaGraphLaunch, then
                                                             cudaMemcpyAsync; records through the runtime
    "cudaMemcpyAsync"  "graph_replay", "kernel", "torch"   _enqueue_cudart: narrowing with the copy
                                                             stream current, then cudaMemcpyAsync
    "copy_"            "graph_replay", "kernel", "torch"   _enqueue_torch: narrowing with the copy
                                                             stream current, then copy_, Event.record

Here: the two rules (:func:`choose_copy_path`, :func:`choose_narrow_path`) and their values
(``COPY_PATHS``, ``NARROW_PATHS``), the dtype each host dtype is staged as on the device
(:func:`staging_dtype`), and the row buckets of the narrowing graphs (:func:`graph_bucket`,
:func:`graph_buckets`).

Why these paths. Host cost of one ``snapshot`` (the engine's scheduler thread pays it every step).
Measured on the H200 machine (torch 2.11, triton 3.6, 1,024 tokens, source (8192, 61, 8) int32, us
per call): the Triton launch 25.7-34.9, ``torch.cuda.current_stream()`` behind every
``Event.record()`` 5.9, the ``torch.cuda.stream`` context 10.1, the D2H ``copy_`` 8.3,
``wait_event`` 0.9; the whole call 67-72 us, so at 1,024 tokens (0.5 MB, 12 us of copy) the ring
moved 6.5 GB/s against 42 GB/s for a plain pinned copy. So (and the stream and event calls went
raw: :mod:`moe_ops.transfer.pipeline` says how):

- the narrowing is one CUDA graph per (slot, row bucket), captured at construction and replayed on
  the copy stream (a replay costs about 3 us of host time, a Triton launch 25-35 us). Buckets are
  powers of two capped at ``max_rows``: a graph narrows ``bucket >= num_rows`` rows into the
  slot's staging buffer (at most twice the rows; the 8192-token narrowing takes 3.1 us on the
  device), and the D2H copy after it moves exactly ``num_rows`` rows, outside the graph. The copy
  stays out because ``read_done`` must follow the narrowing only (the next step's
  ``guard_source`` waits for it: 3 us, not the 80 us D2H of an 8192-token step), and because a
  captured ``copy_`` into pinned memory goes through the host allocator's capture path, which
  differs between torch releases;
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
(taking a slot 8 us under cProfile, releasing it, the handle) the rest. So, for the <= 20 us target:

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
  on the device); ``"cpu"`` (a CPU source).
"""

from __future__ import annotations

import numpy as np
import torch

from .._runtime.triton import next_power_of_2

__all__ = [
    "COPY_PATHS",
    "NARROW_PATHS",
    "choose_copy_path",
    "choose_narrow_path",
    "graph_bucket",
    "graph_buckets",
    "staging_dtype",
]

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
