"""Checks a router's (weights, ids) against the float64 reference (moe_ops.router.reference).

Ids are compared exactly wherever the choice is decided by the inputs and not by rounding:

* methods without a bias choose on the raw logits, which every implementation compares exactly,
  so every row must match, ties included (lowest index first);
* DEEPSEEK_V3 and MINIMAX2 choose on ``sigmoid(x) + bias`` (and sums of them per group), which each
  implementation rounds in float32 its own way. A row whose float64 keys come within 3e-6 of a
  tie between experts (or groups) with *different* inputs is decided by that rounding; such rows
  (about one in 300 on random data) must pick keys equal to the reference's within 3e-6.
  Exact ties between identical inputs round identically everywhere, so they stay exact.

Weights are compared with the float64 weights of the ids the implementation chose (relative error).
"""

from __future__ import annotations

import itertools

import torch

from moe_ops.router.methods import BIAS_METHODS
from moe_ops.router.reference import (
    group_scores,
    route_reference,
    select_experts,
    selection_keys,
    weights_for_ids,
)

KEY_TOL = 3e-6


def _near(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | ((a - b).abs() <= KEY_TOL * (1 + a.abs()))  # a == b: equal infinities


def rounding_decided_rows(config, x64: torch.Tensor, bias64: torch.Tensor | None) -> torch.Tensor:
    """(n,) bool: rows whose choice float32 rounding of the keys may decide (see module doc)."""
    n, num_experts = x64.shape
    if config.method not in BIAS_METHODS or n == 0:
        return torch.zeros(n, dtype=torch.bool)
    keys = selection_keys(x64, config.method, bias64)
    b = (bias64 if bias64 is not None else torch.zeros(num_experts, dtype=torch.float64)).expand(n, -1)
    n_group, topk_group = config.groups
    order = select_experts(keys, num_experts, n_group, topk_group, config.group_top)  # the full ranking
    kept = torch.ones(n, num_experts, dtype=torch.bool)
    size = num_experts // n_group
    if n_group > 1:
        gorder = torch.sort(
            group_scores(keys, n_group, config.group_top), dim=1, descending=True, stable=True
        )[1]
        kept_groups = torch.zeros(n, n_group, dtype=torch.bool).scatter_(1, gorder[:, :topk_group], True)
        kept = kept_groups.repeat_interleave(size, dim=1)
    m = min(config.top_k + 1, num_experts)
    top = order[:, :m]
    sk, sx, sb, skept = keys.gather(1, top), x64.gather(1, top), b.gather(1, top), kept.gather(1, top)
    same_x = (sx[:, :-1] == sx[:, 1:]) | (sx[:, :-1].isnan() & sx[:, 1:].isnan())
    same = same_x & (sb[:, :-1] == sb[:, 1:])
    decided = (_near(sk[:, :-1], sk[:, 1:]) & skept[:, 1:] & ~same).any(1)
    if n_group > 1 and topk_group < n_group:
        scores = group_scores(keys, n_group, config.group_top)
        gsorted, gorder = torch.sort(scores, dim=1, descending=True, stable=True)
        # a group's inputs: (x, bias) of the best experts its score sums
        inner = torch.sort(keys.view(n, n_group, size), dim=2, descending=True, stable=True)[1]
        inner = inner[..., : min(config.group_top, size)]
        first = torch.arange(n_group).view(1, n_group, 1) * size
        members = (inner + first).view(n, -1)
        sig = torch.stack([x64.gather(1, members), b.gather(1, members)], -1).view(n, n_group, -1)
        last_in, first_out = gorder[:, topk_group - 1], gorder[:, topk_group]
        rows = torch.arange(n)
        same_g = (sig[rows, last_in] == sig[rows, first_out]).all(-1)
        decided |= _near(gsorted[:, topk_group - 1], gsorted[:, topk_group]) & ~same_g
    return decided


def _top_keys(keys: torch.Tensor, kept: torch.Tensor, k: int) -> torch.Tensor:
    """The k best keys of one row among the experts of ``kept`` (descending)."""
    return torch.sort(keys[kept], descending=True)[0][:k]


def _kept_group_options(
    keys: torch.Tensor, n_group: int, topk_group: int, group_top: int
) -> list[torch.Tensor]:
    """Expert masks of every kept-group set that float32 rounding of one row's scores may pick.

    Groups scoring clearly above the cut are kept, clearly below dropped; the rest (within
    KEY_TOL of the cut) may fill the remaining places in any combination.
    """
    num_experts = keys.shape[0]
    if n_group <= 1 or topk_group >= n_group:
        return [torch.ones(num_experts, dtype=torch.bool)]
    scores = group_scores(keys[None], n_group, group_top)[0]
    cut = torch.sort(scores, descending=True)[0][topk_group - 1]
    border = _near(scores, cut.expand_as(scores))
    sure = [g for g in range(n_group) if scores[g] > cut and not border[g]]
    maybe = [g for g in range(n_group) if border[g]]
    options = []
    for extra in itertools.combinations(maybe, topk_group - len(sure)):
        kept = torch.zeros(n_group, dtype=torch.bool)
        kept[sure + list(extra)] = True
        options.append(kept.repeat_interleave(num_experts // n_group))
    return options


def check_routing(config, logits: torch.Tensor, bias: torch.Tensor | None, weights, ids, rtol=1e-5) -> None:
    """Asserts ``(weights, ids)`` is ``config``'s routing of ``logits`` (float64 oracle)."""
    n, num_experts = logits.shape
    k = config.top_k
    assert weights.shape == (n, k) and weights.dtype == torch.float32, (weights.shape, weights.dtype)
    assert ids.shape == (n, k) and ids.dtype == torch.int32, (ids.shape, ids.dtype)
    ids = ids.cpu().long()
    weights = weights.cpu().double()
    if n == 0:
        return
    assert ((ids >= 0) & (ids < num_experts)).all(), "an id is out of range"
    assert (torch.sort(ids, 1)[0].diff(dim=1) != 0).all(), "a token got the same expert twice"

    x64 = logits.cpu().double()
    bias64 = None if bias is None else bias.cpu().double()
    n_group, topk_group = config.groups
    scale = config.routed_scaling_factor if config.routed_scaling_factor is not None else 1.0
    _, ref_ids = route_reference(
        x64, k, config.method, bias64, n_group, topk_group, scale, group_top=config.group_top
    )
    decided = rounding_decided_rows(config, x64, bias64)
    exact = ~decided
    mismatch = (ids != ref_ids).any(1) & exact
    if mismatch.any():
        row = int(mismatch.nonzero()[0])
        raise AssertionError(
            f"{config.name}: ids differ from the reference in {int(mismatch.sum())} of {n} rows; "
            f"row {row}: {ids[row].tolist()} vs {ref_ids[row].tolist()}"
        )
    if decided.any():
        keys = selection_keys(x64, config.method, bias64)
        for row in decided.nonzero().flatten().tolist():
            got = torch.sort(keys[row, ids[row]], descending=True)[0]
            options = _kept_group_options(keys[row], n_group, topk_group, config.group_top)
            assert any(_near(_top_keys(keys[row], kept, k), got).all() for kept in options), (
                f"{config.name}: row {row} near a tie chose keys {got.tolist()}, which no rounding of "
                f"the reference's keys {_top_keys(keys[row], options[0], k).tolist()} explains"
            )

    finite = torch.isfinite(x64).all(1)
    want_w = weights_for_ids(x64, ids, config.method, scale)[finite]
    got_w = weights[finite]
    err = (got_w - want_w).abs()
    bad = err > rtol * want_w.abs()
    assert not bad.any(), (
        f"{config.name}: weight relative error {float((err / want_w.abs())[bad].max()):.3g} > {rtol} "
        f"({int(bad.sum())} weights)"
    )


def replay_forward_args(
    router_logits, recorded_ids, bias, weights, ids, errors, method, n_group, topk_group, scale,
    *, nonfinite=None, row_count=None, unnormalized=False, group_top=2, hash_table=None, token_ids=None,
) -> dict:  # fmt: skip
    """The replay forward launchers' arguments (``replay_rows_triton`` / ``_torch``: the op's, in the
    order ``moe_ops.replay.op.REPLAY_OP`` generates) by name, from the tests' usual order."""
    return dict(
        router_logits=router_logits, recorded_ids=recorded_ids, weights=weights, ids=ids, errors=errors,
        nonfinite=nonfinite, row_count=row_count, bias=bias, hash_table=hash_table, token_ids=token_ids,
        method=int(method), n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale,
        unnormalized=unnormalized, group_top=group_top,
    )  # fmt: skip


def replay_backward_args(
    grad_weights, router_logits, weights, ids, grad_logits, method, scale, unnormalized=False
):
    """The replay backward launchers' arguments by name (``REPLAY_BACKWARD_OP``'s)."""
    return dict(
        grad_weights=grad_weights, router_logits=router_logits, weights=weights, ids=ids,
        grad_logits=grad_logits, method=int(method), routed_scaling_factor=scale, unnormalized=unnormalized,
    )  # fmt: skip
