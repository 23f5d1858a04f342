"""A few CUDA runtime calls through ctypes, on the libcudart that torch already loaded.

The snapshot's D2H copy, event records and narrowing-graph launch are one runtime call each;
through torch they cost more host time than the copy itself takes at small sizes (H200 machine,
torch 2.11: ``copy_`` of a contiguous device slice into pinned memory 8.3 us of dispatch,
``Event.record`` 5.9 us, a ``CUDAGraph.replay()`` on the copy stream inside
``torch.cuda.stream(copy)`` 19.8 us, ``cudaGraphLaunch(exec, copy)`` through ctypes 2.76 us). A ctypes
call with declared ``argtypes`` costs a microsecond or two there (``cudaEventRecord`` 1.5 us under
cProfile).

- :func:`find_loaded_library` reads ``/proc/self/maps`` (the libraries mapped into this process),
  as vLLM's ``CudaRTLibrary`` does; the file name must be ``libcudart.so``, ``libcudart.so.12``,
  ``libcudart.so.12.4.127`` or ``libcudart-<hash>.so.12`` (a wheel's vendored copy), so neither a
  ``libcudart_stub.so`` some packages load nor ``cuda/bindings/.../runtime*.so`` is taken for it.
- :func:`load_cudart` returns a :class:`CudaRuntime` on torch's such library, or None when none
  is mapped (a CPU build, or a torch that links the runtime statically): callers then use torch.
  The library is opened with ``ctypes.CDLL`` on the path already mapped, which returns that same
  loaded instance (the dynamic loader keys by path and soname), so its per-thread state (current
  device, last error) is the one torch's calls use.

Every call checks its ``cudaError_t``: a nonzero one is cleared from the runtime's per-thread last
error (``cudaGetLastError``: torch checks it after its own kernel launches and would otherwise
report our failure there) and raised as RuntimeError with ``cudaGetErrorString``.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from pathlib import Path

__all__ = ["CudaRuntime", "find_loaded_libraries", "find_loaded_library", "load_cudart"]

# enum cudaMemcpyKind (cuda_runtime_api.h): cudaMemcpyDeviceToHost = 2
CUDA_MEMCPY_DEVICE_TO_HOST = 2


def _library_pattern(name: str) -> re.Pattern:
    # name.so, name.so.12, name.so.12.4.127, name-1a2b3c4d.so.12 (auditwheel's vendored copies)
    return re.compile(re.escape(name) + r"(?:-[0-9a-fA-F]+)?\.so(?:\.\d+)*")


def find_loaded_libraries(name: str, maps: str | None = None) -> list[str]:
    """The paths of the libraries named ``name`` (e.g. ``"libcudart"``) mapped into this process,
    each once, in the order of the maps file.

    Args:
        name: the library's name without ``.so``; the file name must be ``name.so[.N...]`` or
            ``name-<hex>.so[.N...]`` exactly.
        maps: the text of a ``/proc/<pid>/maps`` file (default: this process's, read now); an
            unreadable one (no procfs) reads as no library.
    """
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    pattern = _library_pattern(name)
    paths: list[str] = []
    for line in maps.splitlines():
        # address perms offset dev inode pathname; the pathname may contain spaces
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            path = fields[5].strip()
            if pattern.fullmatch(path.rsplit("/", 1)[-1]) and path not in paths:
                paths.append(path)
    return paths


def find_loaded_library(name: str, maps: str | None = None) -> str | None:
    """The first of :func:`find_loaded_libraries`, or None."""
    paths = find_loaded_libraries(name, maps)
    return paths[0] if paths else None


class CudaRuntime:
    """``cudaMemcpyAsync``, ``cudaEventRecord``, ``cudaStreamWaitEvent`` and ``cudaGraphLaunch`` of
    one loaded libcudart.

    Thread-safe: the methods only call the runtime, whose calls are thread-safe; the instance holds
    no mutable state after construction.

    Args:
        path: the library file (``find_loaded_library("libcudart")``).
    """

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        # cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
        #                             cudaStream_t stream)
        self._memcpy_async = lib.cudaMemcpyAsync
        self._memcpy_async.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._memcpy_async.restype = ctypes.c_int
        # cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
        self._event_record = lib.cudaEventRecord
        self._event_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._event_record.restype = ctypes.c_int
        # cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
        self._stream_wait_event = lib.cudaStreamWaitEvent
        self._stream_wait_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._stream_wait_event.restype = ctypes.c_int
        # cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream)
        self._graph_launch = lib.cudaGraphLaunch
        self._graph_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._graph_launch.restype = ctypes.c_int
        # const char* cudaGetErrorString(cudaError_t error)
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p
        # cudaError_t cudaGetLastError(void)
        self._get_last_error = lib.cudaGetLastError
        self._get_last_error.argtypes = []
        self._get_last_error.restype = ctypes.c_int

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """Enqueues ``cudaMemcpyAsync(dst, src, nbytes, kind, stream)``; pointers and the stream
        handle are ints (``Tensor.data_ptr()``, ``torch.cuda.Stream.cuda_stream``)."""
        error = self._memcpy_async(dst, src, nbytes, kind, stream)
        if error:
            self._raise("cudaMemcpyAsync", error)

    def memcpy_d2h_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """:meth:`memcpy_async` with ``cudaMemcpyDeviceToHost``."""
        error = self._memcpy_async(dst, src, nbytes, CUDA_MEMCPY_DEVICE_TO_HOST, stream)
        if error:
            self._raise("cudaMemcpyAsync", error)

    def event_record(self, event: int, stream: int) -> None:
        """Enqueues ``cudaEventRecord(event, stream)`` (``torch.cuda.Event.cuda_event`` handle)."""
        error = self._event_record(event, stream)
        if error:
            self._raise("cudaEventRecord", error)

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Enqueues ``cudaStreamWaitEvent(stream, event, 0)``: work queued on ``stream`` later waits
        for the event's last record."""
        error = self._stream_wait_event(stream, event, 0)
        if error:
            self._raise("cudaStreamWaitEvent", error)

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        """Enqueues ``cudaGraphLaunch(graph_exec, stream)``: the instantiated graph's work runs on
        ``stream``, after the work queued there before (``CUDAGraph.raw_cuda_graph_exec()`` handle;
        the ``CUDAGraph`` owns the exec and must outlive every launch). Unlike
        ``CUDAGraph.replay()`` it needs no current-stream switch, and it skips replay's RNG
        prologue (correct only for graphs without RNG consumers). Call it with the graph's device
        current, as ``replay()`` does (it sets it through a device guard). Launches of one exec
        must not run concurrently from several threads (CUDA graph objects are not thread-safe):
        the caller serialises them."""
        error = self._graph_launch(graph_exec, stream)
        if error:
            self._raise("cudaGraphLaunch", error)

    def error_string(self, error: int) -> str:
        text = self._error_string(error)
        return text.decode("utf-8", "replace") if text else "unknown error"

    def _raise(self, call: str, error: int) -> None:
        self._get_last_error()  # clears it: torch's next launch check must not report it
        raise RuntimeError(f"{call} failed with cudaError {error}: {self.error_string(error)}")


_LOAD_LOCK = threading.Lock()
# path -> runtime (None: no libcudart was mapped at the first look); looked up once per process
_LOADED: dict[str, CudaRuntime | None] = {}


def load_cudart() -> CudaRuntime | None:
    """The runtime torch loaded (cached after the first call), or None where no libcudart is
    mapped into the process. Call it after CUDA is initialised (a CUDA build of torch maps
    libcudart when ``torch._C`` loads, so any CUDA tensor suffices). Thread-safe.

    With several libcudart files mapped (another package's vendored copy beside torch's), the one
    the dynamic loader resolves torch's soname to (``libcudart.so.<torch.version.cuda major>``,
    ``RTLD_NOLOAD``: only an already loaded one) is taken: its per-thread current device is the
    one torch sets.
    """
    with _LOAD_LOCK:
        if "libcudart" not in _LOADED:
            path = _torch_cudart(find_loaded_libraries("libcudart"))
            _LOADED["libcudart"] = CudaRuntime(path) if path is not None else None
        return _LOADED["libcudart"]


def _torch_cudart(paths: list[str]) -> str | None:
    if len(paths) <= 1:
        return paths[0] if paths else None
    import torch

    major = (torch.version.cuda or "").split(".")[0]
    try:
        torch_handle = ctypes.CDLL(f"libcudart.so.{major}", mode=os.RTLD_NOLOAD)._handle
    except OSError:
        return paths[0]
    for path in paths:
        if ctypes.CDLL(path)._handle == torch_handle:
            return path
    return paths[0]
