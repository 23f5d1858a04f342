"""Triton availability, in one place.

Triton kernels run on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before the
kernel modules were imported (Triton decides at decoration time whether ``@triton.jit`` compiles or
interprets). The test suite's ``conftest.py`` sets it on machines without CUDA so that every kernel
is exercised in CI.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships for Linux x86-64 only; elsewhere the PyTorch references run.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "interpreting", "next_power_of_2", "triton_runs_on"]


# Read once, at import: this module is imported before any kernel module, and Triton reads the same
# variable when the kernels are decorated, so the two agree for the life of the process.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interpreting() -> bool:
    """True when Triton kernels in this process are interpreted on the CPU (TRITON_INTERPRET=1)."""
    return _INTERPRETING


def triton_runs_on(device: torch.device) -> bool:
    """True when a Triton kernel can run on tensors of ``device`` in this process."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return not interpreting()
    return device.type == "cpu" and interpreting()


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()
