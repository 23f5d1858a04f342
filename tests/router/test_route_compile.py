"""moe_ops.route under torch.compile(fullgraph=True) and FakeTensor tracing; opcheck of its ops."""

from __future__ import annotations

import copy

import pytest
import torch
from capture_models import layout_inputs
from gpu_helpers import skip_unless_triton_runs
from route_models import RoutedMoE

from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, route
from moe_ops.graphs import CompileCounters, count_graph_breaks
from moe_ops.router.methods import METHODS

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
# every layout on CPU; on CUDA (an inductor compile each) LOCAL and SHARDED here, GATHERED in the
# reduce-overhead test and SEQUENCE_PARALLEL in the CUDA-graph tests
LAYOUT_DEVICES = [(layout, "cpu") for layout in BatchLayout] + [
    pytest.param(layout, "cuda", marks=pytest.mark.gpu) for layout in (BatchLayout.LOCAL, BatchLayout.SHARDED)
]


def _inputs(layout, device):
    # SEQUENCE_PARALLEL without a TP group (tp_size 1) sees the LOCAL batch
    base = BatchLayout.LOCAL if layout == BatchLayout.SEQUENCE_PARALLEL else layout
    return layout_inputs(base, [5, 6], [8, 8], device=device)


@pytest.mark.parametrize("layout, device", LAYOUT_DEVICES, ids=lambda v: getattr(v, "name", v))
def test_compiled_route_equals_eager_without_graph_breaks(layout, device):
    model = RoutedMoE(layout=layout, dp_rank=1).to(device)
    eager = copy.deepcopy(model)
    x, counts, sizes, start = _inputs(layout, device)
    assert count_graph_breaks(model, x, counts, sizes) == 0

    compiled = torch.compile(model, fullgraph=True)
    with CompileCounters() as cc:
        for live in ([5, 6], [0, 3], [8, 8], [2, 0], [7, 1]):  # counts change in place: no recompile
            counts.copy_(torch.tensor(live, dtype=torch.int32))
            model.routing.fill_(-7)
            eager.routing.fill_(-7)
            y, ids = compiled(x, counts, sizes)
            ref_y, ref_ids = eager(x, counts, sizes)
            c = live[1]
            # exact although inductor rounds the float32 layers otherwise than eager (outputs up to
            # 1e-6 apart relative, measured on CPU): no router key of this data is within 3e-5 of a
            # tie (routing_checks' rule, float64), 30x that
            assert torch.equal(ids, ref_ids), f"compiled routing differs from eager at {live}"
            torch.testing.assert_close(y, ref_y)
            assert torch.equal(model.routing, eager.routing), f"compiled capture differs from eager at {live}"
            assert torch.equal(model.routing[:c], ids[start : start + c])
            assert (model.routing[c:] == -7).all(), "rows past the live count were written"
    assert cc.graph_breaks == 0
    assert cc.graphs <= 1, f"recompiled {cc.graphs} times for changing counts"


def test_compiled_interpreted_triton_without_graph_breaks():
    """The Triton path (interpreted here) behind the same custom op compiles the same way."""
    skip_unless_triton_runs("cpu")
    model = RoutedMoE(layout=BatchLayout.GATHERED, dp_rank=1, backend="triton")
    eager = copy.deepcopy(model)
    x, counts, sizes, _ = _inputs(BatchLayout.GATHERED, "cpu")
    compiled = torch.compile(model, fullgraph=True)
    with CompileCounters() as cc:
        for live in ([5, 6], [1, 2]):
            counts.copy_(torch.tensor(live, dtype=torch.int32))
            _, ids = compiled(x, counts, sizes)
            _, ref_ids = eager(x, counts, sizes)
            # exact: the data of the test above, whose routing is clear of ties
            assert torch.equal(ids, ref_ids) and torch.equal(model.routing, eager.routing)
    assert cc.graph_breaks == 0 and cc.graphs <= 1


@pytest.mark.parametrize("method", list(RoutingMethod), ids=lambda m: m.name)
def test_every_method_compiles_without_graph_breaks(method):
    spec = METHODS[method]
    top_k = spec.top_k or 4
    kw = dict(routed_scaling_factor=2.0)  # every method takes the factor
    if spec.bias:
        kw["bias"] = torch.randn(16) * 0.1

    def fn(logits):
        weights, ids = route(logits, top_k, method, **kw)
        return weights * 2, ids

    logits = torch.randn(6, 16)
    assert count_graph_breaks(fn, logits) == 0
    weights, ids = torch.compile(fn, fullgraph=True)(logits)
    ref_w, ref_ids = route(logits, top_k, method, **kw)
    # exact: the custom op runs its eager kernel inside the graph too, on the same logits
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w * 2)


def test_fake_tensor_tracing_does_not_run_the_kernel():
    """route traces under FakeTensorMode (fake implementations), with and without a capture."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(6, 64)
        buffer = torch.empty(8, 2, 8, dtype=torch.int32)
        counts = torch.empty(1, dtype=torch.int32)
        weights, ids = route(logits, 8, capture=CaptureTarget(buffer, 1, token_counts=counts))
        assert weights.shape == (6, 8) and ids.dtype == torch.int32
        route(logits, 8, RoutingMethod.DEEPSEEK_V3, n_group=8, topk_group=4, bias=torch.empty(64))


def _opcheck_args(device):
    logits = torch.randn(10, 32, device=device)
    bias = torch.randn(32, device=device)
    weights = torch.empty(10, 4, device=device)
    ids = torch.empty(10, 4, dtype=torch.int32, device=device)
    nonfinite = torch.zeros(1, dtype=torch.int32, device=device)
    buffer = torch.full((8, 3, 4), -7, dtype=torch.int32, device=device)
    wbuf = torch.full((8, 3, 4), -7.0, dtype=torch.float16, device=device)
    counts = torch.tensor([3, 5], dtype=torch.int32, device=device)
    sizes = torch.tensor([2, 3, 2, 3], dtype=torch.int32, device=device)
    errors = torch.zeros(8, dtype=torch.int32, device=device)
    stamps = torch.full((3,), -1, dtype=torch.int32, device=device)
    step = torch.ones(1, dtype=torch.int32, device=device)
    # by name (the ops' argument order is generated: moe_ops.router.args.OpSignature); renormalize=False
    # (unnormalized), and the group score sums a group's two best keys (TOP2_SUM: group_top 2)
    route_kwargs = dict(
        router_logits=logits,
        weights=weights,
        ids=ids,
        nonfinite=nonfinite,
        bias=bias,
        method=int(RoutingMethod.DEEPSEEK_V3),
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        unnormalized=True,
        group_top=2,
        num_fused_shared_experts=0,
    )
    capture_kwargs = dict(
        route_kwargs,
        buffer=buffer,
        weights_buffer=wbuf,
        token_counts=counts,
        sizes=sizes,
        errors=errors,
        stamps=stamps,
        step=step,
        expert_map=torch.empty(0, dtype=torch.int32, device=device),  # no map: route's ids are logical
        layer_id=2,
        dp_rank=1,
        n_first=2,  # SHARDED rank 1 of 2 ranks x 2 shards: two sizes precede its rows
        num_logical_experts=0,
    )
    return route_kwargs, capture_kwargs


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, use_triton):
    """The kernel ops (Triton on CUDA and interpreted CPU) and the reference ops (the twin)."""
    if use_triton:
        skip_unless_triton_runs(device)
        route_, route_capture_ = torch.ops.moe_ops.route_, torch.ops.moe_ops.route_capture_
    else:
        route_, route_capture_ = (
            torch.ops.moe_ops.route_reference_,
            torch.ops.moe_ops.route_capture_reference_,
        )
    route_kwargs, capture_kwargs = _opcheck_args(device)
    torch.library.opcheck(route_.default, (), route_kwargs)
    torch.library.opcheck(route_capture_.default, (), capture_kwargs)
