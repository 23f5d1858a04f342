"""Device-side fault counters for the capture kernels.

Counts that only turn out inconsistent on the device (``c`` larger than the rows ``topk_ids`` has
left, or than the buffer) cannot raise without a host sync. The kernels clamp instead, and the first
program of a faulty call records it here: ``errors[0]`` counts faulty calls, ``errors[1]`` ORs their
fault flags. Host code checks at a sync point it already has, with :func:`check_capture_errors`.

The counter tensor of a device is allocated once and never moves (CUDA graphs bake its address), so
make one eager capture call (a warm-up) before capturing a graph.
"""

from __future__ import annotations

import threading

import torch

__all__ = [
    "FAULT_BAD_OFFSET",
    "FAULT_DEST_SHORT",
    "FAULT_NEGATIVE_COUNT",
    "FAULT_SOURCE_SHORT",
    "CaptureFaultError",
    "capture_error_counter",
    "check_capture_errors",
    "describe_faults",
]

FAULT_NEGATIVE_COUNT = 1  # c < 0: clamped to 0
FAULT_SOURCE_SHORT = 2  # start + c > rows of topk_ids: only the rows that exist were copied
FAULT_DEST_SHORT = 4  # c > rows of the buffer: only the rows that fit were written
FAULT_BAD_OFFSET = 8  # a negative size before this rank, or a start past the end of topk_ids

_FAULT_NAMES = {
    FAULT_NEGATIVE_COUNT: "negative token count",
    FAULT_SOURCE_SHORT: "token count larger than the rows of topk_ids left for this rank",
    FAULT_DEST_SHORT: "token count larger than the capture buffer's rows",
    FAULT_BAD_OFFSET: "negative shard size or rank offset past the end of topk_ids",
}

_lock = threading.Lock()
# device -> (2,) int32 tensor: [faulty calls, OR of fault flags]
_counters: dict[torch.device, torch.Tensor] = {}


class CaptureFaultError(RuntimeError):
    """Raised by :func:`check_capture_errors` when a capture kernel had to clamp."""

    def __init__(self, device: torch.device, calls: int, flags: int):
        self.device, self.calls, self.flags = device, calls, flags
        super().__init__(
            f"{calls} routing-capture call(s) on {device} were clamped: {describe_faults(flags)}. "
            "token_counts/shard_sizes disagree with the tensors they describe; the rows outside the "
            "valid range were not written."
        )


def describe_faults(flags: int) -> str:
    """Human-readable list of the fault bits set in ``flags``."""
    names = [name for bit, name in _FAULT_NAMES.items() if flags & bit]
    return "; ".join(names) if names else "no faults"


def _normalise(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# Under torch.compile this runs at trace time, as plain Python, and the graph holds the counter as a
# constant: the first traced capture call may allocate it without a graph break (a lock or an
# allocation traced by dynamo would break the graph).
@torch._dynamo.assume_constant_result
def capture_error_counter(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The persistent (2,) int32 fault counter of ``device``: [faulty calls, OR of fault flags].

    Allocated on first use and then fixed for the process (its address is safe to bake into CUDA
    graphs). Marked as a static address so that inductor's CUDA-graph trees accept the capture
    op's mutation of it.
    """
    device = _normalise(device)
    counter = _counters.get(device)
    if counter is None:
        with _lock:
            counter = _counters.get(device)
            if counter is None:
                counter = torch.zeros(2, dtype=torch.int32, device=device)
                torch._dynamo.mark_static_address(counter)
                _counters[device] = counter
    return counter


def check_capture_errors(
    device: torch.device | str | int | None = None, *, reset: bool = True, raise_error: bool = True
) -> int:
    """Reads the fault counter of ``device`` and returns how many capture calls were clamped.

    HOST SYNC: this copies 8 bytes from the device, which waits for the work queued before it on
    the current stream. Call it where the host already synchronises (e.g. after reading the step's
    outputs), never inside a captured or compiled step.

    Args:
        device: the device whose counter to read (default: the current CUDA device, else CPU).
        reset: zero the counter after reading it.
        raise_error: raise :class:`CaptureFaultError` when any call was clamped.
    """
    device = _normalise(device)
    counter = _counters.get(device)
    if counter is None:
        return 0
    calls, flags = (int(v) for v in counter.tolist())
    if reset:
        counter.zero_()
    if raise_error and calls:
        raise CaptureFaultError(device, calls, flags)
    return calls
