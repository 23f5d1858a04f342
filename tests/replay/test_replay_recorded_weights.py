"""replay_routing(weights="recorded"): the rollout's weights as the value, the computed weights'
gradient (straight-through), the computed weights wherever a row was not replayed from its record."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ops import RoutingMethod, replay_routing, route
from moe_ops.replay import check_replay_errors

E, K = 16, 4
METHODS = [RoutingMethod.RENORMALIZE, RoutingMethod.DEEPSEEK_V3, RoutingMethod.SQRTSOFTPLUS]
BACKENDS = ["torch", "triton"]


def _kw(method):
    if method == RoutingMethod.DEEPSEEK_V3:
        return dict(bias=torch.linspace(-0.1, 0.1, E), n_group=4, topk_group=2, routed_scaling_factor=2.5)
    if method == RoutingMethod.SQRTSOFTPLUS:
        return dict(bias=torch.linspace(0.1, -0.1, E), routed_scaling_factor=1.5)
    return {}


def _case(n: int, seed: int, method):
    """Logits, a record (the router's choice with shuffled columns, one row of -1 routed live, one
    faulty row of a repeated id) and rollout weights near the computed ones, one row NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, E, generator=g, dtype=torch.float64)
    _, ids = route(x.float(), K, method, backend="torch", **_kw(method))
    perm = torch.argsort(torch.rand(n, K, generator=g), dim=1)
    recorded = ids.gather(1, perm).long()
    kinds = torch.zeros(n, dtype=torch.long)  # 0 replayed, 1 live (-1), 2 faulty, 3 NaN weights
    if n >= 4:
        recorded[1] = -1
        recorded[2, 1] = recorded[2, 0]
        kinds[1], kinds[2], kinds[3] = 1, 2, 3
    w_rollout = torch.rand(n, K, generator=g, dtype=torch.float32)
    if n >= 4:
        w_rollout[3, 2] = float("nan")
    return x, recorded, w_rollout, kinds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
@settings(max_examples=10, deadline=None)
@given(n=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_value_is_the_record_and_the_gradient_the_computed_one(backend, method, n, seed):
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    x, recorded, w_rollout, kinds = _case(n, seed, method)
    kw = dict(
        backend=backend, **{k: (v.double() if torch.is_tensor(v) else v) for k, v in _kw(method).items()}
    )
    check_replay_errors("cpu", raise_error=False)
    xc = x.clone().requires_grad_()
    computed, ids_c = replay_routing(xc, recorded, method, **kw)
    xr = x.clone().requires_grad_()
    got, ids_r = replay_routing(xr, recorded, method, weights="recorded", recorded_weights=w_rollout, **kw)
    check_replay_errors("cpu", raise_error=False)
    assert torch.equal(ids_r, ids_c)
    use = (kinds == 0)[:, None].expand(n, K)
    # the record exactly where replayed, the computed weights elsewhere
    assert torch.equal(got[use], w_rollout.double()[use])
    assert torch.equal(got[~use], computed.detach()[~use])
    # the gradient is the computed weights' gradient, for any incoming gradient
    g = torch.randn(n, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (grad_r,) = torch.autograd.grad(got, xr, g) if n else (torch.zeros_like(x),)
    (grad_c,) = torch.autograd.grad(computed, xc, g) if n else (torch.zeros_like(x),)
    torch.testing.assert_close(grad_r, grad_c, rtol=0, atol=0)


def test_shared_expert_columns_keep_their_constant_weight():
    x = torch.randn(3, E)
    _, ids = route(x, K, RoutingMethod.RENORMALIZE, backend="torch")
    w_rollout = torch.full((3, K), 0.25)
    got, got_ids = replay_routing(
        x, ids, RoutingMethod.RENORMALIZE, num_fused_shared_experts=2, weights="recorded",
        recorded_weights=w_rollout, backend="torch",
    )  # fmt: skip
    assert got.shape == (3, K + 2) and torch.equal(got[:, :K], w_rollout)
    assert torch.equal(got[:, K:], torch.ones(3, 2)) and torch.equal(
        got_ids[:, K:], torch.tensor([[E, E + 1]] * 3)
    )


def test_compiled_recorded_weights_equal_eager():
    x = torch.randn(5, E)
    _, ids = route(x, K, RoutingMethod.RENORMALIZE, backend="torch")
    w_rollout = torch.rand(5, K)

    def step(logits, rec, w):
        return replay_routing(
            logits, rec, RoutingMethod.RENORMALIZE, weights="recorded", recorded_weights=w, backend="torch"
        )

    got = torch.compile(step, fullgraph=True)(x, ids, w_rollout)
    want = step(x, ids, w_rollout)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(weights="rollout"), ValueError, "weights must be one of"),
        (dict(weights="recorded"), ValueError, "needs recorded_weights"),
        (dict(recorded_weights=torch.zeros(3, K)), ValueError, 'only used with weights="recorded"'),
        (dict(weights="recorded", recorded_weights=torch.zeros(3, K + 1)), ValueError, "recorded_ids' shape"),
        (
            dict(weights="recorded", recorded_weights=torch.zeros(3, K, dtype=torch.int32)),
            ValueError,
            "float16",
        ),
        (dict(weights="recorded", recorded_weights=[[0.0] * K] * 3), TypeError, "must be a torch.Tensor"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(kwargs, exc, match):
    x = torch.randn(3, E)
    _, ids = route(x, K, RoutingMethod.RENORMALIZE, backend="torch")
    check_replay_errors("cpu", raise_error=False)
    with pytest.raises(exc, match=match):
        replay_routing(x, ids, RoutingMethod.RENORMALIZE, backend="torch", **kwargs)
    assert check_replay_errors("cpu", raise_error=False) == 0
