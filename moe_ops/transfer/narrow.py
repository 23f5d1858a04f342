"""The snapshot's narrowing: the leading rows of a wide id buffer cast into a narrow staging buffer.

Two implementations of one destination-passing contract, ``dst.view(-1)[:n] = src.view(-1)[:n]``
cast to ``dst.dtype`` with two's-complement truncation (what ``torch.Tensor.copy_`` does for
integer narrowing: ids that do not fit wrap), both tensors contiguous, same element count per row.
A float channel (routing weights beside the ids) takes the same contract with float tensors on
both sides, cast as ``copy_`` casts (round to nearest even); an integer and a float side are
refused. With stamps, ``(num_layers,) int32 stamps`` and ``(1,) int32 step``, the ids of layer
``l`` are taken only where ``stamps[l] == step[0]``; the other layers' rows read -1 cast to
``dst.dtype`` (the fill value: the maximum of an unsigned dtype; NaN for a float ``dst``), so a
layer that was not captured in the current step never delivers an earlier step's ids:

* :func:`narrow_rows_triton` - one flat Triton kernel (CUDA; CPU tensors under ``TRITON_INTERPRET=1``);
* :func:`narrow_rows_torch` - its PyTorch twin, ``copy_`` of the leading rows: the CPU path and the
  test oracle.

Why a kernel of our own: the snapshot's narrowing runs on the copy stream between a step's last
capture and the next step's first one (``TransferPipeline.guard_source``), so its time is on the
compute stream's critical path once per step. On an H200, 8192 tokens x 61 layers x 8 ids (16 MB of
int32 read, 4 MB of uint8 written): ``copy_`` (PyTorch's generic cast kernel, not vectorised across
dtypes) 7.8 us, this kernel 3.1 us with 2048 ids x 8 warps per program (1024-16384 ids and 4 or 8
warps all measured 3.1-4.2 us) - as long as its loads are vectorised (see the kernel).
"""

from __future__ import annotations

import functools

import torch

from .._runtime.launcher import KernelLauncher
from .._runtime.triton import HAS_TRITON, triton_runs_on

__all__ = ["check_narrow", "launch_narrow", "narrow_rows", "narrow_rows_torch", "narrow_rows_triton"]

# The stale-layer fill of a float dst. One object: the launcher keys constexpr values in a tuple,
# whose comparison takes `is` before `==` (NaN != NaN), so every launch finds the same entry.
_NAN = float("nan")

# ids per program and warps (H200 sweep above)
_BLOCK = 2048
_WARPS = 8


def check_narrow(dst: torch.Tensor, src: torch.Tensor, num_rows: int, stamps=None, step=None) -> int:
    """Validates the contract; returns the element count to cast."""
    if (stamps is None) != (step is None):
        raise ValueError("stamps and step go together: pass both or neither")
    if stamps is not None and (
        src.dim() != 3 or stamps.shape != (src.shape[1],) or step.shape != (1,) or stamps.device != src.device
    ):
        raise ValueError(
            f"stamps must be (num_layers,) and step (1,) on the source's device for a (rows, num_layers, "
            f"top_k) source, got {tuple(stamps.shape)}, {tuple(step.shape)} for {tuple(src.shape)}"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    if src.device != dst.device:
        raise ValueError(f"src and dst must be on one device, got {src.device} and {dst.device}")
    if src.dtype.is_floating_point != dst.dtype.is_floating_point or torch.bool in (src.dtype, dst.dtype):
        raise ValueError(
            f"src and dst must both be integer or both be floating point, got {src.dtype} and {dst.dtype}"
        )
    if src.dim() < 1 or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"src and dst must have the same row shape, got {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    rows = min(src.shape[0], dst.shape[0])
    if not 0 <= num_rows <= rows:
        raise ValueError(f"num_rows must be in [0, {rows}] (rows of src and dst), got {num_rows}")
    return num_rows * (src[0].numel() if src.shape[0] else 0)


if HAS_TRITON:
    import triton
    import triton.language as tl

    # The row count is a runtime int (a new count never compiles a new variant); the row size is a
    # constexpr (one variant per model shape), so the compiler knows the element count is a multiple
    # of the row size's power-of-two factor (8 for 61 x 8 ids) and vectorises the masked loads and
    # stores by that much. With a runtime element count it proves nothing and issues scalar loads:
    # 7.0 us for the 8192-token step above instead of 3.1 us.
    @triton.jit(do_not_specialize=["n_rows"])
    def _narrow_kernel(
        src_ptr,
        dst_ptr,
        stamps_ptr,
        step_ptr,
        n_rows,
        ROW: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK: tl.constexpr,
        STAMPED: tl.constexpr,
        FILL: tl.constexpr,
    ):
        n = n_rows.to(tl.int64) * ROW
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src_ptr + offs, mask=mask)
        if STAMPED:
            # layer of each id: constant divisors (ROW, TOP_K are constexprs), and the stamps are a
            # few hundred bytes that stay in L1
            layer = (offs % ROW) // TOP_K
            fresh = tl.load(stamps_ptr + layer, mask=mask, other=0) == tl.load(step_ptr)
            x = tl.where(fresh, x, FILL)
        tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def narrow_rows_triton(
    dst: torch.Tensor,
    src: torch.Tensor,
    num_rows: int,
    stamps: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> None:
    """Casts rows ``[0, num_rows)`` of ``src`` into ``dst`` on the current stream (one launch, no
    allocation, no host read of device values); with ``stamps``/``step``, stale layers read -1."""
    check_narrow(dst, src, num_rows, stamps, step)
    launch_narrow(dst, src, num_rows, stamps, step)


def launch_narrow(dst, src, num_rows: int, stamps=None, step=None) -> None:
    """:func:`narrow_rows_triton` without the checks, for a caller that validated its fixed tensors
    once (the snapshot pipeline: under cProfile on the H200 machine, ``check_narrow`` took 20 of the
    264 us of host time of a 1024-token snapshot)."""
    if num_rows == 0:
        return
    row = src.shape[1] * src.shape[2] if src.dim() == 3 else src[0].numel()
    n = num_rows * row
    stamped = stamps is not None
    grid = (triton.cdiv(n, _BLOCK),)
    args = (src, dst, stamps if stamped else src, step if stamped else src, num_rows)
    fill = _NAN if dst.dtype.is_floating_point else -1
    constexprs = dict(
        ROW=row, TOP_K=src.shape[-1] if stamped else 1, BLOCK=_BLOCK, STAMPED=stamped, FILL=fill
    )
    if src.device.type == "cuda":
        _narrow_launcher()(grid, args, constexprs, _WARPS)
    else:  # interpreted
        _narrow_kernel[grid](*args, **constexprs, num_warps=_WARPS)


@functools.cache
def _narrow_launcher() -> KernelLauncher:
    return KernelLauncher(_narrow_kernel)


# reference
def narrow_rows_torch(
    dst: torch.Tensor,
    src: torch.Tensor,
    num_rows: int,
    stamps: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> None:
    """PyTorch twin of :func:`narrow_rows_triton`: ``dst[:num_rows].copy_(src[:num_rows])``, stale
    layers masked to -1 (NaN for floats) on the device (no host reads)."""
    check_narrow(dst, src, num_rows, stamps, step)
    if not num_rows:
        return
    rows = src[:num_rows]
    if stamps is not None:
        fresh = (stamps == step)[None, :, None]
        fill = _NAN if rows.dtype.is_floating_point else -1
        rows = torch.where(fresh, rows, torch.full((), fill, dtype=rows.dtype, device=rows.device))
    dst[:num_rows].copy_(rows)


def narrow_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    num_rows: int,
    stamps: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> None:
    """The Triton kernel where Triton runs on the tensors' device, else the PyTorch twin."""
    if triton_runs_on(src.device):
        narrow_rows_triton(dst, src, num_rows, stamps, step)
    else:
        narrow_rows_torch(dst, src, num_rows, stamps, step)
