"""Routing-mismatch metrics: how far the trainer's live routing strays from the rollout's record.

Set semantics: a token's routing is the *set* of its experts, so column order never matters and an
id listed twice counts once. A recorded row without a record (all -1: a last token, padding, a
dropped step; or all ``no_record``) is no routing at all, so it is left out of every count of its
layer. All arithmetic stays on the device in fixed shapes (no boolean indexing, no ``.item()``), so
the metrics trace under ``torch.compile(fullgraph=True)`` and capture in CUDA graphs; the host waits
only when the caller reads a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RoutingMismatch", "routing_mismatch"]

_ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class RoutingMismatch:
    """Per-layer mismatch between recorded and live routing, over the counted tokens of each layer:
    the valid tokens whose recorded row in that layer holds a record.

    Every tensor is on the inputs' device; reading one (``float(m.disjoint.max())``) is a host sync.
    With no counted token the fractions are NaN (0 / 0), never a made-up 0.
    """

    # (num_layers,) float32 in [0, 1]: fraction of counted tokens whose expert set differs
    changed: torch.Tensor
    # (num_layers,) float32 in [0, 1]: mean over counted tokens of |recorded & live| / top_k
    overlap: torch.Tensor
    # (num_layers,) float32 in [0, 1]: fraction of counted tokens with no expert in common
    disjoint: torch.Tensor
    # (num_layers,) int64: tokens counted per layer, valid and recorded (each fraction's denominator)
    num_tokens: torch.Tensor
    # Weight metrics, only where routing_mismatch was given recorded_weights and live_weights (else
    # None), over the counted tokens whose expert SET matched (changed False), each recorded expert
    # compared with the live weight of the same expert:
    # (num_layers,) float32 >= 0: mean |recorded - live| over those tokens' experts
    weight_mean_abs: torch.Tensor | None = None
    # (num_layers,) float32 >= 0: the largest |recorded - live| among them
    weight_max_abs: torch.Tensor | None = None
    # (num_layers,) int64 <= num_tokens: the tokens compared (each weight metric's population)
    weight_num_tokens: torch.Tensor | None = None


def _tensor(t: Any) -> Any:
    """A numpy array as a CPU tensor (no copy); anything else unchanged."""
    return torch.from_numpy(t) if isinstance(t, np.ndarray) else t


def _check(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a numpy array, got {type(t).__name__}")
    if t.dim() not in (2, 3):
        raise ValueError(f"{name} must be (n, top_k) or (n, num_layers, top_k), got shape {tuple(t.shape)}")
    if t.dtype not in _ID_DTYPES:
        raise ValueError(f"{name} must be uint8, int8, int16, int32 or int64, got {t.dtype}")
    if t.shape[-1] < 1:
        raise ValueError(
            f"{name} must have at least one expert column (top_k >= 1), got shape {tuple(t.shape)}"
        )
    return t


def _members(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., k) bool: ``a[..., i]`` occurs in ``b[..., :]``. One compare per column of ``b``: k
    passes over (..., k) instead of one (..., k, k) temporary."""
    hit = a == b[..., :1]
    for j in range(1, b.shape[-1]):
        hit = hit | (a == b[..., j : j + 1])
    return hit


def _first_occurrence(a: torch.Tensor) -> torch.Tensor:
    """(..., k) bool: ``a[..., i]`` differs from every ``a[..., j]``, j < i (each distinct id once)."""
    cols = [torch.ones_like(a[..., 0], dtype=torch.bool)]
    for i in range(1, a.shape[-1]):
        cols.append(~(a[..., :i] == a[..., i : i + 1]).any(-1))
    return torch.stack(cols, dim=-1)


_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_weights(name: str, t: object, ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a numpy array, got {type(t).__name__}")
    if tuple(t.shape) != tuple(ids.shape):
        raise ValueError(
            f"{name} must have the ids' shape {tuple(ids.shape)} (one weight per id), got {tuple(t.shape)}"
        )
    if t.dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if t.device != ids.device:
        raise ValueError(f"{name} must be on recorded_ids' device {ids.device}, got {t.device}")
    return t


def routing_mismatch(
    recorded_ids: torch.Tensor | np.ndarray,
    live_ids: torch.Tensor | np.ndarray,
    *,
    valid: torch.Tensor | np.ndarray | None = None,
    no_record: int = -1,
    recorded_weights: torch.Tensor | np.ndarray | None = None,
    live_weights: torch.Tensor | np.ndarray | None = None,
) -> RoutingMismatch:
    """Compares two routings of the same tokens, per layer, as sets of experts.

    Args:
        recorded_ids: (n, top_k) or (n, num_layers, top_k) integer - e.g. the rollout's record
            (``replay_batch``'s rows, or a replayer's ``buffer[:n]``). A row that is all -1 (or all
            ``no_record``) has no record: it is not counted in its layer.
        live_ids: same shape, integer (any of the dtypes; they need not match) - e.g. what the
            trainer's router chooses live for the same tokens (``RoutingReplayer.live_buffer``
            of a replayed forward).
        valid: (n,) bool or None - tokens to count (padding False); None counts every token.
        no_record: the no-record marker of ``recorded_ids`` besides -1: -1 or 0 (all-zero rows, as
            verl and slime send them; needs ``top_k >= 2``).
        recorded_weights, live_weights: both or neither; the ids' shape, float16/bfloat16/float32/
            float64 - the gate weights beside each id (the rollout's recorded weights channel; the
            trainer's router weights). Given, the result's ``weight_*`` fields say how far the
            gates drifted where the expert set did not: per layer, over the counted tokens whose
            set matched, each recorded expert's weight against the live weight of the same expert
            (columns may be in any order; an id listed twice compares its first live column),
            in float32 (float64 inputs in float64, then float32).

    Each argument is a torch tensor or a numpy array (taken as a CPU tensor, no copy).

    Returns:
        A :class:`RoutingMismatch`; a 2-D input is one layer (``num_layers = 1``).

    No host reads, no synchronisation; temporaries of (n, num_layers, top_k) elements. Raises
    ValueError naming the argument for shapes, dtypes, devices or a marker that disagree
    (TypeError for non-arrays).
    """
    recorded_ids, live_ids, valid = _tensor(recorded_ids), _tensor(live_ids), _tensor(valid)
    _check("recorded_ids", recorded_ids)
    _check("live_ids", live_ids)
    if live_ids.shape != recorded_ids.shape:
        raise ValueError(
            f"live_ids must have recorded_ids' shape {tuple(recorded_ids.shape)}, got {tuple(live_ids.shape)}"
        )
    if live_ids.device != recorded_ids.device:
        raise ValueError(
            f"live_ids must be on recorded_ids' device {recorded_ids.device}, got {live_ids.device}"
        )
    n = recorded_ids.shape[0]
    if valid is not None:
        if not isinstance(valid, torch.Tensor):
            raise TypeError(
                f"valid must be a torch.Tensor, a numpy array or None, got {type(valid).__name__}"
            )
        if valid.dtype != torch.bool or tuple(valid.shape) != (n,):
            raise ValueError(
                f"valid must be a ({n},) bool tensor (one flag per token), got "
                f"{valid.dtype} {tuple(valid.shape)}"
            )
        if valid.device != recorded_ids.device:
            raise ValueError(
                f"valid must be on recorded_ids' device {recorded_ids.device}, got {valid.device}"
            )

    if (
        isinstance(no_record, bool)
        or not isinstance(no_record, (int, np.integer))
        or no_record not in (-1, 0)
    ):
        raise ValueError(f"no_record must be -1 or 0 (all-zero rows), got {no_record!r}")
    if no_record == 0 and recorded_ids.shape[-1] == 1:
        raise ValueError(
            "no_record=0 needs top_k >= 2: with top_k == 1 the row [0] is expert 0, a valid choice"
        )

    recorded_weights, live_weights = _tensor(recorded_weights), _tensor(live_weights)
    if (recorded_weights is None) != (live_weights is None):
        given = "recorded_weights" if live_weights is None else "live_weights"
        raise ValueError(
            f"{given} needs the other weights too: pass recorded_weights and live_weights, or neither"
        )
    if recorded_weights is not None:
        _check_weights("recorded_weights", recorded_weights, recorded_ids)
        _check_weights("live_weights", live_weights, recorded_ids)

    common = torch.promote_types(recorded_ids.dtype, live_ids.dtype)
    a = recorded_ids.to(common)
    b = live_ids.to(common)
    if a.dim() == 2:
        a, b = a[:, None], b[:, None]
    top_k = a.shape[-1]
    a_first = _first_occurrence(a)
    b_first = _first_occurrence(b)
    shared = (_members(a, b) & a_first).sum(-1)  # (n, L) distinct experts in both sets
    size_a = a_first.sum(-1)
    size_b = b_first.sum(-1)
    changed = ~((shared == size_a) & (shared == size_b))
    disjoint = shared == 0

    # (n, L): the row holds a record. An unsigned dtype holds no -1 (a uint8 compare with -1 would
    # match 255, a valid id at 256 experts)
    recorded = torch.ones(a.shape[:-1], dtype=torch.bool, device=a.device)
    if a.dtype.is_signed:
        recorded &= ~(a == -1).all(-1)
    if no_record != -1:
        recorded &= ~(a == no_record).all(-1)
    weight = recorded.to(torch.float32)
    if valid is not None:
        weight = weight * valid.to(torch.float32)[:, None]
    count = weight.sum(0)  # (L,)
    weight_fields = {}
    if recorded_weights is not None:
        weight_fields = _weight_drift(a, b, recorded_weights, live_weights, (weight > 0) & ~changed)
    return RoutingMismatch(
        changed=(changed.to(torch.float32) * weight).sum(0) / count,
        overlap=(shared.to(torch.float32) * weight).sum(0) / (count * top_k),
        disjoint=(disjoint.to(torch.float32) * weight).sum(0) / count,
        num_tokens=count.to(torch.int64),
        **weight_fields,
    )


def _weight_drift(
    a: torch.Tensor, b: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, same: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The ``weight_*`` fields: ``a``/``b`` (n, L, k) ids, ``wa``/``wb`` their weights (2-D or 3-D
    as given), ``same`` (n, L) the counted tokens whose expert set matched. Fixed shapes, k passes."""
    if wa.dim() == 2:
        wa, wb = wa[:, None], wb[:, None]
    dtype = torch.float64 if torch.float64 in (wa.dtype, wb.dtype) else torch.float32
    wa, wb = wa.to(dtype), wb.to(dtype)
    # the live weight of each recorded expert: of the FIRST live column holding the same id (sets
    # match, so every recorded id has one)
    matched = torch.zeros_like(wa)
    found = torch.zeros(a.shape, dtype=torch.bool, device=a.device)
    for j in range(b.shape[-1]):
        hit = (a == b[..., j : j + 1]) & ~found
        matched = torch.where(hit, wb[..., j : j + 1], matched)
        found = found | hit
    diff = (wa - matched).abs()  # (n, L, k)
    cells = same[..., None].expand_as(diff)
    n_tokens = same.sum(0)  # (L,)
    total = torch.where(cells, diff, 0).sum((0, 2))
    # max over the compared cells; NaN where a layer compared none (never a made-up 0)
    if diff.shape[0] == 0:  # no token (a static shape): amax has nothing to reduce
        worst = torch.full(n_tokens.shape, float("-inf"), dtype=dtype, device=diff.device)
    else:
        worst = torch.where(cells, diff, float("-inf")).amax((0, 2))
    worst = torch.where(n_tokens > 0, worst, float("nan"))
    return dict(
        weight_mean_abs=(total / (n_tokens * a.shape[-1])).to(torch.float32),
        weight_max_abs=worst.to(torch.float32),
        weight_num_tokens=n_tokens.to(torch.int64),
    )
