"""replay_routing under torch.compile(fullgraph=True), forward and backward; FakeTensor tracing;
opcheck of its two registered ops."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from strategies import MODEL_ROUTERS

from moe_ops import RoutingMethod, replay_routing, routing_mismatch
from moe_ops.graphs import CompileCounters, mark_rows_dynamic
from moe_ops.replay import check_replay_errors
from moe_ops.router.methods import METHODS

BACKENDS = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpret"),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
]
DEEPSEEK = MODEL_ROUTERS[0]
SIZES = (5, 9, 17, 2)  # rows of consecutive steps: one dynamic graph serves them all


class ReplayedRouter(torch.nn.Module):
    """A router layer as a trainer has it: logits from a trainable gate, weights by replay."""

    def __init__(self, hidden=16, n_experts=32, backend="auto", method=RoutingMethod.DEEPSEEK_V3):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate = torch.nn.Parameter(torch.randn(hidden, n_experts, generator=g) / hidden**0.5)
        self.register_buffer("bias", torch.randn(n_experts, generator=g) * 0.1)
        self.backend, self.method = backend, method

    def forward(self, x, recorded):
        kw = dict(bias=self.bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
        if self.method != RoutingMethod.DEEPSEEK_V3:
            kw = {}
        weights, ids = replay_routing(x @ self.gate, recorded, self.method, backend=self.backend, **kw)
        return (weights * torch.arange(1, recorded.shape[1] + 1, device=x.device)).sum(), ids


def _step_inputs(n, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g).to(device)
    recorded = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(n)]).int().to(device)
    recorded[0] = -1  # a live row
    if n > 3:
        recorded[3, 1] = 40  # a faulty row
    return x, recorded


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forward_backward_without_graph_breaks_or_recompiles(backend):
    backend, device = backend
    if backend == "triton":
        skip_unless_triton_runs(device)
    model = ReplayedRouter(backend=backend).to(device)
    eager = ReplayedRouter(backend=backend).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with CompileCounters() as cc:
        for step, n in enumerate(SIZES):
            x, recorded = _step_inputs(n, device, step)
            mark_rows_dynamic(x, recorded)
            model.gate.grad = eager.gate.grad = None
            loss, ids = compiled(x, recorded)
            loss.backward()
            ref_loss, ref_ids = eager(x, recorded)
            ref_loss.backward()
            assert torch.equal(ids, ref_ids), f"step {step}: compiled ids differ from eager"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(model.gate.grad, eager.gate.grad, rtol=1e-5, atol=1e-6)
    assert cc.graph_breaks == 0
    # one dynamic graph for n >= 2 (dynamo specialises 0 and 1 whatever is marked: none used here)
    assert cc.graphs == 1, f"compiled {cc.graphs} graphs: {cc.recompile_reasons}"
    faulty = sum(n > 3 for n in SIZES)
    assert check_replay_errors(device, raise_error=False) == 2 * faulty  # compiled + eager calls


@pytest.mark.parametrize("method", list(RoutingMethod), ids=lambda m: m.name)
def test_every_method_traces_forward_and_backward_in_one_graph(method):
    """fullgraph through AOT autograd (forward and backward graphs from the fake implementations);
    aot_eager runs the graphs without inductor's codegen."""
    spec = METHODS[method]
    top_k = spec.top_k or 4
    kw = dict(routed_scaling_factor=2.0)  # every method takes the factor
    if spec.bias:
        kw["bias"] = torch.randn(16) * 0.1

    def fn(logits, recorded):
        weights, ids = replay_routing(logits, recorded, method, **kw)
        return (weights * weights).sum(), ids

    logits = torch.randn(6, 16)
    recorded = torch.stack([torch.randperm(16)[:top_k] for _ in range(6)])
    recorded[2] = -1
    torch._dynamo.reset()
    with CompileCounters() as cc:
        x = logits.clone().requires_grad_()
        loss, ids = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, recorded)
        loss.backward()
    assert cc.graph_breaks == 0 and cc.graphs == 1
    ref_x = logits.clone().requires_grad_()
    ref_loss, ref_ids = fn(ref_x, recorded)
    ref_loss.backward()
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(x.grad, ref_x.grad)


def test_fake_tensor_tracing_does_not_run_the_kernels():
    """Forward and backward under FakeTensorMode (the fake implementations, shapes and dtypes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(6, 64, dtype=torch.bfloat16, requires_grad=True)
        recorded = torch.empty(6, 8, dtype=torch.int16)
        weights, ids = replay_routing(
            logits, recorded, RoutingMethod.DEEPSEEK_V3, n_group=8, topk_group=4, bias=torch.empty(64)
        )
        assert weights.shape == (6, 8) and weights.dtype == torch.float32 and ids.dtype == torch.int32
        (grad,) = torch.autograd.grad(weights.sum(), logits)
        assert grad.shape == (6, 64) and grad.dtype == torch.bfloat16


def test_compiled_routing_mismatch_without_graph_breaks():
    def fn(recorded, live, valid):
        m = routing_mismatch(recorded, live, valid=valid)
        return m.changed, m.overlap, m.disjoint, m.num_tokens

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    with CompileCounters() as cc:
        for n in (6, 11):
            recorded = torch.randint(0, 8, (n, 3, 4))
            live = torch.randint(0, 8, (n, 3, 4), dtype=torch.int16)
            valid = torch.rand(n) < 0.8
            mark_rows_dynamic(recorded, live, valid)
            got = compiled(recorded, live, valid)
            want = fn(recorded, live, valid)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, equal_nan=True)
    assert cc.graph_breaks == 0 and cc.graphs == 1


def _opcheck_args(device):
    logits = torch.randn(10, 32, device=device)
    recorded = torch.randint(0, 32, (10, 4), device=device)
    recorded[2] = -1
    recorded[4, 0] = 33
    bias = torch.randn(32, device=device)
    weights = torch.empty(10, 4, device=device)
    ids = torch.empty(10, 4, dtype=torch.int32, device=device)
    errors = torch.zeros(2, dtype=torch.int32, device=device)
    nonfinite = torch.zeros(1, dtype=torch.int32, device=device)
    # by name: the ops' argument order is generated (moe_ops.replay.op.REPLAY_OP); DeepSeek-V3 with
    # 4 groups keeping 2 (TOP2_SUM: group_top 2) and a scale
    forward = dict(
        router_logits=logits, recorded_ids=recorded, weights=weights, ids=ids, errors=errors,
        nonfinite=nonfinite, row_count=None, bias=bias, hash_table=None, token_ids=None,
        method=int(RoutingMethod.DEEPSEEK_V3), n_group=4, topk_group=2, routed_scaling_factor=2.5,
        unnormalized=False, group_top=2,
    )  # fmt: skip
    grad_w = torch.randn(10, 4, device=device)
    ids_ok = torch.stack([torch.randperm(32)[:4] for _ in range(10)]).int().to(device)
    grad_logits = torch.empty(10, 32, device=device)
    backward = dict(
        grad_weights=grad_w, router_logits=logits, weights=weights.normal_(), ids=ids_ok,
        grad_logits=grad_logits, method=int(RoutingMethod.DEEPSEEK_V3), routed_scaling_factor=2.5,
        unnormalized=False,
    )  # fmt: skip
    return forward, backward


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device, use_triton):
    """The kernel ops (Triton on CUDA and interpreted CPU) and the reference ops (the twins)."""
    ops = torch.ops.moe_ops
    if use_triton:
        skip_unless_triton_runs(device)
        forward_, backward_ = ops.replay_routing_, ops.replay_routing_backward_
    else:
        forward_, backward_ = ops.replay_routing_reference_, ops.replay_routing_backward_reference_
    forward, backward = _opcheck_args(device)
    torch.library.opcheck(forward_.default, (), forward)
    # with the replayer's row count checked in the forward (a mismatch: 9 rows held, 10 read)
    row_count = torch.tensor([9], dtype=torch.int32, device=device)
    torch.library.opcheck(forward_.default, (), dict(forward, row_count=row_count))
    torch.library.opcheck(backward_.default, (), backward)
