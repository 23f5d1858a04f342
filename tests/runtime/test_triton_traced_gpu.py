"""The wrap_triton path on CUDA: inside ``trace_triton_kernels`` inductor launches the capture and
route kernels from its own code and computes exactly what eager does (the CPU twin of this file,
test_triton_traced.py, checks the traced graph with interpreted kernels)."""

from __future__ import annotations

import pytest
import torch
from test_triton_traced import (
    HOP,
    _capture,
    _capture_tensors,
    _recording_backend,
    _route_args,
    _route_capture,
)

from moe_ops._runtime.library import HAS_WRAP_TRITON, trace_triton_kernels

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _traced(cuda_device):
    if not HAS_WRAP_TRITON:
        pytest.skip("this torch has no torch.library.wrap_triton")
    torch._dynamo.reset()
    with trace_triton_kernels():
        yield
    torch._dynamo.reset()


def _on(t: dict, device) -> dict:
    return {k: v.to(device) for k, v in t.items()}


@pytest.mark.parametrize("backend", ["recording", "inductor"])
def test_compiled_capture_launches_the_kernel_and_equals_eager(cuda_device, backend):
    graphs = None
    if backend == "recording":
        backend, graphs = _recording_backend()
    compiled = torch.compile(_capture, backend=backend, fullgraph=True)
    for n, seed, live in ((10, 0, [3, 5]), (12, 1, [4, 6]), (12, 2, [9, 9])):
        got, want = _on(_capture_tensors(n, seed), cuda_device), _on(_capture_tensors(n, seed), cuda_device)
        for t in (got, want):
            t["counts"].copy_(torch.tensor(live, dtype=torch.int32))
        compiled(got)
        _capture(want)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} differs from eager at n={n}, counts={live}"
    if graphs is not None:
        assert graphs and all(HOP in code for code in graphs), "the graph does not launch the Triton kernel"


def test_compiled_route_capture_equals_eager(cuda_device):
    compiled = torch.compile(_route_capture, backend="inductor", fullgraph=True)
    for n, seed in ((10, 0), (13, 1)):
        got, want = _on(_route_args(n, seed, True), cuda_device), _on(_route_args(n, seed, True), cuda_device)
        compiled(got)
        _route_capture(want)
        for name in ("ids", "buffer", "errors", "stamps"):
            assert torch.equal(got[name], want[name]), f"{name} differs from eager at n={n}"
        # the same kernel on the same floats under inductor's launch: weights to float32 rounding
        torch.testing.assert_close(got["weights"], want["weights"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("devices, traced", [(("cuda",), True), ((), False)])
def test_cuda_calls_are_traced_by_default_and_opaque_when_turned_off(cuda_device, devices, traced):
    """Outside any block (the default, ``("cuda",)``) CUDA calls become the Triton kernel;
    ``trace_triton_kernels(False)`` (``()``) keeps the op."""
    from moe_ops._runtime import library

    saved = library._TRACED_DEVICES[0]
    library._TRACED_DEVICES[0] = devices
    try:
        backend, graphs = _recording_backend()
        torch._dynamo.reset()
        compiled = torch.compile(_capture, backend=backend, fullgraph=True)
        got, want = _on(_capture_tensors(10, 0), cuda_device), _on(_capture_tensors(10, 0), cuda_device)
        compiled(got)
        _capture(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert graphs
        for code in graphs:
            assert (HOP in code) == traced and ("moe_ops.capture_routing_" in code) != traced, code
    finally:
        library._TRACED_DEVICES[0] = saved


@pytest.mark.parametrize("trace", [True, False])
def test_export_run_decompositions_keeps_the_op_and_saves(cuda_device, tmp_path, trace):
    """``ExportedProgram.run_decompositions()`` keeps the capture op (functionalised, not split into
    kernel nodes) on CUDA, traced path on or off, and the program saves, loads and writes the rows."""
    from moe_ops import CaptureTarget
    from moe_ops.capture.op import capture_into

    class Capture(torch.nn.Module):
        def forward(self, buffer, ids, counts):
            capture_into(CaptureTarget(buffer, 1, token_counts=counts), ids)
            return buffer + 0

    buffer = torch.full((8, 2, 4), -7, dtype=torch.int32, device=cuda_device)
    ids = torch.randint(0, 100, (8, 4), dtype=torch.int32, device=cuda_device)
    counts = torch.tensor([5], dtype=torch.int32, device=cuda_device)
    with trace_triton_kernels(trace):
        program = torch.export.export(Capture(), (buffer, ids, counts)).run_decompositions()
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert not any("triton_kernel_wrapper" in t for t in targets), targets
    assert any("auto_functionalized" in t for t in targets), targets
    path = tmp_path / "capture.pt2"
    torch.export.save(program, path)
    out = torch.export.load(path).module()(buffer.clone(), ids, counts)
    want = buffer.clone()
    want[:5, 1] = ids[:5]
    assert torch.equal(out, want)
