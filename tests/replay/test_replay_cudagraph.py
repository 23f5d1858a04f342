"""CUDA graphs: replay_routing forward (and forward + backward) captured once, replayed with new
logits and new records in place; inductor's CUDA-graph trees; no host syncs; no per-size compiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from strategies import MODEL_ROUTERS

from moe_ops import replay_routing, routing_mismatch
from moe_ops.graphs import CompileCounters
from moe_ops.replay import check_replay_errors

pytestmark = pytest.mark.gpu

DEEPSEEK = MODEL_ROUTERS[0]
N = 64


def _fill(rng, logits, recorded, cfg) -> int:
    """New logits and a new record in place (some -1 rows, one faulty row); returns faulty rows."""
    n = logits.shape[0]
    logits.copy_(torch.from_numpy(rng.standard_normal((n, cfg.num_experts)).astype(np.float32)))
    rows = np.stack([rng.permutation(cfg.num_experts)[: cfg.top_k] for _ in range(n)])
    rows[rng.integers(n, size=5)] = -1
    rows[7, 2] = cfg.num_experts  # out of range: routed live, counted
    recorded.copy_(torch.from_numpy(rows))
    return 1


def _inputs(device, cfg=DEEPSEEK, requires_grad=False):
    logits = torch.zeros(N, cfg.num_experts, device=device, requires_grad=requires_grad)
    recorded = torch.zeros(N, cfg.top_k, dtype=torch.int32, device=device)
    bias = torch.randn(cfg.num_experts, device=device) * 0.1
    return logits, recorded, cfg.route_kwargs(bias)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_manual_cuda_graph_forward_follows_new_logits_and_records(cuda_device, backend):
    cfg = DEEPSEEK
    logits, recorded, kw = _inputs(cuda_device)
    rng = np.random.default_rng(0)

    def step():
        return replay_routing(logits, recorded, cfg.method, backend=backend, **kw)

    _fill(rng, logits, recorded, cfg)
    step()  # warm-up: compiles the kernel, allocates the fault counter
    torch.cuda.synchronize()
    check_replay_errors(cuda_device, raise_error=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = step()
    faulty = 0
    for _ in range(5):
        faulty += _fill(rng, logits, recorded, cfg)
        graph.replay()
        torch.cuda.synchronize()
        ref_w, ref_ids = replay_routing(logits.clone(), recorded.clone(), cfg.method, backend=backend, **kw)
        faulty += 1  # the eager reference call counts the same row
        assert torch.equal(ids, ref_ids), "the replayed graph did not follow the new record"
        torch.testing.assert_close(weights, ref_w, rtol=0, atol=0)
    assert check_replay_errors(cuda_device, raise_error=False) == faulty


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_manual_cuda_graph_forward_and_backward(cuda_device, backend):
    """Forward and the gradient w.r.t. the logits in one graph (a training step's router part)."""
    cfg = DEEPSEEK
    logits, recorded, kw = _inputs(cuda_device, requires_grad=True)
    grad_out = torch.zeros(N, cfg.top_k, device=cuda_device)
    rng = np.random.default_rng(1)

    def step():
        weights, ids = replay_routing(logits, recorded, cfg.method, backend=backend, **kw)
        (grad,) = torch.autograd.grad(weights, logits, grad_out)
        return weights, ids, grad

    with torch.no_grad():
        _fill(rng, logits, recorded, cfg)
        grad_out.normal_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as autograd capture wants
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, grad = step()
    for _ in range(4):
        with torch.no_grad():
            _fill(rng, logits, recorded, cfg)
            grad_out.normal_()
        graph.replay()
        torch.cuda.synchronize()
        x = logits.detach().clone().requires_grad_()
        ref_w, ref_ids = replay_routing(x, recorded.clone(), cfg.method, backend=backend, **kw)
        (ref_grad,) = torch.autograd.grad(ref_w, x, grad_out)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=0, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)
    check_replay_errors(cuda_device, raise_error=False)


class _Router(torch.nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        g = torch.Generator(device=device).manual_seed(0)
        self.gate = torch.nn.Parameter(torch.randn(32, cfg.num_experts, device=device, generator=g) * 0.2)
        self.register_buffer("bias", torch.randn(cfg.num_experts, device=device, generator=g) * 0.1)
        self.cfg = cfg

    def forward(self, x, recorded):
        kw = self.cfg.route_kwargs(self.bias)
        weights, ids = replay_routing(x @ self.gate, recorded, self.cfg.method, **kw)
        return (weights * weights).sum(), ids


def test_reduce_overhead_forward_backward_has_no_cudagraph_skips(cuda_device):
    cfg = DEEPSEEK
    model = _Router(cfg, cuda_device)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(N, 32, device=cuda_device)
    recorded = torch.zeros(N, cfg.top_k, dtype=torch.int32, device=cuda_device)
    logits_stub = torch.zeros(N, cfg.num_experts, device=cuda_device)
    rng = np.random.default_rng(2)
    with CompileCounters() as cc:
        for step in range(6):
            _fill(rng, logits_stub, recorded, cfg)
            x.normal_()
            model.gate.grad = None
            loss, ids = compiled(x, recorded)
            loss.backward()
            # recorded rows are the record bit for bit; live rows route on logits that inductor's
            # matmul may round differently from eager's, so the loss is compared with a tolerance
            replayed = ((recorded >= 0) & (recorded < cfg.num_experts)).all(1)
            assert torch.equal(ids[replayed], recorded[replayed]), f"step {step}"
            ref_logits = (x @ model.gate.detach()).requires_grad_()
            ref_w, _ = replay_routing(
                ref_logits, recorded.clone(), cfg.method, **cfg.route_kwargs(model.bias)
            )
            torch.testing.assert_close(loss, (ref_w * ref_w).sum(), rtol=1e-4, atol=1e-4)
    assert cc.cudagraph_skips == 0, "inductor skipped CUDA graphs (the fault counter must be static)"
    assert cc.graph_breaks == 0 and cc.graphs == 1
    check_replay_errors(cuda_device, raise_error=False)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_host_sync(cuda_device, backend):
    """torch's sync debug mode raises on any synchronising call: forward, backward and the metric."""
    cfg = DEEPSEEK
    logits, recorded, kw = _inputs(cuda_device, requires_grad=True)
    with torch.no_grad():
        _fill(np.random.default_rng(3), logits, recorded, cfg)

    def step():
        weights, ids = replay_routing(logits, recorded, cfg.method, backend=backend, **kw)
        weights.sum().backward()
        return routing_mismatch(recorded, ids)

    step()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_replay_errors(cuda_device, raise_error=False)


def test_no_recompile_per_batch_size(cuda_device):
    """Token count (below 2048: one launch configuration), records and strides compile nothing new."""
    from moe_ops.replay import kernels

    cfg = DEEPSEEK
    bias = torch.randn(cfg.num_experts, device=cuda_device)
    kw = cfg.route_kwargs(bias)
    rng = np.random.default_rng(4)

    def call(n):
        logits = torch.randn(n, cfg.num_experts, device=cuda_device, requires_grad=True)
        buffer = torch.from_numpy(np.stack([rng.permutation(cfg.num_experts)[:8] for _ in range(3 * n)]))
        recorded = buffer.view(n, 3, 8).to(cuda_device, torch.int16)[:, 1]  # a strided layer view
        weights, _ = replay_routing(logits, recorded, cfg.method, **kw)
        weights.sum().backward()

    call(16)
    index = cuda_device.index or 0
    forward, backward = kernels._replay_kernel, kernels._replay_backward_kernel
    before = (len(forward.device_caches[index][0]), len(backward.device_caches[index][0]))
    for n in (9, 300, 64, 1500):
        call(n)
    after = (len(forward.device_caches[index][0]), len(backward.device_caches[index][0]))
    assert after == before, "new compiled variants for a new batch size"
