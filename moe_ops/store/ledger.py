"""``RoutingLedger``: request-lifecycle bookkeeping on top of a :class:`SlotStore`.

The engine tells the ledger what its scheduler does (start/resume with a prefix hit, append KV
blocks, schedule tokens, preempt, finish, abort) and hands it each step's rows when they land from
the async pipeline, in any order. The ledger guarantees, for every request, that the routing it
returns equals what that request's tokens were routed to, row for row:

- Pre-free capture: before a request's blocks go back to the engine (finish, abort, preemption),
  its rows are copied out of the store into a private copy. Rows of steps still in flight are
  delivered into that copy when they land (the ledger remembers which step writes which slot).
- Block reuse: each block carries the sequence number of the first step scheduled after its last
  fresh allocation; a landing step older than that is never written into the block (its rows only
  go to the private copies of the requests that computed them). So an aborted request's late rows
  cannot leak into the next owner of its blocks, whatever order steps land in.
- Preemption and resume: every attempt of a request ends in a private copy; the returned routing is
  the most complete copy (the most tokens; the latest attempt on a tie), rows in token order.
- Prefix hits: a request that starts on cached blocks reads the rows the computing request wrote
  (or will write, if that step is still in flight) at those slots.

Everything here is host-side numpy; nothing touches a device.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .slot_store import SlotStore, slots_for

__all__ = ["FinishedRouting", "RoutingLedger", "ScheduledStep"]


@dataclass(frozen=True)
class ScheduledStep:
    """What :meth:`RoutingLedger.schedule` hands back for one step."""

    # sequence number of the step; pass it to land() with the step's rows
    seq: int
    # (num_tokens,) int64 KV slot of each row of the step, rows in the order of the entries
    slot_mapping: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class FinishedRouting:
    """A finished (or aborted) request's routing, from :meth:`RoutingLedger.collect`."""

    req_id: Hashable
    # (num_tokens, num_layers, top_k) rows of the request's tokens, token order
    routing: np.ndarray
    # True when the request was aborted (the routing covers the tokens computed until then)
    aborted: bool


@dataclass(eq=False)
class _Copy:
    # (length, num_layers, top_k) rows of one attempt; pending rows arrive when their step lands
    rows: np.ndarray
    # tokens [0, length) of the request were computed (or prefix-hit) in this attempt
    length: int
    # which attempt of the request (0 = first run, +1 per resume)
    attempt: int


@dataclass(eq=False)
class _Request:
    # the engine's id of the request
    req_id: Hashable
    # KV block table of the current attempt (empty while preempted)
    blocks: list[int] = field(default_factory=list)
    # tokens [0, computed) of the current attempt are scheduled or prefix-hit
    computed: int = 0
    # attempts started so far minus one (0 = first run, +1 per resume)
    attempt: int = 0
    # "running", "preempted", "finished" or "aborted"
    state: str = "running"
    # most complete private copy so far (None: none taken yet)
    best: _Copy | None = None
    # finished/aborted: the last step sequence number scheduled before it; ready once all landed
    done_seq: int = -1


@dataclass(eq=False)
class _Step:
    # the step's sequence number (its key in the ledger's in-flight steps)
    seq: int
    # (n,) slot of each row
    slots: np.ndarray
    # rows of this step to deliver into private copies: (row indices, copy, positions in the copy)
    redirects: list[tuple[np.ndarray, _Copy, np.ndarray]] = field(default_factory=list)


class RoutingLedger:
    """Request bookkeeping so that reads never mix requests, lose rows or return stale ones.

    Args:
        store: the :class:`SlotStore` of the KV cache's slots.
        block_size: tokens per KV block; ``store.num_slots`` must be a multiple of it.

    Host-side only. Calls mirror an engine scheduler; see docs/transfer.md for the mapping to one.
    """

    def __init__(self, store: SlotStore, block_size: int):
        if not isinstance(store, SlotStore):
            raise TypeError(f"store must be a SlotStore, got {type(store).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if store.num_slots % block_size:
            raise ValueError(
                f"store.num_slots={store.num_slots} must be a multiple of block_size={block_size}"
            )
        self.store = store
        self.block_size = block_size
        self.num_blocks = store.num_slots // block_size
        # refs[b]: running requests holding block b (prefix hits share a block)
        self._refs = np.zeros(self.num_blocks, dtype=np.int64)
        # epoch[b]: first step seq scheduled after b's last fresh allocation; older steps' rows are
        # never written into b
        self._epoch = np.zeros(self.num_blocks, dtype=np.int64)
        # pending_seq[slot]: seq of the latest scheduled, not yet landed write to slot (-1: none)
        self._pending_seq = np.full(store.num_slots, -1, dtype=np.int64)
        # pending_row[slot]: row of that write within its step
        self._pending_row = np.zeros(store.num_slots, dtype=np.int64)
        self._requests: dict[Hashable, _Request] = {}
        self._steps: dict[int, _Step] = {}
        self._next_seq = 0

    # ----------------------------------------------------------------------------------- requests

    def add_request(
        self, req_id: Hashable, cached_blocks: Sequence[int] = (), num_cached_tokens: int = 0
    ) -> None:
        """Starts a request, optionally on a prefix-cache hit.

        Args:
            req_id: any hashable id, unused so far.
            cached_blocks: blocks of the prefix hit, shared with whoever computed them.
            num_cached_tokens: tokens covered by the hit, ``len(cached_blocks) * block_size``.
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already exists (state {self._requests[req_id].state})")
        req = _Request(req_id)
        self._start_attempt(req, cached_blocks, num_cached_tokens)
        self._requests[req_id] = req

    def resume(self, req_id: Hashable, cached_blocks: Sequence[int] = (), num_cached_tokens: int = 0) -> None:
        """Starts a new attempt of a preempted request (recompute from token 0, or from a prefix hit)."""
        req = self._get(req_id, "running", "preempted")
        if req.state != "preempted":
            raise ValueError(f"request {req_id!r} is {req.state}, only a preempted request can resume")
        self._start_attempt(req, cached_blocks, num_cached_tokens, attempt=req.attempt + 1)
        req.state = "running"

    def _start_attempt(self, req: _Request, cached_blocks, num_cached_tokens: int, attempt: int = 0) -> None:
        blocks = self._block_list("cached_blocks", cached_blocks)
        if isinstance(num_cached_tokens, bool) or not isinstance(num_cached_tokens, (int, np.integer)):
            raise TypeError(f"num_cached_tokens must be an int, got {type(num_cached_tokens).__name__}")
        if num_cached_tokens != len(blocks) * self.block_size:
            raise ValueError(
                f"num_cached_tokens must be len(cached_blocks) * block_size = "
                f"{len(blocks) * self.block_size} (prefix hits cover whole blocks), got {num_cached_tokens}"
            )
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"cached_blocks has duplicates: {blocks}")
        self._refs[blocks] += 1
        req.blocks = list(blocks)
        req.computed = int(num_cached_tokens)
        req.attempt = attempt

    def append_blocks(self, req_id: Hashable, block_ids: Sequence[int]) -> None:
        """Appends freshly allocated blocks to a running request's block table.

        A fresh block may hold another request's old rows (or have old steps in flight): from now
        on no step scheduled before this call writes into it. ValueError if a block is held by a
        running request.
        """
        req = self._get(req_id, "running")
        blocks = self._block_list("block_ids", block_ids)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block_ids has duplicates: {blocks}")
        held = [b for b in blocks if self._refs[b] > 0]
        if held:
            raise ValueError(
                f"blocks {held} are held by running requests; a fresh block must be free "
                "(prefix hits are passed to add_request/resume instead)"
            )
        self._refs[blocks] = 1
        self._epoch[blocks] = self._next_seq
        req.blocks.extend(blocks)

    def schedule(self, entries: Sequence[tuple[Hashable, int]]) -> ScheduledStep:
        """Schedules one step: ``entries`` are ``(req_id, num_new_tokens)`` in batch-row order.

        Each request's next ``num_new_tokens`` tokens (after those already computed) must be
        covered by its blocks. Returns the step's sequence number and slot mapping; the rows the
        step produces must be passed to :meth:`land` in this order.
        """
        parts = []
        plan = []
        seen = set()
        for req_id, n in entries:
            req = self._get(req_id, "running")
            if req_id in seen:
                raise ValueError(f"request {req_id!r} appears twice in one step")
            seen.add(req_id)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"num_new_tokens of {req_id!r} must be an int >= 0, got {n!r}")
            need = req.computed + int(n)
            if need > len(req.blocks) * self.block_size:
                raise IndexError(
                    f"request {req_id!r}: tokens [{req.computed}, {need}) need "
                    f"{-(-need // self.block_size)} blocks, it holds {len(req.blocks)}; append blocks first"
                )
            parts.append(slots_for(req.blocks, self.block_size, req.computed, int(n)))
            plan.append((req, int(n)))
        slots = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        seq = self._next_seq
        self._next_seq += 1
        for req, n in plan:
            req.computed += n
        self._pending_seq[slots] = seq
        self._pending_row[slots] = np.arange(slots.size, dtype=np.int64)
        self._steps[seq] = _Step(seq, slots)
        return ScheduledStep(seq, slots)

    def land(self, seq: int, rows: np.ndarray) -> None:
        """Delivers step ``seq``'s rows (any order of steps): (num_tokens, num_layers, top_k).

        Rows go into the store at slots whose block was not freshly reallocated after the step was
        scheduled and that no later step rewrites, and into the private copies that were waiting for
        them (requests freed while the step was in flight).
        """
        step = self._steps.get(seq)
        if step is None:
            raise KeyError(f"step {seq} is not in flight (landed already, or never scheduled)")
        rows = np.asarray(rows)
        expected = (step.slots.size, *self.store.row_shape)
        if rows.shape != expected:
            raise ValueError(f"rows of step {seq} must have shape {expected}, got {rows.shape}")
        slots = step.slots
        current = self._pending_seq[slots] == seq
        fresh = self._epoch[slots // self.block_size] <= seq
        keep = current & fresh
        self.store.write(slots[keep], rows[keep])
        self._pending_seq[slots[current]] = -1
        for row_idx, copy, positions in step.redirects:
            copy.rows[positions] = rows[row_idx]
        del self._steps[seq]

    def preempt(self, req_id: Hashable) -> None:
        """Frees a running request's blocks after copying its rows out; :meth:`resume` restarts it."""
        req = self._get(req_id, "running")
        self._detach(req)
        req.state = "preempted"

    def finish(self, req_id: Hashable) -> None:
        """Frees a request's blocks after copying its rows out; :meth:`collect` returns its routing
        once every step scheduled so far has landed."""
        self._end(req_id, "finished")

    def abort(self, req_id: Hashable) -> None:
        """Like :meth:`finish`, for a request cut short (collected with ``aborted=True``)."""
        self._end(req_id, "aborted")

    def _end(self, req_id: Hashable, state: str) -> None:
        req = self._get(req_id, "running", "preempted")
        if req.state == "running":
            self._detach(req)
        req.state = state
        req.done_seq = self._next_seq - 1

    def collect(self) -> list[FinishedRouting]:
        """Routing of the finished and aborted requests whose steps have all landed; forgets them."""
        oldest = min(self._steps) if self._steps else self._next_seq
        out = []
        for req_id, req in list(self._requests.items()):
            if req.state in ("finished", "aborted") and req.done_seq < oldest:
                if req.best is None:
                    routing = np.empty((0, *self.store.row_shape), dtype=self.store.dtype)
                else:
                    routing = req.best.rows
                out.append(FinishedRouting(req_id, routing, req.state == "aborted"))
                del self._requests[req_id]
        return out

    # ------------------------------------------------------------------------------------ queries

    @property
    def in_flight(self) -> list[int]:
        """Sequence numbers of the scheduled steps that have not landed."""
        return sorted(self._steps)

    def state(self, req_id: Hashable) -> str:
        """State of a request: running, preempted, finished or aborted (KeyError once collected)."""
        return self._get(req_id).state

    def block_refs(self, block_id: int) -> int:
        """Running requests holding ``block_id``."""
        return int(self._refs[block_id])

    # ----------------------------------------------------------------------------------- internals

    def _get(self, req_id: Hashable, *states: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        if states and req.state not in states:
            raise ValueError(f"request {req_id!r} is {req.state}; expected {' or '.join(states)}")
        return req

    def _block_list(self, name: str, block_ids: Sequence[int]) -> list[int]:
        blocks = [int(b) for b in np.asarray(block_ids, dtype=np.int64).reshape(-1).tolist()]
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"{name} must be in [0, {self.num_blocks}), got {bad[:8]}")
        return blocks

    def _detach(self, req: _Request) -> None:
        """Pre-free capture: copies the current attempt's rows out, then releases its blocks."""
        slots = slots_for(req.blocks, self.block_size, 0, req.computed)
        copy = _Copy(self.store.read_slots(slots), req.computed, req.attempt)
        pending = self._pending_seq[slots]
        for seq in np.unique(pending[pending >= 0]).tolist():
            positions = np.flatnonzero(pending == seq)
            self._steps[seq].redirects.append((self._pending_row[slots[positions]], copy, positions))
        if req.best is None or copy.length >= req.best.length:
            req.best = copy
        self._refs[req.blocks] -= 1
        req.blocks = []
        req.computed = 0
