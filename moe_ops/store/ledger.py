"""``RoutingLedger``: request-lifecycle bookkeeping on top of a :class:`SlotStore`.

The engine tells the ledger what its scheduler does (start/resume with a prefix hit, append KV
blocks, schedule tokens, reject draft tokens, preempt, finish, abort) and hands it each step's rows
when they land from the async pipeline, in any order, or tells it that a step's rows will never
come (``drop``). The ledger guarantees, for every request, that the routing it returns equals what
that request's tokens were routed to, row for row, and marks the rows that never arrived:

- Pre-free capture: before a request's blocks go back to the engine (finish, abort, preemption),
  its rows are copied out of the store into the request's private rows. Rows of steps still in
  flight are delivered there when they land (the ledger remembers which step writes which slot).
- Block reuse: each block carries the sequence number of the first step scheduled after its last
  fresh allocation; a landing step older than that is never written into the block (its rows only
  go to the private rows of the requests that computed them). So an aborted request's late rows
  cannot leak into the next owner of its blocks, whatever order steps land in.
- Preemption and resume (``policy``): ``"sampling"`` (default) keeps, for every position, the row of
  the forward that sampling used: the earliest attempt that computed it and sampled; an attempt
  preempted (or ended) before its first sample contributes no row (``add_request(prompt_len=)``
  tells the ledger when a request first samples). ``"latest"`` returns the most complete attempt
  (the latest on a tie).
- Prefix hits: a request that starts on cached blocks reads the rows the computing request wrote
  (or will write, if that step is still in flight) at those slots.
- Speculative decoding: ``reject`` takes back the last positions of a request; their rows never
  reach it, and the step that computes them again writes them.

Every channel of the store (:mod:`moe_ops.channels`: the ids, and e.g. weights beside them) takes
the same path: ``land`` takes one mapping of every channel's rows, private rows hold every channel,
and a collected request hands each back.

Everything here is host-side numpy; nothing touches a device.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from .handoff import (
    BlocksRecord,
    HandoffRecord,
    decode_blocks,
    decode_handoff,
    encode_blocks,
    encode_handoff,
    new_handoff_id,
)
from .session import Session, row_digests
from .slot_store import SlotStore, slots_for

__all__ = ["POLICIES", "FinishedRouting", "RoutingLedger", "ScheduledStep"]

# "sampling": each position's row from the earliest attempt that computed it; "latest": the most
# complete attempt's rows (the latest on a tie)
POLICIES = ("sampling", "latest")
_ENDED = ("finished", "aborted")
# handoff ids a ledger remembers beyond its held requests (a record imported twice is refused):
# 65536 ids, about 6 MB of a Python dict
_REMEMBERED_HANDOFFS = 1 << 16


@dataclass(frozen=True)
class ScheduledStep:
    """What :meth:`RoutingLedger.schedule` hands back for one step."""

    # sequence number of the step; pass it to land() (or drop()) with the step's rows
    seq: int
    # (num_tokens,) int64 KV slot of each row of the step, rows in the order of the entries;
    # read-only (a view of the ledger's own array)
    slot_mapping: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class FinishedRouting:
    """A finished (or aborted) request's routing, from :meth:`RoutingLedger.collect`."""

    req_id: Hashable
    # (num_tokens, num_layers, top_k) rows of the request's tokens [start, start + num_tokens),
    # token order; rows where missing is True hold the store's fill value
    routing: np.ndarray
    # True when the request was aborted (the routing covers the tokens the policy keeps until then:
    # under "sampling", none of an attempt that had not sampled yet)
    aborted: bool
    # (num_tokens,) bool - True where a row never arrived (its step was dropped)
    missing: np.ndarray
    # token position of routing[0]: the start given to add_request
    start: int = 0
    # channel name -> (num_tokens, *row_shape) rows of each channel of the store beside the ids,
    # same tokens and missing rows (which hold the channel's fill); empty for an ids-only store
    channels: Mapping[str, np.ndarray] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(eq=False)
class _Rows:
    # (n, num_layers, top_k) private rows of tokens [start, start + n) of one request; rows of
    # steps in flight hold the fill value until the step lands
    rows: np.ndarray
    # (n,) bool - True where the row's step was dropped (the row holds the fill value)
    missing: np.ndarray
    # redirects of steps in flight that still deliver into these rows; ready at 0
    pending: int = 0
    # channel name -> (n, *row_shape) private rows of each channel beside the ids, same tokens
    more: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(eq=False)
class _Request:
    # the engine's id of the request
    req_id: Hashable
    # rows of tokens [0, start) are never copied out nor returned
    start: int = 0
    # KV block table of the current attempt (empty while preempted)
    blocks: list[int] = field(default_factory=list)
    # tokens [0, cached) of the current attempt came from its prefix hit (cannot be rejected)
    cached: int = 0
    # tokens [0, computed) of the current attempt are scheduled or prefix-hit
    computed: int = 0
    # "running", "preempted", "finished" or "aborted"
    state: str = "running"
    # tokens of the prompt; None: not given (every attempt counts as sampling from its first token)
    prompt_len: int | None = None
    # the current attempt first samples with the step that makes tokens [0, sample_at) computed: the
    # tokens the request knows (its prompt; after an attempt that sampled, the positions it computed
    # and the token it sampled last); 0 when prompt_len is None
    sample_at: int = 0
    # the current attempt has scheduled the step that samples (True from the start if prompt_len is None)
    sampled: bool = True
    # sampling: the longest ended attempt that sampled (tokens [0, covered) have their rows in result);
    # latest: the length of the attempt whose rows are in result
    covered: int = 0
    # the rows to return, tokens [start, start + len); None while no attempt has ended
    result: _Rows | None = None
    # the session this request is a turn of (add_request(session=)), or None
    session: Hashable | None = None


@dataclass(eq=False)
class _Step:
    # the step's sequence number (its key in the ledger's in-flight steps)
    seq: int
    # (n,) read-only slot of each row
    slots: np.ndarray
    # rows of this step to deliver into private rows: (row indices, request, rows, positions in them)
    redirects: list[tuple[np.ndarray, _Request, _Rows, np.ndarray]] = field(default_factory=list)


def _locked(method):
    """Runs the method under the ledger's lock (each call is atomic against every other)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class RoutingLedger:
    """Request bookkeeping so that reads never mix requests, lose rows or return stale ones.

    Args:
        store: the :class:`SlotStore` of the KV cache's slots.
        block_size: tokens per KV block; ``store.num_slots`` must be a multiple of it.
        policy: which rows a preempted and resumed request returns. ``"sampling"`` (default): for
            every position, the rows of the forward that sampling used (whose logits were sampled,
            which an RL trainer corrects against): the earliest attempt that computed the position
            and sampled. An attempt preempted or ended before its first sample contributes no row
            (its outputs were never used: the first token is sampled by a later attempt, attending
            to that attempt's KV); later attempts only fill positions no earlier sampling attempt
            computed. The ledger knows when a request first samples from
            ``add_request(prompt_len=)``; without it every attempt counts from its first token.
            ``"latest"``: the most complete attempt (the most tokens; the latest on a tie), whether
            it sampled or not.

    Host-side only. Calls mirror an engine scheduler; see docs/transfer.md for the mapping to one.

    Thread safety: every public method and property may be called from any thread, concurrently
    (e.g. ``land``/``drop`` on an engine's output thread while its scheduler thread calls
    ``schedule``, ``finish``, ``preempt``, ``abort``, ``reject`` and ``collect``). One lock
    serialises them: each call is atomic, and a call's checks and effects see the state left by
    the calls that finished before it. What stays the caller's job is the order the engine
    defines: ``land(seq)`` after the ``schedule`` that returned ``seq``, ``finish`` after the last
    ``schedule`` of that request. Arrays the ledger hands out (``slot_mapping``, the routing and
    ``missing`` of a collected request) are never written by it again. ``store`` itself is not
    locked: while other threads call the ledger, read it only through the ledger.
    """

    def __init__(self, store: SlotStore, block_size: int, policy: str = "sampling"):
        if not isinstance(store, SlotStore):
            raise TypeError(f"store must be a SlotStore, got {type(store).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if store.num_slots % block_size:
            raise ValueError(
                f"store.num_slots={store.num_slots} must be a multiple of block_size={block_size}"
            )
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.store = store
        self.block_size = block_size
        self.policy = policy
        self.num_blocks = store.num_slots // block_size
        # a plain Lock: no public method calls another one, so nothing re-enters
        self._lock = threading.Lock()
        # refs[b]: running requests holding block b (prefix hits share a block)
        self._refs = np.zeros(self.num_blocks, dtype=np.int64)
        # epoch[b]: first step seq scheduled after b's last fresh allocation; older steps' rows are
        # never written into b
        self._epoch = np.zeros(self.num_blocks, dtype=np.int64)
        # pending_seq[slot]: seq of the latest scheduled, not yet landed write to slot (-1: none)
        self._pending_seq = np.full(store.num_slots, -1, dtype=np.int64)
        # pending_row[slot]: row of that write within its step
        self._pending_row = np.zeros(store.num_slots, dtype=np.int64)
        # no_row[slot]: the slot holds no row of its latest write (not landed since the block's fresh
        # allocation or the slot's latest schedule: in flight, dropped, or its position rejected)
        self._no_row = np.ones(store.num_slots, dtype=bool)
        self._requests: dict[Hashable, _Request] = {}
        self._steps: dict[int, _Step] = {}
        # ended requests whose rows have all arrived (or were dropped), in the order they got ready
        self._ready: dict[Hashable, _Request] = {}
        self._next_seq = 0
        # handoff ids imported, oldest first (the last _REMEMBERED_HANDOFFS): a record lands once
        self._imported: dict[int, None] = {}
        # session id -> what the ledger delivered for it (multi-turn deltas; moe_ops.store.session)
        self._sessions: dict[Hashable, Session] = {}

    # ----------------------------------------------------------------------------------- requests

    @_locked
    def add_request(
        self,
        req_id: Hashable,
        cached_blocks: Sequence[int] = (),
        num_cached_tokens: int = 0,
        start: int | None = None,
        *,
        prompt_len: int | None = None,
        session: Hashable | None = None,
    ) -> None:
        """Starts a request, optionally on a prefix-cache hit.

        Args:
            req_id: any hashable id, unused so far.
            cached_blocks: blocks of the prefix hit, shared with whoever computed them.
            num_cached_tokens: tokens covered by the hit, ``len(cached_blocks) * block_size``; less
                than ``prompt_len`` when that is given (the forward of the last prompt token samples).
            start: first token position whose row is returned (multi-turn clients ask for the rows
                after the previous turn's; SGLang's ``routed_experts_start_len``). Rows of tokens
                before it are never copied out of the store. Fixed for the request's life: every
                attempt is cut at the same position, and prefix hits do not move it. None
                (default): 0, or with ``session`` the first position the client may not hold.
            session: the multi-turn session this request is a turn of (any hashable id), or None.
                The ledger remembers what it delivered for the session (positions and a digest of
                each row, 16 bytes a token) and, unless ``start`` is given, starts the request at the
                first position whose row the client does not hold: the delivered rows the turn
                reads unchanged from the prefix cache are not sent again; positions it recomputes,
                or whose cached row differs from the delivered one, are (the client splices the
                delta: :func:`moe_ops.store.session.splice_turn`). A finished turn (not an aborted
                one) updates the session when collected; :meth:`end_session` forgets it.
            prompt_len: tokens of the prompt (vLLM's ``num_prompt_tokens``, SGLang's
                ``len(origin_input_ids)``), an int >= 1. The request first samples with the step
                that computes its last prompt token; an attempt preempted before that step, or
                ended before it, contributes no row under ``policy="sampling"``. After an attempt
                that sampled, a resumed attempt samples once it has recomputed every position that
                attempt computed plus the token it sampled last (the engine keeps sampled tokens
                across preemption, and preempts once it has the outputs of the steps it scheduled).
                None (default): the ledger cannot tell, and every attempt counts from its first
                scheduled token (what the ledger did before it took ``prompt_len``).
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already exists (state {self._requests[req_id].state})")
        if start is None and session is not None:
            start = self._session_start(session, cached_blocks, num_cached_tokens)
        start = _check_int("start", 0 if start is None else start, 0)
        if prompt_len is not None and (
            isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) or prompt_len < 1
        ):
            raise ValueError(f"prompt_len must be an int >= 1 or None, got {prompt_len!r}")
        req = _Request(req_id, start=start, session=session)
        if prompt_len is not None:
            req.prompt_len = req.sample_at = int(prompt_len)
        self._start_attempt(req, cached_blocks, num_cached_tokens)
        if session is not None:
            self._sessions.setdefault(session, Session())
        self._requests[req_id] = req

    def _session_start(self, session: Hashable, cached_blocks, num_cached_tokens) -> int:
        """The first position of a new turn whose row the session's client may not hold: at most
        what it holds, at most the prefix hit (the rest is recomputed), and the first cached row
        that differs from the delivered one (or has not landed). Reads only; no state changes."""
        sess = self._sessions.get(session)
        if sess is None or sess.delivered == 0:
            return 0
        blocks = self._block_list("cached_blocks", cached_blocks)
        counted = isinstance(num_cached_tokens, (int, np.integer)) and not isinstance(num_cached_tokens, bool)
        # (a bad num_cached_tokens is named by _start_attempt's check, which runs next)
        hit = min(int(num_cached_tokens) if counted else 0, len(blocks) * self.block_size, sess.delivered)
        slots = slots_for(blocks, self.block_size, 0, hit)
        ready = (self._pending_seq[slots] < 0) & ~self._no_row[slots]
        first_blank = int(np.argmin(ready)) if not ready.all() else hit
        arrays = [self.store.arrays[c.name][slots[:first_blank]] for c in self.store.channels]
        return sess.first_change(row_digests(arrays))

    @_locked
    def end_session(self, session: Hashable) -> None:
        """Forgets what the ledger delivered for ``session`` (its next turn, if any, starts at 0).
        KeyError for a session it does not know."""
        if session not in self._sessions:
            raise KeyError(f"unknown session {session!r}")
        del self._sessions[session]

    @_locked
    def session_delivered(self, session: Hashable) -> int:
        """Positions ``[0, n)`` whose rows the session's client holds, as far as the ledger knows
        (0 for a session it does not know)."""
        sess = self._sessions.get(session)
        return 0 if sess is None else sess.delivered

    @_locked
    def resume(self, req_id: Hashable, cached_blocks: Sequence[int] = (), num_cached_tokens: int = 0) -> None:
        """Starts a new attempt of a preempted request (recompute from token 0, or from a prefix hit).

        With ``prompt_len`` given, the hit must leave the request's last known token to compute
        (the forward that samples): ValueError otherwise.
        """
        req = self._get(req_id, "running", "preempted")
        if req.state != "preempted":
            raise ValueError(f"request {req_id!r} is {req.state}, only a preempted request can resume")
        self._start_attempt(req, cached_blocks, num_cached_tokens)
        req.state = "running"

    def _start_attempt(self, req: _Request, cached_blocks, num_cached_tokens: int) -> None:
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
        if req.prompt_len is not None and num_cached_tokens >= req.sample_at:
            # engines cap a hit at the known tokens - 1 (vLLM: num_tokens - 1, SGLang: input_len - 1)
            raise ValueError(
                f"num_cached_tokens={num_cached_tokens} must be < {req.sample_at} (the tokens request "
                f"{req.req_id!r} knows): the forward of the last one samples, so a prefix hit leaves it "
                "to compute"
            )
        self._refs[blocks] += 1
        req.blocks = list(blocks)
        req.cached = req.computed = int(num_cached_tokens)
        req.sampled = req.prompt_len is None

    # ------------------------------------------------------------------- prefill/decode handoff

    @_locked
    def export_handoff(self, req_id: Hashable, num_tokens: int | None = None) -> bytes:
        """Prefill side: the rows of a running request's positions ``[0, num_tokens)`` (default:
        every position it computed) as a handoff record (:mod:`moe_ops.store.handoff`), bytes that
        a KV connector carries beside the request's KV blocks to the decode instance, whose
        ledger continues the request with :meth:`import_handoff`.

        The rows are read from the store: export once the steps that computed them landed (or
        were dropped: such rows travel as missing). ValueError while one is in flight, for
        ``num_tokens`` beyond what the request computed, or a request id that is not a str or an
        int. The request stays as it is (finish or abort it on this instance as the engine does).
        """
        req = self._get(req_id, "running")
        n = req.computed if num_tokens is None else _check_int("num_tokens", num_tokens, 0)
        if n > req.computed:
            raise ValueError(f"num_tokens={n}: request {req_id!r} has computed {req.computed} tokens")
        rows, missing = self._landed_rows(
            slots_for(req.blocks, self.block_size, 0, n), f"rows of request {req_id!r}", "export its handoff"
        )
        record = HandoffRecord(
            req_id,
            new_handoff_id(),
            sampled=req.sampled,
            prompt_len=req.prompt_len,
            num_experts=self.store.shape.num_experts,
            channels=self.store.channels,
            rows=rows,
            missing=missing,
            computed=req.computed,
        )
        return encode_handoff(record)

    @_locked
    def import_handoff(
        self,
        req_id: Hashable,
        record: bytes,
        block_ids: Sequence[int],
        num_tokens: int | None = None,
        *,
        start: int = 0,
    ) -> None:
        """Decode side: starts request ``req_id`` on ``block_ids`` - free blocks the KV connector
        wrote the request's KV into, in block-table order - with the handoff record's rows of
        positions ``[0, num_tokens)`` at their slots, as if this ledger had computed them.

        Args:
            req_id: the request, as the prefill instance named it (the record's own id must match).
            record: :meth:`export_handoff`'s bytes.
            block_ids: the request's blocks holding the transferred KV; more are appended with
                :meth:`append_blocks` as decode goes on.
            num_tokens: the positions whose KV arrived (default: every row of the record). With
                fewer, the decode instance recomputes the rest and its own forwards' rows are the
                ones returned for them (the rows of the forward whose KV is used).
            start: as :meth:`add_request`'s.

        The request then runs as one this ledger started: ``schedule`` its next tokens, ``finish``,
        ``collect`` (prefill rows + decode rows, exactly as one instance would return them; rows
        that never arrived on the prefill side are ``missing``). Its first sample is the prefill
        attempt's when the record says it sampled (vLLM and SGLang prefill instances sample the
        first token).

        ValueError, with nothing changed, for a record that is malformed or truncated, of another
        request, from another model shape (channels, dtypes, row shapes or expert count differ from
        this store's), imported already (while its request is held, or among the last 65536
        imports), or for blocks that are held or do not cover ``num_tokens``.
        """
        rec = decode_handoff(record)
        if rec.req_id != req_id or type(rec.req_id) is not type(req_id):
            raise ValueError(f"handoff record is for request {rec.req_id!r}, not {req_id!r}")
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already exists (state {self._requests[req_id].state})")
        if rec.handoff_id in self._imported:
            raise ValueError(
                f"handoff record {rec.handoff_id:#018x} of request {req_id!r} was imported already: a record "
                "lands once"
            )
        self._check_record_shape(rec.channels, rec.num_experts, "handoff record")
        n = rec.num_tokens if num_tokens is None else _check_int("num_tokens", num_tokens, 0)
        if n > rec.num_tokens:
            raise ValueError(f"num_tokens={n}: the handoff record holds {rec.num_tokens} rows")
        start = _check_int("start", start, 0)
        blocks = self._block_list("block_ids", block_ids)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block_ids has duplicates: {blocks}")
        held = [b for b in blocks if self._refs[b] > 0]
        if held:
            raise ValueError(
                f"blocks {held} are held by running requests; the transferred KV goes into free blocks"
            )
        if n > len(blocks) * self.block_size:
            raise ValueError(
                f"num_tokens={n} needs {-(-n // self.block_size)} blocks of {self.block_size}, "
                f"got {len(blocks)}"
            )
        self._refs[blocks] = 1
        self._no_row[self._block_slots(blocks)] = True  # positions past n: no row until computed
        self._write_fresh(
            blocks,
            slots_for(blocks, self.block_size, 0, n),
            {k: v[:n] for k, v in rec.rows.items()},
            rec.missing[:n],
        )
        req = _Request(req_id, start=start, blocks=list(blocks), cached=n, computed=n)
        if rec.prompt_len is not None:
            req.prompt_len = req.sample_at = rec.prompt_len
            req.sampled = rec.sampled
            if rec.sampled:  # it knows the positions the prefill computed and the token it sampled
                req.sample_at = max(req.sample_at, rec.computed + 1)
        self._requests[req_id] = req
        self._imported[rec.handoff_id] = None
        if len(self._imported) > _REMEMBERED_HANDOFFS:
            del self._imported[next(iter(self._imported))]

    # -------------------------------------------------------------------------- KV offload tiers

    @_locked
    def offload_blocks(self, block_ids: Sequence[int]) -> bytes:
        """KV offload: the rows of whole blocks whose KV the engine copies to a lower tier (CPU
        memory, disk, a remote cache), as a blocks record (:mod:`moe_ops.store.handoff`, ``MOEB``)
        that the tier keeps beside the KV; :meth:`load_blocks` puts them back wherever the KV is
        loaded. Reads only: the blocks stay as they are, held or cached (the engine frees and reuses
        them as it does; a later fresh allocation clears them here).

        ValueError while a step that writes one of their slots is in flight (offload once it lands
        or is dropped: a dropped row travels as missing), for a block twice or out of range."""
        blocks = self._block_list("block_ids", block_ids)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block_ids has duplicates: {blocks}")
        rows, missing = self._landed_rows(
            self._block_slots(blocks), f"rows of blocks {blocks[:8]}", "offload them"
        )
        record = BlocksRecord(
            self.block_size, self.store.shape.num_experts, self.store.channels, rows, missing
        )
        return encode_blocks(record)

    @_locked
    def load_blocks(self, block_ids: Sequence[int], record: bytes) -> None:
        """KV loaded back from a lower tier into free blocks ``block_ids`` (as many as the record
        holds, in its order; other ids than the ones offloaded, as the engine allocates): their rows
        come back with the KV, so a request that then hits these blocks
        (``add_request(cached_blocks=...)``) reads the rows of the forward that computed the KV -
        whatever ran in the blocks it left meanwhile. Call it when the engine decides to load (before
        the request that hits the blocks is added or resumed). A block dropped from every tier is
        recomputed instead: its new forward's rows land as any step's (nothing to call).

        ValueError, with nothing changed, for a malformed record, one from another model shape or
        block size, a count of blocks that differs, a block held by a running request (its rows are
        in use: load into free blocks), a block twice."""
        rec = decode_blocks(record)
        self._check_record_shape(rec.channels, rec.num_experts, "blocks record")
        if rec.block_size != self.block_size:
            raise ValueError(
                f"blocks record has blocks of {rec.block_size} tokens, this ledger {self.block_size}"
            )
        blocks = self._block_list("block_ids", block_ids)
        if len(blocks) != rec.num_blocks:
            raise ValueError(
                f"the blocks record holds {rec.num_blocks} blocks, block_ids names {len(blocks)}"
            )
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block_ids has duplicates: {blocks}")
        held = [b for b in blocks if self._refs[b] > 0]
        if held:
            raise ValueError(
                f"blocks {held} are held by running requests: load a lower tier's KV and rows into free "
                "blocks, before the request that hits them starts"
            )
        self._write_fresh(blocks, self._block_slots(blocks), rec.rows, rec.missing)

    def _block_slots(self, blocks: list[int]) -> np.ndarray:
        """Every slot of ``blocks``, block after block."""
        bs = self.block_size
        return (np.asarray(blocks, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)

    def _landed_rows(self, slots: np.ndarray, what: str, then: str) -> tuple[dict, np.ndarray]:
        """Every channel's rows at ``slots`` and which hold no row (copies), for a record that
        carries them away; ValueError while a step that writes one is in flight."""
        waiting = self._pending_seq[slots]
        if (waiting >= 0).any():
            seqs = sorted(set(waiting[waiting >= 0].tolist()))
            raise ValueError(f"{what} are in flight (steps {seqs[:8]}): {then} once they land or are dropped")
        rows = {c.name: self.store.arrays[c.name][slots] for c in self.store.channels}
        return rows, self._no_row[slots].copy()

    def _check_record_shape(self, channels, num_experts: int, what: str) -> None:
        """ValueError unless a record's channels and expert count are this store's."""
        mine = [(c.name, c.dtype.str, c.row_shape) for c in self.store.channels]
        theirs = [(c.name, c.dtype.str, c.row_shape) for c in channels]
        if theirs != mine or num_experts != self.store.shape.num_experts:
            raise ValueError(
                f"{what} is from another model shape: channels {theirs} of {num_experts} experts, "
                f"this store holds {mine} of {self.store.shape.num_experts}"
            )

    def _write_fresh(self, blocks: list[int], slots: np.ndarray, rows: dict, missing: np.ndarray) -> None:
        """A record's rows into freshly filled blocks: no step scheduled before now writes into them
        (an older step in flight lands nowhere here), and a copy-out never waits for one."""
        self._epoch[blocks] = self._next_seq
        self._pending_seq[slots] = -1
        for channel in self.store.channels:
            self.store.arrays[channel.name][slots] = rows[channel.name]
        self._no_row[slots] = missing

    @_locked
    def append_blocks(self, req_id: Hashable, block_ids: Sequence[int]) -> None:
        """Appends freshly allocated blocks to a running request's block table.

        A fresh block may hold another request's old rows (or have old steps in flight): from now
        on no step scheduled before this call writes into it, and its old rows are never read.
        ValueError if a block is held by a running request.
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
        self._no_row[self._block_slots(blocks)] = True
        req.blocks.extend(blocks)

    @_locked
    def schedule(self, entries: Sequence[tuple[Hashable, int]]) -> ScheduledStep:
        """Schedules one step: ``entries`` are ``(req_id, num_new_tokens)`` in batch-row order.

        Each request's next ``num_new_tokens`` tokens (after those already computed) must be
        covered by its blocks. Draft tokens of speculative decoding are scheduled like any other
        (take back the rejected ones with :meth:`reject`). The entry that makes every token the
        request knows computed is its attempt's first sample (see ``prompt_len``). Returns the
        step's sequence number and a read-only slot mapping; the rows the step produces must be
        passed to :meth:`land` in this order (or the step given up with :meth:`drop`).
        """
        bs = self.block_size
        parts = []
        short = []  # slots of consecutive short entries, as Python ints
        plan = []
        seen = set()
        for req_id, n in entries:
            req = self._get(req_id, "running")
            if req_id in seen:
                raise ValueError(f"request {req_id!r} appears twice in one step")
            seen.add(req_id)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"num_new_tokens of {req_id!r} must be an int >= 0, got {n!r}")
            n = int(n)
            c, need = req.computed, req.computed + n
            if need > len(req.blocks) * bs:
                raise IndexError(
                    f"request {req_id!r}: tokens [{c}, {need}) need "
                    f"{-(-need // bs)} blocks, it holds {len(req.blocks)}; append blocks first"
                )
            if n <= 32:
                # decode-sized: plain arithmetic (blocks were range-checked by append_blocks);
                # slots_for's array checks cost ~5 us per entry: 340 us for a 64-request decode step
                # on a 2-core CPU, 51 us this way
                blocks = req.blocks
                short.extend(blocks[t // bs] * bs + t % bs for t in range(c, need))
            else:
                if short:
                    parts.append(np.array(short, dtype=np.int64))
                    short = []
                parts.append(slots_for(req.blocks, bs, c, n))
            plan.append((req, n))
        if short:
            parts.append(np.array(short, dtype=np.int64))
        slots = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.empty(0, np.int64)
        # the engine gets a view: a read-only view of a read-only array cannot be made writable
        slots.flags.writeable = False
        seq = self._next_seq
        self._next_seq += 1
        for req, n in plan:
            req.computed += n
            if not req.sampled and req.computed >= req.sample_at:
                req.sampled = True
        self._pending_seq[slots] = seq
        self._pending_row[slots] = np.arange(slots.size, dtype=np.int64)
        self._no_row[slots] = True  # until this step lands
        self._steps[seq] = _Step(seq, slots)
        return ScheduledStep(seq, slots.view())

    @_locked
    def land(self, seq: int, rows: np.ndarray | Mapping[str, np.ndarray]) -> None:
        """Delivers step ``seq``'s rows (any order of steps): (num_tokens, num_layers, top_k) ids,
        or, for a store with channels beside the ids, a mapping of every channel's name to its
        rows (``SnapshotHandle.results()``).

        Every row is checked like :meth:`SlotStore.write` checks them (integer dtype, values the
        store's dtype holds, every channel present and of its dtype), also rows that only go to
        private copies; nothing changes when it raises. Rows go into the store at slots whose
        block was not freshly reallocated after the step was scheduled and that no later step
        rewrites (nor :meth:`reject` took back), and into the private rows that were waiting for
        them (requests freed while the step was in flight).
        """
        step = self._steps.get(seq)
        if step is None:
            raise KeyError(f"step {seq} is not in flight (landed already, dropped, or never scheduled)")
        checked = self.store._check_channel_rows(rows, step.slots.size, name=f"rows of step {seq}")
        rows = checked.pop("ids")  # checked: the other channels' rows
        arrays = self.store.arrays
        slots = step.slots
        current = self._pending_seq[slots] == seq
        keep = current & (self._epoch[slots // self.block_size] <= seq)
        if keep.all():  # the usual case: no boolean gather of the rows
            self.store.data[slots] = rows
            for name, values in checked.items():
                arrays[name][slots] = values
            self._no_row[slots] = False
        else:
            kept = slots[keep]
            self.store.data[kept] = rows[keep]
            for name, values in checked.items():
                arrays[name][kept] = values[keep]
            self._no_row[kept] = False
        self._pending_seq[slots[current]] = -1
        for row_idx, req, dst, positions in step.redirects:
            dst.rows[positions] = rows[row_idx]
            for name, values in checked.items():
                dst.more[name][positions] = values[row_idx]
            self._delivered(req, dst)
        del self._steps[seq]

    @_locked
    def drop(self, seq: int) -> None:
        """Gives up step ``seq``: its rows will never arrive (its snapshot raised, its handle was lost).

        The step's rows read as the store's fill value, and every request that holds one returns
        it marked in :attr:`FinishedRouting.missing`; requests waiting only for this step are then
        delivered by :meth:`collect`, and no other request is affected. The store's slots that
        the step would have written now hold the fill value. KeyError if the step is not in flight.
        """
        step = self._steps.get(seq)
        if step is None:
            raise KeyError(f"step {seq} is not in flight (landed already, dropped, or never scheduled)")
        slots = step.slots
        current = self._pending_seq[slots] == seq
        kept = slots[current & (self._epoch[slots // self.block_size] <= seq)]
        self.store.data[kept] = self.store.fill  # no_row[kept] stays True: set by schedule
        extra = self.store.channels[1:]
        for channel in extra:
            self.store.arrays[channel.name][kept] = channel.fill
        self._pending_seq[slots[current]] = -1
        for _, req, dst, positions in step.redirects:
            dst.rows[positions] = self.store.fill
            for channel in extra:
                dst.more[channel.name][positions] = channel.fill
            dst.missing[positions] = True
            self._delivered(req, dst)
        del self._steps[seq]

    @_locked
    def reject(self, req_id: Hashable, num_tokens: int) -> None:
        """Takes back the last ``num_tokens`` scheduled positions of a running request (speculative
        decoding: the draft tokens the verify step rejected).

        Their rows never reach the request, also when their step lands after this call, under
        either policy; the request's next scheduled tokens start at the first rejected position,
        and the step that computes those positions again writes them. ``num_tokens`` may be at
        most the positions scheduled in the current attempt (prefix-hit tokens are not scheduled).
        The blocks stay with the request. Positions a prefix hit of another request shares are not
        to be rejected (engines cache only blocks of verified tokens), nor positions a sample used
        (the attempt stays sampled).
        """
        req = self._get(req_id, "running")
        scheduled = req.computed - req.cached
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise ValueError(f"num_tokens must be an int, got {num_tokens!r}")
        if not 0 <= num_tokens <= scheduled:
            raise ValueError(
                f"num_tokens must be in [0, {scheduled}] (positions of request {req_id!r} scheduled in "
                f"this attempt), got {num_tokens}"
            )
        n = int(num_tokens)
        slots = slots_for(req.blocks, self.block_size, req.computed - n, n)
        self._pending_seq[slots] = -1  # a late landing of their step leaves these slots alone
        self._no_row[slots] = True
        req.computed -= n

    @_locked
    def preempt(self, req_id: Hashable) -> None:
        """Frees a running request's blocks after copying out the rows the policy keeps (none of an
        attempt that has not sampled yet, under ``"sampling"``); :meth:`resume` restarts it."""
        req = self._get(req_id, "running")
        self._detach(req)
        req.state = "preempted"

    @_locked
    def finish(self, req_id: Hashable) -> None:
        """Frees a request's blocks after copying its rows out; :meth:`collect` returns its routing
        once every row it holds has landed (or its step was dropped)."""
        self._end(req_id, "finished")

    @_locked
    def abort(self, req_id: Hashable) -> None:
        """Like :meth:`finish`, for a request cut short (collected with ``aborted=True``)."""
        self._end(req_id, "aborted")

    def _end(self, req_id: Hashable, state: str) -> None:
        req = self._get(req_id, "running", "preempted")
        if req.state == "running":
            self._detach(req)
        req.state = state
        if req.result is None or req.result.pending == 0:
            self._ready[req_id] = req

    @_locked
    def collect(self) -> list[FinishedRouting]:
        """Routing of the finished and aborted requests whose rows have all arrived or were
        dropped, in the order they got ready; forgets them.

        A request does not wait for steps that hold none of its rows. ``routing`` and ``missing``
        are the request's private arrays (rows from ``start`` on only, no copy made here).
        """
        out = []
        for req in self._ready.values():
            result = req.result if req.result is not None else self._rows(0)
            channels = MappingProxyType(result.more)
            if req.session is not None and req.state == "finished" and req.session in self._sessions:
                digests = row_digests([result.rows, *(result.more[c.name] for c in self.store.channels[1:])])
                self._sessions[req.session].record(req.start, digests, result.missing)
            out.append(
                FinishedRouting(
                    req.req_id, result.rows, req.state == "aborted", result.missing, req.start, channels
                )
            )
            del self._requests[req.req_id]
        self._ready.clear()
        return out

    # ------------------------------------------------------------------------------------ queries

    @property
    @_locked
    def in_flight(self) -> list[int]:
        """Sequence numbers of the scheduled steps that have not landed nor been dropped."""
        return sorted(self._steps)

    @_locked
    def state(self, req_id: Hashable) -> str:
        """State of a request: running, preempted, finished or aborted (KeyError once collected)."""
        return self._get(req_id).state

    @_locked
    def block_refs(self, block_id: int) -> int:
        """Running requests holding ``block_id``."""
        return int(self._refs[block_id])

    @_locked
    def held_requests(self) -> list[Hashable]:
        """Ids of the requests the ledger holds (not collected yet), in the order they were added."""
        return list(self._requests)

    @_locked
    def pending_slots(self) -> int:
        """Slots whose latest scheduled write has not landed (nor been dropped or rejected)."""
        return int(np.count_nonzero(self._pending_seq >= 0))

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

    def _delivered(self, req: _Request, dst: _Rows) -> None:
        """One redirect into ``dst`` was delivered; an ended request whose rows these are is ready
        once none is left."""
        dst.pending -= 1
        if dst.pending == 0 and dst is req.result and req.state in _ENDED:
            self._ready[req.req_id] = req

    def _rows(self, n: int) -> _Rows:
        """Private rows of ``n`` tokens, every channel (written by _capture before they are read)."""
        row_shape = self.store.row_shape
        rows = _Rows(np.empty((n, *row_shape), dtype=self.store.dtype), np.zeros(n, dtype=bool))
        for channel in self.store.channels[1:]:
            rows.more[channel.name] = np.empty((n, *channel.row_shape), dtype=channel.dtype)
        return rows

    def _detach(self, req: _Request) -> None:
        """Pre-free capture: copies the attempt's rows that the policy keeps, then frees its blocks."""
        end = req.computed
        if req.sampled:
            # the engine keeps the sampled tokens: the next attempt samples after recomputing these
            # positions and the token sampled last
            req.sample_at = max(req.sample_at, end + 1)
        if self.policy == "sampling":
            # an attempt that never sampled contributes nothing (no copy, no redirect): no sampled
            # token used its forward
            if req.sampled:
                # earlier sampling attempts own tokens [0, covered): only the tokens after them are copied
                lo = max(req.covered, req.start)
                if end > lo:
                    n = end - req.start
                    if req.result is None:
                        req.result = self._rows(n)
                    else:  # grow in place: redirects into the same _Rows keep their positions
                        old = req.result
                        new = self._rows(n)
                        new.rows[: old.rows.shape[0]] = old.rows
                        new.missing[: old.missing.shape[0]] = old.missing
                        for name, values in old.more.items():
                            new.more[name][: values.shape[0]] = values
                        old.rows, old.missing, old.more = new.rows, new.missing, new.more
                    self._capture(req, req.result, lo, end)
                req.covered = max(req.covered, end)
        elif req.result is None or end >= req.covered:
            # a shorter attempt than the kept one is never returned: it is not even copied
            req.result = self._rows(max(end - req.start, 0))
            if end > req.start:
                self._capture(req, req.result, req.start, end)
            req.covered = end
        self._refs[req.blocks] -= 1
        req.blocks = []
        req.computed = req.cached = 0

    def _capture(self, req: _Request, dst: _Rows, lo: int, end: int) -> None:
        """Copies the current attempt's rows of tokens [lo, end) into ``dst`` (which holds tokens
        from ``req.start`` on); rows of steps in flight are redirected to it."""
        slots = slots_for(req.blocks, self.block_size, lo, end - lo)
        first = lo - req.start
        out = dst.rows[first : first + slots.size]
        # mode="clip" writes straight into out (mode="raise" buffers a second copy); slots_for only
        # yields slots of valid blocks
        np.take(self.store.data, slots, axis=0, out=out, mode="clip")
        extra = self.store.channels[1:]
        for channel in extra:
            np.take(
                self.store.arrays[channel.name],
                slots,
                axis=0,
                out=dst.more[channel.name][first : first + slots.size],
                mode="clip",
            )
        pending = self._pending_seq[slots]
        waiting = pending >= 0
        no_row = self._no_row[slots] & ~waiting
        dst.missing[first : first + slots.size] = no_row
        blank = no_row | waiting
        if blank.any():
            out[blank] = self.store.fill
            for channel in extra:
                dst.more[channel.name][first : first + slots.size][blank] = channel.fill
        if waiting.any():
            for seq in np.unique(pending[waiting]).tolist():
                idx = np.flatnonzero(pending == seq)
                self._steps[seq].redirects.append((self._pending_row[slots[idx]], req, dst, idx + first))
                dst.pending += 1
