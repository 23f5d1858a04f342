"""The snapshot's narrowing: the leading rows of a wide id buffer cast into a narrow staging buffer.

Two implementations of one destination-passing contract, ``dst.view(-1)[:n] = src.view(-1)[:n]``
cast to ``dst.dtype`` with two's-complement truncation (what ``torch.Tensor.copy_`` does for
integer narrowing: ids that do not fit wrap), both tensors contiguous, same element count per row:

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

import torch

from .._triton import HAS_TRITON, triton_runs_on

__all__ = ["narrow_rows", "narrow_rows_torch", "narrow_rows_triton"]

# ids per program and warps (H200 sweep above)
_BLOCK = 2048
_WARPS = 8


def _check(dst: torch.Tensor, src: torch.Tensor, num_rows: int) -> int:
    """Validates the contract; returns the element count to cast."""
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    if src.device != dst.device:
        raise ValueError(f"src and dst must be on one device, got {src.device} and {dst.device}")
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
    def _narrow_kernel(src_ptr, dst_ptr, n_rows, ROW: tl.constexpr, BLOCK: tl.constexpr):
        n = n_rows.to(tl.int64) * ROW
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src_ptr + offs, mask=mask)
        tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def narrow_rows_triton(dst: torch.Tensor, src: torch.Tensor, num_rows: int) -> None:
    """Casts rows ``[0, num_rows)`` of ``src`` into ``dst`` on the current stream (one launch, no
    allocation, no host read of device values)."""
    n = _check(dst, src, num_rows)
    if n == 0:
        return
    row = src[0].numel()
    _narrow_kernel[(triton.cdiv(n, _BLOCK),)](src, dst, num_rows, ROW=row, BLOCK=_BLOCK, num_warps=_WARPS)


# reference
def narrow_rows_torch(dst: torch.Tensor, src: torch.Tensor, num_rows: int) -> None:
    """PyTorch twin of :func:`narrow_rows_triton`: ``dst[:num_rows].copy_(src[:num_rows])``."""
    _check(dst, src, num_rows)
    if num_rows:
        dst[:num_rows].copy_(src[:num_rows])


def narrow_rows(dst: torch.Tensor, src: torch.Tensor, num_rows: int) -> None:
    """The Triton kernel where Triton runs on the tensors' device, else the PyTorch twin."""
    if triton_runs_on(src.device):
        narrow_rows_triton(dst, src, num_rows)
    else:
        narrow_rows_torch(dst, src, num_rows)
