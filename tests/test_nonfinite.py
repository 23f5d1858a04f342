"""Non-finite logits (NaN, +inf, -inf, -0.0): every Triton kernel path against its PyTorch twin.

The paths: the router (``route_rows_triton``), the replay forward (``replay_rows_triton``) and the
replay backward (``replay_backward_triton``), for every method, on rows with NaN, +-inf, whole rows
of one special value and SIGMOID_RENORM rows below its 1e-20 floor, with finite and non-finite
biases. Interpreted on the CPU here; the ``cuda`` parametrisation (marker gpu) runs the same tests
with the compiled kernels.

The rule (docs/routing.md, "Non-finite logits"): ids equal the twin's exactly and the fault counter
too; a weight or gradient is NaN exactly where the twin's is, +inf / -inf exactly where the twin's
is; finite values agree to 1e-5 relative + 1e-6 absolute (float32, two operation orders; on a GPU
the kernels' exp is an approximation within 2 ulp), plus one rounding of the result for bf16/fp16
gradients (2**-7 / 2**-10 relative); float64 to 1e-12 relative + 1e-14 absolute. Output buffers
are poisoned with a finite sentinel before each call, so an unwritten cell differs from the twin.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import POISON, NonFiniteCase, nonfinite_cases

from moe_ops import RoutingMethod, replay_routing, route
from moe_ops.replay import check_replay_errors
from moe_ops.replay.kernels import (
    replay_backward_torch,
    replay_backward_triton,
    replay_rows_torch,
    replay_rows_triton,
)
from moe_ops.router.kernels import route_rows_torch, route_rows_triton
from moe_ops.router.methods import REPLAY_LOGIT_DTYPES

# the interpreter runs the kernels in numpy, which warns on these rows (an all-NaN max, inf - inf,
# exp overflow): the values are what the tests check
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DEVICES = [pytest.param("cpu", id="interpret"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
METHODS = [pytest.param(m, id=m.name) for m in RoutingMethod]
EXAMPLES = 12  # per method and path: 65 s interpreted in all with -n 2 on this 2-core machine
NAN, INF = float("nan"), float("inf")
SENTINEL = -7777.0  # poison of float outputs: no weight or gradient of these cases equals it
# one rounding of a float32 result to the gradient's dtype (relative)
ULP = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


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


def _poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    fill = SENTINEL if dtype.is_floating_point else POISON
    return torch.full(shape, fill, dtype=dtype, device=device)


def _groups(case: NonFiniteCase) -> tuple[int, int, float]:
    cfg = case.config
    n_group, topk_group = cfg.groups
    return n_group, topk_group, 1.0 if cfg.routed_scaling_factor is None else cfg.routed_scaling_factor


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_route_kernel_equals_twin_on_nonfinite_logits(device, method, data):
    skip_unless_triton_runs(device)
    case = data.draw(nonfinite_cases(methods=(method,)))
    logits, bias, _, _ = case.tensors(device)
    if bias is not None:
        bias = bias.float()  # route's bias: float32/bf16/fp16
    n, k = case.n, case.config.top_k
    out = {}
    for name, kernel in (("triton", route_rows_triton), ("torch", route_rows_torch)):
        weights, ids = _poisoned((n, k), torch.float32, device), _poisoned((n, k), torch.int32, device)
        kernel(logits, bias, weights, ids, int(case.config.method), *_groups(case))
        out[name] = weights, ids
    assert torch.equal(out["triton"][1], out["torch"][1]), "ids differ from the twin"
    assert_twin(out["triton"][0], out["torch"][0], "route weights")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_replay_forward_kernel_equals_twin_on_nonfinite_logits(device, method, data):
    skip_unless_triton_runs(device)
    case = data.draw(nonfinite_cases(methods=(method,), dtypes=REPLAY_LOGIT_DTYPES))
    logits, bias, recorded, _ = case.tensors(device)
    n, k = case.n, case.config.top_k
    wdtype = _compute_dtype(logits)
    out = {}
    for name, kernel in (("triton", replay_rows_triton), ("torch", replay_rows_torch)):
        weights, ids = _poisoned((n, k), wdtype, device), _poisoned((n, k), torch.int32, device)
        errors = torch.zeros(2, dtype=torch.int32, device=device)
        kernel(logits, recorded, bias, weights, ids, errors, int(case.config.method), *_groups(case))
        out[name] = weights, ids, errors
    assert torch.equal(out["triton"][1], out["torch"][1]), "ids differ from the twin"
    assert out["triton"][2].tolist() == out["torch"][2].tolist(), "fault counter differs from the twin"
    assert_twin(out["triton"][0], out["torch"][0], "replay weights")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_replay_backward_kernel_equals_twin_on_nonfinite_logits(device, method, data):
    """Both backward implementations on the same inputs: the twin's forward (weights, ids) of the
    case's record and an incoming gradient."""
    skip_unless_triton_runs(device)
    case = data.draw(nonfinite_cases(methods=(method,), dtypes=REPLAY_LOGIT_DTYPES))
    logits, bias, recorded, grad = case.tensors(device)
    n, k = case.n, case.config.top_k
    n_group, topk_group, scale = _groups(case)
    method = int(case.config.method)
    weights = torch.empty((n, k), dtype=_compute_dtype(logits), device=device)
    ids = torch.empty((n, k), dtype=torch.int32, device=device)
    errors = torch.zeros(2, dtype=torch.int32, device=device)
    replay_rows_torch(logits, recorded, bias, weights, ids, errors, method, n_group, topk_group, scale)
    out = {}
    for name, kernel in (("triton", replay_backward_triton), ("torch", replay_backward_torch)):
        grad_logits = _poisoned(logits.shape, logits.dtype, device)
        kernel(grad, logits, weights, ids, grad_logits, method, scale)
        out[name] = grad_logits
    assert_twin(out["triton"], out["torch"], "grad_logits")


# ---------------------------------------------------------------------------------------------------
# The reproducer: a NaN logit among SIGMOID_RENORM's chosen experts
# ---------------------------------------------------------------------------------------------------

NAN_ROW = [[float("nan"), 1.0, 0.5, -1.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_renorm_replay_of_a_nan_logit_is_nan_not_huge(device):
    """sum(sigmoid) is NaN: max(NaN, 1e-20) must stay NaN (torch.clamp's rule), so every weight of
    the row is NaN, as the twin's; a NaN-dropping max gave 1e-20 and a weight of 7.3e19."""
    skip_unless_triton_runs(device)
    x = torch.tensor(NAN_ROW, device=device, requires_grad=True)
    recorded = torch.tensor([[0, 1]], device=device)
    out = {}
    for backend in ("triton", "torch"):
        w, ids = replay_routing(x, recorded, RoutingMethod.SIGMOID_RENORM, backend=backend)
        (grad,) = torch.autograd.grad(w, x, torch.ones_like(w))
        out[backend] = w.detach(), ids, grad
    assert check_replay_errors(x.device) == 0
    tri_w, tri_ids, tri_grad = out["triton"]
    assert torch.isnan(out["torch"][0]).all()
    assert torch.isnan(tri_w).all(), f"weights {tri_w.tolist()}"
    assert torch.equal(tri_ids, out["torch"][1])
    assert_twin(tri_grad, out["torch"][2], "grad_logits")
    assert torch.isnan(tri_grad[0, :2]).all() and (tri_grad[0, 2:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_renorm_route_choosing_a_nan_logit_is_nan_not_huge(device):
    """top_k = num_experts: the router has to choose the NaN expert too (last: NaN ranks lowest)."""
    skip_unless_triton_runs(device)
    x = torch.tensor(NAN_ROW, device=device)
    tri_w, tri_ids = route(x, 4, RoutingMethod.SIGMOID_RENORM, backend="triton")
    ref_w, ref_ids = route(x, 4, RoutingMethod.SIGMOID_RENORM, backend="torch")
    assert tri_ids.tolist() == ref_ids.tolist() == [[1, 2, 3, 0]]
    assert torch.isnan(ref_w).all() and torch.isnan(tri_w).all(), f"weights {tri_w.tolist()}"


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


def _padded_weight(method: RoutingMethod, value: float, k: int) -> float:
    """The weight of every chosen expert of a row whose logits all equal ``value``, from the
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
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("device", DEVICES)
def test_padded_rows_of_one_nonfinite_value(device, method, value):
    """What a serving engine's padded rows get from ``route`` and ``replay_routing`` (live and
    recorded), Triton against the twin: the padded rows choose experts 0..k-1 (all keys tie, the
    lowest index wins: distinct and in range, which vLLM's topk_softmax only reaches by clamping
    NaN/inf to 0), their weights follow the methods' formulas in IEEE arithmetic (NaN for every
    softmax method: no clamp), no fault is counted, and the real rows are routed as without the
    padding. A zero bias: every key of a padded row ties (a bias would choose by its order)."""
    skip_unless_triton_runs(device)
    k, kw = _padded_kwargs(method, device)
    gen = torch.Generator().manual_seed(int(method))
    real = torch.randn(PAD_REAL, PAD_EXPERTS, generator=gen).to(device)
    x = torch.cat([real, torch.full((PAD_ROWS, PAD_EXPERTS), value, device=device)])
    want_ids = torch.arange(k, dtype=torch.int32).expand(PAD_ROWS, k)
    out = {}
    for backend in ("triton", "torch"):
        weights, ids = route(x, k, method, backend=backend, **kw)
        real_weights, real_ids = route(real, k, method, backend=backend, **kw)
        assert torch.equal(ids[PAD_REAL:].cpu(), want_ids), f"{backend}: padded ids {ids[PAD_REAL:].tolist()}"
        assert torch.equal(ids[:PAD_REAL], real_ids), f"{backend}: the padding changed a real row's ids"
        torch.testing.assert_close(weights[:PAD_REAL], real_weights, rtol=1e-6, atol=0)
        want = torch.full((PAD_ROWS, k), _padded_weight(method, value, k))
        assert_twin(weights[PAD_REAL:].cpu(), want, f"{backend}: padded weights")
        recorded = torch.cat([real_ids.long(), want_ids.long().to(device)])
        live = torch.cat([real_ids.long(), torch.full((PAD_ROWS, k), -1, device=device)])
        for name, record in (("recorded", recorded), ("live", live)):
            replay_weights, replay_ids = replay_routing(x, record, method, backend=backend, **kw)
            assert torch.equal(replay_ids, ids), f"{backend} {name} replay: ids differ from route"
            assert_twin(replay_weights, weights, f"{backend} {name} replay weights")
        assert check_replay_errors(x.device, raise_error=False) == 0
        out[backend] = weights, ids
    assert torch.equal(out["triton"][1], out["torch"][1]), "ids differ from the twin"
    assert_twin(out["triton"][0], out["torch"][0], "route weights")
