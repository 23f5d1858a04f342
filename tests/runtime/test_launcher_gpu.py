"""The eager CUDA launch path: KernelLauncher picks the kernel Triton picks, and eager_caller skips
the dispatcher only where the dispatcher would do nothing else (CPU key tests: test_launcher.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_ops import BatchLayout, RoutingMethod, capture_routing, check_capture_errors, route
from moe_ops._runtime import library
from moe_ops._runtime.launcher import KernelLauncher
from moe_ops.capture import kernels as capture_kernels
from moe_ops.capture.kernels import capture_rows_torch, capture_rows_triton
from moe_ops.capture.op import target_tensors
from moe_ops.capture.spec import kernel_args
from moe_ops.capture.target import CaptureTarget, no_weights

pytestmark = pytest.mark.gpu

POISON = -7


def _capture_case(device, offset: int, dtype, stride_k: int, n: int = 24, k: int = 4, layers: int = 3):
    """A GATHERED capture whose ids are a view ``offset`` elements into a larger tensor, with
    columns ``stride_k`` apart (alignment and stride classes Triton specialises on)."""
    g = torch.Generator(device="cpu").manual_seed(offset * 31 + stride_k)
    base = torch.randint(0, 60, (n * k * stride_k + offset + 8,), generator=g, dtype=torch.int64)
    ids = base.to(dtype).to(device)[offset : offset + n * k * stride_k].view(n, k * stride_k)[:, ::stride_k]
    buffer = torch.full((n, layers, k), POISON, dtype=torch.int32, device=device)
    counts = torch.tensor([n // 2, n - n // 2], dtype=torch.int32, device=device)
    return buffer, ids, counts


def _args(buffer, ids, counts, layer):
    target = CaptureTarget(buffer, layer, token_counts=counts, dp_rank=1, layout=BatchLayout.GATHERED)
    errors, stamps, step = target_tensors(target)
    # no weights: the target's (0,) stand-in, and the same for the weights the op is given
    none = no_weights(buffer)
    return (
        buffer,
        ids,
        none,
        target.spec.weights_buffer,
        counts,
        target.sizes,
        errors,
        stamps,
        step,
        target.spec.expert_map,
        layer,
        1,
        target.n_first,
        0,
    )


def _runtime(args):
    """The kernel's runtime arguments for ``_args``' capture-op arguments, in the kernel's order
    (moe_ops.capture.spec.kernel_args: the kernel's own pointers and scalars, then the capture's)."""
    (
        buffer,
        ids,
        topk_weights,
        wbuf,
        counts,
        sizes,
        errors,
        stamps,
        step,
        emap,
        layer,
        dp_rank,
        n_first,
        n_logical,
    ) = args
    own_scalars = (ids.shape[0], *ids.stride(), 0, 0, ids.shape[1])  # 0, 0: the unread weights' strides
    return kernel_args(
        (ids, topk_weights),
        own_scalars,
        buffer,
        wbuf,
        counts,
        sizes,
        errors,
        stamps,
        step,
        emap,
        layer,
        dp_rank,
        n_first,
        n_logical,
    )


@pytest.mark.parametrize("offset", [0, 1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
@pytest.mark.parametrize("stride_k", [1, 2])
def test_launcher_writes_what_the_twin_writes_and_reuses_tritons_kernel(cuda_device, offset, dtype, stride_k):
    buffer, ids, counts = _capture_case(cuda_device, offset, dtype, stride_k)
    expected = buffer.clone()
    for layer in range(3):
        args = _args(expected, ids, counts, layer)
        capture_rows_torch(*args)
        # twice: the first launch of a key goes through JITFunction.run, the second through the
        # cached kernel's launcher; both write every row
        for _ in range(2):
            buffer[:, layer] = POISON
            capture_rows_triton(*_args(buffer, ids, counts, layer))
            torch.cuda.synchronize()
            assert torch.equal(buffer[:, layer], expected[:, layer])
    launcher = capture_kernels._capture_launcher()
    kernel = capture_kernels._capture_rows_kernel
    n_src, top_k = ids.shape
    args = _args(buffer, ids, counts, 0)
    grid, num_warps, constexprs = capture_kernels._capture_plan(
        n_src, top_k, buffer.shape[0], args[-2], args[5].shape[0], buffer.dtype, ids.dtype, False
    )
    runtime = _runtime(args)
    key = launcher.key(runtime, constexprs, num_warps, torch.cuda.current_device())
    chosen = launcher._cache[key][0]
    assert chosen is kernel.warmup(*runtime, grid=grid, **constexprs, num_warps=num_warps)
    assert check_capture_errors(cuda_device) == 0


def test_the_cache_holds_one_kernel_per_triton_specialisation(cuda_device):
    launcher = KernelLauncher(capture_kernels._capture_rows_kernel)
    seen = {}
    for offset in (0, 1, 4):
        for dtype in (torch.int32, torch.int64):
            buffer, ids, counts = _capture_case(cuda_device, offset, dtype, 1)
            args = _args(buffer, ids, counts, 0)
            n_src, top_k = ids.shape
            grid, num_warps, constexprs = capture_kernels._capture_plan(
                n_src, top_k, buffer.shape[0], args[-2], args[5].shape[0], buffer.dtype, ids.dtype, False
            )
            runtime = _runtime(args)
            buffer.fill_(POISON)
            launcher(grid, runtime, constexprs, num_warps)
            expected = torch.full_like(buffer, POISON)
            capture_rows_torch(expected, *args[1:])
            torch.cuda.synchronize()
            assert torch.equal(buffer, expected), f"offset {offset}, {dtype}: the launch wrote other rows"
            key = launcher.key(runtime, constexprs, num_warps, torch.cuda.current_device())
            seen[key] = launcher._cache[key][0]
    # misaligned int32 views (offset 1) and int64 ids are their own specialisations
    assert len(set(map(id, seen.values()))) == len(seen) >= 4
    # every launch read its counts where the kernel's order puts them: no window was clamped
    assert check_capture_errors(cuda_device) == 0


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """eager_caller over a counting wrapper of the capture op's registered CUDA kernel."""
    calls = []
    kernel = library._CUDA_KERNELS["capture_routing_"]

    def counting(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setitem(library._CUDA_KERNELS, "capture_routing_", counting)
    return library.eager_caller("capture_routing_"), calls


def test_eager_calls_skip_the_dispatcher_and_write_what_the_op_writes(cuda_device, counted):
    call, calls = counted
    buffer, ids, counts = _capture_case(cuda_device, 0, torch.int32, 1)
    via_op = buffer.clone()
    for layer in range(3):
        torch.ops.moe_ops.capture_routing_(*_args(via_op, ids, counts, layer))
        call(*_args(buffer, ids, counts, layer))
    torch.cuda.synchronize()
    assert len(calls) == 3
    assert torch.equal(buffer, via_op)


def test_a_dispatch_mode_sees_the_op(cuda_device, counted):
    call, calls = counted
    buffer, ids, counts = _capture_case(cuda_device, 0, torch.int32, 1)
    with _Recorder() as rec:
        call(*_args(buffer, ids, counts, 0))
    assert calls == []
    assert any("capture_routing_" in op for op in rec.ops), rec.ops
    expected = torch.full_like(buffer, POISON)
    capture_rows_torch(*_args(expected, ids, counts, 0))
    assert torch.equal(buffer, expected)


def test_the_profiler_records_the_op(cuda_device, counted):
    call, calls = counted
    buffer, ids, counts = _capture_case(cuda_device, 0, torch.int32, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(*_args(buffer, ids, counts, 0))
    assert calls == []
    assert any("capture_routing_" in e.name for e in prof.events())


def test_public_calls_take_the_direct_path_and_route_with_grad_takes_the_op(cuda_device):
    """capture_routing and route on plain CUDA tensors equal their twins; logits that need a gradient
    go through the op (autograd sees it) and route the same."""
    buffer, ids, counts = _capture_case(cuda_device, 0, torch.int32, 1)
    capture_routing(buffer, ids, 1, token_counts=counts, dp_rank=1, layout=BatchLayout.GATHERED)
    expected = torch.full_like(buffer, POISON)
    capture_rows_torch(*_args(expected, ids, counts, 1))
    assert torch.equal(buffer, expected)
    logits = torch.randn(33, 64, device=cuda_device)
    w, i = route(logits, 4, RoutingMethod.RENORMALIZE)
    w2, i2 = route(logits.clone().requires_grad_(), 4, RoutingMethod.RENORMALIZE)
    assert torch.equal(i, i2)
    assert torch.equal(w, w2)


def test_jit_trace_records_the_op(cuda_device, counted):
    call, calls = counted
    buffer, ids, counts = _capture_case(cuda_device, 0, torch.int32, 1)
    args = _args(buffer, ids, counts, 0)

    def step(buffer, ids):
        call(buffer, ids, *args[2:])
        return buffer

    traced = torch.jit.trace(step, (buffer, ids), check_trace=False)
    assert calls == []
    assert "capture_routing_" in str(traced.graph)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_replay_eager_calls_take_the_registered_kernels_and_equal_the_twin(cuda_device, monkeypatch, grad):
    """replay_routing on plain CUDA tensors: the forward (and, with grad, the backward) run the ops'
    registered CUDA kernels through eager_caller, once each, and equal the twin's outputs."""
    from moe_ops import replay_routing
    from moe_ops.replay import check_replay_errors
    from moe_ops.replay import op as replay_op

    calls = {"replay_routing_": 0, "replay_routing_backward_": 0}
    for name, attr, checked in (
        ("replay_routing_", "_forward_call", replay_op.REPLAY_OP.positions(*replay_op._CALLER_TENSORS)),
        ("replay_routing_backward_", "_backward_call", (0, 1)),
    ):
        kernel = library._CUDA_KERNELS[name]

        def counting(*args, _kernel=kernel, _name=name):
            calls[_name] += 1
            return _kernel(*args)

        monkeypatch.setitem(library._CUDA_KERNELS, name, counting)
        monkeypatch.setattr(replay_op, attr, library.eager_caller(name, checked=checked))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(33, 64, generator=g).to(cuda_device)
    recorded = torch.stack([torch.randperm(64, generator=g)[:4] for _ in range(33)]).to(cuda_device)
    recorded[3] = -1
    recorded[5, 0] = 64  # faulty: routed live, counted
    check_replay_errors(cuda_device, raise_error=False)
    x = logits.clone().requires_grad_(grad)
    w, i = replay_routing(x, recorded, RoutingMethod.RENORMALIZE)
    ref = logits.clone().requires_grad_(grad)
    w_ref, i_ref = replay_routing(ref, recorded, RoutingMethod.RENORMALIZE, backend="torch")
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    if grad:
        upstream = torch.randn(w.shape, generator=g).to(cuda_device)
        (w * upstream).sum().backward()
        (w_ref * upstream).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)
    assert calls == {"replay_routing_": 1, "replay_routing_backward_": int(grad)}
    assert check_replay_errors(cuda_device, raise_error=False) == 2  # the faulty row, both calls


def test_replay_checks_lose_no_fault_counted_on_another_stream(cuda_device):
    """Replays on a side stream add to the counter while the host checks on the main stream: the
    checks' read-and-subtract (an atomic index_add_) loses no faulty row."""
    from moe_ops import replay_routing
    from moe_ops.replay import check_replay_errors

    logits = torch.randn(64, 32, device=cuda_device)
    recorded = torch.full((64, 4), 40, dtype=torch.int32, device=cuda_device)  # 64 faulty rows a call
    check_replay_errors(cuda_device, raise_error=False)
    side = torch.cuda.Stream()
    calls, seen = 200, 0
    with torch.cuda.stream(side):
        for c in range(calls):
            replay_routing(logits, recorded, RoutingMethod.RENORMALIZE)
            if c % 10 == 0:
                with torch.cuda.stream(torch.cuda.default_stream()):
                    seen += check_replay_errors(cuda_device, raise_error=False)
    torch.cuda.synchronize()
    assert seen + check_replay_errors(cuda_device, raise_error=False) == 64 * calls
