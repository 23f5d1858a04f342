"""Non-finite logits (NaN, +inf, -inf, -0.0): every Triton kernel path against its PyTorch twin and
the rule for non-finite weights.

The paths: the router (``route_rows_triton``), the replay forward (``replay_rows_triton``) and the
replay backward (``replay_backward_triton``), for every method, on rows with NaN, +-inf, whole rows
of one special value and SIGMOID_RENORM rows below its 1e-20 floor, with finite and non-finite
biases. Interpreted on the CPU here; the ``cuda`` parametrisation (marker gpu) runs the same tests
with the compiled kernels.

The rule (docs/routing.md, "Non-finite logits"): ids equal the twin's exactly; a row whose formula
weights (the method's weight rule at those ids, computed here independently in float64) are not all
finite gets weights exactly 0 in every routed column and is counted once in the non-finite rows
counter (``check_nonfinite_rows``); every other row's weights equal the formula (1e-5 relative +
1e-6 absolute: float32, two operation orders; on a GPU the kernels' exp is an approximation within
2 ulp; float64 logits to 1e-12 + 1e-14), so every weight is finite. The backward gives a zeroed row
the gradient 0 and every other row the gradient of the method's rule, Triton and twin alike (NaN,
+-inf at the same positions, finite values within the tolerance above, plus one rounding of the
result for bf16/fp16 gradients: 2**-7 / 2**-10 relative). Output buffers are poisoned with a finite
sentinel before each call, so an unwritten cell differs from the expected value.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_checks import replay_backward_args, replay_forward_args
from strategies import POISON, NonFiniteCase, nonfinite_cases
from threads import run_threads

from moe_ops import CaptureTarget, RoutingMethod, check_nonfinite_rows, replay_routing, route
from moe_ops.replay import check_replay_errors
from moe_ops.replay.kernels import (
    replay_backward_torch,
    replay_backward_triton,
    replay_rows_torch,
    replay_rows_triton,
)
from moe_ops.router import NonFiniteRowsError
from moe_ops.router.args import REPLAY_LOGIT_DTYPES
from moe_ops.router.kernels import route_rows_torch, route_rows_triton
from moe_ops.router.methods import METHODS, WeightRule
from moe_ops.router.reference import rule_gradient

# the interpreter runs the kernels in numpy, which warns on these rows (an all-NaN max, inf - inf,
# exp overflow): the values are what the tests check
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DEVICES = [pytest.param("cpu", id="interpret"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
METHOD_PARAMS = [pytest.param(m, id=m.name) for m in RoutingMethod]
EXAMPLES = 12  # per method and path: 65 s interpreted in all with -n 2 on this 2-core machine
NAN, INF = float("nan"), float("inf")
SENTINEL = -7777.0  # poison of float outputs: no weight or gradient of these cases equals it
# one rounding of a float32 result to the gradient's dtype (relative)
ULP = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
EPS = 1e-20  # the rules' sum epsilon / floor (docs/routing.md)


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype == torch.float64:
        return 1e-12, 1e-14
    return 1e-5 + ULP[dtype], 1e-6


def assert_twin(tri: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """NaN, +inf and -inf at the same positions; finite values within the module's tolerance."""
    assert tri.dtype == ref.dtype and tri.shape == ref.shape, (
        f"{what}: {tri.dtype} {tri.shape} vs {ref.dtype}"
    )
    tri, ref = tri.cpu(), ref.cpu()
    for name, where in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        diff = where(tri) != where(ref)
        assert not diff.any(), f"{what}: {name} differs from the twin at {diff.nonzero().tolist()[:6]}"
    finite = torch.isfinite(ref)
    rtol, atol = _tolerance(tri.dtype)
    torch.testing.assert_close(tri[finite], ref[finite], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def formula_weights(x: torch.Tensor, ids: torch.Tensor, rule: WeightRule, scale: float) -> torch.Tensor:
    """The weight rule at ``ids`` in float64, written from the table in docs/routing.md (not the
    twin's code): x (n, E) logits, ids (n, k) int64. IEEE arithmetic throughout (NaN, +-inf kept)."""
    x = x.double().cpu()
    xs = x.gather(1, ids.long().cpu())
    if rule == WeightRule.LOGIT:
        w = xs
    elif rule == WeightRule.SOFTMAX:
        w = torch.softmax(x, dim=1).gather(1, ids.long().cpu())
    elif rule in (WeightRule.SOFTMAX_CHOSEN, WeightRule.SOFTMAX_RENORM):
        w = torch.softmax(xs, dim=1)  # p[sel] / sum p[sel] == softmax(x[sel])
    elif rule in (WeightRule.SQRTSOFTPLUS_SCALED, WeightRule.SQRTSOFTPLUS_TIMES_SCALE):
        q = torch.sqrt(F.softplus(xs))
        w = (
            q * scale / (q.sum(1, keepdim=True) + EPS)
            if rule == WeightRule.SQRTSOFTPLUS_SCALED
            else q * scale
        )
    else:
        s = torch.sigmoid(xs)
        if rule == WeightRule.SIGMOID:
            w = s
        elif rule == WeightRule.SIGMOID_RENORM:
            total = s.sum(1, keepdim=True)
            w = s / torch.where(torch.isnan(total), total, total.clamp(min=EPS))
        elif rule == WeightRule.SIGMOID_SCALED:
            w = s * scale / (s.sum(1, keepdim=True) + EPS)
        else:
            assert rule == WeightRule.SIGMOID_TIMES_SCALE
            w = s * scale
    return w if rule.holds_scale else w * scale


def assert_rule(weights: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, rule, scale, what: str) -> int:
    """``weights`` (n, k) follow the rule at ``ids``: rows whose float64 formula is not all finite are
    exactly 0, every other row equals the formula; every weight finite. Returns the zeroed rows."""
    w = weights.cpu()
    want = formula_weights(x, ids, rule, scale)
    zeroed = ~torch.isfinite(want).all(1)
    assert torch.isfinite(w).all(), (
        f"{what}: a non-finite weight at {(~torch.isfinite(w)).nonzero().tolist()[:6]}"
    )
    assert (w[zeroed] == 0).all(), f"{what}: a zeroed row's weights are {w[zeroed].tolist()[:3]}"
    rtol, atol = _tolerance(w.dtype)
    torch.testing.assert_close(
        w[~zeroed], want[~zeroed].to(w.dtype), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )
    return int(zeroed.sum())


def _poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    fill = SENTINEL if dtype.is_floating_point else POISON
    return torch.full(shape, fill, dtype=dtype, device=device)


def _groups(case: NonFiniteCase) -> tuple[int, int, float]:
    cfg = case.config
    n_group, topk_group = cfg.groups
    return n_group, topk_group, 1.0 if cfg.routed_scaling_factor is None else cfg.routed_scaling_factor


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _rule(method) -> WeightRule:
    return METHODS[RoutingMethod(method)].computed(False)[0]


@pytest.mark.parametrize("method", METHOD_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_route_kernel_and_twin_zero_and_count_nonfinite_rows(device, method, data):
    skip_unless_triton_runs(device)
    case = data.draw(nonfinite_cases(methods=(method,)))
    logits, bias, _, _ = case.tensors(device)
    if bias is not None:
        bias = bias.float()  # route's bias: float32/bf16/fp16
    n, k = case.n, case.config.top_k
    n_group, topk_group, scale = _groups(case)
    out = {}
    check_nonfinite_rows(device, raise_error=False)
    for name, kernel in (("triton", route_rows_triton), ("torch", route_rows_torch)):
        weights, ids = _poisoned((n, k), torch.float32, device), _poisoned((n, k), torch.int32, device)
        kernel(logits, bias, weights, ids, int(case.config.method), n_group, topk_group, scale)
        counted = check_nonfinite_rows(device, raise_error=False)
        zeroed = assert_rule(weights, ids, logits, _rule(method), scale, f"{name} route weights")
        assert counted == zeroed, f"{name}: counted {counted} rows, {zeroed} were zeroed"
        out[name] = weights, ids
    assert torch.equal(out["triton"][1], out["torch"][1]), "ids differ from the twin"
    assert_twin(out["triton"][0], out["torch"][0], "route weights")


@pytest.mark.parametrize("method", METHOD_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_replay_forward_kernel_and_twin_zero_and_count_nonfinite_rows(device, method, data):
    """Recorded, live (-1) and faulty rows alike: the rule at the returned ids."""
    skip_unless_triton_runs(device)
    case = data.draw(nonfinite_cases(methods=(method,), dtypes=REPLAY_LOGIT_DTYPES))
    logits, bias, recorded, _ = case.tensors(device)
    n, k = case.n, case.config.top_k
    n_group, topk_group, scale = _groups(case)
    wdtype = _compute_dtype(logits)
    out = {}
    check_nonfinite_rows(device, raise_error=False)
    for name, kernel in (("triton", replay_rows_triton), ("torch", replay_rows_torch)):
        weights, ids = _poisoned((n, k), wdtype, device), _poisoned((n, k), torch.int32, device)
        errors = torch.zeros(2, dtype=torch.int32, device=device)
        kernel(
            **replay_forward_args(
                logits, recorded, bias, weights, ids, errors, case.config.method, n_group, topk_group, scale
            )
        )
        counted = check_nonfinite_rows(device, raise_error=False)
        zeroed = assert_rule(weights, ids, logits, _rule(method), scale, f"{name} replay weights")
        assert counted == zeroed, f"{name}: counted {counted} rows, {zeroed} were zeroed"
        out[name] = weights, ids, errors
    assert torch.equal(out["triton"][1], out["torch"][1]), "ids differ from the twin"
    assert out["triton"][2].tolist() == out["torch"][2].tolist(), "fault counter differs from the twin"
    assert_twin(out["triton"][0], out["torch"][0], "replay weights")


@pytest.mark.parametrize("method", METHOD_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_replay_backward_gives_zeroed_rows_gradient_zero(device, method, data):
    """Both backward implementations on the same inputs (the twin's forward of the case's record and
    an incoming gradient): a zeroed row's gradient is 0 in every column; every other row's is the
    method's gradient rule (the reference's ``rule_gradient``, as before the rule), Triton as twin."""
    skip_unless_triton_runs(device)
    case = data.draw(nonfinite_cases(methods=(method,), dtypes=REPLAY_LOGIT_DTYPES))
    logits, bias, recorded, grad = case.tensors(device)
    n, k = case.n, case.config.top_k
    n_group, topk_group, scale = _groups(case)
    method = int(case.config.method)
    weights = torch.empty((n, k), dtype=_compute_dtype(logits), device=device)
    ids = torch.empty((n, k), dtype=torch.int32, device=device)
    errors = torch.zeros(2, dtype=torch.int32, device=device)
    replay_rows_torch(
        **replay_forward_args(
            logits, recorded, bias, weights, ids, errors, method, n_group, topk_group, scale
        )
    )
    check_nonfinite_rows(device, raise_error=False)
    zeroed = ~torch.isfinite(formula_weights(logits, ids, _rule(method), scale)).all(1)
    x = logits.to(weights.dtype)
    rule = METHODS[RoutingMethod(method)].computed(False)[1]
    want = rule_gradient(grad.to(weights.dtype), weights, x, ids.long(), rule, scale).to(logits.dtype).cpu()
    want[zeroed] = 0.0
    out = {}
    for name, kernel in (("triton", replay_backward_triton), ("torch", replay_backward_torch)):
        grad_logits = _poisoned(logits.shape, logits.dtype, device)
        kernel(**replay_backward_args(grad, logits, weights, ids, grad_logits, method, scale))
        assert (grad_logits.cpu()[zeroed] == 0).all(), f"{name}: a zeroed row's gradient is not 0"
        assert_twin(grad_logits, want, f"{name} grad_logits")
        out[name] = grad_logits
    assert_twin(out["triton"], out["torch"], "grad_logits")


# ---------------------------------------------------------------------------------------------------
# The reproducer: a NaN logit among SIGMOID_RENORM's chosen experts
# ---------------------------------------------------------------------------------------------------

NAN_ROW = [[float("nan"), 1.0, 0.5, -1.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_renorm_replay_of_a_nan_logit_is_zeroed_and_counted(device):
    """sum(sigmoid) is NaN (max(NaN, 1e-20) stays NaN, torch.clamp's rule; a NaN-dropping max gave
    1e-20 and a weight of 7.3e19 beside the NaN): the row's weights are 0, it is counted once, and
    its gradient is 0 - autograd's NaN * 0 of a where would be NaN."""
    skip_unless_triton_runs(device)
    x = torch.tensor(NAN_ROW, device=device, requires_grad=True)
    recorded = torch.tensor([[0, 1]], device=device)
    check_nonfinite_rows(x.device, raise_error=False)
    for backend in ("triton", "torch"):
        w, ids = replay_routing(x, recorded, RoutingMethod.SIGMOID_RENORM, backend=backend)
        (grad,) = torch.autograd.grad(w, x, torch.ones_like(w))
        assert w.tolist() == [[0.0, 0.0]], f"{backend}: weights {w.tolist()}"
        assert ids.tolist() == [[0, 1]]
        assert grad.tolist() == [[0.0] * 4], f"{backend}: gradient {grad.tolist()}"
        assert check_nonfinite_rows(x.device, raise_error=False) == 1
    assert check_replay_errors(x.device) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_renorm_route_choosing_a_nan_logit_is_zeroed_and_counted(device):
    """top_k = num_experts: the router has to choose the NaN expert too (last: NaN ranks lowest)."""
    skip_unless_triton_runs(device)
    x = torch.tensor(NAN_ROW, device=device)
    check_nonfinite_rows(x.device, raise_error=False)
    for backend in ("triton", "torch"):
        w, ids = route(x, 4, RoutingMethod.SIGMOID_RENORM, backend=backend)
        assert ids.tolist() == [[1, 2, 3, 0]]
        assert w.tolist() == [[0.0] * 4], f"{backend}: weights {w.tolist()}"
        with pytest.raises(NonFiniteRowsError, match="1 routed row"):
            check_nonfinite_rows(x.device)
        assert check_nonfinite_rows(x.device) == 0  # the raising check reset the counter


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_the_weights_do_not_read_changes_nothing(device):
    """RENORMALIZE weighs the chosen logits only: a NaN it did not choose leaves the row's weights
    as without it and counts nothing; DEFAULT's softmax runs over the whole row: zeroed, counted."""
    skip_unless_triton_runs(device)
    x = torch.tensor([[2.0, 1.0, NAN, -1.0], [2.0, 1.0, 0.0, -1.0]], device=device)
    check_nonfinite_rows(x.device, raise_error=False)
    for backend in ("triton", "torch"):
        w, _ = route(x, 2, RoutingMethod.RENORMALIZE, backend=backend)
        assert torch.equal(w[0], w[1]) and (w[0] > 0).all()
        assert check_nonfinite_rows(x.device, raise_error=False) == 0
        w, _ = route(x, 2, RoutingMethod.DEFAULT, backend=backend)
        assert w[0].tolist() == [0.0, 0.0] and (w[1] > 0).all()
        assert check_nonfinite_rows(x.device, raise_error=False) == 1


# ---------------------------------------------------------------------------------------------------
# Padded rows: whole rows of NaN, +inf or -inf after the batch's real rows (CUDA-graph padding)
# ---------------------------------------------------------------------------------------------------

PAD_VALUES = [pytest.param(v, id=name) for name, v in (("nan", NAN), ("posinf", INF), ("neginf", -INF))]
PAD_EXPERTS, PAD_REAL, PAD_ROWS, PAD_SCALE = 8, 3, 2, 2.5
SOFTMAX_METHODS = {
    RoutingMethod.DEFAULT,
    RoutingMethod.RENORMALIZE,
    RoutingMethod.RENORMALIZE_NAIVE,
    RoutingMethod.DEEPSEEK_V2,
    RoutingMethod.SOFTMAX_BIAS,
}


def _padded_formula(method: RoutingMethod, value: float, k: int) -> float:
    """The formula weight of every chosen expert of a row whose logits all equal ``value``, from the
    methods' formulas (docs/routing.md), not from the code: softmax over a row of one non-finite
    value is NaN (inf - inf, -inf - -inf, NaN); s = sigmoid(value) is 1 / 0 / NaN."""
    s = 1.0 if value == INF else 0.0 if value == -INF else NAN
    if method in SOFTMAX_METHODS:
        return NAN
    if method == RoutingMethod.TOPK:
        return value
    if method == RoutingMethod.SIGMOID_RENORM:
        return s / max(k * s, 1e-20) if s == s else NAN
    if method in (RoutingMethod.DEEPSEEK_V3, RoutingMethod.MINIMAX2):
        return s * PAD_SCALE / (k * s + 1e-20)
    if method == RoutingMethod.SQRTSOFTPLUS:
        q = INF if value == INF else 0.0 if value == -INF else NAN  # sqrt(softplus(value))
        return q * PAD_SCALE / (k * q + 1e-20) if q != INF else NAN  # inf / inf
    return s  # LLAMA4, SIGMOID, TOPK_SIGMOID


def _padded_kwargs(method: RoutingMethod, device) -> tuple[int, dict]:
    if method == RoutingMethod.LLAMA4:
        return 1, {}
    if method == RoutingMethod.DEEPSEEK_V3:
        kw = dict(n_group=4, topk_group=2, routed_scaling_factor=PAD_SCALE)
        return 3, {**kw, "bias": torch.zeros(PAD_EXPERTS, device=device)}
    if method in (RoutingMethod.MINIMAX2, RoutingMethod.SQRTSOFTPLUS):
        return 3, {"bias": torch.zeros(PAD_EXPERTS, device=device), "routed_scaling_factor": PAD_SCALE}
    return 3, {}


@pytest.mark.parametrize("value", PAD_VALUES)
@pytest.mark.parametrize("method", METHOD_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_padded_rows_of_one_nonfinite_value(device, method, value):
    """What a serving engine's padded rows get from ``route`` and ``replay_routing`` (live and
    recorded), Triton against the twin: the padded rows choose experts 0..k-1 (all keys tie, the
    lowest index wins: distinct and in range, which vLLM's topk_softmax only reaches by clamping
    NaN/inf to 0); where their formula weights are not finite (every softmax method; TOPK at +-inf;
    NaN everywhere) they get weights 0 and each is counted once (route does not know they are
    padding), elsewhere the formula's finite value (the sigmoids' 1 / 0); no replay fault; the real
    rows are routed as without the padding. A zero bias: every key of a padded row ties."""
    skip_unless_triton_runs(device)
    k, kw = _padded_kwargs(method, device)
    gen = torch.Generator().manual_seed(int(method))
    real = torch.randn(PAD_REAL, PAD_EXPERTS, generator=gen).to(device)
    x = torch.cat([real, torch.full((PAD_ROWS, PAD_EXPERTS), value, device=device)])
    want_ids = torch.arange(k, dtype=torch.int32).expand(PAD_ROWS, k)
    formula = _padded_formula(method, value, k)
    pad_counted = 0 if math.isfinite(formula) else PAD_ROWS
    want = torch.full((PAD_ROWS, k), formula if math.isfinite(formula) else 0.0)
    check_nonfinite_rows(x.device, raise_error=False)
    out = {}
    for backend in ("triton", "torch"):
        weights, ids = route(x, k, method, backend=backend, **kw)
        assert check_nonfinite_rows(x.device, raise_error=False) == pad_counted, f"{backend}: route's count"
        real_weights, real_ids = route(real, k, method, backend=backend, **kw)
        assert torch.equal(ids[PAD_REAL:].cpu(), want_ids), f"{backend}: padded ids {ids[PAD_REAL:].tolist()}"
        assert torch.equal(ids[:PAD_REAL], real_ids), f"{backend}: the padding changed a real row's ids"
        torch.testing.assert_close(weights[:PAD_REAL], real_weights, rtol=1e-6, atol=0)
        assert_twin(weights[PAD_REAL:].cpu(), want, f"{backend}: padded weights")
        recorded = torch.cat([real_ids.long(), want_ids.long().to(device)])
        live = torch.cat([real_ids.long(), torch.full((PAD_ROWS, k), -1, device=device)])
        for name, record in (("recorded", recorded), ("live", live)):
            replay_weights, replay_ids = replay_routing(x, record, method, backend=backend, **kw)
            assert torch.equal(replay_ids, ids), f"{backend} {name} replay: ids differ from route"
            assert_twin(replay_weights, weights, f"{backend} {name} replay weights")
            counted = check_nonfinite_rows(x.device, raise_error=False)
            assert counted == pad_counted, f"{backend} {name} replay: counted {counted}"
        assert check_replay_errors(x.device, raise_error=False) == 0
        out[backend] = weights, ids
    assert torch.equal(out["triton"][1], out["torch"][1]), "ids differ from the twin"
    assert_twin(out["triton"][0], out["torch"][0], "route weights")


# ---------------------------------------------------------------------------------------------------
# Fused capture, the hash router, threads
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_capture_records_the_zeroed_weights(device, backend):
    """route with a capture target and a weights buffer: the captured weights are what route
    returned (a zeroed row's 0, not its NaN), in the buffer's dtype; the rows are counted once."""
    if backend == "triton":
        skip_unless_triton_runs(device)
    x = torch.tensor([[1.0, NAN, 0.5, -1.0], [0.25, 1.0, 2.0, -2.0], [INF, 0.0, 1.0, 2.0]], device=device)
    buffer = torch.full((4, 2, 2), POISON, dtype=torch.int32, device=device)
    wbuf = torch.full((4, 2, 2), SENTINEL, dtype=torch.bfloat16, device=device)
    counts = torch.tensor([3], dtype=torch.int32, device=device)
    target = CaptureTarget(buffer, 1, token_counts=counts, weights_buffer=wbuf)
    check_nonfinite_rows(x.device, raise_error=False)
    weights, ids = route(x, 2, RoutingMethod.DEFAULT, capture=target, backend=backend)
    assert check_nonfinite_rows(x.device, raise_error=False) == 2  # the NaN row and the +inf row
    assert weights[0].tolist() == [0.0, 0.0] and weights[2].tolist() == [0.0, 0.0]
    assert (weights[1] > 0).all()
    assert torch.equal(buffer[:3, 1], ids)
    assert torch.equal(wbuf[:3, 1], weights.to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("device", DEVICES)
def test_hash_router_zeroes_and_counts_nonfinite_rows_apart_from_its_faults(device, backend):
    """A hash layer weighs the table's ids by the method's rule: a NaN among them zeroes the row and
    counts it here; a faulty row (token id outside the table: ids -1, weights 0) is the hash
    counter's, not this one's."""
    if backend == "triton":
        skip_unless_triton_runs(device)
    from moe_ops.router.hash import check_hash_errors

    x = torch.tensor([[NAN, 1.0, 0.5, -1.0], [0.25, 1.0, 2.0, -2.0], [NAN, 0.0, 1.0, 2.0]], device=device)
    table = torch.tensor([[0, 1], [2, 3]], device=device)
    token_ids = torch.tensor([0, 1, 5], device=device)  # row 2: a token id outside the table
    check_nonfinite_rows(x.device, raise_error=False)
    check_hash_errors(x.device, raise_error=False)
    weights, ids = route(
        x, 2, RoutingMethod.RENORMALIZE, hash_table=table, token_ids=token_ids, backend=backend
    )
    assert ids.tolist() == [[0, 1], [2, 3], [-1, -1]]
    assert weights[0].tolist() == [0.0, 0.0] and weights[2].tolist() == [0.0, 0.0]
    assert torch.isfinite(weights).all() and (weights[1] > 0).all()
    assert check_nonfinite_rows(x.device, raise_error=False) == 1
    assert check_hash_errors(x.device, raise_error=False) == 1


def test_threads_count_every_zeroed_row_once():
    """Two threads route batches with NaN rows while a third checks the counter: the checks' sum is
    every zeroed row, once (the counter's read subtracts what it read; the twins add under the CPU
    counters' lock)."""
    rounds, nan_rows = 40, 3
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    x[1:4, 5] = NAN  # DEFAULT's whole-row softmax: three zeroed rows per call
    check_nonfinite_rows("cpu", raise_error=False)
    seen, failures, done = [], [], []

    def worker(seed: int) -> None:
        try:
            if seed == 2:
                while len(done) < 2:
                    seen.append(check_nonfinite_rows("cpu", raise_error=False))
                return
            for _ in range(rounds):
                weights, _ = route(x, 2, RoutingMethod.DEFAULT, backend="torch")
                if not torch.isfinite(weights).all():
                    failures.append("a non-finite weight")
            done.append(seed)
        except Exception as exc:  # reported to the test below
            failures.append(repr(exc))
            done.append(seed)

    run_threads(worker, 3)
    seen.append(check_nonfinite_rows("cpu", raise_error=False))
    assert not failures, failures
    assert sum(seen) == 2 * rounds * nan_rows, (sum(seen), len(seen))
