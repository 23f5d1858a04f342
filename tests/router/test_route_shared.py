"""Fused shared experts (``num_fused_shared_experts``): the columns ``route`` and ``replay_routing``
append after the routed top-k, what capture records of them, and what replay refuses.

The rule tested is vLLM's and FlashInfer's (docs/routing.md "Fused shared experts"): ids
``num_experts + j`` in columns ``top_k + j`` at weight 1.0, ``routed_scaling_factor`` untouched.
:func:`peer_shared_columns` restates it from FlashInfer's DeepSeek-V3 routing reference
(``flashinfer/trace/templates/moe.py``: ``torch.arange(E, E + S)`` and ``torch.ones`` appended)
and vLLM's ``init_aiter_topK_meta_data`` (``shared_expert_ids = [n_routed_experts + i ...]``,
``shared_experts_score=1.0``); neither peer exposes that step as a function of its own (FlashInfer's
runs the experts right after it; vLLM and SGLang are not installed here), so the restatement is
written from their code, independently of the twin.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    MODEL_ROUTERS,
    POISON,
    VIEW_GUARD,
    capture_cases,
    router_cases,
    router_configs,
    shared_capture_cases,
)

import moe_ops
from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, capture_routing, replay_routing, route
from moe_ops.capture.errors import FAULT_SLOTS
from moe_ops.replay.kernels import REPLAY_FAULT_OUT_OF_RANGE
from moe_ops.replay.op import ReplayFaultError, check_replay_errors, replay_fault_counter
from moe_ops.router.kernels import route_rows_torch, route_rows_triton

BACKENDS = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpret"),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.gpu),
]
# interpreted Triton pays per program and operation: few, small cases
SMALL = dict(max_experts=64, max_top_k=8)


def _skip(backend: str, device: str) -> None:
    if backend == "triton":
        skip_unless_triton_runs(device)
    elif device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def peer_shared_columns(n: int, num_experts: int, n_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, s) float32, ids (n, s) int64) of the shared columns, row by row as the peers
    build them: ids num_experts + j, weight 1.0 for every token."""
    ids = [[num_experts + j for j in range(n_shared)] for _ in range(n)]
    weights = [[1.0] * n_shared for _ in range(n)]
    return (
        torch.tensor(weights, dtype=torch.float32).reshape(n, n_shared),
        torch.tensor(ids, dtype=torch.int64).reshape(n, n_shared),
    )


def _route(case, backend, device, n_shared, **kw):
    logits, bias = case.tensors(device)
    cfg = case.config
    return route(
        logits,
        cfg.top_k,
        cfg.method,
        backend=backend,
        num_fused_shared_experts=n_shared,
        **cfg.route_kwargs(bias),
        **kw,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30, deadline=None)
@given(case=router_cases(router_configs(**SMALL), max_tokens=12), n_shared=st.integers(1, 4))
def test_route_appends_the_peers_shared_columns(backend, case, n_shared):
    """Routed columns: exactly route without shared experts (ids and weights bit-equal, the scale
    on them only); shared columns: the peers' ids and weight 1.0, whatever the scale."""
    backend, device = backend
    _skip(backend, device)
    w, ids = _route(case, backend, device, n_shared)
    w0, ids0 = _route(case, backend, device, 0)
    k, e = case.config.top_k, case.config.num_experts
    assert w.shape == ids.shape == (case.n, k + n_shared)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids[:, :k], ids0)
    torch.testing.assert_close(w[:, :k], w0, rtol=0, atol=0, equal_nan=True)
    ref_w, ref_ids = peer_shared_columns(case.n, e, n_shared)
    assert torch.equal(ids[:, k:].cpu().long(), ref_ids)
    assert torch.equal(w[:, k:].cpu(), ref_w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaling_factor_leaves_shared_weight_at_one(backend):
    """DeepSeek-V3 with routed_scaling_factor 2.5 (FlashInfer: routed weights scaled, shared 1.0)."""
    backend, device = backend
    _skip(backend, device)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 32, generator=gen).to(device)
    bias = (torch.randn(32, generator=gen) * 0.1).to(device)
    kw = dict(bias=bias, n_group=4, topk_group=2, backend=backend, num_fused_shared_experts=1)
    w1, _ = route(logits, 4, RoutingMethod.DEEPSEEK_V3, routed_scaling_factor=1.0, **kw)
    w25, ids = route(logits, 4, RoutingMethod.DEEPSEEK_V3, routed_scaling_factor=2.5, **kw)
    torch.testing.assert_close(w25[:, :4], w1[:, :4] * 2.5, rtol=1e-6, atol=0)
    assert torch.equal(w25[:, 4].cpu(), torch.ones(6)) and torch.equal(ids[:, 4].cpu(), torch.full((6,), 32))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(
    case=router_cases(router_configs(**SMALL), max_tokens=10, kinds=("normal", "ties")),
    n_shared=st.integers(1, 3),
)
def test_router_kernels_write_every_cell_of_poisoned_strided_outputs(backend, case, n_shared):
    """The launchers themselves, outputs poisoned (NaN weights, POISON ids) and as column slices of
    wider tensors: every cell of the view written (routed and shared; finite logits give finite
    weights, so a NaN left is an unwritten cell), the guard columns beside it untouched."""
    backend, device = backend
    _skip(backend, device)
    logits, bias = case.tensors(device)
    cfg = case.config
    width = cfg.top_k + n_shared
    w_base = torch.full((case.n, width + 2), float(VIEW_GUARD), device=device)
    i_base = torch.full((case.n, width + 2), VIEW_GUARD, dtype=torch.int32, device=device)
    w_base[:, 1 : width + 1] = float("nan")
    i_base[:, 1 : width + 1] = POISON
    weights, ids = w_base[:, 1 : width + 1], i_base[:, 1 : width + 1]
    n_group, topk_group = cfg.groups
    scale = cfg.routed_scaling_factor or 1.0
    kernel = route_rows_triton if backend == "triton" else route_rows_torch
    method = int(cfg.method)
    kernel(
        logits, bias, weights, ids, method, n_group, topk_group, scale,
        num_fused_shared_experts=n_shared, group_top=cfg.group_top,
    )  # fmt: skip
    ref_w, ref_ids = _route(case, "torch", device, n_shared)
    assert torch.equal(ids, ref_ids) and not weights.isnan().any()
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-7)
    for base in (w_base, i_base):
        assert (base[:, 0] == VIEW_GUARD).all() and (base[:, -1] == VIEW_GUARD).all()


def _counter_delta(device, fn):
    moe_ops.check_capture_errors(device, raise_error=False)
    out = fn()
    counter = moe_ops.capture_error_counter(device).tolist()
    moe_ops.check_capture_errors(device, raise_error=False)
    return out, counter


def check_capture(backend, device, case, router, n_shared, keep) -> None:
    """Fused capture records ``ids[:, :width]`` (the routed columns; with the knob every column)
    exactly as ``capture_routing`` of that slice does: this rank's rows, the rest poisoned."""
    logits, bias = router.tensors(device)
    cfg = router.config
    buffer, _, counts, sizes = case.tensors(device)
    capture_kw = dict(token_counts=counts, dp_rank=case.dp_rank, layout=case.layout, shard_sizes=sizes)
    kw = dict(cfg.route_kwargs(bias), backend=backend, num_fused_shared_experts=n_shared)
    fused_buf = buffer.clone()
    target = CaptureTarget(fused_buf, case.layer_id, **capture_kw)
    (w1, ids1), faults1 = _counter_delta(
        device,
        lambda: route(logits, cfg.top_k, cfg.method, capture=target, capture_shared_experts=keep, **kw),
    )
    width = cfg.top_k + (n_shared if keep else 0)
    sep_buf = buffer.clone()

    def separate():
        w, ids = route(logits, cfg.top_k, cfg.method, **kw)
        capture_routing(sep_buf, ids[:, :width], case.layer_id, **capture_kw)
        return w, ids

    (w2, ids2), faults2 = _counter_delta(device, separate)
    assert torch.equal(ids1, ids2) and torch.equal(w1, w2), "capturing changed the routing"
    assert faults1 == faults2 == [0] * FAULT_SLOTS
    expected = buffer.clone()
    rows = ids1[case.start : case.start + case.c, :width]
    expected[: case.c, case.layer_id] = rows.to(expected.dtype)
    assert torch.equal(fused_buf, expected), f"fused capture ({case.layout.name}, keep={keep})"
    assert torch.equal(sep_buf, expected), f"capture_routing of ids[:, :{width}] ({case.layout.name})"
    if not keep:
        shared_ids = torch.arange(cfg.num_experts, cfg.num_experts + n_shared, device=device)
        assert not torch.isin(fused_buf.long(), shared_ids).any(), "a shared id reached the buffer"


@pytest.mark.parametrize("backend", BACKENDS[:2])
@settings(max_examples=25, deadline=None)
@given(cases=shared_capture_cases())
def test_capture_records_the_routed_columns_unless_told(backend, cases):
    """Every layout (SEQUENCE_PARALLEL through its fallback), strided and sliced buffers and counts."""
    check_capture(*backend, *cases)


@pytest.mark.parametrize("backend", BACKENDS[2:])
@settings(max_examples=20, deadline=None)
@given(
    cases=shared_capture_cases(
        configs=st.just(MODEL_ROUTERS[0]),
        capture_kw=dict(buffer_dtypes=(torch.int32, torch.int16)),
        dtypes=(torch.bfloat16,),
    )
)
def test_capture_records_the_routed_columns_unless_told_gpu(backend, cases):
    _skip(*backend)
    check_capture(*backend, *cases)


@settings(max_examples=40, deadline=None)
@given(case=capture_cases(top_ks=(1, 2, 6, 8)), n_shared=st.integers(1, 3))
def test_capture_routing_of_a_column_slice_drops_the_appended_columns(case, n_shared):
    """``capture_routing(buffer, ids[:, :top_k], ...)``: a strided slice of ids with shared columns
    appended records exactly the routed ids, in every layout and ids memory layout."""
    buffer, topk_ids, counts, sizes = case.tensors("cpu")
    n, k = topk_ids.shape
    shared = torch.arange(512, 512 + n_shared, dtype=topk_ids.dtype).expand(n, n_shared)
    full = torch.cat([topk_ids, shared], dim=1)  # what route(..., num_fused_shared_experts) gives
    before = buffer.clone()
    capture_routing(
        buffer,
        full[:, :k],
        case.layer_id,
        token_counts=counts,
        dp_rank=case.dp_rank,
        layout=case.layout,
        shard_sizes=sizes,
    )
    assert torch.equal(buffer, case.expected(before))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(
    case=router_cases(
        router_configs(**SMALL), max_tokens=10, dtypes=(torch.float32,), kinds=("normal", "ties")
    ),
    n_shared=st.integers(1, 3),
)
def test_replay_of_the_captured_routed_columns_gives_route_back(backend, case, n_shared):
    """replay(x, route(x).ids[:, :top_k], s) == route(x, s): ids exactly, weights within 1e-6."""
    backend, device = backend
    _skip(backend, device)
    logits, bias = case.tensors(device)
    cfg = case.config
    kw = dict(cfg.route_kwargs(bias), backend=backend, num_fused_shared_experts=n_shared)
    w, ids = route(logits, cfg.top_k, cfg.method, **kw)
    rw, rids = replay_routing(logits, ids[:, : cfg.top_k], cfg.method, **kw)
    assert torch.equal(rids, ids)
    torch.testing.assert_close(rw, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_shared_columns_carry_no_gradient(backend):
    """The shared weights are constants: a loss on them moves no logit, and the routed part's
    gradient is replay's without shared experts (float64, gradcheck on the whole output)."""
    backend, device = backend
    _skip(backend, device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, dtype=torch.float64, generator=gen).to(device)
    bias = (torch.randn(12, dtype=torch.float64, generator=gen) * 0.1).to(device)
    kw = dict(bias=bias, routed_scaling_factor=2.5, backend=backend)
    _, ids = route(x.float(), 3, RoutingMethod.MINIMAX2, **dict(kw, bias=bias.float()))
    recorded = ids.clone()
    g = torch.randn(5, 3 + 2, dtype=torch.float64, generator=gen).to(device)

    def grad(n_shared, upstream):
        leaf = x.clone().requires_grad_(True)
        w, _ = replay_routing(leaf, recorded, RoutingMethod.MINIMAX2, num_fused_shared_experts=n_shared, **kw)
        (w * upstream).sum().backward()
        return leaf.grad

    torch.testing.assert_close(grad(2, g), grad(0, g[:, :3]), rtol=0, atol=0)
    only_shared = torch.zeros_like(g)
    only_shared[:, 3:] = 1.0
    assert torch.equal(grad(2, only_shared), torch.zeros_like(x))
    leaf = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda t: replay_routing(t, recorded, RoutingMethod.MINIMAX2, num_fused_shared_experts=2, **kw)[0],
        (leaf,),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_faults_on_a_shared_id_in_the_recorded_routed_columns(backend):
    """Recorded ids that kept a shared column where replay expects routed ones: the shared id is
    outside [0, num_experts), so the row is a fault (REPLAY_FAULT_OUT_OF_RANGE, counted on the
    device, raised by check_replay_errors) and is routed live; the other rows are replayed."""
    backend, device = backend
    _skip(backend, device)
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(device)
    kw = dict(backend=backend, num_fused_shared_experts=1)
    live_w, live_ids = route(logits, 3, RoutingMethod.RENORMALIZE, **kw)
    recorded = torch.tensor([[1, 2, 3], [4, 5, 16], [6, 7, 8], [16, 9, 10]], dtype=torch.int32, device=device)
    check_replay_errors(device, raise_error=False)
    w, ids = replay_routing(logits, recorded, RoutingMethod.RENORMALIZE, **kw)
    rows, flags = replay_fault_counter(device).tolist()
    assert rows == 2 and flags & REPLAY_FAULT_OUT_OF_RANGE
    with pytest.raises(ReplayFaultError):
        check_replay_errors(device)
    assert torch.equal(ids[[1, 3]], live_ids[[1, 3]])
    assert torch.equal(ids[[0, 2], :3], recorded[[0, 2]])
    assert torch.equal(ids[:, 3].cpu(), torch.full((4,), 16)) and torch.equal(w[:, 3].cpu(), torch.ones(4))
    torch.testing.assert_close(w[[1, 3]], live_w[[1, 3]], rtol=0, atol=1e-6)


def _target(buffer, counts=None):
    counts = torch.tensor([4], dtype=torch.int32) if counts is None else counts
    return CaptureTarget(buffer, 0, token_counts=counts, layout=BatchLayout.LOCAL)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(num_fused_shared_experts=-1), ValueError, "num_fused_shared_experts must be an int >= 0"),
        (dict(num_fused_shared_experts=True), TypeError, "num_fused_shared_experts must be an int"),
        (dict(num_fused_shared_experts=1.0), TypeError, "num_fused_shared_experts must be an int"),
        (dict(num_fused_shared_experts=2**31), ValueError, "beyond int32"),
        (dict(capture_shared_experts=True, num_fused_shared_experts=1), ValueError, "needs a capture target"),
        (dict(capture_shared_experts=1, num_fused_shared_experts=1), TypeError, "must be a bool"),
        (dict(backend="flashinfer", num_fused_shared_experts=1), ValueError, "backend='flashinfer'"),
    ],
)
def test_route_refuses_bad_shared_arguments(kw, error, match):
    with pytest.raises(error, match=match):
        route(torch.randn(4, 8), 2, RoutingMethod.RENORMALIZE, **kw)


def test_replay_refuses_bad_shared_count():
    with pytest.raises(ValueError, match="num_fused_shared_experts must be an int >= 0"):
        replay_routing(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int32), num_fused_shared_experts=-2)


@pytest.mark.parametrize(
    "width, dtype, num_experts, keep, n_shared, match",
    [
        (2, torch.int32, 8, True, 1, "top_k=3 columns but buffer was sized for top_k=2"),
        (3, torch.int32, 8, False, 1, "top_k=2 columns but buffer was sized for top_k=3"),
        (3, torch.int16, 32768, True, 1, "cannot hold expert ids up to 32768"),
        (2, torch.int32, 8, True, 0, "num_fused_shared_experts=0 appends none"),
    ],
)
def test_capture_width_and_dtype_must_fit_what_is_kept(width, dtype, num_experts, keep, n_shared, match):
    """The buffer's width is the knob's (top_k, or top_k + s with capture_shared_experts) and its
    dtype holds the largest kept id; refused before anything is written."""
    buffer = torch.full((4, 1, width), POISON, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        route(
            torch.randn(4, num_experts),
            2,
            RoutingMethod.RENORMALIZE,
            capture=_target(buffer),
            num_fused_shared_experts=n_shared,
            capture_shared_experts=keep,
            backend="torch",
        )
    assert (buffer == POISON).all()


def test_route_capture_op_called_by_name_writes_what_route_writes():
    """``route_capture_``'s arguments are generated (moe_ops.router.args.OpSignature): its own by
    name, the routing ones from a RoutingArgs, the capture's from the target's spec; the op then
    writes what ``route`` returns and records it."""
    from moe_ops.router.args import resolve_routing
    from moe_ops.router.op import ROUTE_CAPTURE

    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    buffer = torch.full((4, 1, 2), POISON, dtype=torch.int32)
    target = _target(buffer)
    weights = torch.full((4, 2), float("nan"))
    ids = torch.full((4, 2), POISON, dtype=torch.int32)
    nonfinite = torch.zeros(1, dtype=torch.int32)
    routing = resolve_routing(logits, 2, RoutingMethod.RENORMALIZE, backend="torch")
    host = ROUTE_CAPTURE.values(routing, router_logits=logits, weights=weights, ids=ids, nonfinite=nonfinite)
    args = ROUTE_CAPTURE.join(host, target.spec)
    assert len(args) == len(ROUTE_CAPTURE.names)
    torch.ops.moe_ops.route_capture_reference_(*args)
    ref_w, ref_ids = route(logits, 2, RoutingMethod.RENORMALIZE, backend="torch")
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w) and torch.equal(buffer[:, 0], ref_ids)


def test_compiled_route_with_shared_experts_equals_eager():
    """torch.compile(fullgraph=True): the shared columns and the routed-only capture, traced."""
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(5)) * 0.1
    counts = torch.tensor([6], dtype=torch.int32)

    def step(x, buffer):
        target = CaptureTarget(buffer, 0, token_counts=counts)
        return route(
            x,
            3,
            RoutingMethod.DEEPSEEK_V3,
            bias=bias,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            capture=target,
            num_fused_shared_experts=2,
        )

    eager_buf = torch.full((8, 1, 3), POISON, dtype=torch.int32)
    compiled_buf = eager_buf.clone()
    w1, ids1 = step(logits, eager_buf)
    w2, ids2 = torch.compile(step, fullgraph=True)(logits, compiled_buf)
    assert torch.equal(ids1, ids2) and torch.equal(w1, w2) and torch.equal(eager_buf, compiled_buf)
    assert torch.equal(compiled_buf[:6, 0], ids1[:, :3]) and (compiled_buf[6:] == POISON).all()
