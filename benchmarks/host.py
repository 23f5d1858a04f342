"""Host wall-clock per call: what a layer call costs the CPU thread that issues it.

Outside CUDA graphs (eager, and torch.compile without graphs: large prefills, every training step)
the host issues every launch, so the host time per call, not the kernel, bounds a step of small
kernels. :func:`host_us_per_call` times ``fn`` back to back with ``time.perf_counter`` and
synchronises once at the end of each trial (the device time of a trial is included only where it
exceeds the host's).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["host_us_per_call", "launch_floor_us", "sync", "target_column", "target_note"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us_per_call(
    fn: Callable[[], object], device: torch.device, calls_per_fn: int = 1, iters: int = 50, trials: int = 7
) -> float:
    """Median over ``trials`` of (wall time of ``iters`` calls of ``fn``) / (iters * calls_per_fn),
    in us; ``calls_per_fn``: layer calls one ``fn`` makes (61 for a model step)."""
    for _ in range(3):
        fn()
    sync(device)
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e6 / (iters * calls_per_fn))
    return statistics.median(times)


def target_column(dev: torch.device) -> str:
    """The host tables' targets column: ``target_us`` on a GPU, ``gpu_target_us`` elsewhere. The
    targets (eager <= 25 us, compiled <= 5 us per call) are for the host of a GPU machine, where the
    call launches a CUDA kernel; on the CPU the op runs its PyTorch twin on CPU tensors, and the
    targets are printed beside those numbers for reference only."""
    return "target_us" if dev.type == "cuda" else "gpu_target_us"


def target_note(dev: torch.device) -> str:
    """What a host table's title adds on the CPU: that its targets are a GPU machine's."""
    if dev.type == "cuda":
        return ""
    return (
        "; gpu_target_us: the targets for a GPU machine's host (CUDA launches), not for this CPU run: "
        "shown for reference"
    )


def launch_floor_us(device: torch.device, layers: int, compiled_layers: int) -> dict[str, float]:
    """Host us per launch of a one-store Triton kernel with the capture kernel's argument list
    (7 tensors, 13 ints): through ``JITFunction.run`` and through the package's KernelLauncher
    (eager, ``layers`` launches per call), and launched by inductor from a compiled function of
    ``compiled_layers`` launches (``wrap_triton``, no CUDA graphs). The floor of any path that
    issues one kernel per layer call. CUDA only (empty dict elsewhere)."""
    if device.type != "cuda" or _floor_kernel is None:
        return {}
    from moe_ops._runtime.launcher import KernelLauncher

    tensors = tuple(torch.zeros(16, dtype=torch.int32, device=device) for _ in range(7))
    ints = (64, 256, 3, 3, 3, 488, 8, 1, 8, 1, 1, 1, 8)
    args = tensors + ints
    launcher = KernelLauncher(_floor_kernel)

    def jit_run():
        for _ in range(layers):
            _floor_kernel[(1,)](*args, num_warps=4)

    def prebound():
        for _ in range(layers):
            launcher((1,), args, {}, 4)

    out = {
        "eager, JITFunction.run": host_us_per_call(jit_run, device, calls_per_fn=layers),
        "eager, KernelLauncher": host_us_per_call(prebound, device, calls_per_fn=layers),
    }
    if hasattr(torch.library, "wrap_triton"):
        # dynamo turns a @triton.jit launch in the compiled function into inductor's own launch
        def inductor_launched(*tensors):
            for _ in range(compiled_layers):
                _floor_kernel[(1,)](*tensors, *ints, num_warps=4)

        compiled = torch.compile(inductor_launched, fullgraph=True)
        out["compiled (no graphs)"] = host_us_per_call(
            lambda: compiled(*tensors), device, calls_per_fn=compiled_layers
        )
    return out


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _floor_kernel(p0, p1, p2, p3, p4, p5, p6, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12):
        """One store and nothing else, with the capture kernel's argument list (a kernel that
        writes nothing is dead code to inductor, which then launches nothing)."""
        tl.store(p0, i0)

except ImportError:  # pragma: no cover - no triton: no floor
    _floor_kernel = None
