"""A snapshot's handle: wait for its copy, read its rows, give its ring slot back.

:meth:`TransferPipeline.snapshot <moe_ops.transfer.pipeline.TransferPipeline.snapshot>` returns one
:class:`SnapshotHandle` per snapshot. It waits on that snapshot's own ``copy_done`` event only
(never a device-wide sync), hands the rows out as an owned copy or a read-only view into the pinned
slot, and gives the slot back to the ring (:mod:`moe_ops.transfer.ring`) at ``release`` or, for a
handle dropped unreleased, when it is garbage collected.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..channels import IDS, pick_channel
from .ring import _check_timeout, _Slot

if TYPE_CHECKING:
    from .pipeline import TransferPipeline

__all__ = ["SnapshotHandle"]

# Sleep between event queries of a wait with a finite timeout (CUDA events have no timed wait):
# 50 us bounds the added latency well under a step's 1-10 ms.
_EVENT_POLL_S = 5e-5


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
    slot back once its copy finished (see :mod:`moe_ops.transfer.ring`); a ``copy=False`` view keeps
    the handle alive.

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
        self.pipeline._ring.release(self)

    def __enter__(self) -> SnapshotHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # The collector runs this on whatever thread allocates, possibly inside a pipeline call that
        # holds the ring lock: so no lock here, only a queue append; snapshot() reclaims the slot.
        if getattr(self, "released", True) or sys.is_finalizing():
            return
        self.pipeline._ring.orphan(self)

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError(
                f"snapshot {self.seq} was released: its ring slot may already hold another step's rows"
            )
