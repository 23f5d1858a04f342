"""Hash routing: route(..., hash_table=, token_ids=) and replay_routing of a hash layer.

Against transformers' own DeepseekV4HashRouter (ids exact, weights within float32 rounding), the
literal reference over hypothesis-drawn methods, shapes, dtypes and logits layouts with poisoned
outputs, fused capture in every layout against route then capture_routing, faults (bad token ids and
table entries: counted, never read out of bounds), replay round trips and gradcheck in float64,
and torch.compile(fullgraph=True).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import POISON, hash_cases, routed_capture_cases

import moe_ops
from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, capture_routing, replay_routing, route
from moe_ops.graphs import CompileCounters
from moe_ops.replay import check_replay_errors
from moe_ops.router.hash import (
    HASH_FAULT_ENTRY,
    HASH_FAULT_TOKEN_ID,
    HashFaultError,
    check_hash_errors,
    hash_fault_counter,
)
from moe_ops.router.hash_kernels import route_hash_rows_torch, route_hash_rows_triton
from moe_ops.router.methods import METHODS
from moe_ops.router.reference import hash_route_reference

CPU_BACKENDS = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpret"),
]
GPU_BACKENDS = [
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.gpu),
]
M = RoutingMethod


def _skip_unavailable(backend: str, device: str) -> None:
    if backend == "triton":
        skip_unless_triton_runs(device)


def _expected_ids(hash_table: torch.Tensor, token_ids: torch.Tensor, num_experts: int) -> np.ndarray:
    """The table's ids per row, -1 where the token id or an entry is out of range (plain numpy)."""
    table = hash_table.cpu().numpy().astype(np.int64)
    out = []
    for t in token_ids.cpu().numpy().astype(np.int64):
        row = table[t] if 0 <= t < table.shape[0] else None
        ok = row is not None and ((row >= 0) & (row < num_experts)).all()
        out.append(row if ok else np.full(table.shape[1], -1))
    return np.stack(out) if out else np.zeros((0, table.shape[1]), dtype=np.int64)


def _expected_faults(hash_table, token_ids, num_experts) -> tuple[int, int]:
    """(faulty rows, OR of HASH_FAULT_* bits) of a batch (plain numpy)."""
    table = hash_table.cpu().numpy().astype(np.int64)
    rows, flags = 0, 0
    for t in token_ids.cpu().numpy().astype(np.int64):
        if not 0 <= t < table.shape[0]:
            rows, flags = rows + 1, flags | HASH_FAULT_TOKEN_ID
        elif not ((table[t] >= 0) & (table[t] < num_experts)).all():
            rows, flags = rows + 1, flags | HASH_FAULT_ENTRY
    return rows, flags


# ---------------------------------------------------------------------------------------------------
# transformers' DeepseekV4HashRouter
# ---------------------------------------------------------------------------------------------------

# (scoring_func of the model, moe-ops method whose weight rule it is); SQRTSOFTPLUS joins once it is
# a RoutingMethod member
_V4_SCORES = [pytest.param("sigmoid", M.DEEPSEEK_V3, id="sigmoid-DEEPSEEK_V3")]
if hasattr(RoutingMethod, "SQRTSOFTPLUS"):
    _V4_SCORES.append(pytest.param("sqrtsoftplus", RoutingMethod.SQRTSOFTPLUS, id="sqrtsoftplus"))


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
@pytest.mark.parametrize("scoring_func, method", _V4_SCORES)
def test_route_hash_equals_transformers_deepseek_v4_hash_router(backend, scoring_func, method):
    """The model's own hash router (tiny config): route's ids equal its ``tid2eid[input_ids]``
    exactly and its weights within float32 rounding."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    backend, device = backend
    _skip_unavailable(backend, device)
    config = DeepseekV4Config(
        vocab_size=40,
        hidden_size=16,
        num_local_experts=12,
        num_experts_per_tok=3,
        scoring_func=scoring_func,
        routed_scaling_factor=1.5,
    )
    g = torch.Generator().manual_seed(0)
    router = DeepseekV4HashRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.tid2eid.copy_(torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(40)]))
    router.to(device)
    hidden = torch.randn(2, 7, 16, generator=g).to(device)
    input_ids = torch.randint(0, 40, (2, 7), generator=g).to(device)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden, input_ids)
    weights, ids = route(
        logits,
        3,
        method,
        routed_scaling_factor=config.routed_scaling_factor,
        hash_table=router.tid2eid,
        token_ids=input_ids.reshape(-1),
        backend=backend,
    )
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# the router against the literal reference, poisoned outputs
# ---------------------------------------------------------------------------------------------------


def _check_hash_rows(backend: str, device: str, case) -> None:
    _skip_unavailable(backend, device)
    logits, table, tokens = case.tensors(device)
    n, k = logits.shape[0], case.top_k
    weights = torch.full((n, k), float("nan"), dtype=torch.float32, device=device)  # poison
    ids = torch.full((n, k), POISON, dtype=torch.int32, device=device)
    faults = torch.zeros(2, dtype=torch.int32, device=device)
    launch = route_hash_rows_triton if backend == "triton" else route_hash_rows_torch
    launch(logits, table, tokens, weights, ids, faults, int(case.method), case.routed_scaling_factor or 1.0)
    expected = _expected_ids(table, tokens, case.num_experts)
    assert np.array_equal(ids.cpu().numpy(), expected), "ids differ from hash_table[token_ids]"
    ref_w, ref_ids = hash_route_reference(
        logits.cpu().double(), table.cpu(), tokens.cpu(), case.method, case.routed_scaling_factor or 1.0
    )
    assert np.array_equal(ref_ids.numpy(), expected)
    torch.testing.assert_close(weights.cpu(), ref_w.float(), rtol=1e-5, atol=1e-6)
    assert faults.tolist() == list(_expected_faults(table, tokens, case.num_experts))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=60, deadline=None)
@given(case=hash_cases())
def test_route_hash_rows_equal_reference(backend, case):
    """Every method's weight rule at the table's ids, in every dtype and logits layout (gaps hold
    NaN: a read there shows), outputs poisoned first; faulty rows -1 / 0 and counted exactly."""
    _check_hash_rows(*backend, case)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@settings(max_examples=60, deadline=None)
@given(case=hash_cases(max_experts=512, max_tokens=300))
def test_route_hash_rows_equal_reference_gpu(backend, case):
    _check_hash_rows(*backend, case)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=25, deadline=None)
@given(case=hash_cases(methods=tuple(sorted(m for m, s in METHODS.items() if s.unnormalized))))
def test_route_hash_renormalize_false(backend, case):
    """renormalize=False selects the method's unnormalized rule on hash rows too."""
    backend, device = backend
    _skip_unavailable(backend, device)
    logits, table, tokens = case.tensors(device)
    weights, ids = route(
        logits, case.top_k, case.method, renormalize=False, hash_table=table, token_ids=tokens,
        backend=backend, **case.route_kwargs(),
    )  # fmt: skip
    ref_w, ref_ids = hash_route_reference(
        logits.double(), table, tokens, case.method, case.routed_scaling_factor or 1.0, unnormalized=True
    )
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w.float(), rtol=1e-5, atol=1e-6)
    check_hash_errors(device, raise_error=False)


# ---------------------------------------------------------------------------------------------------
# faults: counted, never read out of bounds
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
def test_bad_token_ids_and_entries_are_counted_and_never_read(backend):
    """Token ids -1, vocab and 2**40 and entries -1 and num_experts: the rows get ids -1 and weights
    0 (the table's neighbouring rows and the logits' neighbouring columns hold values that would
    show a read), check_hash_errors reports them once, with their bits."""
    backend, device = backend
    _skip_unavailable(backend, device)
    e, k, vocab = 6, 2, 5
    base = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 0], [0, 2]], device=device)
    table = base[1 : vocab + 1]  # rows 0 and vocab + 1 of the base: valid ids a bad read would give
    table[2, 1] = -1
    table[3, 0] = e
    wide = torch.full((6, e + 2), float("nan"), device=device)
    logits = wide[:, :e]  # a gather past the row reads NaN
    logits.copy_(torch.randn(6, e, generator=torch.Generator().manual_seed(1)).to(device))
    tokens = torch.tensor([0, -1, vocab, 2**40, 2, 3], dtype=torch.int64, device=device)
    check_hash_errors(device, raise_error=False)
    weights, ids = route(logits, k, M.RENORMALIZE, hash_table=table, token_ids=tokens, backend=backend)
    assert ids.tolist() == [[1, 2]] + [[-1, -1]] * 5
    assert torch.equal(weights[1:], torch.zeros(5, k, device=device))
    assert torch.isfinite(weights).all()
    with pytest.raises(HashFaultError, match="5 hash-routed row") as info:
        check_hash_errors(device)
    assert info.value.flags == HASH_FAULT_TOKEN_ID | HASH_FAULT_ENTRY
    assert check_hash_errors(device) == 0  # read and reset


# ---------------------------------------------------------------------------------------------------
# fused capture in every layout
# ---------------------------------------------------------------------------------------------------


def _capture_counter(device, fn):
    moe_ops.check_capture_errors(device, raise_error=False)
    out = fn()
    counter = moe_ops.capture_error_counter(device).tolist()
    moe_ops.check_capture_errors(device, raise_error=False)
    return out, counter


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
@settings(max_examples=40, deadline=None)
@given(cases=routed_capture_cases(), vocab=st.integers(1, 30), seed=st.integers(0, 2**32 - 1))
def test_fused_capture_records_the_table_ids(backend, cases, vocab, seed):
    """route(..., hash_table, capture=) records the table's ids (-1 for faulty rows) in every layout:
    equal to route, then capture_routing (buffer and capture fault counter), rest still poisoned."""
    backend, device = backend
    _skip_unavailable(backend, device)
    case, router = cases
    cfg = router.config
    logits, _ = router.tensors(device)
    rng = np.random.default_rng(seed)
    e, k, n = cfg.num_experts, cfg.top_k, logits.shape[0]
    table = torch.from_numpy(np.stack([rng.permutation(e)[:k] for _ in range(vocab)])).to(device)
    tokens = torch.from_numpy(rng.integers(-1, vocab + 1, size=n)).to(device)  # -1 and vocab: faulty
    method = RoutingMethod.RENORMALIZE if METHODS[cfg.method].bias else cfg.method
    kw = dict(routed_scaling_factor=cfg.routed_scaling_factor) if METHODS[method].scaled else {}
    buffer, _, counts, sizes = case.tensors(device)
    capture_kw = dict(token_counts=counts, dp_rank=case.dp_rank, layout=case.layout, shard_sizes=sizes)
    hashed = dict(hash_table=table, token_ids=tokens, backend=backend, **kw)

    fused_buf = buffer.clone()
    target = CaptureTarget(fused_buf, case.layer_id, **capture_kw)
    (w1, ids1), faults1 = _capture_counter(device, lambda: route(logits, k, method, capture=target, **hashed))
    sep_buf = buffer.clone()

    def separate():
        w, ids = route(logits, k, method, **hashed)
        capture_routing(sep_buf, ids, case.layer_id, **capture_kw)
        return w, ids

    (w2, ids2), faults2 = _capture_counter(device, separate)
    check_hash_errors(device, raise_error=False)
    assert torch.equal(ids1, ids2) and torch.equal(w1, w2), "capturing changed the routing"
    assert np.array_equal(ids1.cpu().numpy(), _expected_ids(table, tokens, e))
    assert torch.equal(fused_buf, sep_buf), (
        f"fused capture differs from route + capture_routing ({case.layout})"
    )
    assert faults1 == faults2
    expected = buffer.clone()
    expected[: case.c, case.layer_id] = ids1[case.start : case.start + case.c].to(expected.dtype)
    assert torch.equal(fused_buf, expected)


# ---------------------------------------------------------------------------------------------------
# replay of a hash layer
# ---------------------------------------------------------------------------------------------------


def _replay_case(device, dtype=torch.float32):
    """(logits (6, 8), table (5, 2), token ids (6,)) with row 4's token id out of the vocabulary."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8, generator=g, dtype=torch.float64).to(dtype).to(device)
    table = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(5)]).to(device)
    tokens = torch.tensor([0, 3, 4, 1, 7, 2], device=device)
    return logits, table, tokens


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.SIGMOID_RENORM, M.DEFAULT, M.RENORMALIZE])
def test_replay_of_route_hash_round_trip(backend, method):
    """replay(x, route(x, table).ids, table) == route(x, table); a row without a record takes the
    table's ids again (a faulty token -1 / 0 and counted); a record that differs from the table is
    forced (a hash layer's replay is a forced replay)."""
    backend, device = backend
    _skip_unavailable(backend, device)
    logits, table, tokens = _replay_case(device)
    kw = dict(routed_scaling_factor=2.5) if METHODS[method].scaled else {}
    hashed = dict(hash_table=table, token_ids=tokens, backend=backend, **kw)
    w, ids = route(logits, 2, method, **hashed)
    check_hash_errors(device, raise_error=False)
    check_replay_errors(device, raise_error=False)
    rw, rids = replay_routing(logits, ids, method, **hashed)
    assert torch.equal(rids, ids)
    torch.testing.assert_close(rw, w, rtol=1e-6, atol=1e-7)
    assert check_replay_errors(device, raise_error=False) == 1  # row 4: no record, table can't route it
    recorded = ids.clone()
    recorded[1] = -1  # no record: the table
    recorded[2] = torch.tensor([7, 6]) if table[4].tolist() != [7, 6] else torch.tensor([5, 6])
    recorded[4] = torch.tensor([0, 1])  # a record for the faulty token: forced, no fault
    rw, rids = replay_routing(logits, recorded, method, **hashed)
    assert rids[[0, 1, 3, 5]].tolist() == ids[[0, 1, 3, 5]].tolist()
    assert rids[2].tolist() == recorded[2].tolist() and rids[4].tolist() == [0, 1]
    no_table = dict(kw, backend=backend)
    forced_w, _ = replay_routing(logits, rids, method, **no_table)
    torch.testing.assert_close(rw, forced_w, rtol=1e-6, atol=1e-7)
    assert check_replay_errors(device, raise_error=False) == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("method", list(RoutingMethod))
def test_gradcheck_of_replay_with_hash_table_float64(backend, method):
    """gradcheck of replay_routing with a table in float64: a recorded row, rows without a record
    (the table's ids), a faulty record (the table's ids) and an unroutable row (zero gradient);
    gradients reach the logits through the weight rule only."""
    backend, device = backend
    _skip_unavailable(backend, device)
    if backend == "triton" and method not in (M.DEEPSEEK_V3, M.DEFAULT, M.SIGMOID_RENORM):
        pytest.skip("interpreted: three methods (one per gradient shape) keep the case short")
    k = METHODS[method].top_k or 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64).requires_grad_()
    table = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(3)])
    tokens = torch.tensor([0, 1, 2, 9])  # row 3: token 9 is out of the vocabulary
    recorded = torch.full((4, k), -1, dtype=torch.int64)
    recorded[0] = torch.arange(k) + 1
    recorded[2, 0] = 17  # faulty record
    kw = dict(routed_scaling_factor=2.5) if METHODS[method].scaled else {}

    def weights(logits):
        return replay_routing(
            logits, recorded, method, hash_table=table, token_ids=tokens, backend=backend, **kw
        )[0]

    assert torch.autograd.gradcheck(weights, (x,), eps=1e-6, atol=1e-8, rtol=1e-6)
    w = weights(x)
    w.sum().backward()
    assert torch.equal(x.grad[3], torch.zeros(6, dtype=torch.float64))  # the unroutable row
    assert (w[3] == 0).all()
    check_replay_errors(device, raise_error=False)


# ---------------------------------------------------------------------------------------------------
# torch.compile, argument checks
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, device",
    [("torch", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)],
)
def test_compiled_route_with_table_fullgraph(backend, device):
    """torch.compile(fullgraph=True) of a hashed route with a fused LOCAL capture: no graph break,
    equal to eager, the fault counter counted on the device (no host read in the graph)."""
    _skip_unavailable(backend, device)
    logits, table, tokens = _replay_case(device)
    buffer = torch.full((6, 2, 2), POISON, dtype=torch.int32, device=device)
    counts = torch.tensor([6], dtype=torch.int32, device=device)

    def fn(x, tok):
        target = CaptureTarget(buffer, 1, token_counts=counts, dp_rank=0, layout=BatchLayout.LOCAL)
        return route(x, 2, M.SIGMOID_RENORM, hash_table=table, token_ids=tok, capture=target, backend=backend)

    check_hash_errors(device, raise_error=False)
    moe_ops.check_capture_errors(device, raise_error=False)
    ref_w, ref_ids = fn(logits, tokens)
    ref_buffer = buffer.clone()
    buffer.fill_(POISON)
    with CompileCounters() as cc:
        w, ids = torch.compile(fn, fullgraph=True)(logits, tokens)
    assert cc.graph_breaks == 0
    assert torch.equal(ids, ref_ids) and torch.equal(buffer, ref_buffer)
    torch.testing.assert_close(w, ref_w)
    assert hash_fault_counter(device)[0].item() == 2  # row 4 in each call
    check_hash_errors(device, raise_error=False)
    moe_ops.check_capture_errors(device, raise_error=False)


def _bad_args(device):
    table = torch.zeros(5, 2, dtype=torch.int64, device=device)
    tokens = torch.zeros(3, dtype=torch.int64, device=device)
    groups = dict(n_group=2, topk_group=1)
    return [
        (dict(hash_table=table), ValueError, "hash_table needs token_ids"),
        (dict(token_ids=tokens), ValueError, "token_ids needs hash_table"),
        (dict(hash_table=table.float(), token_ids=tokens), ValueError, "hash_table must be uint8"),
        (dict(hash_table=table, token_ids=tokens.float()), ValueError, "token_ids must be uint8"),
        (dict(hash_table=table[:, :1], token_ids=tokens), ValueError, r"2-D \(vocab >= 1, top_k=2\)"),
        (dict(hash_table=table[:0], token_ids=tokens), ValueError, "hash_table must be 2-D"),
        (dict(hash_table=table[0], token_ids=tokens), ValueError, "hash_table must be 2-D"),
        (dict(hash_table=table, token_ids=tokens[:2]), ValueError, r"shape \(n_tokens,\) = \(3,\)"),
        (dict(hash_table=table, token_ids=tokens[None]), ValueError, "token_ids must have shape"),
        (dict(hash_table=table.tolist(), token_ids=tokens), TypeError, "hash_table must be a torch.Tensor"),
        (dict(hash_table=table, token_ids=tokens, **groups), ValueError, "n_group/topk_group choose"),
        (dict(hash_table=table, token_ids=tokens, backend="flashinfer"), ValueError, "no hash routing"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(12))
def test_bad_hash_arguments_raise_before_anything_is_written(case):
    logits = torch.randn(3, 4)
    kwargs, error, message = _bad_args("cpu")[case]
    method = M.DEEPSEEK_V3 if "n_group" in kwargs else M.RENORMALIZE
    buffer = torch.full((3, 1, 2), POISON, dtype=torch.int32)
    target = CaptureTarget(buffer, 0, token_counts=torch.tensor([3], dtype=torch.int32), dp_rank=0)
    with pytest.raises(error, match=message):
        route(logits, 2, method, capture=target, **kwargs)
    assert (buffer == POISON).all()
    replay_kw = {key: v for key, v in kwargs.items() if key != "backend"}
    if "backend" not in kwargs:
        with pytest.raises(error, match=message):
            replay_routing(logits, torch.full((3, 2), -1), method, **replay_kw)


def test_bias_is_refused_beside_a_table():
    logits = torch.randn(3, 4)
    table = torch.zeros(5, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="bias chooses experts"):
        route(
            logits,
            2,
            M.DEEPSEEK_V3,
            bias=torch.zeros(4),
            hash_table=table,
            token_ids=torch.zeros(3, dtype=torch.int64),
        )


def test_table_on_another_device_is_refused():
    meta = torch.zeros(5, 2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="hash_table must be on router_logits' device cpu"):
        route(torch.randn(3, 4), 2, hash_table=meta, token_ids=torch.zeros(3, dtype=torch.int64))


class _Rows:
    """A replayer holding one layer's recorded rows (the ``layer_ids`` protocol of
    ``replaying_forward``; moe_ops.RoutingReplayer is one)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def layer_ids(self, layer: int, n: int) -> torch.Tensor:
        return self.rows[:n]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_replay_rule_of_transformers_hash_router(backend):
    """ReplayRule(hash_table_attr="tid2eid", token_ids_arg=1) around transformers' own
    DeepseekV4HashRouter: recorded rows forced, a -1 row keeps the model's output, a faulty record
    takes the table's ids (not a top-k of the logits), weights by the model's formula."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    from moe_ops.attach.replaying import ReplayRule, replaying_forward

    backend, device = backend
    _skip_unavailable(backend, device)
    config = DeepseekV4Config(
        vocab_size=20, hidden_size=8, num_local_experts=6, num_experts_per_tok=2, scoring_func="sigmoid",
        routed_scaling_factor=1.5,
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    router = DeepseekV4HashRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.tid2eid.copy_(torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(20)]))
    hidden = torch.randn(1, 4, 8, generator=g)
    input_ids = torch.tensor([[5, 9, 5, 13]])
    with torch.no_grad():
        logits, hf_w, hf_ids = router(hidden, input_ids)
    recorded = torch.tensor([[4, 1], [-1, -1], [2, 2], [0, 3]])  # row 2: an expert twice (faulty)
    rule = ReplayRule(M.DEEPSEEK_V3, routed_scaling_factor=1.5, hash_table_attr="tid2eid", token_ids_arg=1)
    check_replay_errors(device, raise_error=False)
    forward = replaying_forward(router.forward, _Rows(recorded), 0, rule, router, backend=backend)
    with torch.no_grad():
        _, w, ids = forward(hidden, input_ids)
    table_row = router.tid2eid[13].tolist()
    assert ids.tolist() == [[4, 1], hf_ids[1].tolist(), hf_ids[2].tolist(), [0, 3]]
    assert ids[2].tolist() == router.tid2eid[5].tolist() and ids[3].tolist() != table_row
    torch.testing.assert_close(w[1:3], hf_w[1:3])  # the model's own rows (-1, and the table's ids)
    s = torch.sigmoid(logits[[0, 3]].gather(1, torch.tensor([[4, 1], [0, 3]])))
    torch.testing.assert_close(w[[0, 3]], s / (s.sum(-1, keepdim=True) + 1e-20) * 1.5)
    assert check_replay_errors(device, raise_error=False) == 1  # the faulty record


@pytest.mark.gpu
def test_route_hash_in_a_cuda_graph(cuda_device):
    """A captured hashed route with fused capture, replayed after the token ids and the logits
    changed in place: the graph's ids, weights, buffer and fault count follow the new values."""
    logits, table, tokens = _replay_case(cuda_device)
    buffer = torch.full((6, 1, 2), POISON, dtype=torch.int32, device=cuda_device)
    counts = torch.tensor([6], dtype=torch.int32, device=cuda_device)
    target = CaptureTarget(buffer, 0, token_counts=counts, dp_rank=0, layout=BatchLayout.LOCAL)

    def step():
        return route(logits, 2, M.SIGMOID_RENORM, hash_table=table, token_ids=tokens, capture=target)

    step()  # warm-up: compiles the kernel, allocates the counters
    check_hash_errors(cuda_device, raise_error=False)
    moe_ops.check_capture_errors(cuda_device, raise_error=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = step()
    tokens.copy_(torch.tensor([4, 4, 0, 9, 1, 2], device=cuda_device))  # row 3 now faulty, row 4 not
    logits.mul_(2.0)
    graph.replay()
    ref_w, ref_ids = hash_route_reference(logits.double(), table, tokens, M.SIGMOID_RENORM)
    assert torch.equal(ids.long(), ref_ids) and torch.equal(buffer[:, 0].long(), ref_ids)
    torch.testing.assert_close(w, ref_w.float(), rtol=1e-5, atol=1e-6)
    assert check_hash_errors(cuda_device, raise_error=False) == 1
    moe_ops.check_capture_errors(cuda_device, raise_error=False)


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(RoutingMethod))
def test_replay_with_hash_table_triton_equals_twin_gpu(cuda_device, method):
    """On CUDA, replay_routing with a table (recorded, -1, faulty-record and unroutable rows): the
    Triton kernels' ids, weights and float32 gradients against the twins'."""
    k = METHODS[method].top_k or 2
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 32, generator=g).to(cuda_device)
    table = torch.stack([torch.randperm(32, generator=g)[:k] for _ in range(50)]).to(cuda_device)
    tokens = torch.randint(0, 52, (64,), generator=g).to(cuda_device)  # 50, 51: unroutable
    recorded = torch.full((64, k), -1, dtype=torch.int32)
    recorded[::3] = torch.stack([torch.randperm(32, generator=g)[:k] for _ in range(22)]).int()
    recorded[1::7, 0] = 40  # faulty
    recorded = recorded.to(cuda_device)
    kw = dict(routed_scaling_factor=2.5) if METHODS[method].scaled else {}
    results = []
    for backend in ("triton", "torch"):
        xb = x.clone().requires_grad_()
        hashed = dict(hash_table=table, token_ids=tokens, backend=backend, **kw)
        w, ids = replay_routing(xb, recorded, method, **hashed)
        (w * torch.linspace(-1, 1, w.numel(), device=cuda_device).view_as(w)).sum().backward()
        results.append((w.detach(), ids, xb.grad))
    (tw, tids, tgrad), (rw, rids, rgrad) = results
    assert torch.equal(tids, rids)
    torch.testing.assert_close(tw, rw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tgrad, rgrad, rtol=1e-5, atol=1e-6)
    check_replay_errors(cuda_device, raise_error=False)
