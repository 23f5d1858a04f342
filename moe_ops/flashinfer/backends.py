"""Where FlashInfer's kernels run on this machine: one :class:`Support` (ok, reason) per kernel and device.

The ops ask :func:`kernel_support` before a launch (:mod:`moe_ops.flashinfer.ops` imports this
module; this module imports nothing of the ops), and ``moe_ops.backends()``
(:mod:`moe_ops.backend_report`) prints the same answers, so the report says exactly what a call
would do.

FlashInfer is imported only when a CUDA device exists (its architecture lists live in its modules);
on a machine without CUDA nothing is imported beyond the package metadata.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import shutil
from dataclasses import dataclass

import torch

from ..router.methods import RoutingMethod

__all__ = [
    "DEEPSEEK_V3",
    "Support",
    "device_description",
    "flashinfer_version",
    "fused_topk_support",
    "kernel_support",
    "trtllm_moe_support",
]

# the one routing method FlashInfer's fused_topk_deepseek implements; its RoutingMethodType.DeepSeekV3
# has the same value (checked in tests/flashinfer/test_flashinfer_ops.py)
DEEPSEEK_V3 = int(RoutingMethod.DEEPSEEK_V3)

_INSTALL_HINT = "flashinfer not installed (pip install 'moe-ops[flashinfer]')"


@dataclass(frozen=True)
class Support:
    """Whether a kernel can run on a device, with the one-line reason either way."""

    # True when the kernel can run on the device asked about
    ok: bool
    # why (not), e.g. "trtllm MoE: needs SM100/SM103, found SM90"
    reason: str


@functools.cache
def flashinfer_version() -> str | None:
    """The installed flashinfer-python version (package metadata only: does not import it; cached)."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _cuda_device(device: torch.device | str | int | None) -> torch.device | None:
    """The CUDA device to describe (None: none available, or a non-CUDA device was asked about)."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
    if not torch.cuda.is_available():
        return None
    if device is None or device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _sm(cc: tuple[int, int]) -> str:
    return f"SM{cc[0]}{cc[1]}"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _no_cuda(device: torch.device | str | int | None) -> str:
    if device is not None and torch.device(device).type != "cuda":
        return f"needs a CUDA device, asked about {torch.device(device)}"
    return "no CUDA device"


def _has_nvcc() -> bool:
    if shutil.which("nvcc"):
        return True
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))


def fused_topk_support(device: torch.device | str | int | None = None) -> Support:
    """Can FlashInfer's ``fused_topk_deepseek`` run on ``device`` (default: the current CUDA device)?

    It runs on the architectures FlashInfer lists for it (SM89, SM90, SM100/103/107, SM120/121 in
    0.7.2) and is JIT-compiled with nvcc on first use (about 20 s on an H200); no download.
    """
    if flashinfer_version() is None:
        return Support(False, _INSTALL_HINT)
    cuda = _cuda_device(device)
    if cuda is None:
        return Support(False, _no_cuda(device))
    return _fused_topk_support_cc(_capability(cuda.index))


@functools.cache
def _fused_topk_support_cc(cc: tuple[int, int]) -> Support:
    from flashinfer.fused_moe import fused_topk_deepseek

    if not fused_topk_deepseek.is_compute_capability_supported(cc[0] * 10 + cc[1]):
        return Support(False, f"fused_topk_deepseek: needs SM89/SM90/SM100+, found {_sm(cc)}")
    if not _has_nvcc() and importlib.util.find_spec("flashinfer_jit_cache") is None:
        return Support(False, "fused_topk_deepseek: JIT-compiled on first use, but no nvcc was found")
    return Support(True, f"fused_topk_deepseek on {_sm(cc)} (nvcc JIT on first use, about 20 s)")


def trtllm_moe_support(device: torch.device | str | int | None = None) -> Support:
    """Can FlashInfer's monolithic trtllm MoE kernels run on ``device``?

    They need SM100/SM103 (FlashInfer's ``is_trtllm_moe_supported`` is False below major 10 and its
    module is built for sm100) and download their cubins on first use.
    """
    if flashinfer_version() is None:
        return Support(False, _INSTALL_HINT)
    cuda = _cuda_device(device)
    if cuda is None:
        return Support(False, _no_cuda(device))
    return _trtllm_support_on(cuda.index)


@functools.cache
def _trtllm_support_on(index: int) -> Support:
    cc = _capability(index)
    if cc not in ((10, 0), (10, 3)):
        return Support(False, f"trtllm MoE: needs SM100/SM103, found {_sm(cc)}")
    from flashinfer.fused_moe.core import is_trtllm_moe_supported
    from flashinfer.tllm_enums import DtypeTrtllmGen

    with torch.cuda.device(index):
        if not is_trtllm_moe_supported(DtypeTrtllmGen.Bfloat16, DtypeTrtllmGen.Bfloat16):
            return Support(False, f"trtllm MoE: is_trtllm_moe_supported is False on {_sm(cc)}")
    return Support(True, f"trtllm-gen MoE on {_sm(cc)} (cubins downloaded on first use)")


def kernel_support(name: str, device: torch.device | str | int | None = None) -> Support:
    """Support of the wrapped FlashInfer function ``name`` (a name of :data:`moe_ops.flashinfer.ops.SPECS`).

    ``fused_topk_deepseek`` has its own device list; every ``trtllm_*_moe`` function shares the
    trtllm-gen MoE one (tests/flashinfer/test_flashinfer_backends.py checks that this covers every wrapped
    name). ValueError for any other name.
    """
    if name == "fused_topk_deepseek":
        return fused_topk_support(device)
    if isinstance(name, str) and name.startswith("trtllm_") and name.endswith("_moe"):
        return trtllm_moe_support(device)
    raise ValueError(f"name must be fused_topk_deepseek or a trtllm_*_moe function, got {name!r}")


def device_description(device: torch.device | str | int | None = None) -> str:
    """The device a report describes, e.g. "NVIDIA H200 (SM90)", "no CUDA device" or
    "cpu (FlashInfer kernels need CUDA)" (default: the current CUDA device, if any)."""
    cuda = _cuda_device(device)
    if cuda is not None:
        return f"{torch.cuda.get_device_name(cuda)} ({_sm(_capability(cuda.index))})"
    if device is not None and torch.device(device).type != "cuda":
        return f"{torch.device(device)} (FlashInfer kernels need CUDA)"
    return _no_cuda(device)
