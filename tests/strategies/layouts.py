"""Memory layouts the kernels must honour, and the poison values that show a wrong read or write: the
same values in sliced, strided, transposed and expanded views (capture's ids, counts and buffers;
replay's logits, ids, outputs and gradients)."""

from __future__ import annotations

import torch

__all__ = [
    "BACKWARD_GRAD_LAYOUTS",
    "BACKWARD_ROW_LAYOUTS",
    "BUFFER_VIEWS",
    "COUNT_VIEWS",
    "ID_VIEWS",
    "PAD_ID",
    "POISON",
    "VIEW_GUARD",
    "buffer_view",
    "count_view",
    "ids_view",
    "strided_rows",
    "view_base_untouched",
]


POISON = -7  # buffer cells that must not be written
PAD_ID = -99  # ids in padding rows of topk_ids: must never reach the buffer


# Memory layouts the capture kernels must read by stride: a Triton kernel that assumes contiguity is
# wrong only on the GPU path, which the PyTorch twin cannot show.
ID_VIEWS = ("contiguous", "sliced", "strided", "transposed")
COUNT_VIEWS = ("contiguous", "strided", "expanded")
BUFFER_VIEWS = ("contiguous", "sliced")
VIEW_GUARD = -31  # cells of a view's base outside the view: must never be read or written


def ids_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (n, k) with the same values in another memory layout: ``sliced`` the first k columns
    of a wider tensor (e.g. ids[:, :top_k] of a fused shared-expert tensor), ``strided`` every
    other row, ``transposed`` column-major."""
    n, k = t.shape
    if kind == "sliced":
        wide = torch.full((n, k + 3), VIEW_GUARD, dtype=t.dtype, device=t.device)
        wide[:, :k] = t
        return wide[:, :k]
    if kind == "strided":
        tall = torch.full((2 * n, k), VIEW_GUARD, dtype=t.dtype, device=t.device)
        tall[::2] = t
        return tall[::2]
    if kind == "transposed":
        return t.t().contiguous().t()
    return t


def count_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (n,) in another memory layout: ``strided`` a column of an (n, 2) tensor (counts sliced
    out of a larger one), ``expanded`` a stride-0 view of one element (all values equal)."""
    if kind == "strided":
        wide = torch.full((t.shape[0], 2), VIEW_GUARD, dtype=t.dtype, device=t.device)
        wide[:, 0] = t
        return wide[:, 0]
    if kind == "expanded":
        assert bool((t == t[0]).all()), "an expanded view needs equal values"
        return t[:1].expand(t.shape[0])
    return t


def buffer_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (m, L, k) in another layout: ``sliced`` the first k columns of a wider buffer."""
    if kind == "sliced":
        m, layers, k = t.shape
        wide = torch.full((m, layers, k + 2), VIEW_GUARD, dtype=t.dtype, device=t.device)
        wide[..., :k] = t
        return wide[..., :k]
    return t


def view_base_untouched(t: torch.Tensor) -> bool:
    """For a sliced buffer: the base's cells outside the view still hold VIEW_GUARD."""
    base = t._base
    if base is None:
        return True
    return bool((base[..., t.shape[-1] :] == VIEW_GUARD).all())


# Strided layouts the replay kernels (forward and backward) must honour: a view's gaps hold NaN, so a
# read there shows up in the result and a write there shows up in the gap.
#   logits / grad_logits: "contiguous"; "row_padded" (rows of E + 3, the tail a gap);
#   "column_strided" (every other column of a (n, 2E) buffer).
#   incoming grad of the weights: those, plus "expanded" (stride 0 both ways, what autograd hands
#   over for w.sum()) and "transposed" (column-major).
BACKWARD_ROW_LAYOUTS = ("contiguous", "row_padded", "column_strided")
BACKWARD_GRAD_LAYOUTS = (*BACKWARD_ROW_LAYOUTS, "expanded", "transposed")


def strided_rows(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` (n, m) copied into a view of ``layout``; the buffer's other elements are NaN."""
    n, m = values.shape
    if layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        return values.t().contiguous().t()
    if layout == "expanded":
        assert values.numel() == 0 or bool((values == values.flatten()[0]).all()), "expanded: one value"
        fill = values.flatten()[0] if values.numel() else torch.zeros((), dtype=values.dtype)
        return fill.reshape(1, 1).expand(n, m)
    if layout == "row_padded":
        base = torch.full((n, m + 3), float("nan"), dtype=values.dtype)
        view = base[:, :m]
    elif layout == "column_strided":
        base = torch.full((n, 2 * m), float("nan"), dtype=values.dtype)
        view = base[:, ::2]
    else:
        raise ValueError(f"layout must be one of {BACKWARD_GRAD_LAYOUTS}, got {layout!r}")
    view.copy_(values)
    return view
