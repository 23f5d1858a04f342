"""Device-side fault counters for the capture kernels.

Counts that only turn out inconsistent on the device (``c`` larger than the rows ``topk_ids`` has
left, or than the buffer) and ids that do not fit the buffer cannot raise without a host sync. The
kernels clamp (or store the fill value -1) instead and record the fault in a :class:`FaultCounter`;
host code checks it at a sync point it already has (:meth:`FaultCounter.check`,
:func:`check_capture_errors`).

Which counter a call records into: every :class:`~moe_ops.RoutingCapturer` owns one (and every
``CaptureTarget`` built from it carries it), so one capturer's check never reports, nor clears,
another's faults. A bare ``capture_routing`` call without a counter records into the device-wide
counter of its device (:func:`capture_error_counter`).

Layout of a counter, (FAULT_SLOTS,) int32 on the device, only ever incremented by the kernels:

    slot 0              calls that had to clamp their row window (counted once per call)
    slot 1 + log2(bit)  per fault bit: calls with that window fault, or, for FAULT_BAD_ID, ids
                        that were negative or did not fit the buffer (or, with an expert map, the
                        map's physical range; for indexer positions, their key range), for
                        FAULT_BAD_MAP, ids the expert map sent outside the logical range, and for
                        FAULT_DUPLICATE, indexer positions repeated within a row (each stored as -1)

Reading is lossless under concurrency: :meth:`FaultCounter.read_and_reset` copies the slots to the
host and then SUBTRACTS what it read (an atomic ``index_add_`` on CUDA; under the CPU counters' lock
on the CPU, where the kernels' increments take the same lock), so increments that land between the
read and the reset stay in the counter for the next check instead of being zeroed. The machinery
(the tensor, the read-and-subtract, the lock, the device-wide registry) is the package's one fault
counter, :mod:`moe_ops._runtime.faults`, which replay's counter shares; this module gives the
capture's slots their meaning.

Thread safety: :meth:`FaultCounter.read_and_reset`, :meth:`FaultCounter.check`,
:func:`check_capture_errors` and the capture calls themselves may run on any threads at once; every
fault is reported by exactly one check.

A counter's tensor is allocated once and never moves (CUDA graphs bake its address), so make one
eager capture call (a warm-up) before capturing a graph with the device-wide counter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# cpu_counter_lock: re-exported for the capture and router kernels, which import it from here
from .._runtime.faults import DeviceCounter, cpu_counter_lock, device_counter, existing_counter

__all__ = [
    "FAULT_BAD_ID",
    "FAULT_BAD_MAP",
    "FAULT_BAD_OFFSET",
    "FAULT_DEST_SHORT",
    "FAULT_DUPLICATE",
    "FAULT_NEGATIVE_COUNT",
    "FAULT_SLOTS",
    "FAULT_SOURCE_SHORT",
    "CaptureFaultError",
    "FaultCounter",
    "FaultReport",
    "capture_error_counter",
    "check_capture_errors",
    "cpu_counter_lock",
    "describe_faults",
    "device_fault_counter",
]

FAULT_NEGATIVE_COUNT = 1  # c < 0: clamped to 0
FAULT_SOURCE_SHORT = 2  # start + c > rows of topk_ids: only the rows that exist were copied
FAULT_DEST_SHORT = 4  # c > rows of the buffer: only the rows that fit were written
FAULT_BAD_OFFSET = 8  # a negative size before this rank, or a start past the end of topk_ids
FAULT_BAD_ID = 16  # an id < 0 or beyond the buffer dtype's range: -1 stored in its place
# with an expert map: an id p < 0 or >= P (the map's physical slots) is FAULT_BAD_ID; a map entry
# expert_map[p] outside [0, num_logical_experts) is this one (the map, not the id, is wrong: a
# balancer that wrote a stale or torn map), -1 stored in its place
FAULT_BAD_MAP = 32
# indexer positions (moe_ops.indexer): a position already recorded earlier in the same row - the
# later copy is stored as -1 (a top-k set holds each key position once; a repeat is an indexer
# bug or a torn row, never a choice)
FAULT_DUPLICATE = 64
# bits that describe the row window (uniform over a call, recorded once per call)
WINDOW_FAULTS = FAULT_NEGATIVE_COUNT | FAULT_SOURCE_SHORT | FAULT_DEST_SHORT | FAULT_BAD_OFFSET
# slot 0 + one slot per fault bit (all 8 used: a new bit needs a wider counter)
FAULT_SLOTS = 8
_BITS = (
    FAULT_NEGATIVE_COUNT,
    FAULT_SOURCE_SHORT,
    FAULT_DEST_SHORT,
    FAULT_BAD_OFFSET,
    FAULT_BAD_ID,
    FAULT_BAD_MAP,
    FAULT_DUPLICATE,
)
# slot of a fault bit: 1 + log2(bit)
FAULT_SLOT = {bit: 1 + bit.bit_length() - 1 for bit in _BITS}

_FAULT_NAMES = {
    FAULT_NEGATIVE_COUNT: "negative token count",
    FAULT_SOURCE_SHORT: "token count larger than the rows of topk_ids left for this rank",
    FAULT_DEST_SHORT: "token count larger than the capture buffer's rows",
    FAULT_BAD_OFFSET: "negative shard size or rank offset past the end of topk_ids",
    FAULT_BAD_ID: "expert id negative or too large for the buffer dtype or the expert map (stored as -1)",
    FAULT_BAD_MAP: "expert map entry outside the logical expert range (stored as -1)",
    FAULT_DUPLICATE: "indexer position repeated within a row (the repeat stored as -1)",
}


def describe_faults(flags: int) -> str:
    """Human-readable list of the fault bits set in ``flags``."""
    names = [name for bit, name in _FAULT_NAMES.items() if flags & bit]
    return "; ".join(names) if names else "no faults"


@dataclass(frozen=True)
class FaultReport:
    """What one read of a :class:`FaultCounter` found (all zeros: no fault since the last read)."""

    # calls whose row window had to be clamped
    calls: int
    # OR of the fault bits seen (FAULT_* constants)
    flags: int
    # ids that were negative or too large for the buffer or the expert map (each stored as -1)
    bad_ids: int
    # ids whose expert-map entry was outside the logical range (each stored as -1)
    bad_mapped: int = 0
    # indexer positions repeated within their row (each repeat stored as -1)
    duplicates: int = 0

    @classmethod
    def of(cls, values: list[int]) -> FaultReport:
        """The report of a counter's (FAULT_SLOTS,) values (e.g. ``counter.tensor.tolist()``)."""
        return _report(list(values))

    @property
    def total(self) -> int:
        """Faults in all: clamped calls plus ids refused."""
        return self.calls + self.bad_ids + self.bad_mapped + self.duplicates


class CaptureFaultError(RuntimeError):
    """Raised by a check when a capture kernel had to clamp a window or refuse an id."""

    def __init__(
        self,
        device: torch.device,
        calls: int,
        flags: int,
        bad_ids: int = 0,
        bad_mapped: int = 0,
        duplicates: int = 0,
    ):
        self.device, self.calls, self.flags, self.bad_ids = device, calls, flags, bad_ids
        self.bad_mapped, self.duplicates = bad_mapped, duplicates
        parts = []
        if calls:
            parts.append(f"{calls} routing-capture call(s) on {device} were clamped")
        if bad_ids:
            parts.append(f"{bad_ids} expert id(s) on {device} did not fit the buffer")
        if bad_mapped:
            parts.append(f"{bad_mapped} expert id(s) on {device} mapped outside the logical experts")
        if duplicates:
            parts.append(f"{duplicates} indexer position(s) on {device} repeated within their row")
        super().__init__(
            f"{' and '.join(parts)}: {describe_faults(flags)}. token_counts/shard_sizes, ids or the expert "
            "map disagree with the tensors they describe; rows outside the valid range were not written."
        )


class FaultCounter(DeviceCounter):
    """A persistent (FAULT_SLOTS,) int32 fault counter on one device (see the module docstring).

    Args:
        device: where the counter lives (the capture buffer's device).

    Attributes:
        tensor: (FAULT_SLOTS,) int32 on ``device`` - what the kernels increment; never reallocated
            and marked as a static address (CUDA graphs and inductor's graph trees bake it).

    Thread-safe: see the module docstring.
    """

    def __init__(self, device: torch.device | str | int | None = None):
        super().__init__(FAULT_SLOTS, device)

    def read_and_reset(self) -> FaultReport:
        """Reads the counter and subtracts what it read, losing no concurrent increment.

        HOST SYNC: copies 32 bytes from the device, which waits for the work queued before it on
        the current stream. Call it where the host already synchronises, never inside a captured or
        compiled step.
        """
        return _report(self.read(reset=True))

    def peek(self) -> FaultReport:
        """Reads the counter without resetting it (HOST SYNC, as :meth:`read_and_reset`)."""
        return _report(self.read(reset=False))

    def check(self, *, reset: bool = True, raise_error: bool = True) -> int:
        """Reads (and by default resets) the counter; returns the number of faults
        (:attr:`FaultReport.total`), raising :class:`CaptureFaultError` when there were any and
        ``raise_error``. HOST SYNC, as :meth:`read_and_reset`."""
        report = self.read_and_reset() if reset else self.peek()
        if raise_error and report.total:
            raise CaptureFaultError(
                self.device, report.calls, report.flags, report.bad_ids, report.bad_mapped, report.duplicates
            )
        return report.total

    def __repr__(self) -> str:
        return f"FaultCounter(device={self.device})"


def _report(values: list[int]) -> FaultReport:
    flags = 0
    for bit, slot in FAULT_SLOT.items():
        if values[slot]:
            flags |= bit
    return FaultReport(
        calls=values[0],
        flags=flags,
        bad_ids=values[FAULT_SLOT[FAULT_BAD_ID]],
        bad_mapped=values[FAULT_SLOT[FAULT_BAD_MAP]],
        duplicates=values[FAULT_SLOT[FAULT_DUPLICATE]],
    )


def device_fault_counter(device: torch.device | str | int | None = None) -> FaultCounter:
    """The device-wide :class:`FaultCounter` of ``device``, for capture calls that bring none.

    Allocated on first use and then fixed for the process.
    """
    return device_counter("capture", device, FaultCounter)


# Under torch.compile this runs at trace time, as plain Python, and the graph holds the counter as a
# constant: the first traced capture call may allocate it without a graph break (a lock or an
# allocation traced by dynamo would break the graph).
@torch._dynamo.assume_constant_result
def capture_error_counter(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The tensor of the device-wide counter of ``device`` (see :func:`device_fault_counter`)."""
    return device_fault_counter(device).tensor


def check_capture_errors(
    device: torch.device | str | int | None = None, *, reset: bool = True, raise_error: bool = True
) -> int:
    """Checks the DEVICE-WIDE counter of ``device`` (bare ``capture_routing`` / ``route`` calls
    without a capturer's counter); returns the number of faults recorded since the last check.

    HOST SYNC: copies 32 bytes from the device, which waits for the work queued before it on the
    current stream. Call it where the host already synchronises (e.g. after reading the step's
    outputs), never inside a captured or compiled step. Thread-safe, and lossless: a fault recorded
    while the check runs is reported by the next check.

    Args:
        device: the device whose counter to read (default: the current CUDA device, else CPU).
        reset: subtract what was read from the counter.
        raise_error: raise :class:`CaptureFaultError` when there were faults.
    """
    counter = existing_counter("capture", device)
    if counter is None:
        return 0
    return counter.check(reset=reset, raise_error=raise_error)
