"""``renormalize`` of ``route`` and ``replay_routing``: False on DEEPSEEK_V3 / MINIMAX2 weights the
chosen experts ``sigmoid(x) * routed_scaling_factor``, without the division by their sum.

The oracle is the peers' formula written here in numpy (vLLM's ``fused_topk_bias`` /
``grouped_topk`` and SGLang's ``biased_grouped_topk`` with ``renormalize=False``: the unbiased
sigmoid scores gathered at the chosen experts, times ``routed_scaling_factor``), not the twin.
The knob never changes the choice: the ids are the method's own (``test_route.py`` checks those).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_checks import rounding_decided_rows
from strategies import RouterCase, knob_configs, router_cases
from strategies.layouts import strided_rows

from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, replay_routing, route
from moe_ops.router.kernels import route_rows_torch, route_rows_triton
from moe_ops.router.methods import METHODS, UNNORMALIZED_METHODS, WeightRule

CPU_BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton-interpret")]
LOGIT_LAYOUTS = ("contiguous", "row_padded", "column_strided")
POISON_ID = -7
SIGMOID_KNOB_METHODS = tuple(
    m for m in sorted(UNNORMALIZED_METHODS) if METHODS[m].unnormalized == WeightRule.SIGMOID_TIMES_SCALE
)


def _skip(backend: str, device: str = "cpu") -> None:
    if backend == "triton":
        skip_unless_triton_runs(device)


def peer_weights(
    logits: torch.Tensor,
    ids: torch.Tensor,
    scale: float | None,
    renormalize: bool,
    method: RoutingMethod = RoutingMethod.DEEPSEEK_V3,
) -> np.ndarray:
    """The peers' weights at ``ids`` in float64 numpy: the method's score ``s`` of ``x[ids]``
    (``sigmoid``; SQRTSOFTPLUS: ``sqrt(softplus)``, softplus ``x`` above 20 as torch's), divided by
    ``sum s + 1e-20`` when ``renormalize``, times ``scale`` (1.0 when None); the softmax methods
    (SOFTMAX_BIAS, DEEPSEEK_V2): the row's softmax at ``ids``, divided by its sum there when
    ``renormalize``."""
    x = logits.double().cpu().numpy()
    chosen = np.take_along_axis(x, ids.long().cpu().numpy(), axis=1)
    if method in (RoutingMethod.SOFTMAX_BIAS, RoutingMethod.DEEPSEEK_V2):
        # softmax scores over the whole row, unbiased: p[sel], or p[sel] / sum p[sel]
        e = np.exp(x - x.max(axis=1, keepdims=True))
        p = np.take_along_axis(e / e.sum(axis=1, keepdims=True), ids.long().cpu().numpy(), axis=1)
        if renormalize:
            p = p / p.sum(axis=1, keepdims=True)
        return p * (1.0 if scale is None else scale)
    with np.errstate(over="ignore", invalid="ignore"):
        if method == RoutingMethod.SQRTSOFTPLUS:
            s = np.sqrt(np.where(chosen > 20.0, chosen, np.log1p(np.exp(chosen))))
        else:
            s = 1.0 / (1.0 + np.exp(-chosen))
        if renormalize:
            s = s / (s.sum(axis=1, keepdims=True) + 1e-20)
    return s * (1.0 if scale is None else scale)


def assert_weights(got: torch.Tensor, want: np.ndarray, rtol: float = 1e-5) -> None:
    """The formula's weights within ``rtol`` (float32 rounding), and exactly 0 on the rows where the
    formula has a NaN or +-inf (docs/routing.md "Non-finite logits": such a row is zeroed)."""
    want = np.where(np.isfinite(want).all(axis=1, keepdims=True), want, 0.0)
    torch.testing.assert_close(got.double().cpu(), torch.from_numpy(want), rtol=rtol, atol=1e-6)


@st.composite
def knob_cases(draw, renormalize=(None, True, False), max_tokens: int = 24):
    # the sigmoid methods' knob (SOFTMAX_BIAS's renormalize=False: tests/router/test_route_groups.py)
    configs = knob_configs(renormalize, max_experts=96, max_top_k=8, methods=SIGMOID_KNOB_METHODS)
    case = draw(router_cases(configs=configs, max_tokens=max_tokens))
    return case, draw(st.sampled_from(LOGIT_LAYOUTS))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=40, deadline=None)
@given(data=knob_cases())
def test_route_weights_are_the_peers_formula(backend, data):
    case, layout = data
    _skip(backend)
    cfg = case.config
    logits, bias = case.tensors("cpu")
    x = strided_rows(logits, layout)  # unused cells NaN: a read outside the rows shows
    weights, ids = route(x, cfg.top_k, cfg.method, backend=backend, **cfg.route_kwargs(bias))
    own_cfg = dataclasses.replace(cfg, renormalize=None)
    own_weights, own_ids = route(x, cfg.top_k, cfg.method, backend=backend, **own_cfg.route_kwargs(bias))
    assert torch.equal(ids, own_ids), "renormalize changed the choice"
    assert_weights(
        weights,
        peer_weights(logits, ids, cfg.routed_scaling_factor, cfg.renormalize is not False, cfg.method),
    )
    if cfg.renormalize is not False:  # the method's own rule, bit for bit
        assert torch.equal(weights.nan_to_num(7.0), own_weights.nan_to_num(7.0))


@settings(max_examples=30, deadline=None)
@given(data=knob_cases(renormalize=(False,)), capture=st.booleans())
def test_kernel_equals_twin_into_poisoned_outputs(data, capture):
    """The Triton kernel (with and without fused capture) against its twin: ids exactly, weights
    within float32 rounding, every output cell written, the capture buffer's other cells kept."""
    skip_unless_triton_runs("cpu")
    case, layout = data
    cfg = case.config
    logits, bias = case.tensors("cpu")
    x = strided_rows(logits, layout)
    n_group, topk_group = cfg.groups
    scale = 1.0 if cfg.routed_scaling_factor is None else cfg.routed_scaling_factor
    out = {}
    for name, kernel in (("triton", route_rows_triton), ("torch", route_rows_torch)):
        weights = torch.full((case.n, cfg.top_k), float("nan"))
        ids = torch.full((case.n, cfg.top_k), POISON_ID, dtype=torch.int32)
        buffer = torch.full((case.n + 3, 2, cfg.top_k), POISON_ID, dtype=torch.int32)
        spec = None
        if capture:
            counts = torch.tensor([case.n], dtype=torch.int32)
            spec = CaptureTarget(buffer, 1, token_counts=counts, layout=BatchLayout.LOCAL).spec
        kernel(x, bias, weights, ids, int(cfg.method), n_group, topk_group, scale, spec, unnormalized=True)
        out[name] = weights, ids, buffer
    (tri_w, tri_ids, tri_buf), (ref_w, ref_ids, ref_buf) = out["triton"], out["torch"]
    assert not (tri_ids == POISON_ID).any(), "an id was not written"
    # rows whose sigmoid + bias keys lie within float32 rounding of a tie may order differently
    # (docs/routing.md, tie-break rule); every other row exactly
    same = ~rounding_decided_rows(cfg, logits.double(), None if bias is None else bias.double())
    assert torch.equal(tri_ids[same], ref_ids[same])
    if capture:
        assert torch.equal(tri_buf[: case.n, 1], tri_ids) and torch.equal(ref_buf[: case.n, 1], ref_ids)
    for buf in (tri_buf, ref_buf):
        assert (buf[case.n :] == POISON_ID).all() and (buf[:, 0] == POISON_ID).all()
        assert capture or (buf == POISON_ID).all()
    torch.testing.assert_close(tri_w[same], ref_w[same], rtol=1e-5, atol=1e-6, equal_nan=True)
    assert_weights(tri_w, peer_weights(logits, tri_ids, cfg.routed_scaling_factor, False, cfg.method))
    assert_weights(ref_w, peer_weights(logits, ref_ids, cfg.routed_scaling_factor, False, cfg.method))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=30, deadline=None)
@given(data=knob_cases(), live=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_replay_of_route_ids_is_route(backend, data, live, seed):
    """replay_routing(x, route(x).ids) == route(x) with the knob: the recorded rows and the rows of
    -1 routed live alike."""
    case, layout = data
    _skip(backend)
    cfg = case.config
    logits, bias = case.tensors("cpu")
    x = strided_rows(logits, layout)
    kw = cfg.route_kwargs(bias)
    weights, ids = route(x, cfg.top_k, cfg.method, backend=backend, **kw)
    recorded = ids.clone()
    rows = torch.rand(case.n, generator=torch.Generator().manual_seed(seed)) < live
    recorded[rows] = -1
    rw, rids = replay_routing(x, recorded, cfg.method, backend=backend, **kw)
    assert torch.equal(rids, ids)
    torch.testing.assert_close(rw, weights, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("method", SIGMOID_KNOB_METHODS, ids=lambda m: m.name)
@settings(max_examples=6, deadline=None)
@given(
    n=st.integers(1, 4),
    groups=st.booleans(),
    scale=st.sampled_from([None, 1.0, 2.5, -0.7]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gradcheck_renormalize_off(backend, method, n, groups, scale, seed):
    """float64 gradcheck of the s * scale rule through replay_routing's forward and backward."""
    _skip(backend)
    gen = torch.Generator().manual_seed(seed)
    grouped = groups and METHODS[method].groups
    num_experts, top_k = 16, 4
    x = (torch.randn(n, num_experts, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    bias = torch.randn(num_experts, generator=gen, dtype=torch.float64) * 0.1
    kw = dict(
        bias=bias,
        n_group=4 if grouped else None,
        topk_group=2 if grouped else None,
        routed_scaling_factor=scale,
        renormalize=False,
        backend=backend,
    )
    ids = route(x.detach().float(), top_k, method, **{**kw, "bias": bias.float()})[1]
    ids[0] = -1  # one row routed live

    def weights(logits):
        return replay_routing(logits, ids, method, **kw)[0]

    assert torch.autograd.gradcheck(weights, (x,))
    # and against autograd through the peers' formula at the same ids
    w, got_ids = replay_routing(x, ids, method, **kw)
    g = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad(w, x, g)
    x2 = x.detach().clone().requires_grad_()
    chosen = x2.gather(1, got_ids.long())
    # the method's score: sigmoid, or SQRTSOFTPLUS's sqrt(softplus) (torch's softplus, threshold 20)
    score = chosen.sigmoid() if method != RoutingMethod.SQRTSOFTPLUS else F.softplus(chosen).sqrt()
    want_w = score * (1.0 if scale is None else scale)
    (want,) = torch.autograd.grad(want_w, x2, g)
    torch.testing.assert_close(w.detach(), want_w.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def _refused() -> list:
    """(method, value) pairs renormalize cannot take, from the table: a method without the knob
    (its weights are no distribution), or the other rule where another method has it."""
    pairs = []
    for method, spec in METHODS.items():
        for value in (True, False):
            allowed = spec.renormalizes is not None and (
                value == spec.renormalizes
                or (value is False and spec.unnormalized is not None)
                or (value is True and spec.renormalized is not None)
            )
            if not allowed:
                pairs.append(pytest.param(method, value, id=f"{method.name}-{value}"))
    return pairs


@pytest.mark.parametrize(("method", "value"), _refused())
def test_refused_values_name_the_method_and_touch_nothing(method, value):
    spec = METHODS[method]
    top_k = spec.top_k or 2
    logits = torch.randn(3, 8)
    bias = torch.zeros(8) if spec.bias else None
    buffer = torch.full((4, 1, top_k), POISON_ID, dtype=torch.int32)
    target = CaptureTarget(buffer, 0, token_counts=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"renormalize={value} cannot apply to {method.name}: "):
        route(logits, top_k, method, bias=bias, renormalize=value, capture=target, backend="torch")
    assert (buffer == POISON_ID).all(), "a refused call wrote the capture buffer"
    recorded = torch.arange(top_k, dtype=torch.int32).repeat(3, 1)
    with pytest.raises(ValueError, match=rf"cannot apply to {method.name}"):
        replay_routing(logits, recorded, method, bias=bias, renormalize=value, backend="torch")


@pytest.mark.parametrize("value", [1, 0, "False", np.bool_(False), 0.0])
def test_renormalize_must_be_a_bool_or_none(value):
    with pytest.raises(ValueError, match="renormalize must be True, False or None"):
        route(torch.randn(2, 8), 2, RoutingMethod.MINIMAX2, renormalize=value)
    with pytest.raises(ValueError, match="renormalize must be True, False or None"):
        replay_routing(
            torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), RoutingMethod.MINIMAX2, renormalize=value
        )


def test_own_value_is_accepted_and_changes_nothing():
    """renormalize equal to the method's own rule is the method: the same call bit for bit."""
    x = torch.randn(6, 16)
    for method, spec in METHODS.items():
        if spec.renormalizes is None:
            continue
        top_k = spec.top_k or 3
        bias = torch.randn(16) if spec.bias else None
        base = route(x, top_k, method, bias=bias, backend="torch")
        same = route(x, top_k, method, bias=bias, renormalize=spec.renormalizes, backend="torch")
        assert torch.equal(base[0], same[0]) and torch.equal(base[1], same[1]), method


def test_flashinfer_backend_refuses_renormalize_off():
    with pytest.raises(ValueError, match="backend='flashinfer' always renormalises DEEPSEEK_V3"):
        route(torch.randn(2, 16), 2, RoutingMethod.DEEPSEEK_V3, renormalize=False, backend="flashinfer")


@pytest.mark.gpu
@settings(max_examples=20, deadline=None)
@given(
    case=router_cases(configs=knob_configs((False,)), max_tokens=300, dtypes=(torch.float32, torch.bfloat16))
)
def test_cuda_kernels_renormalize_off(case: RouterCase):
    """On CUDA: route (Triton) against the peers' formula and the twin's ids, and replay of its ids
    equal to route."""
    skip_unless_triton_runs("cuda")
    cfg = case.config
    logits, bias = case.tensors("cuda")
    kw = cfg.route_kwargs(bias)
    weights, ids = route(logits, cfg.top_k, cfg.method, backend="triton", **kw)
    _, ref_ids = route(logits, cfg.top_k, cfg.method, backend="torch", **kw)
    x64, b64 = logits.double().cpu(), None if bias is None else bias.double().cpu()
    same = ~rounding_decided_rows(cfg, x64, b64)
    assert torch.equal(ids.cpu()[same], ref_ids.cpu()[same])
    assert_weights(weights, peer_weights(logits, ids, cfg.routed_scaling_factor, False, cfg.method))
    rw, rids = replay_routing(logits, ids, cfg.method, backend="triton", **kw)
    assert torch.equal(rids, ids)
    torch.testing.assert_close(rw, weights, rtol=1e-6, atol=1e-7, equal_nan=True)


def test_replay_rule_passes_renormalize():
    """attach_replay's rule carries the knob to replay_routing and to its attach-time check."""
    from torch import nn

    from moe_ops.attach.replaying import ReplayRule, check_rule, replay_router_output

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=gen)
    ids = torch.argsort(torch.rand(5, 16, generator=gen), dim=1)[:, :4].to(torch.int32)
    live = torch.zeros(5, 4)
    rule = ReplayRule(RoutingMethod.MINIMAX2, routed_scaling_factor=2.5, renormalize=False)
    weights, got = replay_router_output(x, live, ids, ids, rule, backend="torch")
    assert torch.equal(got, ids)
    assert_weights(weights, peer_weights(x, ids, 2.5, False))
    router = nn.Module()
    router.num_experts = 16
    with pytest.raises(
        ValueError, match="cannot be replayed with TOPK: renormalize=True cannot apply to TOPK"
    ):
        check_rule(ReplayRule(RoutingMethod.TOPK, renormalize=True), router, "layers.0.gate", 4)
