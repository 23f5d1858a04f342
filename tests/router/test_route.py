"""moe_ops.route against the float64 reference: every method, real and random shapes, three dtypes.

Backends: the PyTorch reference and the Triton kernel (interpreted on CPU, compiled on CUDA).
Comparison rules (exact ids, near-tie rows of the sigmoid+bias methods) are in routing_checks.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_checks import check_routing
from strategies import GPU_ROUTER_CASES, MODEL_ROUTERS, RouterCase, router_cases

from moe_ops import RoutingMethod, route
from moe_ops.router.methods import METHODS, SCORE_KEYS

CPU_BACKENDS = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpret"),
]
GPU_BACKENDS = [
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.gpu),
]
MODELS = [pytest.param(c, id=c.name) for c in MODEL_ROUTERS]


def _skip_unavailable(backend: str, device: str) -> None:
    if backend == "triton":
        skip_unless_triton_runs(device)


def run_route(case: RouterCase, backend: str, device: str):
    logits, bias = case.tensors(device)
    cfg = case.config
    weights, ids = route(logits, cfg.top_k, cfg.method, backend=backend, **cfg.route_kwargs(bias))
    return logits, bias, weights, ids


def check_case(backend_device, case: RouterCase) -> None:
    backend, device = backend_device
    _skip_unavailable(backend, device)
    logits, bias, weights, ids = run_route(case, backend, device)
    assert weights.device == logits.device and ids.device == logits.device
    check_routing(case.config, logits, bias, weights, ids)


@pytest.mark.parametrize("backend", [CPU_BACKENDS[0]])
@settings(max_examples=800)
@given(case=router_cases())
def test_reference_matches_float64(backend, case):
    check_case(backend, case)


@pytest.mark.parametrize("backend", [CPU_BACKENDS[1]])
@settings(max_examples=250)
@given(case=router_cases(max_tokens=24))
def test_triton_interpreted_matches_float64(backend, case):
    check_case(backend, case)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@settings(max_examples=80)
@given(case=router_cases(**GPU_ROUTER_CASES))
def test_route_matches_float64_gpu(backend, case):
    check_case(backend, case)


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize(
    "device, cases",
    [
        pytest.param("cpu", router_cases(max_tokens=16, kinds=("special", "ties")), id="interpret"),
        pytest.param(
            "cuda",
            router_cases(**GPU_ROUTER_CASES, kinds=("special", "ties")),
            id="cuda",
            marks=pytest.mark.gpu,
        ),
    ],
)
@settings(max_examples=100)
@given(data=st.data())
def test_triton_equals_reference_twin_on_edge_values(device, cases, data):
    """+-inf, NaN, -0.0 and exact ties: the kernel and its PyTorch twin agree bit for bit on ids.

    NaN ranks below every number and -0.0 equals 0.0. Weights of rows with a non-finite logit are
    unspecified (documented); the other rows' weights agree.
    """
    _skip_unavailable("triton", device)
    case = data.draw(cases)
    logits, _, tri_w, tri_ids = run_route(case, "triton", device)
    _, _, ref_w, ref_ids = run_route(case, "torch", device)
    if METHODS[case.config.method].key not in SCORE_KEYS:  # keys each backend rounds its own way
        assert torch.equal(tri_ids, ref_ids)
    finite = torch.isfinite(logits).all(1)
    torch.testing.assert_close(tri_w[finite], ref_w[finite], rtol=1e-5, atol=1e-7)


def _tie_logits(config, n: int, seed: int, device):
    """Logits from {-2, ..., 2}: almost every row has ties, most of them at the top-k boundary."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.integers(-2, 3, size=(n, config.num_experts)).astype(np.float32))
    bias = None
    if config.has_bias:
        bias = torch.from_numpy(rng.choice([0.0, 0.25], size=config.num_experts).astype(np.float32))
        bias = bias.to(device)
    return x.to(device), bias


@pytest.mark.parametrize("config", MODELS)
@pytest.mark.parametrize("device", DEVICES)
def test_ties_triton_and_reference_agree(config, device):
    """Data built with ties: same expert sets and the same weights per expert in both backends."""
    _skip_unavailable("triton", device)
    logits, bias = _tie_logits(config, 48, 7, device)
    kw = config.route_kwargs(bias)
    tri_w, tri_ids = route(logits, config.top_k, config.method, backend="triton", **kw)
    ref_w, ref_ids = route(logits, config.top_k, config.method, backend="torch", **kw)
    tri_sorted, tri_order = torch.sort(tri_ids, 1)
    ref_sorted, ref_order = torch.sort(ref_ids, 1)
    assert torch.equal(tri_sorted, ref_sorted), "different expert sets on tied data"
    torch.testing.assert_close(tri_w.gather(1, tri_order), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-7)
    # the data really has ties where they matter: the k-th and (k+1)-th best keys are equal
    if config.top_k < config.num_experts and METHODS[config.method].key not in SCORE_KEYS:
        top = torch.sort(logits.float().cpu(), 1, descending=True)[0]
        assert (top[:, config.top_k - 1] == top[:, config.top_k]).any()
    # and the rule is the documented one: lowest index first among equal raw logits
    if config.method in (RoutingMethod.RENORMALIZE, RoutingMethod.TOPK, RoutingMethod.DEFAULT):
        x = logits.cpu()
        ids = tri_ids.cpu().long()
        for row in range(x.shape[0]):
            chosen = x[row, ids[row]]
            assert (chosen[:-1] >= chosen[1:]).all(), "not in descending order"
            ties = chosen[:-1] == chosen[1:]
            assert (ids[row, :-1][ties] < ids[row, 1:][ties]).all(), "a tie did not go to the lower index"
            cut = chosen[-1]
            rest = [e for e in range(x.shape[1]) if x[row, e] == cut and e not in ids[row].tolist()]
            assert all(e > ids[row][chosen == cut].max() for e in rest), "a lower tied index was skipped"


@pytest.mark.parametrize("config", MODELS)
@pytest.mark.parametrize("device", DEVICES)
def test_fp32_weight_accuracy(config, device):
    """Weights of fp32 logits within 1e-5 relative error of float64, on each model's routing."""
    case = RouterCase(config, n=64, dtype=torch.float32, seed=3, kind="normal", scale=2.0)
    check_case(("triton", device), case)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [MODEL_ROUTERS[0], MODEL_ROUTERS[3]], ids=lambda c: c.name)
@pytest.mark.parametrize("n", [512, 4096, 16384])
def test_large_batches_gpu(cuda_device, config, n):
    """Token counts that take the multi-row launch configurations (up to 16384)."""
    case = RouterCase(config, n=n, dtype=torch.bfloat16, seed=n, kind="normal", scale=1.0)
    check_case(("triton", "cuda"), case)


def test_large_batch_reference_cpu():
    case = RouterCase(MODEL_ROUTERS[0], n=16384, dtype=torch.float32, seed=5, kind="normal", scale=1.0)
    check_case(("torch", "cpu"), case)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("config", [MODEL_ROUTERS[0], MODEL_ROUTERS[5]], ids=lambda c: c.name)
def test_zero_tokens(device, backend, config):
    _skip_unavailable(backend, device)
    logits = torch.empty(0, config.num_experts, device=device)
    bias = torch.zeros(config.num_experts, device=device) if config.has_bias else None
    weights, ids = route(logits, config.top_k, config.method, backend=backend, **config.route_kwargs(bias))
    assert weights.shape == (0, config.top_k) and weights.dtype == torch.float32
    assert ids.shape == (0, config.top_k) and ids.dtype == torch.int32


def test_auto_is_the_reference_on_cpu():
    logits = torch.randn(9, 64)
    w_auto, ids_auto = route(logits, 6, RoutingMethod.SIGMOID_RENORM)
    w_ref, ids_ref = route(logits, 6, RoutingMethod.SIGMOID_RENORM, backend="torch")
    # bit-identical weights: the same kernels on the same logits (another path would round otherwise)
    assert torch.equal(ids_auto, ids_ref) and torch.equal(w_auto, w_ref)


@pytest.mark.gpu
def test_triton_on_cpu_without_interpreter_raises(cuda_device):
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        route(torch.randn(4, 8), 2, backend="triton")


@pytest.mark.gpu
def test_auto_is_triton_on_cuda(cuda_device, monkeypatch):
    """backend='auto' on CUDA launches the Triton kernel: the reference twin is never called."""
    from moe_ops.router import op

    def refuse(*args, **kwargs):
        raise AssertionError("auto used the PyTorch reference on CUDA")

    monkeypatch.setattr(op, "route_rows_torch", refuse)
    config = MODEL_ROUTERS[6]  # GPT-OSS
    logits = torch.randn(4, config.num_experts, device=cuda_device)
    weights, ids = route(logits, config.top_k, config.method)
    check_routing(config, logits, None, weights, ids)


# DeepSeek-V3's router (256 experts, k 8, 8 groups keep 4, bf16 logits): the one method FlashInfer's
# fused_topk_deepseek implements, so the case where auto once asked FlashInfer whether to run it
_AUTO_IMPORTS = """
import sys, torch, moe_ops
logits = torch.randn(5, 256, dtype=torch.bfloat16, device=sys.argv[1])
bias = torch.randn(256, device=sys.argv[1])
weights, ids = moe_ops.route(
    logits, 8, moe_ops.RoutingMethod.DEEPSEEK_V3, bias=bias, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, backend="auto",
)
assert ids.shape == (5, 8) and ids.device == logits.device
print(sorted(m for m in sys.modules if m.startswith(("moe_ops.flashinfer", "flashinfer"))))
print(sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("moe_ops::flashinfer")))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_auto_imports_nothing_of_flashinfer(device):
    """backend="auto" is the Triton router or the reference, never FlashInfer: the first eager
    DeepSeek-V3 call in a fresh interpreter imports no FlashInfer module and registers no
    FlashInfer op (about 5 s on 2 CPU cores, most of it importing torch, plus the Triton compile on a
    GPU; the timeout is a hang guard)."""
    out = subprocess.run(
        [sys.executable, "-c", _AUTO_IMPORTS, device],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout
