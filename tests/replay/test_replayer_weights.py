"""Recorded weights in RoutingReplayer (``weights_dtype``, ``set_batch(weights=...)``, ``rows(weights=
True)``) and ``attach_replay(..., weights="recorded")`` through the transformers and reference-model
wrappers: the rollout's weights are the values, the rule's weights the gradient (replay_routing's
straight-through rule), rows without recorded weights (NaN) keep the computed ones.

Expected values are the recorded arrays themselves and, for gradients, the default mode's
(``weights="computed"``) autograd gradient: the two modes' gradients are the same rule at the same ids.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ops import RoutingReplayer, RoutingShape
from moe_ops.attach.replaying import ReplayRule, replay_routing_rule
from moe_ops.router.methods import RoutingMethod

SHAPE = RoutingShape(num_layers=3, num_experts=8, top_k=2, moe_layers=(1, 2, 4), num_model_layers=5)


def batch(n: int, seed: int = 0, no_record_rows=()) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights): distinct ids per row, weights in (0, 1) exact in bfloat16 and float16;
    no-record rows -1 / NaN."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n, SHAPE.num_layers, SHAPE.num_experts)), axis=-1)[..., : SHAPE.top_k]
    weights = rng.integers(1, 128, size=ids.shape).astype(np.float32) / 128  # 7 bits: exact in bf16
    ids, weights = ids.astype(np.int32), weights
    for row in no_record_rows:
        ids[row], weights[row] = -1, np.nan
    return ids, weights


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN."""
    a, b = a.double(), b.double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    num_slots=st.integers(1, 3),
    with_weights=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_weights_follow_the_ids_through_batches_and_slots(dtype, sizes, num_slots, with_weights):
    r = RoutingReplayer(SHAPE, 6, "cpu", num_slots=num_slots, weights_dtype=dtype)
    assert r.weights_buffer.isnan().all() and r.weights_buffer.dtype == dtype
    held = {}
    for i, n in enumerate(sizes):
        slot = i % num_slots
        ids, weights = batch(n, seed=i)
        given_w = weights if with_weights[i] else None
        r.set_batch(ids, slot=slot, weights=given_w)
        held[slot] = (n, weights if with_weights[i] else np.full(weights.shape, np.nan, np.float32))
        r.select(slot)
        n_held, w_held = held[slot]
        assert same(r.weights_buffer[:n_held], torch.from_numpy(w_held))
        assert r.weights_buffer[n_held:].isnan().all(), "rows past the batch hold no weights"
        for column, layer in enumerate(SHAPE.moe_layers):
            rows = r.rows(layer, n_held, weights=True)
            assert rows.weights.dtype == dtype
            assert same(rows.weights, torch.from_numpy(w_held[:, column]))
            assert rows.row_count is None and torch.equal(rows.ids, r.layer_ids(layer, n_held))
            assert r.rows(layer, n_held).weights is None


def test_weights_that_the_dtype_cannot_hold_are_refused_and_nothing_changes():
    r = RoutingReplayer(SHAPE, 4, "cpu", weights_dtype=torch.bfloat16)
    ids, weights = batch(3)
    r.set_batch(ids, weights=weights)
    before = r.weights_buffer.clone(), r.buffer.clone()
    bad = weights.copy()
    bad[1, 2, 0] = 1 / 3
    with pytest.raises(
        ValueError, match=r"cannot hold exactly, the first at \[row, layer, k\] = \[1, 2, 0\]"
    ):
        r.set_batch(ids, weights=bad)
    assert same(r.weights_buffer, before[0]) and torch.equal(r.buffer, before[1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weights=np.zeros((3, 3, 3), np.float32)), r"weights must have the ids' shape \(3, 3, 2\)"),
        (dict(weights=np.zeros((3, 3, 2), np.int32)), "floating-point weights"),
        (dict(weights="0.5"), None),
        (dict(mtp_weights=np.zeros((3, 0, 2), np.float32)), "mtp_weights given without mtp_routing"),
    ],
)
def test_set_batch_refuses_bad_weights(kwargs, match):
    r = RoutingReplayer(SHAPE, 4, "cpu", weights_dtype=torch.float32)
    ids, _ = batch(3)
    error = TypeError if match is None else ValueError
    with pytest.raises(error, match=match):
        r.set_batch(ids, **kwargs)
    assert r.num_tokens == 0 and (r.buffer == -1).all() and r.weights_buffer.isnan().all()


def test_weights_need_a_replayer_that_keeps_them():
    r = RoutingReplayer(SHAPE, 4, "cpu")
    ids, weights = batch(3)
    with pytest.raises(ValueError, match="keeps no weights: build it with"):
        r.set_batch(ids, weights=weights)
    r.set_batch(ids)
    with pytest.raises(ValueError, match="asks for recorded weights, but this replayer keeps none"):
        r.rows(1, 3, weights=True)
    with pytest.raises(ValueError, match="weights_dtype must be None or one of"):
        RoutingReplayer(SHAPE, 4, "cpu", weights_dtype=torch.float64)


def test_a_recompute_reads_the_weights_of_its_forwards_slot():
    """An eager recompute in backward reads the weights of the slot its forward read, as it reads
    its ids, whichever slot is selected when the backward runs."""
    r = RoutingReplayer(SHAPE, 4, "cpu", num_slots=2, weights_dtype=torch.float32)
    seen = []

    class Read(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            seen.append(r.rows(1, 3, weights=True).weights.clone())
            return g

    outputs = []
    for slot in (0, 1):
        ids, weights = batch(3, seed=slot)
        r.set_batch(ids, slot=slot, weights=weights)
        r.select(slot)
        x = torch.ones(1, requires_grad=True)
        r.rows(1, 3)  # the forward's router call: marks where the selection's nodes start
        outputs.append((Read.apply(x), torch.from_numpy(weights[:, 0])))
    for out, expected in outputs:  # slot 1 is selected for both backwards
        out.sum().backward()
        assert same(seen[-1], expected)


def test_replay_routing_rule_takes_the_recorded_values_and_the_rules_gradient():
    """Both kinds of rule (a method's weights, and weights_fn): recorded rows take the record's
    values, a row without a record (-1) or with NaN weights the computed ones; the gradient is the
    computed mode's, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=gen)
    recorded = torch.tensor([[0, 1], [2, 3], [-1, -1], [4, 5], [6, 7]], dtype=torch.int32)
    weights = torch.tensor(
        [[0.25, 0.75], [0.5, 0.5], [float("nan")] * 2, [float("nan"), 0.5], [0.125, 0.875]]
    )

    def softmax_at(x, ids):
        return torch.softmax(x, -1).gather(1, ids)

    for rule in (
        ReplayRule(RoutingMethod.RENORMALIZE),
        ReplayRule(RoutingMethod.DEFAULT, weights_fn=softmax_at),
    ):
        x = logits.clone().requires_grad_()
        computed, ids = replay_routing_rule(x, recorded, rule)
        grad_out = torch.randn(computed.shape, generator=gen)
        (computed * grad_out).sum().backward()
        expected_grad = x.grad.clone()
        x.grad = None
        out, ids2 = replay_routing_rule(x, recorded, rule, recorded_weights=weights)
        assert torch.equal(ids, ids2)
        use = torch.tensor([True, True, False, False, True])
        assert torch.equal(out[use], weights[use])
        assert torch.equal(out[~use], computed[~use].detach())
        (out * grad_out).sum().backward()
        torch.testing.assert_close(x.grad, expected_grad, rtol=0, atol=1e-7)


def test_weights_that_require_grad_are_stored_as_a_record():
    """A weights tensor that requires grad is copied as values: the buffer joins no graph, and the
    rows read back carry no gradient to the caller's tensor."""
    r = RoutingReplayer(SHAPE, 4, "cpu", weights_dtype=torch.float32)
    ids, weights = batch(3)
    w = torch.from_numpy(weights).requires_grad_()
    r.set_batch(ids, weights=w)
    r.set_batch(ids, weights=weights)
    assert r.weights_buffer.grad_fn is None and not r.weights_buffer.requires_grad
    assert not r.rows(1, 3, weights=True).weights.requires_grad


def test_replay_routing_rule_checks_recorded_weights_for_every_kind_of_rule():
    """Bad recorded weights raise before anything runs, for a method's rule (replay_routing checks
    them) and for a ``weights_fn`` rule alike: never broadcast, never an integer record."""
    logits = torch.randn(3, 8)
    recorded = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)

    def softmax_at(x, ids):
        return torch.softmax(x, -1).gather(1, ids)

    for rule in (
        ReplayRule(RoutingMethod.RENORMALIZE),
        ReplayRule(RoutingMethod.DEFAULT, weights_fn=softmax_at),
    ):
        with pytest.raises(ValueError, match="recorded_weights must have recorded_ids' shape"):
            replay_routing_rule(logits, recorded, rule, recorded_weights=torch.ones(1, 2))
        with pytest.raises(
            ValueError, match="recorded_weights must be float16, bfloat16, float32 or float64"
        ):
            replay_routing_rule(logits, recorded, rule, recorded_weights=torch.ones(3, 2, dtype=torch.int64))
