"""routed_scaling_factor on every routing method: route (Triton kernel and twin) and replay_routing
(forward and backward, Triton and twin).

DEEPSEEK_V3's and MINIMAX2's rules hold the factor (``s * scale / (sum s + 1e-20)``); every other
method's weights are ``scale * rule`` after its rule, as vLLM, SGLang and Megatron apply it.

Tolerances: scaled weights against ``scale *`` the unscaled weights of the same implementation,
1e-6 relative (float32: one product, plus for the rules that hold the factor another operation
order, a few ulp); against Megatron-Core's own ``topk_routing_with_score_function`` (float32
logits, its operations in float32), 1e-6 relative + 1e-7 absolute; replay of route's ids against
route, 1e-6 relative (the same helpers in another tile layout). Ids are compared exactly, and the
unscaled default bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import GPU_ROUTER_CASES, MODEL_ROUTERS, ROUTED_SCALES, router_cases, scaled_router_cases

from moe_ops import RoutingMethod, replay_routing, route
from moe_ops.router.args import validate_route_args
from moe_ops.router.kernels import route_rows_torch, route_rows_triton
from moe_ops.router.methods import METHODS

M = RoutingMethod
BACKENDS = ("torch", "triton")
RTOL = 1e-6
ID_POISON = -99  # every id cell is written: none may keep it


def _strided(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as every other column of a wider NaN buffer (a sliced, column-strided view): a
    read of a gap would bring NaN into the weights or choose a gap."""
    n, e = logits.shape
    base = torch.full((n, 2 * e + 1), float("nan"), dtype=logits.dtype, device=logits.device)
    view = base[:, 1::2]
    view.copy_(logits)
    return view


def _route_poisoned(backend: str, logits, bias, config, scale: float | None):
    """The router kernel (or its twin) into NaN / ID_POISON outputs; returns (weights, ids)."""
    if backend == "triton":
        skip_unless_triton_runs(logits.device.type)
    cfg = validate_route_args(
        logits, config.top_k, config.method, bias, config.n_group, config.topk_group, scale
    )
    n = logits.shape[0]
    weights = torch.full((n, cfg.top_k), float("nan"), dtype=torch.float32, device=logits.device)
    ids = torch.full((n, cfg.top_k), ID_POISON, dtype=torch.int32, device=logits.device)
    kernel = route_rows_triton if backend == "triton" else route_rows_torch
    scale = cfg.routed_scaling_factor
    kernel(logits, bias, weights, ids, int(cfg.method), cfg.n_group, cfg.topk_group, scale)
    assert (ids != ID_POISON).all(), "an id cell was left unwritten"
    return weights, ids


def _check_scaled(backend: str, case, device) -> None:
    config = case.config
    scale = config.routed_scaling_factor
    logits, bias = case.tensors(device)
    x = _strided(logits)
    w_scaled, ids_scaled = _route_poisoned(backend, x, bias, config, scale)
    w_plain, ids_plain = _route_poisoned(backend, x, bias, config, None)
    assert torch.equal(ids_scaled, ids_plain), "the factor changed the choice"
    # NaN where a row's weights are NaN in both (a NaN logit chosen; 0 * inf for TOPK at scale 0)
    torch.testing.assert_close(w_scaled, w_plain * scale, rtol=RTOL, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(case=scaled_router_cases())
def test_scaled_weights_are_scale_times_unscaled(backend, case):
    """Every method x a factor != 1 (0 and negative too): the ids of the unscaled call, the weights
    ``scale *`` its weights, from strided logits into poisoned outputs."""
    _check_scaled(backend, case, "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", list(RoutingMethod), ids=lambda m: m.name)
def test_unscaled_default_is_bit_identical(backend, method):
    """No factor multiplies by 1.0: bit for bit the weights of ``routed_scaling_factor=1.0``, on
    every method (``w * 1.0 == w`` in IEEE arithmetic)."""
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    spec = METHODS[method]
    top_k = spec.top_k or 3
    gen = torch.Generator().manual_seed(int(method))
    x = torch.randn(9, 12, generator=gen)
    bias = torch.randn(12, generator=gen) * 0.1 if spec.bias else None
    w_none, ids_none = route(x, top_k, method, bias=bias, backend=backend)
    w_one, ids_one = route(x, top_k, method, bias=bias, routed_scaling_factor=1.0, backend=backend)
    assert torch.equal(ids_none, ids_one) and torch.equal(w_none, w_one)


# Megatron-Core's routing arguments and the method that has its rule: softmax after the top-k
# (use_pre_softmax=False) is RENORMALIZE, before it DEFAULT; sigmoid s / (sum s + 1e-20) is
# SIGMOID_RENORM's s / max(sum s, 1e-20) (equal for sums >= 1e-20), with expert_bias MINIMAX2; one
# expert's sigmoid is SIGMOID.
MEGATRON_CASES = {
    "softmax": (dict(score_function="softmax", use_pre_softmax=False), M.RENORMALIZE, False),
    "pre_softmax": (dict(score_function="softmax", use_pre_softmax=True), M.DEFAULT, False),
    "sigmoid": (dict(score_function="sigmoid"), M.SIGMOID_RENORM, False),
    "sigmoid_bias": (dict(score_function="sigmoid"), M.MINIMAX2, True),
    "sigmoid_top1": (dict(score_function="sigmoid"), M.SIGMOID, False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MEGATRON_CASES))
@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 8),
    num_experts=st.integers(2, 24),
    data=st.data(),
    scale=st.sampled_from([s for s in ROUTED_SCALES if s]),  # Megatron scales only when truthy
)
def test_matches_megatron_scaling_factor(backend, name, n, num_experts, data, scale):
    """route with routed_scaling_factor against Megatron-Core's own
    ``topk_routing_with_score_function(..., scaling_factor=)`` (installed; run on CPU): the same
    experts and the same dense probabilities."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    kwargs, method, has_bias = MEGATRON_CASES[name]
    top_k = 1 if name == "sigmoid_top1" else data.draw(st.integers(2, num_experts), label="top_k")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    # continuous logits: Megatron's torch.topk orders ties its own way
    logits = torch.randn(n, num_experts, generator=gen) * 2
    bias = torch.randn(num_experts, generator=gen) * 0.1 if has_bias else None
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits, top_k, scaling_factor=scale, expert_bias=bias, **kwargs
    )
    weights, ids = route(logits, top_k, method, bias=bias, routed_scaling_factor=scale, backend=backend)
    mask = torch.zeros(n, num_experts, dtype=torch.bool).scatter_(1, ids.long(), True)
    assert torch.equal(mask, routing_map)
    dense = torch.zeros(n, num_experts).scatter_(1, ids.long(), weights)
    torch.testing.assert_close(dense, probs, rtol=RTOL, atol=1e-7)


def _check_replay_is_route(backend: str, case, device) -> None:
    config = case.config
    logits, bias = case.tensors(device)
    x = _strided(logits)
    kw = config.route_kwargs(bias)
    weights, ids = route(x, config.top_k, config.method, backend=backend, **kw)
    r_weights, r_ids = replay_routing(x, ids, config.method, backend=backend, **kw)
    assert torch.equal(r_ids, ids)
    torch.testing.assert_close(r_weights, weights, rtol=RTOL, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None)
@given(case=scaled_router_cases())
def test_replay_of_routes_ids_with_the_same_factor_is_route(backend, case):
    """replay_routing(x, route(x).ids) with the same factor returns route(x): the same ids, the same
    scaled weights, on every method."""
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    _check_replay_is_route(backend, case, "cpu")


# Every weight rule: each method's own, and its renormalize=False rule where it has one.
RULES = [(m, None) for m in RoutingMethod] + [
    (m, False) for m in RoutingMethod if METHODS[m].unnormalized is not None
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [2.5, -1.5])
@pytest.mark.parametrize("method, renormalize", RULES, ids=lambda v: getattr(v, "name", str(v)))
def test_scaled_replay_gradcheck(backend, scale, method, renormalize):
    """Every weight rule with a factor != 1, float64 replay: gradcheck of the replay kernels' (or
    the twins') backward against finite differences of their forward."""
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    spec = METHODS[method]
    top_k = spec.top_k or 3
    gen = torch.Generator().manual_seed(17 * int(method) + 1)
    x = (torch.randn(3, 8, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ids = torch.argsort(torch.rand(3, 8, generator=gen), dim=1)[:, :top_k].to(torch.int32)
    bias = torch.zeros(8, dtype=torch.float64) if spec.bias else None

    def weights(logits):
        return replay_routing(
            logits,
            ids,
            method,
            bias=bias,
            routed_scaling_factor=scale,
            renormalize=renormalize,
            backend=backend,
        )[0]

    assert torch.autograd.gradcheck(weights, (x,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method, renormalize", RULES, ids=lambda v: getattr(v, "name", str(v)))
def test_zero_factor_gives_zero_weights_and_gradients(backend, method, renormalize):
    """A factor of 0 weighs every expert 0 and sends no gradient (never 0 / 0 = NaN from dividing
    the scaled weights by the factor in the backward)."""
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    spec = METHODS[method]
    top_k = spec.top_k or 3
    gen = torch.Generator().manual_seed(int(method))
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64).requires_grad_()
    ids = torch.argsort(torch.rand(4, 8, generator=gen), dim=1)[:, :top_k].to(torch.int32)
    bias = torch.zeros(8, dtype=torch.float64) if spec.bias else None
    weights, _ = replay_routing(
        x, ids, method, bias=bias, routed_scaling_factor=0.0, renormalize=renormalize, backend=backend
    )
    (grad,) = torch.autograd.grad(weights, x, torch.randn(weights.shape, generator=gen, dtype=torch.float64))
    assert torch.equal(weights, torch.zeros_like(weights))
    assert torch.equal(grad, torch.zeros_like(grad))


# On the GPU: the model shapes in float32 and bf16, each with a factor != 1.
GPU_SCALED_CASES = router_cases(
    st.sampled_from(MODEL_ROUTERS).flatmap(
        lambda c: st.sampled_from(ROUTED_SCALES).map(
            lambda s: type(c)(**{**c.__dict__, "routed_scaling_factor": s})
        )
    ),
    max_tokens=GPU_ROUTER_CASES["max_tokens"],
    dtypes=GPU_ROUTER_CASES["dtypes"],
)


@pytest.mark.gpu
# cuda_device only names the device (no state between examples)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=GPU_SCALED_CASES)
def test_scaled_route_and_replay_gpu(cuda_device, case):
    _check_scaled("triton", case, cuda_device)
    _check_replay_is_route("triton", case, cuda_device)
