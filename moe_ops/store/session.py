"""Multi-turn sessions: each turn sends only the rows the client does not hold yet.

Turn t + 1 of a chat re-sends turn t's tokens as its prompt, and a naive engine re-sends their
routing too: users report routing as 85-97% of a generation's payload. A session view in the
ledger (``RoutingLedger.add_request(..., session=sid)``) remembers what it delivered for the
session - the positions ``[0, delivered)`` and a 128-bit digest of each delivered row - and starts
the next turn's request at the first position whose row the client may not hold:

* positions the new turn recomputes (beyond its prefix-cache hit) are re-sent: their rows are the
  new forward's, which may differ from the old ones (another batch, another kernel);
* positions it reads from the prefix cache are re-sent only from the first one whose row in the
  store differs from the delivered one (another request's blocks with the same prefix, or a block
  recomputed since): the digests compare them;
* a delivered row that was missing (its step dropped) is re-sent.

The client splices the delta onto what it holds: :func:`splice_turn`. The digest (two 64-bit
polynomial hashes of the row's bytes over every channel) tells rows apart unless they differ in
a way that cancels in both at once (for rows that differ in one 8-byte word, never: the
multipliers are odd).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["row_digests", "splice_turn"]

# odd 64-bit multipliers of the two polynomial hashes (the golden ratio's and splitmix64's)
_P1 = np.uint64(0x9E3779B97F4A7C15)
_P2 = np.uint64(0xBF58476D1CE4E5B9)


def row_digests(arrays: list[np.ndarray]) -> np.ndarray:
    """(n, 2) uint64: a digest of each row over ``arrays`` (each ``(n, ...)``, any dtype), as bytes."""
    n = arrays[0].shape[0] if arrays else 0
    out = np.zeros((n, 2), dtype=np.uint64)
    if n == 0:
        return out
    for a in arrays:
        raw = np.ascontiguousarray(a).reshape(n, -1).view(np.uint8)
        pad = -raw.shape[1] % 8
        if pad:
            raw = np.concatenate([raw, np.zeros((n, pad), np.uint8)], axis=1)
        words = np.ascontiguousarray(raw).view("<u8").astype(np.uint64)
        width = words.shape[1]
        with np.errstate(over="ignore"):
            powers1 = np.cumprod(np.full(width, _P1, dtype=np.uint64), dtype=np.uint64)
            powers2 = np.cumprod(np.full(width, _P2, dtype=np.uint64), dtype=np.uint64)
            out[:, 0] = out[:, 0] * _P1 + (words * powers1).sum(axis=1, dtype=np.uint64) + np.uint64(width)
            out[:, 1] = out[:, 1] * _P2 + (words * powers2).sum(axis=1, dtype=np.uint64) + np.uint64(width)
    return out


@dataclass(eq=False)
class Session:
    """What a ledger delivered for one session (see the module docstring)."""

    # the client holds rows of positions [0, delivered)
    delivered: int = 0
    # (capacity, 2) uint64 digests of those rows; rows [0, delivered) are valid
    digests: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.uint64))

    def first_change(self, cached: np.ndarray) -> int:
        """The first position of ``[0, len(cached))`` whose digest differs from the delivered row's
        (``cached``: digests of the rows a new turn reads from the prefix cache), else its length."""
        n = min(len(cached), self.delivered)
        differ = np.flatnonzero((cached[:n] != self.digests[:n]).any(axis=1))
        return int(differ[0]) if differ.size else n

    def record(self, start: int, digests: np.ndarray, missing: np.ndarray) -> None:
        """A turn delivered rows of positions ``[start, start + len(digests))``: the client holds
        ``[0, start)`` (kept) and these, up to the first missing one."""
        held = int(np.argmax(missing)) if missing.any() else len(digests)
        end = start + held
        if self.digests.shape[0] < end:
            grown = np.zeros((max(end, 2 * self.digests.shape[0]), 2), np.uint64)
            grown[: self.delivered] = self.digests[: self.delivered]
            self.digests = grown
        self.digests[start:end] = digests[:held]
        self.delivered = end


def splice_turn(held: np.ndarray, delta: np.ndarray, start: int) -> np.ndarray:
    """The client's side: the full routing of a session after a turn, from the rows it ``held``
    (positions ``[0, len(held))``) and the turn's ``delta`` (positions ``[start, start +
    len(delta))``: ``FinishedRouting.routing`` and ``.start``). ValueError for a delta that starts
    after what is held (a gap) or rows of another shape or dtype."""
    held, delta = np.asarray(held), np.asarray(delta)
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if start > held.shape[0]:
        raise ValueError(f"the delta starts at {start}, the client holds rows of [0, {held.shape[0]}): a gap")
    if held.shape[1:] != delta.shape[1:] or held.dtype != delta.dtype:
        raise ValueError(
            f"held rows {held.shape[1:]} {held.dtype} and delta {delta.shape[1:]} {delta.dtype} differ"
        )
    return np.concatenate([held[:start], delta])
