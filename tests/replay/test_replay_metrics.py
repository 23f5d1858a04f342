"""routing_mismatch against Python sets, its order invariance, padding, and the CI check of the docs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from strategies import MismatchCase, mismatch_cases

import moe_ops
from moe_ops import RoutingMismatch, replay_batch, replay_routing, route, routing_mismatch


def _oracle(case: MismatchCase) -> tuple[list[float], list[float], list[float], list[int]]:
    """(changed, overlap, disjoint) and the token count per layer, from Python sets: a layer counts
    the valid tokens whose recorded row is a record (not all -1, not all the no-record marker)."""
    n, layers, k = case.recorded.shape
    changed, overlap, disjoint, counts = [], [], [], []
    for layer in range(layers):
        rows = [
            t
            for t in range(n)
            if (case.valid is None or case.valid[t])
            and set(case.recorded[t, layer].tolist()) not in ({-1}, {case.no_record})
        ]
        a = [set(case.recorded[t, layer].tolist()) for t in rows]
        b = [set(case.live[t, layer].tolist()) for t in rows]
        counts.append(len(rows))
        if not rows:
            changed.append(math.nan), overlap.append(math.nan), disjoint.append(math.nan)
            continue
        changed.append(sum(x != y for x, y in zip(a, b)) / len(rows))
        overlap.append(sum(len(x & y) / k for x, y in zip(a, b)) / len(rows))
        disjoint.append(sum(not (x & y) for x, y in zip(a, b)) / len(rows))
    return changed, overlap, disjoint, counts


def _tensors(case: MismatchCase, dtypes=(torch.int32, torch.int64)):
    recorded = torch.from_numpy(case.recorded).to(dtypes[0])
    live = torch.from_numpy(case.live).to(dtypes[1])
    if case.flat:
        recorded, live = recorded[:, 0], live[:, 0]
    valid = None if case.valid is None else torch.from_numpy(case.valid)
    return recorded, live, valid


@settings(max_examples=200)
@given(case=mismatch_cases())
def test_matches_python_sets(case):
    recorded, live, valid = _tensors(case, (torch.int16, torch.int64))
    m = routing_mismatch(recorded, live, valid=valid, no_record=case.no_record)
    changed, overlap, disjoint, count = _oracle(case)
    layers = case.recorded.shape[1]
    for name, got, want in (("changed", m.changed, changed), ("overlap", m.overlap, overlap)):
        assert got.shape == (layers,) and got.dtype == torch.float32, name
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7, equal_nan=True, msg=name)
    torch.testing.assert_close(m.disjoint, torch.tensor(disjoint), rtol=1e-6, atol=1e-7, equal_nan=True)
    assert m.num_tokens.tolist() == count and m.num_tokens.dtype == torch.int64
    # the same from numpy arrays
    as_numpy = routing_mismatch(
        recorded.numpy(),
        live.numpy(),
        valid=None if valid is None else valid.numpy(),
        no_record=case.no_record,
    )
    for name in ("changed", "overlap", "disjoint", "num_tokens"):
        torch.testing.assert_close(getattr(as_numpy, name), getattr(m, name), equal_nan=True)


@settings(max_examples=50)
@given(case=mismatch_cases())
def test_column_order_and_argument_order_do_not_matter(case):
    recorded, live, valid = _tensors(case)
    rng = np.random.default_rng(0)
    perm = torch.from_numpy(rng.permutation(recorded.shape[-1]))
    a = routing_mismatch(recorded, live, valid=valid, no_record=case.no_record)
    b = routing_mismatch(recorded[..., perm], live.flip(-1), valid=valid, no_record=case.no_record)
    for m in (b,):
        for field in ("changed", "overlap", "disjoint"):
            torch.testing.assert_close(getattr(m, field), getattr(a, field), equal_nan=True)


def test_known_values_and_padding():
    recorded = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7]])
    live = torch.tensor([[3, 2, 1, 0], [0, 1, 2, 9], [8, 9, 10, 11], [0, 1, 2, 3]])
    m = routing_mismatch(recorded, live)
    assert isinstance(m, RoutingMismatch)
    torch.testing.assert_close(m.changed, torch.tensor([0.75]))
    torch.testing.assert_close(m.overlap, torch.tensor([(1 + 0.75 + 0 + 0) / 4]))
    torch.testing.assert_close(m.disjoint, torch.tensor([0.5]))
    padded = routing_mismatch(recorded, live, valid=torch.tensor([True, True, False, False]))
    torch.testing.assert_close(padded.changed, torch.tensor([0.5]))
    torch.testing.assert_close(padded.disjoint, torch.tensor([0.0]))
    assert padded.num_tokens.tolist() == [2]
    empty = routing_mismatch(recorded, live, valid=torch.zeros(4, dtype=torch.bool))
    assert torch.isnan(empty.changed).all() and empty.num_tokens.tolist() == [0]
    # symmetric in the two routings where every row is a record
    swapped = routing_mismatch(live, recorded)
    for field in ("changed", "overlap", "disjoint"):
        torch.testing.assert_close(getattr(swapped, field), getattr(m, field))


def test_rows_without_a_record_are_not_counted():
    """The issue's reproducer: the documented CI check fed replay_batch(..., pad_to=40) and the
    attention mask, live == recorded on every recorded token, reported each request's last-token
    row of -1 as disjoint (2.86% per layer). Rows without a record count nowhere."""
    shape = moe_ops.RoutingShape(num_layers=2, num_experts=16, top_k=2)
    rng = np.random.default_rng(0)
    lengths = [35, 40, 12]
    requests = [
        np.stack([np.stack([rng.permutation(16)[:2] for _ in range(2)]) for _ in range(t - 1)])
        for t in lengths
    ]
    recorded = replay_batch(requests, shape, num_tokens=lengths, pad_to=40)
    mask = torch.tensor([[j < t for j in range(40)] for t in lengths])
    live = torch.from_numpy(np.where(recorded == -1, 3, recorded))  # the live router routes -1 rows
    m = routing_mismatch(torch.from_numpy(recorded), live, valid=mask.flatten())
    assert m.disjoint.tolist() == [0.0, 0.0] and m.changed.tolist() == [0.0, 0.0]
    assert m.num_tokens.tolist() == [sum(lengths) - 3] * 2  # every valid token but the three last ones
    # verl-style all-zero rows with no_record=0; a uint8 255 (a valid id at 256 experts) is a record
    zeros = torch.tensor([[[0, 0]], [[1, 2]]])
    other = torch.tensor([[[5, 6]], [[1, 2]]])
    assert routing_mismatch(zeros, other, no_record=0).num_tokens.tolist() == [1]
    assert routing_mismatch(zeros, other).disjoint.tolist() == [0.5]
    wide = torch.tensor([[255], [7]], dtype=torch.uint8)
    assert routing_mismatch(wide, torch.tensor([[255], [7]])).num_tokens.tolist() == [2]


def test_ci_check_of_the_docs_fails_a_run_above_one_percent_disjoint():
    """The check docs/replay.md shows: fail when more than 1% of tokens are disjoint in any layer."""

    def check(m: RoutingMismatch, limit: float = 0.01) -> None:
        worst = float(m.disjoint.max())  # host sync: once per step, where the loss is read anyway
        if worst > limit:
            layer = int(m.disjoint.argmax())
            raise AssertionError(f"{worst:.2%} of tokens disjoint from the rollout in layer {layer}")

    n, layers = 400, 3
    recorded = torch.stack([torch.randperm(64)[:8] for _ in range(n * layers)]).view(n, layers, 8)
    live = recorded.clone()
    live[:4, 1] = recorded[:4, 1] + 64  # 4 of 400 tokens = 1%: allowed
    check(routing_mismatch(recorded, live))
    live[4, 1] += 64  # 5 of 400 = 1.25%
    with pytest.raises(AssertionError, match=r"1.25% of tokens disjoint from the rollout in layer 1"):
        check(routing_mismatch(recorded, live))


def test_replayed_ids_have_no_mismatch_and_live_ones_are_measured():
    """The metric on the op's own outputs: replayed ids equal the record; the live router's ids of
    perturbed logits differ by what the perturbation moved."""
    logits = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    recorded = route(logits, 4)[1]
    trainer_logits = logits + 0.3 * torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    replayed = replay_routing(trainer_logits, recorded)[1]
    assert float(routing_mismatch(recorded, replayed).changed) == 0.0
    live = route(trainer_logits, 4)[1]
    m = routing_mismatch(recorded, live)
    want = sum(set(a) != set(b) for a, b in zip(recorded.tolist(), live.tolist())) / 64
    assert 0 < float(m.changed) == pytest.approx(want)


BAD = [
    (dict(recorded_ids=[[1]]), TypeError, "recorded_ids must be a torch.Tensor or a numpy array"),
    (dict(recorded_ids=torch.zeros(4, dtype=torch.int32)), ValueError, r"recorded_ids must be \(n, top_k\)"),
    (dict(live_ids=torch.zeros(4, 3, 2, 1, dtype=torch.int32)), ValueError, "live_ids must be"),
    (dict(live_ids=torch.zeros(4, 3)), ValueError, "live_ids must be uint8, int8, int16, int32 or int64"),
    (dict(live_ids=torch.zeros(4, 2, dtype=torch.int32)), ValueError, r"recorded_ids' shape \(4, 3\)"),
    (dict(recorded_ids=torch.zeros(4, 0, dtype=torch.int32)), ValueError, "at least one expert column"),
    (dict(valid=torch.ones(4)), ValueError, r"valid must be a \(4,\) bool tensor"),
    (dict(valid=torch.ones(5, dtype=torch.bool)), ValueError, r"valid must be a \(4,\) bool tensor"),
    (dict(valid=[True] * 4), TypeError, "valid must be a torch.Tensor, a numpy array or None"),
    (dict(no_record=1), ValueError, "no_record must be -1 or 0"),
    (
        dict(
            no_record=0,
            recorded_ids=torch.zeros(4, 1, dtype=torch.int32),
            live_ids=torch.zeros(4, 1, dtype=torch.int8),
        ),
        ValueError,
        "needs top_k >= 2",
    ),
    (dict(live_ids=torch.zeros(4, 3, dtype=torch.int32, device="meta")), ValueError, "device cpu, got meta"),
]


@pytest.mark.parametrize("change, exc, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments(change, exc, message):
    args = dict(
        recorded_ids=torch.zeros(4, 3, dtype=torch.int32), live_ids=torch.zeros(4, 3, dtype=torch.int64)
    )
    args.update(change)
    valid = args.pop("valid", None)
    no_record = args.pop("no_record", -1)
    with pytest.raises(exc, match=message):
        routing_mismatch(args["recorded_ids"], args["live_ids"], valid=valid, no_record=no_record)


# --- weight metrics ---------------------------------------------------------------------------


def _weight_oracle(case: MismatchCase, wa: np.ndarray, wb: np.ndarray):
    """(mean |diff|, max |diff|, tokens) per layer from Python dicts id -> weight: the counted
    tokens whose expert set matched, each recorded column against the live weight of its id (the
    first live column holding it)."""
    n, layers, k = case.recorded.shape
    means, worsts, counts = [], [], []
    for layer in range(layers):
        diffs, tokens = [], 0
        for t in range(n):
            a, b = case.recorded[t, layer].tolist(), case.live[t, layer].tolist()
            if case.valid is not None and not case.valid[t]:
                continue
            if set(a) in ({-1}, {case.no_record}) or set(a) != set(b):
                continue
            tokens += 1
            first = {}
            for j, e in enumerate(b):
                first.setdefault(e, wb[t, layer, j])
            diffs += [abs(float(wa[t, layer, i]) - float(first[e])) for i, e in enumerate(a)]
        counts.append(tokens)
        means.append(sum(diffs) / (tokens * k) if tokens else math.nan)
        worsts.append(max(diffs) if tokens else math.nan)
    return means, worsts, counts


@settings(max_examples=100)
@given(case=mismatch_cases())
def test_weight_metrics_match_python_dicts(case):
    rng = np.random.default_rng(case.recorded.size)
    wa = rng.random(case.recorded.shape).astype(np.float32)
    wb = rng.random(case.recorded.shape).astype(np.float32)
    # matched rows get live weights near the recorded ones, as a drifting trainer's would
    near = rng.random(case.recorded.shape[:2]) < 0.5
    wb = np.where(near[..., None], wa + np.float32(1e-3), wb).astype(np.float32)
    recorded, live, valid = _tensors(case)
    rw, lw = torch.from_numpy(wa), torch.from_numpy(wb).to(torch.float64)
    if case.flat:
        rw, lw = rw[:, 0], lw[:, 0]
    m = routing_mismatch(
        recorded, live, valid=valid, no_record=case.no_record, recorded_weights=rw, live_weights=lw
    )
    means, worsts, counts = _weight_oracle(case, wa, wb.astype(np.float64))
    assert m.weight_num_tokens.tolist() == counts and m.weight_num_tokens.dtype == torch.int64
    for name, got, want in (("mean", m.weight_mean_abs, means), ("max", m.weight_max_abs, worsts)):
        assert got.dtype == torch.float32 and got.shape == (case.recorded.shape[1],), name
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7, equal_nan=True, msg=name)
    # the id metrics are what they are without weights
    plain = routing_mismatch(recorded, live, valid=valid, no_record=case.no_record)
    assert plain.weight_mean_abs is None and plain.weight_max_abs is None and plain.weight_num_tokens is None
    for name in ("changed", "overlap", "disjoint", "num_tokens"):
        torch.testing.assert_close(getattr(m, name), getattr(plain, name), equal_nan=True)


def test_weight_metrics_known_values():
    # token 0: same set in another order; token 1: another set (left out); token 2: no record
    recorded = torch.tensor([[0, 1], [2, 3], [-1, -1]])
    live = torch.tensor([[1, 0], [2, 4], [5, 6]])
    rw = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.0, 0.0]])
    lw = torch.tensor([[0.45, 0.55], [0.9, 0.1], [0.3, 0.7]], dtype=torch.bfloat16)
    m = routing_mismatch(recorded, live, recorded_weights=rw, live_weights=lw)
    # |0.6 - 0.55| and |0.4 - 0.45| (bf16 live weights: 0.55 -> 0.55078125, 0.45 -> 0.44921875)
    want = [abs(0.6 - 0.55078125), abs(0.4 - 0.44921875)]
    torch.testing.assert_close(m.weight_mean_abs, torch.tensor([sum(want) / 2]))
    torch.testing.assert_close(m.weight_max_abs, torch.tensor([max(want)]))
    assert m.weight_num_tokens.tolist() == [1]
    # no matched token: NaN, never 0
    m = routing_mismatch(recorded[1:], live[1:], recorded_weights=rw[1:], live_weights=lw[1:])
    assert m.weight_num_tokens.tolist() == [0]
    assert math.isnan(float(m.weight_mean_abs[0])) and math.isnan(float(m.weight_max_abs[0]))
    # no token at all
    m = routing_mismatch(recorded[:0], live[:0], recorded_weights=rw[:0], live_weights=lw[:0])
    assert m.weight_num_tokens.tolist() == [0] and math.isnan(float(m.weight_max_abs[0]))


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(recorded_weights=torch.zeros(3, 2)), ValueError, "recorded_weights needs the other weights"),
        (dict(live_weights=torch.zeros(3, 2)), ValueError, "live_weights needs the other weights"),
        (
            dict(recorded_weights=torch.zeros(3, 3), live_weights=torch.zeros(3, 2)),
            ValueError,
            "recorded_weights must have the ids' shape (3, 2)",
        ),
        (
            dict(recorded_weights=torch.zeros(3, 2), live_weights=torch.zeros(3, 2, dtype=torch.int32)),
            ValueError,
            "live_weights must be float16, bfloat16, float32 or float64",
        ),
        (
            dict(recorded_weights=[[0.0]] * 3, live_weights=torch.zeros(3, 2)),
            TypeError,
            "recorded_weights must",
        ),
    ],
)
def test_weight_metrics_bad_arguments(kwargs, exc, message):
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        routing_mismatch(ids, ids, **kwargs)


def test_weight_metrics_compile_without_graph_breaks():
    recorded = torch.tensor([[0, 1], [2, 3], [4, 5]])
    live = torch.tensor([[1, 0], [2, 3], [4, 6]])
    rw, lw = torch.rand(3, 2), torch.rand(3, 2)
    fn = torch.compile(
        lambda a, b, x, y: routing_mismatch(a, b, recorded_weights=x, live_weights=y), fullgraph=True
    )
    got, want = (
        fn(recorded, live, rw, lw),
        routing_mismatch(recorded, live, recorded_weights=rw, live_weights=lw),
    )
    for name in ("weight_mean_abs", "weight_max_abs", "weight_num_tokens"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), equal_nan=True)
