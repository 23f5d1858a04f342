"""CUDA graphs: route + capture captured once, replayed with new logits and live counts in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from capture_models import layout_inputs
from route_models import RoutedMoE
from routing_checks import check_routing
from strategies import MODEL_ROUTERS, POISON

from moe_ops import BatchLayout, CaptureTarget, check_capture_errors, route
from moe_ops.graphs import CompileCounters

pytestmark = pytest.mark.gpu

# live count vectors (dp_size 3, this is rank 1), each within the padded size 8 per rank
LIVE_COUNTS = [[8, 8, 8], [3, 5, 1], [0, 0, 0], [1, 8, 0], [7, 2, 6], [0, 6, 8], [5, 1, 5]]
PADDED = 8
DEEPSEEK = MODEL_ROUTERS[0]


def _layout_tensors(layout, device):
    """(rows, token_counts, shard_sizes, first row of rank 1) for three ranks padded to 8."""
    counts = torch.tensor(LIVE_COUNTS[0], dtype=torch.int32, device=device)
    if layout in (BatchLayout.LOCAL, BatchLayout.SEQUENCE_PARALLEL):
        return PADDED, counts, None, 0
    if layout == BatchLayout.GATHERED:
        return 3 * PADDED, counts, torch.full((3,), PADDED, dtype=torch.int32, device=device), PADDED
    return 3 * PADDED, counts, torch.full((6,), PADDED // 2, dtype=torch.int32, device=device), PADDED


@pytest.mark.parametrize("layout", list(BatchLayout), ids=lambda v: v.name)
def test_manual_cuda_graph_replays_follow_live_logits_and_counts(cuda_device, layout):
    cfg = DEEPSEEK
    n, counts, sizes, block = _layout_tensors(layout, cuda_device)
    logits = torch.empty(n, cfg.num_experts, device=cuda_device)
    bias = torch.randn(cfg.num_experts, device=cuda_device) * 0.1
    buffer = torch.full((16, 5, cfg.top_k), POISON, dtype=torch.int32, device=cuda_device)
    target = CaptureTarget(buffer, 3, token_counts=counts, dp_rank=1, layout=layout, shard_sizes=sizes)

    def step():
        return route(logits, cfg.top_k, cfg.method, capture=target, **cfg.route_kwargs(bias))

    # faults another test on this process left behind are not this test's
    check_capture_errors(cuda_device, raise_error=False)
    logits.normal_()
    step()  # warm-up: compiles the kernel, allocates the fault counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = step()

    rng = np.random.default_rng(0)
    for live in LIVE_COUNTS:
        counts.copy_(torch.tensor(live, dtype=torch.int32))
        logits.copy_(torch.from_numpy(rng.standard_normal((n, cfg.num_experts)).astype(np.float32)))
        buffer.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        check_routing(cfg, logits, bias, weights, ids)
        c = live[1]
        expected = torch.full_like(buffer, POISON)
        expected[:c, 3] = ids[block : block + c]
        assert torch.equal(buffer, expected), f"replay with counts {live} wrote the wrong rows"
    assert check_capture_errors(cuda_device) == 0


def test_reduce_overhead_has_no_cudagraph_skips(cuda_device):
    model = RoutedMoE(layout=BatchLayout.GATHERED, dp_rank=1).to(cuda_device)
    x, counts, sizes, start = layout_inputs(BatchLayout.GATHERED, [5, 6], [8, 8], device=cuda_device)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with CompileCounters() as cc:
        for step, live in enumerate([[5, 6], [0, 3], [8, 8], [2, 0], [7, 1], [1, 8], [4, 4]]):
            counts.copy_(torch.tensor(live, dtype=torch.int32))
            model.routing.fill_(POISON)
            _, ids = compiled(x, counts, sizes)
            c = live[1]
            assert torch.equal(model.routing[:c], ids[start : start + c]), f"step {step}"
            assert (model.routing[c:] == POISON).all(), f"step {step}: rows past the live count written"
    assert cc.cudagraph_skips == 0, "inductor skipped CUDA graphs (the capture mutation must be allowed)"
    assert cc.graph_breaks == 0 and cc.graphs == 1


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layout", list(BatchLayout), ids=lambda v: v.name)
def test_no_host_sync(cuda_device, backend, layout):
    """torch's sync debug mode raises on any synchronising call inside route + capture."""
    cfg = DEEPSEEK
    n, counts, sizes, _ = _layout_tensors(layout, cuda_device)
    logits = torch.randn(n, cfg.num_experts, device=cuda_device)
    bias = torch.randn(cfg.num_experts, device=cuda_device)
    buffer = torch.full((16, 2, cfg.top_k), POISON, dtype=torch.int32, device=cuda_device)
    target = CaptureTarget(buffer, 1, token_counts=counts, dp_rank=1, layout=layout, shard_sizes=sizes)
    kw = cfg.route_kwargs(bias)
    route(logits, cfg.top_k, cfg.method, capture=target, backend=backend, **kw)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        route(logits, cfg.top_k, cfg.method, capture=target, backend=backend, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("capture", [False, True])
def test_triton_allocates_only_the_outputs(cuda_device, capture):
    cfg = DEEPSEEK
    n = 200
    logits = torch.randn(n, cfg.num_experts, device=cuda_device)
    bias = torch.randn(cfg.num_experts, device=cuda_device)
    counts = torch.tensor([n], dtype=torch.int32, device=cuda_device)
    buffer = torch.full((n, 2, cfg.top_k), POISON, dtype=torch.int32, device=cuda_device)
    target = CaptureTarget(buffer, 1, token_counts=counts) if capture else None
    kw = cfg.route_kwargs(bias)
    route(logits, cfg.top_k, cfg.method, capture=target, backend="triton", **kw)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    weights, ids = route(logits, cfg.top_k, cfg.method, capture=target, backend="triton", **kw)
    torch.cuda.synchronize()
    outputs = weights.untyped_storage().nbytes() + ids.untyped_storage().nbytes()
    rounded = sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in (weights, ids))
    assert torch.cuda.max_memory_allocated() - before == rounded, (
        f"allocated beyond the {outputs} output bytes"
    )


def test_no_recompile_per_layer_count_or_batch_size(cuda_device):
    """Layer, counts and token count (below 512: one launch configuration) compile nothing new."""
    from moe_ops.router import kernels

    cfg = DEEPSEEK
    kern = kernels._route_kernel
    bias = torch.randn(cfg.num_experts, device=cuda_device)
    buffer = torch.full((300, 8, cfg.top_k), POISON, dtype=torch.int32, device=cuda_device)
    counts = torch.tensor([1, 1], dtype=torch.int32, device=cuda_device)
    kw = cfg.route_kwargs(bias)

    def call(n, layer, live):
        counts.copy_(torch.tensor(live, dtype=torch.int32))
        target = CaptureTarget(buffer, layer, token_counts=counts, dp_rank=1, layout=BatchLayout.GATHERED)
        logits = torch.randn(n, cfg.num_experts, device=cuda_device)
        return route(logits, cfg.top_k, cfg.method, capture=target, **kw)

    call(8, 0, [4, 4])
    before = len(kern.device_caches[cuda_device.index or 0][0])
    for n, layer, live in ((1, 1, [0, 1]), (17, 7, [9, 8]), (300, 3, [150, 150]), (64, 5, [0, 0])):
        call(n, layer, live)
    assert len(kern.device_caches[cuda_device.index or 0][0]) == before, "new compiled variants"
