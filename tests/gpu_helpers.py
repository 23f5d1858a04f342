"""Test helpers: skipping where a Triton kernel cannot run, and (GPU) a busy kernel of a known
duration on the current stream."""

from __future__ import annotations

import functools

import pytest
import torch

from moe_ops._runtime.triton import triton_runs_on


def skip_unless_triton_runs(device: str | torch.device) -> None:
    """Skips the calling test where Triton kernels cannot run on ``device`` (CPU without
    TRITON_INTERPRET=1, which conftest sets on machines without CUDA)."""
    if not triton_runs_on(torch.device(device)):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by conftest on machines without CUDA)")


@functools.cache
def _cycles_per_ms() -> float:
    """Calibrates torch.cuda._sleep (a spin of N clock cycles) against CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def sleep_ms(ms: float) -> None:
    """Enqueues a kernel that keeps the current stream busy for about ``ms`` milliseconds."""
    torch.cuda._sleep(int(_cycles_per_ms() * ms))
