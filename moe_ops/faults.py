"""One fault check: every device-side fault counter of a device, read in one report.

Faults that only show on the device - a count larger than its rows, an id out of range, a row whose
weights came out NaN - cannot raise without a host sync, so the kernels count them and carry on
(clamp, route live, write -1 or 0). Four kinds, each a device-wide counter
(:mod:`moe_ops._runtime.faults`):

============  =============================================================  ===================
kind          what it counts                                                 its meaning lives in
============  =============================================================  ===================
capture       capture calls whose row window was clamped; ids the buffer or  moe_ops.capture.errors
              the expert map refused (stored as -1)
replay        replayed rows with bad recorded ids (routed live), hash rows    moe_ops.replay.op
              the table could not route, router calls with a row count
              other than the batch's
hash          hash-routed rows the table could not route (ids -1, weights 0) moe_ops.router.hash
nonfinite     routed or replayed rows whose weights were not finite (zeroed) moe_ops.router.nonfinite
============  =============================================================  ===================

:func:`check_faults` reads and resets every kind of one device (and the own counters of the
capturers it is given: a ``RoutingCapturer`` records into its own) and returns a
:class:`FaultSummary`; with faults it raises :class:`FaultsError`, which carries the summary and
each kind's own error. The per-kind checks (``check_capture_errors``, ``check_replay_errors``,
``check_hash_errors``, ``check_nonfinite_rows``) are views of one kind each, over the same read.

Thread safety: every read is lossless and may run beside the kernels and other checks (each count
is reported by exactly one read); one summary is not a snapshot across kinds (a fault of one kind
recorded while another is read is reported by the next check).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ._runtime.faults import normalise_device, read_counter
from .capture.errors import FAULT_SLOTS, CaptureFaultError, FaultReport
from .replay.op import ReplayFaultError
from .router.hash import HashFaultError
from .router.nonfinite import NonFiniteRowsError

__all__ = ["FaultSummary", "FaultsError", "check_faults"]

_NO_CAPTURE_FAULTS = FaultReport.of([0] * FAULT_SLOTS)


@dataclass(frozen=True)
class FaultSummary:
    """What one :func:`check_faults` found (all zero: no fault since the previous check)."""

    # the device whose counters were read
    device: torch.device
    # the device-wide capture counter: capture calls without a capturer's counter of their own
    capture: FaultReport
    # the own counter of each capturer given to check_faults, in order
    capturers: tuple[FaultReport, ...]
    # faulty replayed rows (routed live) and router calls with a wrong row count, counted once each
    replay_rows: int
    # OR of the replay fault bits seen (moe_ops.replay.kernels.REPLAY_FAULT_*)
    replay_flags: int
    # hash-routed rows the table could not route (ids -1, weights 0)
    hash_rows: int
    # OR of the hash fault bits seen (moe_ops.router.hash.HASH_FAULT_*)
    hash_flags: int
    # routed or replayed rows whose weights were not finite (written as 0)
    nonfinite_rows: int

    @property
    def total(self) -> int:
        """Faults of every kind together (capture faults as :attr:`FaultReport.total`)."""
        captured = self.capture.total + sum(r.total for r in self.capturers)
        return captured + self.replay_rows + self.hash_rows + self.nonfinite_rows

    def errors(self) -> list[RuntimeError]:
        """Each kind's own error (the one its per-kind check raises), for the kinds with faults."""
        found: list[RuntimeError] = []
        for report in (self.capture, *self.capturers):
            if report.total:
                found.append(
                    CaptureFaultError(
                        self.device,
                        report.calls,
                        report.flags,
                        report.bad_ids,
                        report.bad_mapped,
                        report.duplicates,
                    )
                )
        if self.replay_rows:
            found.append(ReplayFaultError(self.device, self.replay_rows, self.replay_flags))
        if self.hash_rows:
            found.append(HashFaultError(self.device, self.hash_rows, self.hash_flags))
        if self.nonfinite_rows:
            found.append(NonFiniteRowsError(self.device, self.nonfinite_rows))
        return found


class FaultsError(RuntimeError):
    """Raised by :func:`check_faults` when any kind counted a fault: ``summary`` is what it read,
    ``errors`` each kind's own error (its message is theirs, one per line)."""

    def __init__(self, summary: FaultSummary):
        self.summary = summary
        self.errors = summary.errors()
        super().__init__("\n".join(str(e) for e in self.errors))


def _slots(kind: str, device: torch.device, width: int) -> list[int]:
    values = read_counter(kind, device)
    return [0] * width if values is None else values


def check_faults(
    device: torch.device | str | int | None = None, *, capturers: Iterable = (), raise_error: bool = True
) -> FaultSummary:
    """Reads and resets every device-wide fault counter of ``device`` (capture, replay, hash,
    non-finite rows) and the own counter of each of ``capturers``; returns what they counted since
    the previous check. A counter never allocated (nothing ran there) reads as 0.

    Args:
        device: the device whose counters to read (default: the current CUDA device, else CPU).
        capturers: capturers whose own fault counters to read too (``RoutingCapturer``: its
            ``fault_counter``; TypeError for an object without one).
        raise_error: raise :class:`FaultsError` when anything was counted (after every reset).

    HOST SYNC: copies each counter from the device (a few dozen bytes), which waits for the work
    queued before it on the current stream. Call it where the host already synchronises (after
    reading the step's outputs or the loss), never inside a captured or compiled step.
    Thread-safe and lossless (module docstring).
    """
    counters = []
    for capturer in capturers:
        counter = getattr(capturer, "fault_counter", None)
        if counter is None or not callable(getattr(counter, "read_and_reset", None)):
            raise TypeError(
                f"capturers must hold capturers with a fault_counter (moe_ops.RoutingCapturer), got "
                f"{type(capturer).__name__}"
            )
        counters.append(counter)
    device = normalise_device(device)
    capture = read_counter("capture", device)
    replay, hashed = _slots("replay", device, 2), _slots("hash", device, 2)
    summary = FaultSummary(
        device=device,
        capture=_NO_CAPTURE_FAULTS if capture is None else FaultReport.of(capture),
        capturers=tuple(counter.read_and_reset() for counter in counters),
        replay_rows=replay[0],
        replay_flags=replay[1],
        hash_rows=hashed[0],
        hash_flags=hashed[1],
        nonfinite_rows=_slots("nonfinite", device, 1)[0],
    )
    if raise_error and summary.total:
        raise FaultsError(summary)
    return summary
