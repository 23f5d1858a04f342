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

__all__ = ["host_us_per_call", "sync"]


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
