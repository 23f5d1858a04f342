"""RoutingMethod.SQRTSOFTPLUS (DeepSeek-V4): route and replay against transformers' own router and
against an independent float64 formula written from the peers' code (not the package's reference).

The peers (transformers' DeepseekV4TopKRouter, Megatron 0.19's ``sqrtsoftplus``, SGLang's
``biased_topk_impl``, vLLM's ``_topk_softplus_sqrt_torch``): ``q = sqrt(softplus(x))``, experts by
``q + bias``, weights ``q[sel] / (sum q[sel] + 1e-20) * scale`` (renormalize off: ``q[sel] * scale``).

Ids are compared exactly on every row whose float64 keys do not come within KEY_TOL of a tie at the
top-k boundary between experts with different (logit, bias); such a row is decided by float32
rounding and must choose keys equal to the formula's within KEY_TOL (the rule of routing_checks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from strategies import POISON, sqrtsoftplus_cases

from moe_ops import RoutingMethod, replay_routing, route
from moe_ops.router.args import validate_route_args
from moe_ops.router.kernels import route_rows_torch, route_rows_triton
from moe_ops.router.methods import METHODS
from moe_ops.router.reference import rule_gradient, rule_weights, sqrt_softplus

M = RoutingMethod.SQRTSOFTPLUS
KEY_TOL = 3e-6
# float32 q against float64: 1.5e-7 relative per score (the reference's docstring), a few of them
# in a weight; 1e-5 leaves room for the sum and the scale
WEIGHT_RTOL = 1e-5


def formula(
    x: torch.Tensor, bias, top_k: int, scale, renormalize
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids, keys) in float64, written from the peers' code: torch's softplus, a stable
    descending sort (ties to the lowest index)."""
    x64 = x.double()
    q = F.softplus(x64).sqrt()
    keys = q if bias is None else q + bias.double()
    keys = torch.where(keys.isnan(), float("-inf"), keys)
    ids = torch.sort(keys, dim=1, descending=True, stable=True)[1][:, :top_k]
    w = q.gather(1, ids)
    if renormalize is not False:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * (1.0 if scale is None else scale), ids, keys


def rounding_rows(x: torch.Tensor, bias, keys: torch.Tensor, top_k: int) -> torch.Tensor:
    """(n,) bool: rows whose choice float32 rounding may decide: a key within KEY_TOL of the next
    one down to rank top_k, between experts with different (logit, bias)."""
    n, num_experts = keys.shape
    if n == 0 or num_experts == 1:
        return torch.zeros(n, dtype=torch.bool)
    order = torch.sort(keys, dim=1, descending=True, stable=True)[1][:, : top_k + 1]
    k = keys.gather(1, order)
    xs = x.double().gather(1, order)
    b = torch.zeros(num_experts, dtype=torch.float64) if bias is None else bias.double()
    bs = b.expand(n, -1).gather(1, order)
    near = (k[:, :-1] == k[:, 1:]) | ((k[:, :-1] - k[:, 1:]).abs() <= KEY_TOL * (1 + k[:, 1:].abs()))
    same = (xs[:, :-1] == xs[:, 1:]) & (bs[:, :-1] == bs[:, 1:])
    return (near & ~same).any(1)


def check_against_formula(x, bias, top_k, scale, renormalize, weights, ids) -> None:
    _, want_ids, keys = formula(x, bias, top_k, scale, renormalize)
    ids = ids.cpu().long()
    decided = rounding_rows(x, bias, keys, top_k)
    bad = (ids != want_ids).any(1) & ~decided
    rows = bad.nonzero().flatten().tolist()
    assert not bad.any(), f"ids differ in rows {rows}: {ids[bad][:2]} vs {want_ids[bad][:2]}"
    for row in decided.nonzero().flatten().tolist():
        got = torch.sort(keys[row, ids[row]], descending=True)[0]
        want = torch.sort(keys[row], descending=True)[0][:top_k]
        assert ((got - want).abs() <= KEY_TOL * (1 + want.abs())).all(), (row, got, want)
    # weights of the ids chosen (the formula's weights at those ids)
    q = F.softplus(x.double()).sqrt().gather(1, ids)
    w = q / (q.sum(-1, keepdim=True) + 1e-20) if renormalize is not False else q
    w = w * (1.0 if scale is None else scale)
    # a logit below -87 gives a subnormal float32 exp(x), so softplus there keeps only the bits above
    # 2**-149: a relative error up to 2**-149 / softplus in q (half that) and in every weight of a
    # renormalised row (a q of 1.7e-21 beside the 1e-20 epsilon weighs 0.15 with 5e-4 of error)
    sp = F.softplus(x.double()).gather(1, ids)
    subnormal = (2.0**-149 / sp).amax(-1, keepdim=True).clamp(max=1.0)
    got = weights.cpu().double()
    tol = (WEIGHT_RTOL + subnormal) * w.abs() + 1e-12
    assert ((got - w).abs() <= tol).all(), (got, w)


def _transformers_router(num_experts: int, top_k: int, hidden: int, scale: float, seed: int):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    config = DeepseekV4Config(
        hidden_size=hidden,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        routed_scaling_factor=scale,
        num_hidden_layers=1,
        vocab_size=64,
    )
    assert config.scoring_func == "sqrtsoftplus"
    router = DeepseekV4TopKRouter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.3)
    return router, gen


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape", [(32, 4, 1.5), (256, 6, 1.5), (7, 7, 2.5)], ids=str)
def test_matches_transformers_deepseek_v4_router(backend, shape):
    """transformers' DeepseekV4TopKRouter on CPU: the same experts (its top-k is unsorted: compared
    as sets) wherever no near tie decides, and its weights per expert within WEIGHT_RTOL."""
    pytest.importorskip("transformers.models.deepseek_v4")
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    num_experts, top_k, scale = shape
    router, gen = _transformers_router(num_experts, top_k, 16, scale, seed=num_experts)
    hidden = torch.randn(2, 9, 16, generator=gen)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(hidden)
    bias = router.e_score_correction_bias
    weights, ids = route(logits, top_k, M, bias=bias, routed_scaling_factor=scale, backend=backend)

    _, _, keys = formula(logits, bias, top_k, scale, None)
    exact = ~rounding_rows(logits, bias, keys, top_k)
    assert exact.sum() >= logits.shape[0] - 2, "the data should hardly have near ties"
    hf_sorted, hf_order = torch.sort(hf_ids, dim=1)
    ours_sorted, our_order = torch.sort(ids.long(), dim=1)
    assert torch.equal(ours_sorted[exact], hf_sorted[exact])
    torch.testing.assert_close(
        weights.gather(1, our_order)[exact], hf_w.gather(1, hf_order)[exact], rtol=WEIGHT_RTOL, atol=0
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=60, deadline=None)
@given(case=sqrtsoftplus_cases())
def test_route_matches_formula(backend, case):
    """Random, exactly tied and nearly tied logits over softplus's whole range, contiguous, strided
    and sliced; outputs are poisoned views of wider buffers (nothing else may be written)."""
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    x, k = case.logits, case.top_k
    cfg = validate_route_args(
        x, k, M, case.bias, None, None, case.routed_scaling_factor, renormalize=case.renormalize
    )
    n = x.shape[0]
    w_buf = torch.full((n, k + 2), float("nan"))
    i_buf = torch.full((n, k + 2), POISON, dtype=torch.int32)
    weights, ids = w_buf[:, :k], i_buf[:, :k]
    launch = route_rows_triton if backend == "triton" else route_rows_torch
    launch(x, case.bias, weights, ids, int(M), 1, 1, cfg.routed_scaling_factor, unnormalized=cfg.unnormalized)
    assert torch.isnan(w_buf[:, k:]).all() and (i_buf[:, k:] == POISON).all(), "wrote past top_k"
    assert not torch.isnan(weights).any() and not (ids == POISON).any(), "a cell was not written"
    check_against_formula(x, case.bias, k, case.routed_scaling_factor, case.renormalize, weights, ids)


@settings(max_examples=40, deadline=None)
@given(case=sqrtsoftplus_cases())
def test_kernel_and_twin_choose_identical_ids(case):
    """The Triton helper and the twin compute q with the same operations in the same order: the same
    ids on every row that float32 rounding does not decide (exact ties between equal inputs
    included) and the same weights within 1e-6. Rows with keys within KEY_TOL between different
    inputs may differ: exp and log are numpy's in the interpreter, SLEEF's in torch on CPU."""
    skip_unless_triton_runs("cpu")
    kwargs = dict(bias=case.bias, routed_scaling_factor=case.routed_scaling_factor)
    kwargs.update(renormalize=case.renormalize)
    tri_w, tri_ids = route(case.logits, case.top_k, M, backend="triton", **kwargs)
    ref_w, ref_ids = route(case.logits, case.top_k, M, backend="torch", **kwargs)
    _, _, keys = formula(case.logits, case.bias, case.top_k, None, None)
    exact = ~rounding_rows(case.logits, case.bias, keys, case.top_k)
    assert torch.equal(tri_ids[exact], ref_ids[exact])
    if case.ties == "exact-ties":
        assert exact.all(), "exact ties between equal inputs are never left to rounding"
    torch.testing.assert_close(tri_w[exact], ref_w[exact], rtol=1e-6, atol=1e-12)


def test_sqrt_softplus_follows_torch_softplus():
    """The rewritten log1p against torch's softplus (threshold 20) over its whole range, in the
    Triton helper (interpreted) and the twin: 1.5e-7 relative in float32, 1e-15 in float64; 0 where
    float32 softplus underflows; inf, 0 and NaN for inf, -inf and NaN."""
    x32 = torch.linspace(-120, 60, 40001)
    for dtype, rtol in ((torch.float32, 2e-7), (torch.float64, 1e-15)):
        x = x32.to(dtype)
        want = F.softplus(x.double()).sqrt()
        got = sqrt_softplus(x).double()
        live = want > (1e-18 if dtype == torch.float32 else 0)
        assert ((got - want).abs() <= rtol * want)[live].all(), dtype
    assert (sqrt_softplus(torch.tensor([-110.0])) == 0).all()
    special = sqrt_softplus(torch.tensor([float("inf"), float("-inf"), float("nan")]))
    assert special[0] == float("inf") and special[1] == 0 and special[2].isnan()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("renormalize", [None, False])
def test_replay_round_trip(backend, renormalize):
    """replay(x, route(x).ids) == route(x), and rows of -1 are routed live to the same."""
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(19, 48, generator=gen) * 3
    bias = torch.randn(48, generator=gen) * 0.1
    kwargs = dict(bias=bias, routed_scaling_factor=1.5, renormalize=renormalize, backend=backend)
    w, ids = route(x, 6, M, **kwargs)
    rec = ids.clone()
    rec[::4] = -1
    rw, rids = replay_routing(x, rec, M, **kwargs)
    assert torch.equal(rids, ids)
    torch.testing.assert_close(rw, w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("renormalize", [None, False])
def test_replay_gradcheck_float64(backend, renormalize):
    """gradcheck of replay_routing (float64, recorded and live rows, logits far below -745 where q
    is 0 and the gradient is taken as 0, and above the softplus threshold)."""
    if backend == "triton":
        skip_unless_triton_runs("cpu")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 7, generator=gen, dtype=torch.float64) * 3
    x[0, 0], x[1, 2] = -800.0, 23.0
    rec = torch.tensor([[0, 1, 2], [2, 3, 4], [-1, -1, -1], [6, 5, 0]], dtype=torch.int32)
    x.requires_grad_()

    def weights(logits):
        return replay_routing(
            logits, rec, M, routed_scaling_factor=2.5, renormalize=renormalize, backend=backend
        )[0]

    assert torch.autograd.gradcheck(weights, (x,), eps=1e-6, atol=1e-7, rtol=1e-6)
    (grad,) = torch.autograd.grad(weights(x).sum(), x)
    assert grad[0, 0] == 0 and torch.isfinite(grad).all()


def test_gradient_rule_matches_autograd_through_torch_softplus():
    """The gradient rules against autograd through the peers' formula (torch's softplus, not the
    reference's rewritten one), float64."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(6, 9, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    ids = torch.argsort(torch.rand(6, 9, generator=gen), dim=1)[:, :4]
    g = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    spec = METHODS[M]
    for weight, unnormalized in ((spec.weight, False), (spec.unnormalized, True)):
        q = F.softplus(x).sqrt().gather(1, ids)
        want_w = q * 1.5 if unnormalized else q / (q.sum(-1, keepdim=True) + 1e-20) * 1.5
        (want,) = torch.autograd.grad(want_w, x, g)
        w = rule_weights(x.detach(), ids, weight, 1.5)
        torch.testing.assert_close(w, want_w.detach(), rtol=1e-14, atol=0)
        _, rule = spec.computed(unnormalized)
        got = rule_gradient(g, w, x.detach(), ids, rule, 1.5)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_table_row():
    """Bias optional, scaled, renormalising with a renormalize=False rule, no groups (no peer but
    Megatron groups sqrtsoftplus scores, and no released model does)."""
    spec = METHODS[M]
    assert spec.bias and spec.scaled and spec.renormalizes and not spec.groups and spec.top_k is None
    x = torch.randn(3, 8)
    assert not validate_route_args(x, 2, M, None, None, None, None).unnormalized
    assert validate_route_args(x, 2, M, None, None, None, 1.5, renormalize=False).unnormalized
    with pytest.raises(ValueError, match="n_group/topk_group are only used by"):
        validate_route_args(x, 2, M, None, 2, 1, None)
