"""Group score rules (``group_score``), DEEPSEEK_V2 and SOFTMAX_BIAS in ``route`` and ``replay_routing``.

The oracles are the peers' own code where it is installed (Megatron-Core's ``group_limited_topk``
for TOPK_SHARE_SUM, transformers' ``DeepseekV2TopkRouter`` for DEEPSEEK_V2) and otherwise the peers'
formula written here in numpy (vLLM's ``grouped_topk`` / ``fused_topk_bias`` and SGLang's
``fused_topk_bias``: softmax scores, ``scores + bias`` chooses, groups by the sum of their best
keys, weights the unbiased scores), never the twin.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_checks import rounding_decided_rows
from strategies import group_cases
from strategies.layouts import strided_rows

from moe_ops import GroupScore, RoutingMethod, replay_routing, route
from moe_ops.router.args import validate_route_args
from moe_ops.router.kernels import route_rows_torch, route_rows_triton
from moe_ops.router.methods import METHODS, SCORE_KEYS, SelectionKey

M = RoutingMethod
CPU_BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton-interpret")]
POISON_ID = -7


def _skip(backend: str) -> None:
    if backend == "triton":
        skip_unless_triton_runs("cpu")


def _logits(rng, n, num_experts, kind):
    if kind == "ties":  # small integers: exact ties inside and across groups
        return rng.integers(-2, 3, size=(n, num_experts)).astype(np.float64)
    if kind == "near":  # pairs one float32 ulp apart
        x = rng.standard_normal((n, num_experts)).astype(np.float32)
        x[:, 1::2] = np.nextafter(x[:, ::2][:, : x[:, 1::2].shape[1]], np.float32(np.inf))
        return x.astype(np.float64)
    return rng.standard_normal((n, num_experts)) * 2.0


def peer_route(x: np.ndarray, config, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(weights, ids) by the peers' formula in float64 numpy, row by row; among equal keys the lowest
    index first (the package's documented rule; the peers' torch.topk leaves ties unordered).

    Scores: softmax for DEEPSEEK_V2 / SOFTMAX_BIAS, sigmoid for DEEPSEEK_V3; the key adds the bias;
    DEEPSEEK_V2's MAX takes the best softmax score (not the logit); a group's score sums its
    ``keys_summed`` best keys; weights are the unbiased scores at the chosen experts, renormalised
    where the rule says so."""
    n, num_experts = x.shape
    n_group, topk_group = config.groups
    size = num_experts // n_group
    spec = METHODS[config.method]
    score = GroupScore(config.group_score or spec.group_score)
    summed = score.keys_summed(config.top_k, topk_group)
    if config.method == M.DEEPSEEK_V3:
        p = 1.0 / (1.0 + np.exp(-x))
        renorm = config.renormalize is not False
    else:
        e = np.exp(x - x.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        renorm = spec.renormalizes if config.renormalize is None else config.renormalize
    keys = p + (0.0 if bias is None else bias[None, :])
    ids = np.zeros((n, config.top_k), dtype=np.int64)
    for r in range(n):
        kept = np.ones(num_experts, dtype=bool)
        if n_group > 1:
            g = keys[r].reshape(n_group, size)
            gscore = [sum(sorted(g[i], reverse=True)[: min(summed, size)]) for i in range(n_group)]
            best = sorted(range(n_group), key=lambda i: (-gscore[i], i))[:topk_group]
            kept = np.repeat(np.isin(np.arange(n_group), best), size)
        order = sorted(np.flatnonzero(kept), key=lambda e: (-keys[r, e], e))
        ids[r] = order[: config.top_k]
    w = np.take_along_axis(p, ids, axis=1)
    if renorm:  # vLLM's sigmoid form adds no 1e-20 either (invisible at these sums)
        w = w / w.sum(axis=1, keepdims=True)
    return w, ids


def _as_sets(ids) -> np.ndarray:
    return np.sort(np.asarray(ids, dtype=np.int64), axis=1)


def _tensors(config, n, kind, seed):
    rng = np.random.default_rng(seed)
    x = _logits(rng, n, config.num_experts, kind)
    bias = None
    if config.has_bias:
        bias = (
            rng.choice([0.0, 0.25], size=config.num_experts)
            if kind == "ties"
            else rng.normal(0, 0.1, config.num_experts)
        )
    return x, bias


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=25, deadline=None)
@given(case=group_cases())
def test_live_float64_routing_is_the_peers_formula(backend, case):
    """replay_routing's live rows (route's rule on float64 keys) against the peers' formula: ids
    exactly, ties included, weights within float64 rounding."""
    _skip(backend)
    config, n, kind, seed = case
    x, bias = _tensors(config, n, kind, seed)
    logits = torch.from_numpy(x)
    b = None if bias is None else torch.from_numpy(bias)
    recorded = torch.full((n, config.top_k), -1, dtype=torch.int32)
    w, ids = replay_routing(logits, recorded, config.method, backend=backend, **config.route_kwargs(b))
    want_w, want_ids = peer_route(x, config, bias)
    if kind == "ties" and METHODS[config.method].key in SCORE_KEYS:
        # the peers sum float64 softmax values: equal logits tie exactly, other sums compare as sets
        assert np.array_equal(_as_sets(ids), _as_sets(want_ids))
    else:
        assert np.array_equal(ids.numpy(), want_ids), (ids, want_ids)
    got = np.take_along_axis(w.numpy(), np.argsort(ids.numpy(), axis=1), axis=1)
    want = np.take_along_axis(want_w, np.argsort(want_ids, axis=1), axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


DEVICES = [
    pytest.param("cpu", group_cases(), id="interpret"),
    pytest.param("cuda", group_cases(max_tokens=300), id="cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device, cases", DEVICES)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), layout=st.sampled_from(["contiguous", "row_padded", "column_strided"]))
def test_kernel_equals_twin_into_poisoned_outputs(device, cases, data, layout):
    """The router kernel against its twin on strided and sliced float32 logits, into outputs filled
    with poison: every cell written, ids exactly (rows that float32 rounding of a score key decides
    excepted), weights within float32 rounding."""
    skip_unless_triton_runs(device)
    config, n, kind, seed = data.draw(cases)
    x, bias = _tensors(config, n, kind, seed)
    logits = strided_rows(torch.from_numpy(x).float(), layout).to(device)
    b = None if bias is None else torch.from_numpy(bias).float().to(device)
    cfg = validate_route_args(
        logits, config.top_k, config.method, b, config.n_group, config.topk_group, None,
        renormalize=config.renormalize, group_score=config.group_score,
    )  # fmt: skip
    out = {}
    for name, kernel in (("triton", route_rows_triton), ("torch", route_rows_torch)):
        weights = torch.full((n, config.top_k), float("nan"), device=device)
        ids = torch.full((n, config.top_k), POISON_ID, dtype=torch.int32, device=device)
        kernel(
            logits, b, weights, ids, int(cfg.method), cfg.n_group, cfg.topk_group, 1.0,
            unnormalized=cfg.unnormalized, group_top=cfg.group_top,
        )  # fmt: skip
        out[name] = weights.cpu(), ids.cpu()
    (tri_w, tri_ids), (ref_w, ref_ids) = out["triton"], out["torch"]
    assert not (tri_ids == POISON_ID).any() and not tri_w.isnan().any()
    same = ~rounding_decided_rows(config, logits.cpu().double(), None if b is None else b.cpu().double())
    assert torch.equal(tri_ids[same], ref_ids[same])
    torch.testing.assert_close(tri_w[same], ref_w[same], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "backend, device, cases",
    [
        pytest.param("torch", "cpu", group_cases(), id="torch"),
        pytest.param("triton", "cpu", group_cases(), id="triton-interpret"),
        pytest.param("triton", "cuda", group_cases(max_tokens=300), id="cuda", marks=pytest.mark.gpu),
    ],
)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), live=st.floats(0.0, 1.0))
def test_replay_of_route_ids_is_route(backend, device, cases, data, live):
    """replay_routing(x, route(x).ids) == route(x), with rows of -1 routed live in between.

    On CUDA a SOFTMAX_BIAS row routed live may differ from route's where its keys lie within float32
    rounding of a tie: each kernel sums the row's softmax denominator in its own launch layout
    (docs/replay.md); every other row exactly."""
    if backend == "triton":
        skip_unless_triton_runs(device)
    config, n, kind, seed = data.draw(cases)
    x, bias = _tensors(config, n, kind, seed)
    logits = torch.from_numpy(x).float().to(device)
    b = None if bias is None else torch.from_numpy(bias).float().to(device)
    kw = config.route_kwargs(b)
    w, ids = route(logits, config.top_k, config.method, backend=backend, **kw)
    recorded = ids.clone()
    recorded[torch.from_numpy(np.random.default_rng(seed).random(n) < live).to(device)] = -1
    rw, rids = replay_routing(logits, recorded, config.method, backend=backend, **kw)
    same = torch.ones(n, dtype=torch.bool)
    if device == "cuda" and METHODS[config.method].key == SelectionKey.SOFTMAX_BIAS:
        same = ~rounding_decided_rows(config, logits.cpu().double(), None if b is None else b.cpu().double())
    assert torch.equal(rids.cpu()[same], ids.cpu()[same])
    torch.testing.assert_close(rw.cpu()[same], w.cpu()[same], rtol=1e-6, atol=1e-7)


def test_megatron_share_rule_is_group_limited_topk():
    """TOPK_SHARE_SUM against Megatron-Core's own group_limited_topk (sigmoid scores + bias, as its
    router feeds them) on a ported case: 256 experts, top-8, 8 groups keep 4 (a share of 2 keys:
    TOP2_SUM's rule) and top-8, 8 groups keep 2 (a share of 4), where DeepSeek-V3's TOP2_SUM
    chooses other experts in many rows."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    rng = np.random.default_rng(0)
    n, num_experts = 256, 256
    x = torch.from_numpy(rng.standard_normal((n, num_experts)))
    bias = torch.from_numpy(rng.normal(0, 0.05, num_experts))
    scores = torch.sigmoid(x) + bias
    for topk_group in (4, 2):
        _, theirs = moe_utils.group_limited_topk(scores, 8, n, num_experts, 8, topk_group)
        recorded = torch.full((n, 8), -1, dtype=torch.int32)
        kw = dict(bias=bias, n_group=8, topk_group=topk_group)
        _, ours = replay_routing(
            x, recorded, M.DEEPSEEK_V3, group_score="TOPK_SHARE_SUM", backend="torch", **kw
        )
        assert np.array_equal(_as_sets(ours), _as_sets(theirs))
        _, top2 = replay_routing(x, recorded, M.DEEPSEEK_V3, backend="torch", **kw)
        differ = int((torch.from_numpy(_as_sets(top2)) != torch.from_numpy(_as_sets(theirs))).any(1).sum())
        if topk_group == 4:
            assert differ == 0  # a share of 2 is TOP2_SUM
        else:
            assert differ > n // 10, differ  # the rule matters: TOP2_SUM is not Megatron's


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "topk_method, groups", [("group_limited_greedy", dict(n_group=4, topk_group=2)), ("greedy", {})]
)
@pytest.mark.parametrize("renormalize", [None, True])
def test_deepseek_v2_is_transformers_router(backend, topk_method, groups, renormalize):
    """DEEPSEEK_V2 against transformers' DeepseekV2TopkRouter itself: the same expert sets, and the
    weights its router returns (softmax(x)[ids] with routed_scaling_factor 1.0), divided by their
    sum with renormalize=True (norm_topk_prob=True, which this router never applies itself)."""
    _skip(backend)
    modeling = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config

    torch.manual_seed(0)
    config = DeepseekV2Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, topk_method=topk_method,
        routed_scaling_factor=1.0, n_group=groups.get("n_group"), topk_group=groups.get("topk_group"),
    )  # fmt: skip
    router = modeling.DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    with torch.no_grad():
        logits, their_w, their_ids = router(torch.randn(24, 32))
    w, ids = route(logits, 4, M.DEEPSEEK_V2, renormalize=renormalize, backend=backend, **groups)
    assert np.array_equal(_as_sets(ids), _as_sets(their_ids))
    order = torch.argsort(ids.long(), dim=1)
    their_order = torch.argsort(their_ids, dim=1)
    want = their_w.gather(1, their_order)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(w.gather(1, order), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", [M.DEEPSEEK_V2, M.SOFTMAX_BIAS])
@pytest.mark.parametrize("renormalize", [None, True, False])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradcheck(method, renormalize, backend):
    """float64 gradcheck of every weight rule the new methods take (replayed rows and a live row)."""
    _skip(backend)
    if renormalize is not None and renormalize == METHODS[method].renormalizes:
        pytest.skip("the method's own rule: renormalize=None covers it")
    torch.manual_seed(1)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    recorded = torch.tensor([[0, 5], [7, 2], [-1, -1]], dtype=torch.int32)
    kw = dict(n_group=4, topk_group=2, renormalize=renormalize, backend=backend)

    def weights(logits):
        return replay_routing(logits, recorded, method, **kw)[0]

    assert torch.autograd.gradcheck(weights, (x,), eps=1e-6, atol=1e-8)


def test_softmax_bias_chooses_by_the_bias_and_weighs_without_it():
    """The bias decides, the weights are the unbiased softmax: renormalised (vLLM's and SGLang's
    renormalize=True), or not (renormalize=False)."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 2.0])
    p = torch.softmax(x.double(), -1)[0]
    w, ids = route(x, 2, M.SOFTMAX_BIAS, bias=bias)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(w.double(), (p[[3, 0]] / p[[3, 0]].sum())[None], rtol=1e-6, atol=0)
    w, ids = route(x, 2, M.SOFTMAX_BIAS, bias=bias, renormalize=False)
    torch.testing.assert_close(w.double(), p[[3, 0]][None], rtol=1e-6, atol=0)


BAD = [
    (
        M.RENORMALIZE,
        dict(group_score="MAX"),
        "group_score is only used by DEEPSEEK_V3, DEEPSEEK_V2 and SOFTMAX_BIAS",
    ),
    (
        M.DEEPSEEK_V2,
        dict(n_group=4, topk_group=2, group_score=GroupScore.TOP2_SUM),
        "DEEPSEEK_V2 chooses on the logits",
    ),
    (
        M.DEEPSEEK_V3,
        dict(n_group=4, topk_group=4, group_score="topk_share_sum"),
        "it needs top_k >= topk_group",
    ),
    (M.DEEPSEEK_V2, dict(n_group=4, topk_group=1, group_score=3), "DEEPSEEK_V2 chooses on the logits"),
    (M.DEEPSEEK_V3, dict(n_group=4, topk_group=2, group_score="SUM"), "group_score must be a GroupScore"),
    (M.DEEPSEEK_V3, dict(n_group=4, topk_group=2, group_score=True), "group_score must be a GroupScore"),
    (M.DEEPSEEK_V2, dict(routed_scaling_factor=float("nan")), "routed_scaling_factor must be finite"),
    (M.DEEPSEEK_V2, dict(bias=torch.zeros(16)), "bias is only used by"),
    (M.DEEPSEEK_V2, dict(renormalize=False, group_score=None), None),
    (M.SOFTMAX_BIAS, dict(renormalize=True), None),
]


@pytest.mark.parametrize("method, change, match", BAD)
def test_bad_group_arguments_raise(method, change, match):
    """What cannot apply is refused with the reason; a method's own value is accepted."""
    logits = torch.randn(6, 16)
    if match is None:
        route(logits, 3, method, **change)
        replay_routing(logits, torch.full((6, 3), -1), method, **change)
        return
    with pytest.raises(ValueError, match=match):
        route(logits, 3, method, **change)
    with pytest.raises(ValueError, match=match):
        replay_routing(logits, torch.full((6, 3), -1), method, **change)


def test_flashinfer_backend_refuses_other_group_scores():
    with pytest.raises(ValueError, match="TOP2_SUM only"):
        route(
            torch.randn(4, 16),
            2,
            M.DEEPSEEK_V3,
            n_group=4,
            topk_group=2,
            group_score="MAX",
            backend="flashinfer",
        )
