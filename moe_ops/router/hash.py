"""Hash routing's faults: the hash fault counter and :func:`check_hash_errors`.

A hash layer (DeepSeek-V4's first MoE layers) takes its experts from a frozen table,
``ids = hash_table[token_ids]``; the logits only weigh them, by the routing method's weight rule
(docs/routing.md, "Hash routing"). ``route(..., hash_table=, token_ids=)`` runs it through the ops
``moe_ops::route_hash_`` and ``moe_ops::route_hash_capture_`` (:mod:`moe_ops.router.op`, kernel and
twin in :mod:`moe_ops.router.hash_kernels`); its arguments are checked with every other routing
argument (:func:`moe_ops.router.args.check_hash_args`).

Faults (a token id outside ``[0, vocab)``, a table entry outside ``[0, num_experts)``) cannot raise
without a host sync: the row's ids are written as -1 and its weights 0, and the row is counted in the
device-wide hash fault counter (:mod:`moe_ops._runtime.faults`, kind ``"hash"``), read by
:func:`check_hash_errors` (or ``moe_ops.check_faults``) at the caller's next sync point.
"""

from __future__ import annotations

import torch

from .._runtime.faults import check_counter, routing_counters
from ._hash import HASH_FAULT_ENTRY, HASH_FAULT_TOKEN_ID
from .args import HASH_ID_DTYPES, check_hash_args

__all__ = [
    "HASH_FAULT_ENTRY",
    "HASH_FAULT_TOKEN_ID",
    "HASH_ID_DTYPES",
    "HashFaultError",
    "check_hash_args",
    "check_hash_errors",
    "hash_fault_counter",
]

_KIND = "hash"
_FAULT_NAMES = {
    HASH_FAULT_TOKEN_ID: "a token id outside [0, vocab) of hash_table",
    HASH_FAULT_ENTRY: "a hash_table entry outside [0, num_experts)",
}


class HashFaultError(RuntimeError):
    """Raised by :func:`check_hash_errors` when hash rows were faulty (ids -1, weights 0)."""

    def __init__(self, device: torch.device, rows: int, flags: int):
        self.device, self.rows, self.flags = device, rows, flags
        names = "; ".join(name for bit, name in _FAULT_NAMES.items() if flags & bit) or "no fault bits"
        super().__init__(
            f"{rows} hash-routed row(s) on {device} were faulty ({names}); their ids were written as "
            "-1 and their weights as 0. token_ids do not belong to hash_table's vocabulary, or the "
            "table does not match the router's num_experts."
        )


# Under torch.compile this runs at trace time, as plain Python (as replay_fault_counter).
@torch._dynamo.assume_constant_result
def hash_fault_counter(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The persistent (2,) int32 hash fault counter of ``device``: [faulty rows, OR of
    HASH_FAULT_* bits]. Allocated on first use, then fixed for the process (a static address)."""
    return routing_counters(device).hash


def check_hash_errors(device: torch.device | str | int | None = None, *, raise_error: bool = True) -> int:
    """Reads and resets the hash fault counter of ``device``; returns the faulty rows counted since
    the last check (0 where the counter was never allocated).

    HOST SYNC: copies 8 bytes from the device. Call it where the host already synchronises, never
    inside a captured or compiled step. Lossless and thread-safe (:mod:`moe_ops._runtime.faults`).

    Args:
        device: the device whose counter to read (default: the current CUDA device, else CPU).
        raise_error: raise :class:`HashFaultError` when any row was faulty (after the reset).
    """
    return check_counter(_KIND, device, HashFaultError, raise_error)
