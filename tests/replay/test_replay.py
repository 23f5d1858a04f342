"""moe_ops.replay_routing: ids, weights, gradients and faults, PyTorch twin and Triton kernel.

Ids are compared exactly. Weights: replaying ``route``'s own ids gives ``route``'s weights to 1e-6
(fp32, absolute); recorded rows match the float64 weight rule to 1e-5 relative. Gradients: float64
gradcheck of the twin for every method; the Triton kernel's fp32 gradients against the twin's to
1e-5 relative + 1e-6 absolute (bf16: torch's bf16 defaults, one rounding of equal fp32 values).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from strategies import GPU_ROUTER_CASES, MODEL_ROUTERS, RecordedCase, RouterCase, RouterConfig, recorded_cases

from benchmarks.cases import BENCH_CASES, BENCH_SIZES
from moe_ops import RoutingMethod, replay_routing, route
from moe_ops._runtime import faults
from moe_ops._runtime.triton import triton_runs_on
from moe_ops.replay import ReplayFaultError, check_replay_errors, replay_fault_counter
from moe_ops.replay.kernels import REPLAY_FAULT_OUT_OF_RANGE, REPLAY_FAULT_REPEATED, replay_weights
from moe_ops.router.methods import BIAS_METHODS, SCALED_METHODS, method_names
from moe_ops.router.methods import METHODS as METHOD_TABLE
from moe_ops.router.reference import route_reference

BACKENDS = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpret"),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.gpu),
]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
MODELS = [pytest.param(c, id=c.name) for c in MODEL_ROUTERS]
METHODS = [pytest.param(m, id=m.name) for m in RoutingMethod]


def _skip_unavailable(backend: str, device: str) -> None:
    if backend == "triton":
        skip_unless_triton_runs(device)


def _scale(config) -> float:
    return 1.0 if config.routed_scaling_factor is None else config.routed_scaling_factor


def _weights64(config, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The float64 weight rule at ``ids`` (the oracle of every replayed row)."""
    return replay_weights(logits.cpu().double(), ids.cpu().long(), config.method, _scale(config))


def _assert_weights_near_float64(config, logits, ids, weights, rows) -> None:
    want = _weights64(config, logits, ids)[rows]
    got = weights.cpu().double()[rows]
    err = (got - want).abs()
    bad = err > 1e-5 * want.abs() + 1e-30
    assert not bad.any(), f"{config.name}: weight error {float(err[bad].max()):.3g} beyond 1e-5 relative"


def run_replay(case: RecordedCase, backend: str, device: str):
    """Routes the case's logits, builds its record from the live ids, replays; returns everything."""
    cfg = case.router.config
    logits, bias = case.router.tensors(device)
    kw = cfg.route_kwargs(bias)
    route_w, route_ids = route(logits, cfg.top_k, cfg.method, backend=backend, **kw)
    recorded = case.recorded(route_ids).to(device)
    check_replay_errors(raise_error=False)  # start from zero
    weights, ids = replay_routing(logits, recorded, cfg.method, backend=backend, **kw)
    faults = check_replay_errors(logits.device, raise_error=False)
    return logits, recorded, route_w, route_ids, weights, ids, faults


def check_case(backend_device, case: RecordedCase) -> None:
    backend, device = backend_device
    _skip_unavailable(backend, device)
    cfg = case.router.config
    logits, recorded, route_w, route_ids, weights, ids, faults = run_replay(case, backend, device)
    n = case.router.n
    assert weights.shape == (n, cfg.top_k) and weights.dtype == torch.float32
    assert ids.shape == (n, cfg.top_k) and ids.dtype == torch.int32
    assert weights.device == logits.device and ids.device == logits.device
    live = case.routed_live()
    want_ids = torch.where(live[:, None], route_ids.cpu().long(), recorded.cpu().long())
    assert torch.equal(ids.cpu().long(), want_ids), "ids are not the record (or route's ids on live rows)"
    assert faults == case.faulty_rows, f"counted {faults} faulty rows, the record has {case.faulty_rows}"
    finite = torch.isfinite(logits.cpu().double()).all(1)
    torch.testing.assert_close(weights.cpu()[live & finite], route_w.cpu()[live & finite], rtol=0, atol=1e-6)
    _assert_weights_near_float64(cfg, logits, ids, weights, finite)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", MODELS)
def test_replaying_route_ids_gives_route(backend, config):
    """replay_routing(x, route(x)[1]) == route(x): ids exactly, weights to 1e-6 (fp32), every method."""
    backend, device = backend
    _skip_unavailable(backend, device)
    logits, bias = RouterCase(config, 48, torch.float32, 11, "normal", 2.0).tensors(device)
    kw = config.route_kwargs(bias)
    ref_w, ref_ids = route(logits, config.top_k, config.method, backend=backend, **kw)
    w, ids = replay_routing(logits, ref_ids, config.method, backend=backend, **kw)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-6)
    assert check_replay_errors(logits.device) == 0


@pytest.mark.parametrize("backend", [BACKENDS[0]])
@settings(max_examples=200)
@given(case=recorded_cases(max_tokens=40))
def test_twin_replays_every_row_kind(backend, case):
    check_case(backend, case)


@pytest.mark.parametrize("backend", [BACKENDS[1]])
@settings(max_examples=40)
@given(case=recorded_cases(max_tokens=12))
def test_triton_interpreted_replays_every_row_kind(backend, case):
    check_case(backend, case)


@pytest.mark.parametrize("backend", [BACKENDS[2]])
@settings(max_examples=60)
@given(case=recorded_cases(**GPU_ROUTER_CASES))
def test_triton_replays_every_row_kind_gpu(backend, case):
    check_case(backend, case)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25)
@given(case=recorded_cases(max_tokens=10, kinds=("special", "ties")))
def test_triton_equals_twin_on_edge_values(device, case):
    """+-inf, NaN, -0.0 and ties: the kernel and its twin choose the same ids (live rows too, for the
    methods without a bias; the biased ones may round sigmoid + bias differently near a tie)."""
    _skip_unavailable("triton", device)
    cfg = case.router.config
    logits, bias = case.router.tensors(device)
    kw = cfg.route_kwargs(bias)
    recorded = case.recorded(route(logits, cfg.top_k, cfg.method, backend="torch", **kw)[1]).to(device)
    tri_w, tri_ids = replay_routing(logits, recorded, cfg.method, backend="triton", **kw)
    ref_w, ref_ids = replay_routing(logits, recorded, cfg.method, backend="torch", **kw)
    check_replay_errors(logits.device, raise_error=False)
    compare = torch.ones(case.router.n, dtype=torch.bool)
    if cfg.method in BIAS_METHODS:
        compare = ~case.routed_live()
    assert torch.equal(tri_ids.cpu()[compare], ref_ids.cpu()[compare])
    finite = torch.isfinite(logits.cpu().float()).all(1) & compare
    torch.testing.assert_close(tri_w.cpu()[finite], ref_w.cpu()[finite], rtol=1e-5, atol=1e-7)


def test_renormalize_naive_far_below_the_best_logit_stays_finite():
    """p[ids] / sum p[ids] underflows to 0/0 in float32 when every recorded expert sits ~104 below
    the row's best logit; the replay computes its exact equal softmax(x[ids])."""
    logits = torch.zeros(3, 16)
    logits[:, 0] = 200.0
    recorded = torch.tensor([[3, 5], [7, 2], [9, 4]], dtype=torch.int32)
    literal = torch.softmax(logits, -1).gather(1, recorded.long())
    assert torch.isnan(literal / literal.sum(-1, keepdim=True)).all()  # the literal form fails here
    for backend in ("torch", "triton") if triton_runs_on(logits.device) else ("torch",):
        w, _ = replay_routing(logits, recorded, RoutingMethod.RENORMALIZE_NAIVE, backend=backend)
        torch.testing.assert_close(w, torch.full((3, 2), 0.5), rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# Faults: bad recorded ids are never read, are routed live and are counted
# ---------------------------------------------------------------------------------------------------


def _faulty_record():
    """(logits view inside a NaN-poisoned block, strided recorded ids, expected live rows, flags)."""
    n, e, k = 7, 16, 4
    block = torch.full((n + 2, e + 12), float("nan"))
    logits = block[1 : n + 1, 4 : 4 + e]  # an id outside [0, e) would read a NaN of the block
    logits.copy_(torch.randn(n, e, generator=torch.Generator().manual_seed(3)))
    buffer = torch.full((n, 3, k), -7, dtype=torch.int64)
    recorded = buffer[:, 1]  # one layer of a capture-style buffer: row stride 3 * k
    rows = [
        [3, 1, 2, 0],  # recorded
        [e, 1, 2, 0],  # one past the last expert
        [5, 5, 2, 0],  # an expert twice
        [-1, -1, -1, -1],  # live
        [-1, 4, -1, 6],  # partly -1: out of range (and -1 twice)
        [2**32 + 3, 1, 2, 0],  # wraps to 3 in int32: still out of range
        [-2, 8, 9, 10],  # one before the first expert
    ]
    recorded.copy_(torch.tensor(rows))
    live = torch.tensor([False, True, True, True, True, True, True])
    return logits, recorded, live, REPLAY_FAULT_OUT_OF_RANGE | REPLAY_FAULT_REPEATED


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_faulty_rows_are_routed_live_never_read_and_counted(backend):
    _skip_unavailable(backend, "cpu")
    logits, recorded, live, flags = _faulty_record()
    check_replay_errors(raise_error=False)
    w, ids = replay_routing(logits, recorded, RoutingMethod.RENORMALIZE, backend=backend)
    ref_w, ref_ids = route(logits.contiguous(), 4, RoutingMethod.RENORMALIZE, backend=backend)
    assert torch.isfinite(w).all(), "a bad id was read (the poisoned block holds NaN)"
    assert torch.equal(ids[live], ref_ids[live]) and torch.equal(ids[~live], recorded[~live].int())
    torch.testing.assert_close(w[live], ref_w[live], rtol=0, atol=1e-6)
    with pytest.raises(ReplayFaultError, match=r"5 replayed row\(s\) on cpu had bad recorded ids") as info:
        check_replay_errors()
    assert (info.value.rows, info.value.flags) == (5, flags)
    assert "outside [0, num_experts)" in str(info.value) and "twice" in str(info.value)
    assert check_replay_errors() == 0, "check_replay_errors did not reset the counter"


def test_faults_add_up_across_calls_and_reset():
    logits, recorded, _, _ = _faulty_record()
    check_replay_errors(raise_error=False)
    for _ in range(3):
        replay_routing(logits, recorded, RoutingMethod.RENORMALIZE)
    counter = replay_fault_counter("cpu")
    assert counter.tolist() == [15, REPLAY_FAULT_OUT_OF_RANGE | REPLAY_FAULT_REPEATED]
    assert check_replay_errors(raise_error=False) == 15
    assert counter.tolist() == [0, 0]
    assert replay_fault_counter("cpu") is counter, "the counter moved (CUDA graphs bake its address)"


def test_check_replay_errors_of_an_unused_device_is_zero():
    assert check_replay_errors("meta") == 0


def test_fault_counter_and_twin_are_thread_safe(monkeypatch):
    """Real threads: concurrent first calls share one counter, and concurrent replays lose no count."""
    # a fresh first use: the registry without the CPU routing counters, and none resolved (both
    # restored after the test)
    for kind in faults.ROUTING_KINDS:
        monkeypatch.delitem(faults._registry, (torch.device("cpu"), kind), raising=False)
    monkeypatch.setattr(faults, "_resolved", {})
    barrier = threading.Barrier(8)
    seen = []

    def first_use():
        barrier.wait()
        seen.append(replay_fault_counter("cpu"))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8 and all(c is seen[0] for c in seen)

    logits, recorded, _, _ = _faulty_record()
    calls = 25

    def replay_many():
        barrier.wait()
        for _ in range(calls):
            replay_routing(logits, recorded, RoutingMethod.RENORMALIZE, backend="torch")

    threads = [threading.Thread(target=replay_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert check_replay_errors(raise_error=False) == 8 * calls * 5


# ---------------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------------


def _method_config(method: RoutingMethod, e: int = 16):
    """(top_k, bias, n_group, topk_group, scale) of an ``e``-expert router of ``method`` (DeepSeek-V3:
    4 groups, keep 2, a float64 bias and a scale float32 cannot hold; MINIMAX2: a float32 bias)."""
    if METHOD_TABLE[method].top_k is not None:
        return METHOD_TABLE[method].top_k, None, 1, 1, 1.0
    if method == RoutingMethod.DEEPSEEK_V3:
        return 4 if e > 8 else 3, torch.linspace(-0.2, 0.2, e, dtype=torch.float64), 4, 2, 2.827
    if method == RoutingMethod.MINIMAX2:
        return 4 if e > 8 else 3, torch.linspace(0.2, -0.2, e), 1, 1, 1.5
    if method == RoutingMethod.SOFTMAX_BIAS:  # softmax + bias in groups; no scale
        return 4 if e > 8 else 3, torch.linspace(-0.2, 0.2, e, dtype=torch.float64), 4, 2, 1.0
    return 4 if e > 8 else 3, None, 1, 1, 1.0


def _kwargs(method: RoutingMethod, bias, n_group: int, topk_group: int, scale: float) -> dict:
    """replay_routing's keyword arguments for a config of :func:`_method_config`."""
    if method not in BIAS_METHODS:
        return {}
    groups = dict(n_group=n_group, topk_group=topk_group) if n_group > 1 else {}
    scaled = dict(routed_scaling_factor=scale) if method in SCALED_METHODS else {}
    return dict(bias=bias, **scaled, **groups)


def _separated_logits(n: int, e: int, seed: int, device="cpu") -> torch.Tensor:
    """(n, e) float64 logits whose values in a row lie >= 0.39 apart: a finite difference of 1e-6
    never changes a live row's choice (or DeepSeek-V3's groups)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.stack([torch.randperm(e, generator=g) for _ in range(n)]).double() * 0.4 - 0.2 * e
    return (spread + torch.rand(n, e, generator=g, dtype=torch.float64) * 0.01).to(device)


def _mixed_record(k: int, e: int, n: int, seed: int) -> torch.Tensor:
    """Recorded rows of random distinct experts (not the top-k), one -1 row and one faulty row."""
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    rows[1] = -1
    rows[3, 0] = e + 2
    return torch.from_numpy(rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_gradcheck_of_public_replay_routing_float64(method, backend):
    """torch.autograd.gradcheck of the public replay_routing on float64 logits (a user's check, and
    Megatron's moe_router_dtype="fp64"), every method with its bias, groups and scale: recorded rows
    (distinct experts, not the top-k), a -1 row and a faulty row (both routed live), on the twins
    and on the Triton kernels (interpreted here: 3 x 8 logits)."""
    backend, device = backend
    _skip_unavailable(backend, device)
    e = 8
    top_k, bias, n_group, topk_group, scale = _method_config(method, e)
    kw = _kwargs(method, None if bias is None else bias.to(device), n_group, topk_group, scale)
    x = _separated_logits(3, e, int(method), device).requires_grad_()
    recorded = _mixed_record(top_k, e, 4, int(method))[:3].to(device)  # rows: recorded, -1, recorded
    recorded[2, 0] = e + 2  # faulty
    check_replay_errors(x.device, raise_error=False)

    def weights(logits):
        return replay_routing(logits, recorded, method, backend=backend, **kw)[0]

    w = weights(x)
    assert w.dtype == torch.float64 and w.requires_grad
    assert torch.autograd.gradcheck(weights, (x,), eps=1e-6, atol=1e-8, rtol=1e-6)
    assert check_replay_errors(x.device, raise_error=False) > 0  # the faulty row was counted


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", MODELS)
def test_float64_logits_replay_in_float64(backend, config):
    """float64 logits: float64 weights (the float64 rule at the ids, to 1e-12) and gradients; live
    and faulty rows take the float64 reference router's ids exactly; the Triton kernels equal the
    twins (ids exactly, weights and gradients to 1e-12)."""
    backend, device = backend
    _skip_unavailable(backend, device)
    n = 5
    x64 = _separated_logits(n, config.num_experts, 21, device)
    bias = None
    if config.has_bias:
        bias = torch.linspace(-0.3, 0.3, config.num_experts, dtype=torch.float64, device=device)
    kw = config.route_kwargs(bias)
    recorded = _mixed_record(config.top_k, config.num_experts, n, 8).to(device)  # row 1: -1, row 3: faulty
    g = torch.randn(n, config.top_k, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(
        device
    )
    out = {}
    check_replay_errors(x64.device, raise_error=False)
    for b in dict.fromkeys((backend, "torch")):
        x = x64.clone().requires_grad_()
        w, ids = replay_routing(x, recorded, config.method, backend=b, **kw)
        (grad,) = torch.autograd.grad(w, x, g)
        out[b] = w.detach(), ids, grad
        assert check_replay_errors(x64.device, raise_error=False) == 1, b
    w, ids, grad = out[backend]
    assert w.dtype == grad.dtype == torch.float64 and ids.dtype == torch.int32
    n_group, topk_group = config.groups
    scale, group_top = _scale(config), config.group_top
    ref_ids = route_reference(
        x64, config.top_k, config.method, bias, n_group, topk_group, scale, group_top=group_top
    )[1]
    live = torch.tensor([False, True, False, True, False], device=device)
    assert torch.equal(ids[live].long(), ref_ids[live]), "live rows: not the float64 router's ids"
    assert torch.equal(ids[~live].long(), recorded[~live].long())
    want = replay_weights(x64, ids.long(), config.method, _scale(config))
    torch.testing.assert_close(w, want, rtol=1e-12, atol=1e-15)
    ref_w, ref_ids, ref_grad = out["torch"]
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", METHODS)
def test_live_rows_get_the_live_routers_gradient(method):
    """A row of -1 is routed by the reference router, and its gradient is autograd's through the
    reference (float64): the weights of the router's own choice, differentiated."""
    top_k, bias, n_group, topk_group, scale = _method_config(method)
    x = torch.randn(9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + int(method)))
    g = torch.randn(9, top_k, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    recorded = torch.full((9, top_k), -1)
    mine = x.clone().requires_grad_()
    w, ids = replay_routing(mine, recorded, method, **_kwargs(method, bias, n_group, topk_group, scale))
    (w * g).sum().backward()

    ref = x.clone().requires_grad_()
    ref_w, ref_ids = route_reference(ref, top_k, method, bias, n_group, topk_group, scale)
    (ref_w * g).sum().backward()
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", MODELS)
def test_gradients_match_autograd_through_the_reference(backend, config):
    """fp32 public API: the gradient of every row (recorded experts that are not the top-k, live and
    faulty rows) equals autograd through the weight rule gathered from the dense scores, so recorded
    experts get their gradient (a zero-filled scatter copy would give them none)."""
    backend, device = backend
    _skip_unavailable(backend, device)
    logits, bias = RouterCase(config, 24, torch.float32, 5, "normal", 1.0).tensors(device)
    kw = config.route_kwargs(bias)
    recorded = _mixed_record(config.top_k, config.num_experts, 24, 9).to(device)
    if config.top_k == 1:
        recorded[3, 0] = config.num_experts + 2
    g = torch.randn(24, config.top_k, generator=torch.Generator().manual_seed(2)).to(device)

    x = logits.clone().requires_grad_()
    w, ids = replay_routing(x, recorded, config.method, backend=backend, **kw)
    (w * g).sum().backward()
    check_replay_errors(logits.device, raise_error=False)

    ref_x = logits.clone().requires_grad_()
    ref_w = replay_weights(ref_x, ids.long(), config.method, _scale(config))
    (ref_w * g).sum().backward()
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    at_ids = x.grad.gather(1, ids.long())
    assert (at_ids != 0).float().mean() > 0.9, "recorded experts got no gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", MODELS)
def test_triton_gradients_match_twin(config, device, dtype):
    skip_unless_triton_runs(device)
    logits, bias = RouterCase(config, 20, dtype, 13, "normal", 1.5).tensors(device)
    kw = config.route_kwargs(bias)
    recorded = _mixed_record(config.top_k, config.num_experts, 20, 4).to(device)
    grads = {}
    for backend in ("triton", "torch"):
        x = logits.clone().requires_grad_()
        w, ids = replay_routing(x, recorded, config.method, backend=backend, **kw)
        # w.sum(): an expanded (stride 0) incoming gradient; the square: a dense one
        (w.sum() + (w * w).sum()).backward()
        grads[backend] = (w, ids, x.grad)
    check_replay_errors(logits.device, raise_error=False)
    (tri_w, tri_ids, tri_grad), (ref_w, ref_ids, ref_grad) = grads["triton"], grads["torch"]
    assert tri_grad.dtype == dtype and tri_grad.shape == logits.shape
    if config.method not in BIAS_METHODS:
        assert torch.equal(tri_ids, ref_ids)
    same = (tri_ids == ref_ids).all(1)
    torch.testing.assert_close(tri_w[same], ref_w[same], rtol=1e-5, atol=1e-7)
    if dtype == torch.float32:
        torch.testing.assert_close(tri_grad[same], ref_grad[same], rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(tri_grad[same], ref_grad[same])


def test_bias_gets_no_gradient():
    """The bias only chooses the experts of live rows (piecewise constant): no gradient reaches it."""
    config = MODEL_ROUTERS[0]
    logits, bias = RouterCase(config, 8, torch.float32, 1, "normal", 1.0).tensors("cpu")
    bias.requires_grad_()
    x = logits.clone().requires_grad_()
    recorded = torch.full((8, config.top_k), -1, dtype=torch.int32)
    w, _ = replay_routing(x, recorded, config.method, **config.route_kwargs(bias))
    w.sum().backward()
    assert bias.grad is None and x.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", [MODEL_ROUTERS[0], MODEL_ROUTERS[8]], ids=lambda c: c.name)
def test_zero_tokens(backend, config):
    backend, device = backend
    _skip_unavailable(backend, device)
    logits, bias = RouterCase(config, 0, torch.float32, 0, "normal", 1.0).tensors(device)
    x = logits.clone().requires_grad_()
    recorded = torch.empty(0, config.top_k, dtype=torch.int32, device=device)
    w, ids = replay_routing(x, recorded, config.method, backend=backend, **config.route_kwargs(bias))
    assert w.shape == (0, config.top_k) and w.dtype == torch.float32
    assert ids.shape == (0, config.top_k) and ids.dtype == torch.int32
    w.sum().backward()
    assert x.grad.shape == (0, config.num_experts)


def test_double_backward_raises():
    """First order only: a second derivative raises instead of returning a gradient with no graph."""
    x = torch.randn(5, 16, requires_grad=True)
    w, _ = replay_routing(x, torch.arange(20).remainder(16).view(5, 4))
    (g,) = torch.autograd.grad((w * w).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


def test_no_grad_skips_autograd():
    logits = torch.randn(5, 16, requires_grad=True)
    recorded = torch.arange(20).remainder(16).view(5, 4).int()
    with torch.no_grad():
        w, _ = replay_routing(logits, recorded)
    assert not w.requires_grad
    w, _ = replay_routing(logits, recorded)
    assert w.requires_grad


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------

DS = dict(method=RoutingMethod.DEEPSEEK_V3, n_group=4, topk_group=2, bias=torch.zeros(16))
# (replay_routing arguments changed from: 6 x 16 float32 logits, 6 x 4 int32 ids, RENORMALIZE),
# exception, message
BAD = [
    (dict(recorded_ids=[[1, 2]]), TypeError, "recorded_ids must be a torch.Tensor"),
    (dict(recorded_ids=torch.zeros(6, dtype=torch.int32)), ValueError, r"recorded_ids must be 2-D"),
    (
        dict(recorded_ids=torch.zeros(6, 4)),
        ValueError,
        "recorded_ids must be uint8, int8, int16, int32 or int64",
    ),
    (dict(recorded_ids=torch.zeros(6, 4, dtype=torch.bool)), ValueError, "got torch.bool"),
    (dict(recorded_ids=torch.zeros(5, 4, dtype=torch.int32)), ValueError, r"one row per token.*\(6\), got 5"),
    (
        dict(recorded_ids=torch.zeros(6, 0, dtype=torch.int32)),
        ValueError,
        r"top_k columns in \[1, num_experts=16\]",
    ),
    (dict(recorded_ids=torch.zeros(6, 17, dtype=torch.int32)), ValueError, "got 17"),
    (
        dict(recorded_ids=torch.zeros(6, 4, dtype=torch.int32, device="meta")),
        ValueError,
        "device cpu, got meta",
    ),
    (
        dict(method=RoutingMethod.LLAMA4),
        ValueError,
        "LLAMA4 routing picks one expert.*recorded_ids must have 1 col",
    ),
    (
        dict(router_logits=torch.randn(6, 16).to(torch.int32)),
        ValueError,
        "router_logits must be float32, bfloat16, float16 or float64, got torch.int32",
    ),
    (
        dict(DS, bias=torch.zeros(16, dtype=torch.int8)),
        ValueError,
        "bias must be float32, bfloat16, float16 or",
    ),
    (dict(router_logits=torch.randn(2, 3, 16)), ValueError, "router_logits must be 2-D"),
    (dict(router_logits="logits"), TypeError, "router_logits must be a torch.Tensor"),
    (dict(method=len(RoutingMethod) + 1), ValueError, "method must be a RoutingMethod"),
    (dict(backend="flashinfer"), ValueError, "backend must be one of 'auto', 'triton', 'torch'"),
    (dict(bias=torch.zeros(16)), ValueError, f"bias is only used by {method_names(BIAS_METHODS)}"),
    (dict(DS, n_group=3), ValueError, "n_group=3 must divide num_experts=16"),
    (dict(DS, bias=torch.zeros(15)), ValueError, r"bias must have shape \(num_experts,\)"),
    (dict(routed_scaling_factor=float("-inf")), ValueError, "routed_scaling_factor must be finite"),
    (dict(DS, routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor must be finite"),
    (dict(routed_scaling_factor=1e39), ValueError, "routed_scaling_factor must be finite in float32"),
]


@pytest.mark.parametrize("change, exc, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments_raise_before_anything_runs(change, exc, message):
    args = dict(
        router_logits=torch.randn(6, 16),
        recorded_ids=torch.full((6, 4), 99, dtype=torch.int32),  # faulty if it ever ran
        method=RoutingMethod.RENORMALIZE,
    )
    args.update(change)
    counter = replay_fault_counter("cpu")
    check_replay_errors(raise_error=False)
    with pytest.raises(exc, match=message):
        replay_routing(**args)
    assert counter.tolist() == [0, 0], "a rejected call ran"


def test_triton_backend_where_triton_cannot_run():
    if triton_runs_on(torch.device("cpu")):
        pytest.skip("Triton runs on CPU tensors here (TRITON_INTERPRET=1)")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        replay_routing(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int32), backend="triton")


def test_triton_backend_too_wide_a_row():
    skip_unless_triton_runs("cpu")
    with pytest.raises(ValueError, match="at most 4096 experts"):
        replay_routing(torch.randn(2, 4097), torch.zeros(2, 2, dtype=torch.int32), backend="triton")
    w, _ = replay_routing(torch.randn(2, 4097), torch.zeros(2, 2, dtype=torch.int32) + torch.tensor([0, 1]))
    assert w.shape == (2, 2)  # "auto" falls back to the twin


# ---------------------------------------------------------------------------------------------------
# The shapes the benchmark measures (benchmarks/cases.py BENCH_CASES["replay"] name this test)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n", BENCH_SIZES["replay"])
@pytest.mark.parametrize("case", BENCH_CASES["replay"], ids=lambda c: c.name)
def test_benchmark_shapes_gpu(cuda_device, case, n):
    """The benchmark's routers (DeepSeek-V3 256/8, RENORMALIZE 128/8) at its sizes, bf16 logits:
    the Triton kernels against the twins, forward and backward, recorded and live rows."""
    config = RouterConfig.of(case)
    logits, bias = RouterCase(config, n, torch.bfloat16, n, "normal", 1.0).tensors(cuda_device)
    kw = config.route_kwargs(bias)
    recorded = route(logits, config.top_k, config.method, backend="torch", **kw)[1]
    recorded[::5] = -1
    out = {}
    for backend in ("triton", "torch"):
        x = logits.clone().requires_grad_()
        w, ids = replay_routing(x, recorded, config.method, backend=backend, **kw)
        (w * w).sum().backward()
        out[backend] = (w, ids, x.grad)
    assert check_replay_errors(cuda_device) == 0
    same = (out["triton"][1] == out["torch"][1]).all(1)
    assert same.float().mean() > 0.99
    torch.testing.assert_close(out["triton"][0][same], out["torch"][0][same], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out["triton"][2][same], out["torch"][2][same])
