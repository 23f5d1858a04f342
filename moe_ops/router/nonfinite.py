"""The non-finite rows counter: rows whose routing weights came out NaN or +-inf and were zeroed.

The rule (docs/routing.md, "Non-finite logits"): a row (a token) any of whose routed weights is not
finite gets weights 0 in all its routed columns - it contributes nothing, like padding - and is
counted once in the device-wide counter of kind ``"nonfinite"`` (:mod:`moe_ops._runtime.faults`),
slot 0: rows zeroed. ``route`` (the router kernel and its twin, with and without fused capture, and
the hash router) and ``replay_routing``'s forward (recorded and live rows) add to it; the kernels
with one atomic per program that zeroed a row, the twins with an atomic ``index_add_`` (under the
CPU counters' lock on the CPU). :func:`check_nonfinite_rows` reads and resets it at the caller's
next sync point. Every routed row below ``n_tokens`` is counted, padded rows included: ``route``
does not know which rows are padding, so an engine that pads with NaN rows sees them counted (pad
with zeros, as vLLM does with zeroed hidden states).
"""

from __future__ import annotations

import torch

from .._runtime.faults import check_counter, cpu_counter_lock, routing_counters

__all__ = [
    "NonFiniteRowsError",
    "check_nonfinite_rows",
    "count_zeroed_rows",
    "nonfinite_counter",
]

# the registry's kind: (1,) int32 [rows zeroed]
_KIND = "nonfinite"


class NonFiniteRowsError(RuntimeError):
    """Raised by :func:`check_nonfinite_rows` when rows' weights were non-finite (and were zeroed)."""

    def __init__(self, device: torch.device, rows: int):
        self.device, self.rows = device, rows
        super().__init__(
            f"{rows} routed row(s) on {device} had non-finite weights (a NaN or +-inf logit the "
            "method's weight rule read); their weights were written as 0 (the rows contribute "
            "nothing). Padded rows count too: pad router inputs with zeros, not NaN or inf."
        )


# Under torch.compile this runs at trace time, as plain Python (as replay_fault_counter), and the
# graph holds the counter as a constant.
@torch._dynamo.assume_constant_result
def nonfinite_counter(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The persistent (1,) int32 non-finite rows counter of ``device``: [rows zeroed]. Allocated on
    first use, then fixed for the process (a static address for CUDA graphs and inductor). The
    count is int32: it wraps after 2**31 rows without a check."""
    return routing_counters(device).nonfinite


def check_nonfinite_rows(device: torch.device | str | int | None = None, *, raise_error: bool = True) -> int:
    """Reads and resets the non-finite rows counter of ``device``; returns the rows zeroed since the
    last check (0 where the counter was never allocated).

    HOST SYNC: copies 4 bytes from the device, which waits for the work queued before it on the
    current stream. Call it where the host already synchronises, never inside a captured or
    compiled step. Lossless and thread-safe (:mod:`moe_ops._runtime.faults`): the check subtracts
    what it read, so a row counted while it runs is reported by the next check.

    Args:
        device: the device whose counter to read (default: the current CUDA device, else CPU).
        raise_error: raise :class:`NonFiniteRowsError` when any row was zeroed (after the reset).
    """
    return check_counter(_KIND, device, NonFiniteRowsError, raise_error)


def count_zeroed_rows(counter: torch.Tensor, zeroed: torch.Tensor) -> None:
    """The twins' count: ``counter[0] += zeroed.sum()`` as an atomic ``index_add_`` (on the CPU
    under the counters' lock; moe_ops._runtime.faults). ``zeroed``: (n,) bool. No host reads."""
    with cpu_counter_lock(counter.device):
        slot = torch.zeros(1, dtype=torch.int64, device=counter.device)
        counter.index_add_(0, slot, zeroed.sum().to(counter.dtype).reshape(1))
