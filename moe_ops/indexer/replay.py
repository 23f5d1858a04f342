"""The trainer's side of indexer records: force the recorded top-k positions, build the attention
mask from them, and measure how far the live indexer strays from the record.

* :func:`replay_indexer` - per query row, the recorded positions where the row holds a valid record,
  the live indexer's where it holds none (all -1: a token the rollout did not record) or a faulty
  one (a position outside the row's keys, or repeated), which is counted in the replay fault counter
  (:func:`moe_ops.check_faults`) exactly as a faulty routing row is;
* :func:`indexer_mask` - the (..., num_keys) bool mask of the chosen keys (True: attend), what
  transformers' eager/SDPA DSA path scatters itself, with -1 (no position) selecting nothing;
* :func:`indexer_mismatch` - ``routing_mismatch``'s counterpart for sets of k positions (k = 512 -
  2048: by sorting and binary search, not the k x k compare ``routing_mismatch`` uses for k = 8).

All three run on the device in fixed shapes (no host reads, no boolean indexing), so they trace
under ``torch.compile(fullgraph=True)`` and capture in CUDA graphs. The positions are sets: column
order never matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._runtime.faults import cpu_counter_lock
from .._runtime.library import destination_op
from ..replay.kernels import REPLAY_FAULT_OUT_OF_RANGE, REPLAY_FAULT_REPEATED, add_count
from ..replay.op import replay_fault_counter

__all__ = ["IndexerMismatch", "indexer_mask", "indexer_mismatch", "replay_indexer"]

_POSITION_DTYPES = (torch.int32, torch.int64)
# sorts after every real position (< 2**31)
_NONE = 1 << 31


def _as_tensor(name: str, t: Any) -> torch.Tensor:
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a numpy array, got {type(t).__name__}")
    if t.dtype not in _POSITION_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() < 2 or t.shape[-1] < 1:
        raise ValueError(f"{name} must be (..., k) with k >= 1, got shape {tuple(t.shape)}")
    return t


def _sorted_sets(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., k) as int64 rows sorted ascending, -1 (and anything negative) as _NONE, last."""
    t = t.to(torch.int64)
    return torch.where(t >= 0, t, _NONE).sort(dim=-1).values


def _record_faults(errors: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    """``errors[0] += rows``, ``errors[1] |= bits`` (0-d int32 each) in the replay fault counter, on
    the device; the CPU counters' lock held as the replay twins hold it (an op, so that
    torch.compile sees a mutation rather than a lock it cannot trace)."""
    with cpu_counter_lock(errors.device):
        add_count(errors, rows)
        errors[1:2].bitwise_or_(bits.to(errors.dtype).reshape(1))


# one device-neutral body (registered for CUDA, and for the CPU through cpu=None)
_record_faults_op = destination_op("indexer_replay_faults_", mutates=("errors",), cuda=_record_faults)


def replay_indexer(
    live: torch.Tensor,
    recorded: torch.Tensor,
    *,
    kv_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The positions the sparse attention reads: ``recorded``'s row where it holds a valid record,
    else ``live``'s.

    Args:
        live: (..., k) int32/int64 - the trainer's own indexer top-k for the same query rows.
        recorded: ``live``'s shape, int32/int64, same device - the rollout's record (a replayer's
            rows; -1 is "no position"). A row that is all -1 holds no record: the live row is used,
            no fault. A row with a position below -1, at or beyond its key count, or repeated is
            faulty: the live row is used, and the row is counted (``REPLAY_FAULT_OUT_OF_RANGE`` /
            ``REPLAY_FAULT_REPEATED`` in the replay fault counter, which
            :func:`moe_ops.check_faults` reads).
        kv_lens: (...) int32/int64 (``live``'s shape without k), same device - the keys each query
            row may read (its causal length), read on the device; None: no upper bound.

    Returns a new tensor of ``recorded``'s dtype. No host reads, no synchronisation.
    """
    live = _as_tensor("live", live)
    recorded = _as_tensor("recorded", recorded)
    if live.shape != recorded.shape:
        raise ValueError(f"live must have recorded's shape {tuple(recorded.shape)}, got {tuple(live.shape)}")
    if live.device != recorded.device:
        raise ValueError(f"live must be on recorded's device {recorded.device}, got {live.device}")
    pos = recorded.to(torch.int64)
    bad = pos < -1
    if kv_lens is not None:
        if not isinstance(kv_lens, torch.Tensor) or kv_lens.dtype not in _POSITION_DTYPES:
            raise ValueError("kv_lens must be an int32/int64 torch.Tensor or None")
        if kv_lens.shape != recorded.shape[:-1] or kv_lens.device != recorded.device:
            raise ValueError(
                f"kv_lens must be {tuple(recorded.shape[:-1])} on {recorded.device} (one key count per "
                f"row), got {tuple(kv_lens.shape)} on {kv_lens.device}"
            )
        bad = bad | ((pos >= kv_lens.to(torch.int64)[..., None]) & (pos != -1))
    bad = bad | (pos > _NONE - 1)  # beyond int32: no key of any engine
    ordered = _sorted_sets(pos)
    repeated = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != _NONE)).any(-1)
    out_of_range = bad.any(-1)
    has_record = (pos != -1).any(-1)
    faulty = has_record & (out_of_range | repeated)
    use = has_record & ~faulty
    bits = (out_of_range & has_record).any().to(torch.int32) * REPLAY_FAULT_OUT_OF_RANGE
    bits = bits | (repeated & has_record).any().to(torch.int32) * REPLAY_FAULT_REPEATED
    _record_faults_op(replay_fault_counter(recorded.device), faulty.sum().to(torch.int32), bits)
    return torch.where(use[..., None], recorded, live.to(recorded.dtype))


def indexer_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(..., num_keys) bool: True at the keys ``positions`` (..., k) chose (what the sparse
    attention reads), False elsewhere. -1 selects nothing; so does any position outside
    ``[0, num_keys)`` - pass recorded rows through :func:`replay_indexer`, which counts those.
    One scatter on the device; no host reads."""
    positions = _as_tensor("positions", positions)
    if isinstance(num_keys, bool) or not isinstance(num_keys, (int, torch.SymInt)) or num_keys < 1:
        raise ValueError(f"num_keys must be an int >= 1, got {num_keys!r}")
    pos = positions.to(torch.int64)
    spill = torch.where((pos >= 0) & (pos < num_keys), pos, num_keys)  # one spare column, cut off
    mask = torch.zeros((*pos.shape[:-1], num_keys + 1), dtype=torch.bool, device=pos.device)
    mask.scatter_(-1, spill, True)
    return mask[..., :num_keys]


@dataclass(frozen=True)
class IndexerMismatch:
    """Per indexer layer, over the counted rows (valid, with a record): how the live top-k sets
    differ from the recorded ones. Tensors on the inputs' device; NaN where a layer counted nothing."""

    # (num_layers,) float32 in [0, 1]: recorded positions the live indexer did not choose, over all
    # recorded positions of the counted rows (position-weighted)
    differ: torch.Tensor
    # (num_layers,) float32 in [0, 1]: fraction of counted rows whose sets differ at all
    changed: torch.Tensor
    # (num_layers,) int64: rows counted per layer
    num_tokens: torch.Tensor


def indexer_mismatch(
    recorded: torch.Tensor | np.ndarray,
    live: torch.Tensor | np.ndarray,
    *,
    valid: torch.Tensor | np.ndarray | None = None,
) -> IndexerMismatch:
    """Compares two indexer records of the same query rows, per layer, as sets of positions.

    Args:
        recorded: (n, k) or (n, num_layers, k) int32/int64 - the rollout's record; an all -1 row
            holds none and is not counted. Positions within a row are distinct (the capture stores
            a repeat as -1).
        live: the same shape - the trainer's own indexer top-k (distinct within a row).
        valid: (n,) bool or None - rows to count (padding False).

    Sorting and one batched binary search: temporaries of (n, num_layers, k) elements, no host
    reads. Raises ValueError/TypeError naming the argument.
    """
    recorded = _as_tensor("recorded", recorded)
    live = _as_tensor("live", live)
    if recorded.dim() not in (2, 3):
        raise ValueError(f"recorded must be (n, k) or (n, num_layers, k), got shape {tuple(recorded.shape)}")
    if live.shape != recorded.shape:
        raise ValueError(f"live must have recorded's shape {tuple(recorded.shape)}, got {tuple(live.shape)}")
    if live.device != recorded.device:
        raise ValueError(f"live must be on recorded's device {recorded.device}, got {live.device}")
    if recorded.dim() == 2:
        recorded, live = recorded[:, None], live[:, None]
    n = recorded.shape[0]
    if valid is not None:
        valid = torch.from_numpy(valid) if isinstance(valid, np.ndarray) else valid
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(valid.shape) != (n,):
            raise ValueError(f"valid must be a ({n},) bool tensor (one flag per row)")
        if valid.device != recorded.device:
            raise ValueError(f"valid must be on recorded's device {recorded.device}, got {valid.device}")
    rec = recorded.to(torch.int64)
    live_sorted = _sorted_sets(live).contiguous()
    is_pos = rec >= 0
    probe = torch.where(is_pos, rec, _NONE).contiguous()
    at = torch.searchsorted(live_sorted, probe).clamp(max=live_sorted.shape[-1] - 1)
    found = (live_sorted.gather(-1, at) == probe) & is_pos
    shared = found.sum(-1)  # (n, L)
    size_rec = is_pos.sum(-1)
    size_live = (live_sorted != _NONE).sum(-1)
    counted = size_rec > 0
    if valid is not None:
        counted = counted & valid[:, None]
    weight = counted.to(torch.float32)
    changed = ~((shared == size_rec) & (shared == size_live))
    total = (size_rec.to(torch.float32) * weight).sum(0)
    return IndexerMismatch(
        differ=((size_rec - shared).to(torch.float32) * weight).sum(0) / total,
        changed=(changed.to(torch.float32) * weight).sum(0) / weight.sum(0),
        num_tokens=weight.sum(0).to(torch.int64),
    )
