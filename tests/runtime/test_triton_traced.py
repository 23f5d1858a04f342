"""The wrap_triton path: under torch.compile the capture and route ops become their Triton kernels
(``triton_kernel_wrapper_functional``), with static and dynamic shapes, and compute what eager does.

On CUDA inductor launches those kernels; here (TRITON_INTERPRET=1, inside
``trace_triton_kernels``) the same decomposition runs on CPU tensors, so aot_eager traces the
same launchers - SymInt sizes included - and runs the interpreted kernels. Sizes stay small: every
launch is interpreted.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import skip_unless_triton_runs
from torch._dynamo.backends.common import aot_autograd

from moe_ops import RoutingMethod
from moe_ops._runtime.library import trace_triton_kernels
from moe_ops.capture.errors import FAULT_SLOTS

POISON = -7
HOP = "triton_kernel_wrapper_functional"


@pytest.fixture(autouse=True)
def _interpreted():
    skip_unless_triton_runs("cpu")
    torch._dynamo.reset()
    with trace_triton_kernels():
        yield
    torch._dynamo.reset()


def _recording_backend():
    graphs: list[str] = []

    def forward(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    return aot_autograd(fw_compiler=forward), graphs


def _capture_tensors(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return dict(
        buffer=torch.full((8, 3, 4), POISON, dtype=torch.int32),
        ids=torch.randint(-1, 70, (n, 4), dtype=torch.int32, generator=g),  # -1: a bad id, counted
        topk_weights=torch.randn(n, 4, generator=g),
        wbuf=torch.full((8, 3, 4), -7.0, dtype=torch.bfloat16),  # poison
        counts=torch.tensor([3, 5], dtype=torch.int32),
        sizes=torch.tensor([2, 3, 2, 3], dtype=torch.int32),
        errors=torch.zeros(FAULT_SLOTS, dtype=torch.int32),
        stamps=torch.full((3,), -1, dtype=torch.int32),
        step=torch.ones(1, dtype=torch.int32),
        # an EPLB map: 70 physical slots on 64 logical experts (ids -1 stay bad ids)
        expert_map=torch.arange(70, dtype=torch.int64) % 64,
    )


def _capture(t):
    # SHARDED, rank 1 of 2 with 2 shards each: two sizes precede this rank's rows; 64 logical experts
    torch.ops.moe_ops.capture_routing_(
        t["buffer"], t["ids"], t["topk_weights"], t["wbuf"], t["counts"], t["sizes"], t["errors"],
        t["stamps"], t["step"], t["expert_map"], 2, 1, 2, 64,
    )  # fmt: skip


def _assert_traced_kernel(graphs: list[str], op: str) -> None:
    assert graphs, "nothing was compiled"
    for code in graphs:
        assert HOP in code, f"the compiled graph does not launch the Triton kernel:\n{code}"
        assert f"moe_ops.{op}" not in code, f"the opaque op is still in the graph:\n{code}"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_capture_traces_the_kernel_and_equals_eager(dynamic):
    backend, graphs = _recording_backend()
    compiled = torch.compile(_capture, backend=backend, fullgraph=True, dynamic=dynamic)
    # 10 and 12 source rows, counts changed in place: one graph with dynamic shapes
    for n, seed, live in ((10, 0, [3, 5]), (12, 1, [4, 6]), (12, 2, [9, 9])):
        got, want = _capture_tensors(n, seed), _capture_tensors(n, seed)
        for t in (got, want):
            t["counts"].copy_(torch.tensor(live, dtype=torch.int32))
        compiled(got)
        _capture(want)  # eager: the op's CPU kernel, the same launcher without tracing
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} differs from eager at n={n}, counts={live}"
        assert (got["buffer"][:, 2] != POISON).any(), "nothing was captured"
        assert (got["wbuf"][:, 2] != -7.0).any(), "no weight was captured"
    _assert_traced_kernel(graphs, "capture_routing_")
    if dynamic:
        assert len(graphs) == 1, f"recompiled for a new row count: {len(graphs)} graphs"


def _route_args(n: int, seed: int, capture: bool):
    g = torch.Generator().manual_seed(seed)
    t = dict(
        logits=torch.randn(n, 32, generator=g),
        bias=torch.randn(32, generator=g) * 0.1,
        weights=torch.zeros(n, 4),
        ids=torch.zeros(n, 4, dtype=torch.int32),
        nonfinite=torch.zeros(1, dtype=torch.int32),
    )
    if capture:
        c = _capture_tensors(1, seed)
        del c["ids"], c["topk_weights"]
        c["expert_map"] = torch.empty(0, dtype=torch.int32)  # route records logical ids: no map
        t.update(c)
    return t


# DeepSeek-V3 with 4 groups keeping 2 and a scale, by name (the ops' argument order is generated:
# moe_ops.router.args.OpSignature); unnormalized False, group_top 2 (TOP2_SUM)
_ROUTING = dict(
    method=int(RoutingMethod.DEEPSEEK_V3),
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    unnormalized=False,
    group_top=2,
)


def _route_kwargs(t):
    return dict(
        router_logits=t["logits"], weights=t["weights"], ids=t["ids"], nonfinite=t["nonfinite"],
        bias=t["bias"], **_ROUTING, num_fused_shared_experts=0,
    )  # fmt: skip


def _route_capture_kwargs(t):
    # SHARDED, rank 1 of 2 with 2 shards each: two sizes precede this rank's rows; no expert map
    return dict(
        _route_kwargs(t), buffer=t["buffer"], weights_buffer=t["wbuf"], token_counts=t["counts"],
        sizes=t["sizes"], errors=t["errors"], stamps=t["stamps"], step=t["step"],
        expert_map=t["expert_map"], layer_id=2, dp_rank=1, n_first=2, num_logical_experts=0,
    )  # fmt: skip


def _route(t):
    torch.ops.moe_ops.route_(**_route_kwargs(t))


def _route_capture(t):
    torch.ops.moe_ops.route_capture_(**_route_capture_kwargs(t))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("capture", [False, True], ids=["route_", "route_capture_"])
def test_route_traces_the_kernel_and_equals_eager(capture, dynamic):
    fn = _route_capture if capture else _route
    backend, graphs = _recording_backend()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    for n, seed in ((10, 0), (13, 1)):
        got, want = _route_args(n, seed, capture), _route_args(n, seed, capture)
        compiled(got)
        fn(want)  # eager: the same interpreted kernel, launched by the op's CPU kernel
        # ids and every capture tensor exactly; weights too (the same kernel on the same floats)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} differs from eager at n={n}"
    _assert_traced_kernel(graphs, "route_capture_" if capture else "route_")
    if dynamic:
        assert len(graphs) == 1, f"recompiled for a new token count: {len(graphs)} graphs"


def test_opcheck_capture_interpreted():
    """opcheck's test_aot_dispatch_dynamic traces the launcher with SymInt sizes (the plan is then
    computed uncached) and compares the functional kernel node's writes with eager."""
    t = _capture_tensors(10, 0)
    torch.library.opcheck(
        torch.ops.moe_ops.capture_routing_.default,
        (t["buffer"], t["ids"], t["topk_weights"], t["wbuf"], t["counts"], t["sizes"], t["errors"],
         t["stamps"], t["step"], t["expert_map"], 2, 1, 2, 64),
    )  # fmt: skip


@pytest.mark.parametrize("capture", [False, True], ids=["route_", "route_capture_"])
def test_opcheck_route_interpreted(capture):
    t = _route_args(10, 0, capture)
    if capture:
        op, kwargs = torch.ops.moe_ops.route_capture_.default, _route_capture_kwargs(t)
    else:
        op, kwargs = torch.ops.moe_ops.route_.default, _route_kwargs(t)
    torch.library.opcheck(op, (), kwargs)


def test_the_block_turns_the_compile_caches_off_and_restores_them():
    """Their keys hold the dynamo graph, the same with and without the flag: a cached artifact would
    hand back the opaque op inside the block (or the traced kernels outside it)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # the autouse fixture holds the block open: the caches are off now
    assert inductor_config.fx_graph_cache is False
    assert functorch_config.enable_autograd_cache is False
    torch._dynamo.reset()
    with trace_triton_kernels():  # nested: still off, and the outer block's state comes back
        assert inductor_config.fx_graph_cache is False
    assert inductor_config.fx_graph_cache is False


def _opaque_capture_graphs() -> list[str]:
    backend, graphs = _recording_backend()
    torch._dynamo.reset()
    compiled = torch.compile(_capture, backend=backend, fullgraph=True)
    got, want = _capture_tensors(10, 0), _capture_tensors(10, 0)
    compiled(got)
    _capture(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    return graphs


def test_outside_the_block_cpu_calls_stay_opaque():
    # the autouse fixture's block is open; leave it for this test by restoring the flag's default
    from moe_ops._runtime import library

    saved = library._TRACED_DEVICES[0]
    library._TRACED_DEVICES[0] = ("cuda",)
    try:
        graphs = _opaque_capture_graphs()
        assert graphs and all("moe_ops.capture_routing_" in code and HOP not in code for code in graphs)
    finally:
        library._TRACED_DEVICES[0] = saved


def test_the_block_with_enabled_false_keeps_the_op_opaque():
    with trace_triton_kernels(False):
        graphs = _opaque_capture_graphs()
    assert graphs and all("moe_ops.capture_routing_" in code and HOP not in code for code in graphs)


@pytest.mark.parametrize("bad", ["off", 0, None])
def test_the_block_takes_a_bool_only(bad):
    with pytest.raises(TypeError, match="enabled must be True or False"), trace_triton_kernels(bad):
        pass


def _replay_args(n: int, seed: int, row_count: bool):
    g = torch.Generator().manual_seed(seed)
    recorded = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(n)]).to(torch.int32)
    recorded[1] = -1  # routed live
    recorded[2, 1] = 40  # out of range: faulty, routed live and counted
    return dict(
        logits=torch.randn(n, 32, generator=g),
        recorded=recorded,
        bias=torch.randn(32, generator=g) * 0.1,
        weights=torch.full((n, 4), float(POISON)),
        ids=torch.full((n, 4), POISON, dtype=torch.int32),
        errors=torch.zeros(2, dtype=torch.int32),
        nonfinite=torch.zeros(1, dtype=torch.int32),
        # a row count that differs from n: one faulty call more
        row_count=torch.tensor([n + 1], dtype=torch.int32) if row_count else None,
        grad_weights=torch.randn(n, 4, generator=g),
        grad_logits=torch.full((n, 32), float(POISON)),
    )


def _replay_kwargs(t):
    return dict(
        router_logits=t["logits"], recorded_ids=t["recorded"], weights=t["weights"], ids=t["ids"],
        errors=t["errors"], nonfinite=t["nonfinite"], row_count=t["row_count"], bias=t["bias"],
        hash_table=None, token_ids=None, **_ROUTING,
    )  # fmt: skip


def _replay_backward_kwargs(t):
    return dict(
        grad_weights=t["grad_weights"], router_logits=t["logits"], weights=t["weights"], ids=t["ids"],
        grad_logits=t["grad_logits"], method=_ROUTING["method"],
        routed_scaling_factor=_ROUTING["routed_scaling_factor"], unnormalized=False,
    )  # fmt: skip


def _replay(t):
    torch.ops.moe_ops.replay_routing_(**_replay_kwargs(t))
    torch.ops.moe_ops.replay_routing_backward_(**_replay_backward_kwargs(t))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("row_count", [False, True], ids=["batch", "row_count"])
def test_replay_traces_the_kernels_and_equals_eager(row_count, dynamic):
    """Both replay ops become their kernels; the outputs, the gradient and the fault counter equal
    eager's (the same interpreted kernels), with no alias between a written and a placeholder
    argument (a never-read bias or row count)."""
    backend, graphs = _recording_backend()
    compiled = torch.compile(_replay, backend=backend, fullgraph=True, dynamic=dynamic)
    for n, seed in ((10, 0), (13, 1)):
        got, want = _replay_args(n, seed, row_count), _replay_args(n, seed, row_count)
        compiled(got)
        _replay(want)
        for name, value in want.items():
            if value is not None:
                assert torch.equal(got[name], value), f"{name} differs from eager at n={n}"
        assert got["errors"].tolist()[0] == 1 + row_count, got["errors"]
    assert graphs
    for code in graphs:
        assert code.count(HOP) >= 2, f"the compiled graph does not launch both kernels:\n{code}"
        assert "moe_ops.replay_routing" not in code, f"an opaque replay op is still in the graph:\n{code}"
    if dynamic:
        assert len(graphs) == 1, f"recompiled for a new token count: {len(graphs)} graphs"


@pytest.mark.parametrize("row_count", [False, True], ids=["batch", "row_count"])
def test_opcheck_replay_interpreted(row_count):
    t = _replay_args(10, 0, row_count)
    torch.library.opcheck(torch.ops.moe_ops.replay_routing_.default, (), _replay_kwargs(t))
    torch.library.opcheck(torch.ops.moe_ops.replay_routing_backward_.default, (), _replay_backward_kwargs(t))
