"""The slicing kernel: copies this DP rank's rows of ``topk_ids`` into one layer of the capture buffer.

The row window is computed on the device from ``token_counts`` / ``sizes`` (never on the host), so a
CUDA graph captured once replays correctly for any live counts. Two implementations of one contract:

* :func:`capture_rows_triton` - the Triton kernel (CUDA; CPU tensors under ``TRITON_INTERPRET=1``);
* :func:`capture_rows_torch` - its PyTorch reference twin (the CPU path, and the test oracle).

Contract (both): with ``(start, c_eff)`` from :mod:`moe_ops.capture.window` (the one row rule),
``buffer[r, layer_id, :] = topk_ids[start + r, :]`` for ``r < c_eff``, except that an id below 0 or
beyond the buffer dtype's range is stored as -1 and counted (FAULT_BAD_ID, one per id); every
other element of ``buffer`` keeps its value. With an expert map (``expert_map`` non-empty; the
kernel's EXPERT_MAP: EPLB's physical -> logical map), an id ``p`` is stored as ``expert_map[p]``:
a ``p`` outside ``[0, P)`` is stored as -1 and counted as FAULT_BAD_ID, an entry outside
``[0, num_logical_experts)`` is stored as -1 and counted as FAULT_BAD_MAP (one per id); the map is
read on the device with masked loads (never out of bounds), at every call, so a balancer that
updates it in place between CUDA-graph replays is seen by the next replay. With a weights buffer
(``weights_buffer`` 3-D; the kernel's WEIGHTS), ``weights_buffer[r, layer_id, :] =
topk_weights[start + r, :]`` for the same rows, cast to its dtype (round to nearest even, as
torch's ``.to``); weights are not checked (a NaN is stored as a NaN, a row whose id became -1
keeps its weight; the expert map does not touch the weights, which are per column). A call
whose window was clamped adds 1 to slot 0 of ``errors`` and 1 to the slot of each fault bit
(:mod:`moe_ops.capture.errors`).
With a stamp (``stamps`` non-empty), ``stamps[layer_id] = step[0]`` records that the layer was
captured in the current step (the snapshot reads layers whose stamp is stale as the fill value).

:func:`record_faults` and :func:`record_stamp` are shared with the fused router kernel, so both
paths record in exactly the same way.
"""

from __future__ import annotations

import functools

import torch

from .._runtime.launcher import KernelLauncher
from .._runtime.library import identity
from .._runtime.triton import HAS_TRITON, next_power_of_2
from .errors import (
    FAULT_BAD_ID,
    FAULT_BAD_MAP,
    FAULT_SLOT,
    FAULT_SLOTS,
    WINDOW_FAULTS,
    cpu_counter_lock,
)
from .spec import kernel_args, kernel_constexprs
from .window import rows_window_torch

__all__ = [
    "capture_rows_torch",
    "capture_rows_triton",
    "id_limit",
    "launch_config",
    "mapped_ids_torch",
    "size_hint",
]

# At most 1024 ids per program (n=8192, k=8 uses 64 programs); a batch smaller than that gets a
# tile just big enough. Inside a CUDA graph of 61 layers on an H200 (n=1, k=8, LOCAL), per layer:
# 1024-id tile 1.11 us, 1-row tile with 1 warp 1.05 us, with 4 warps 1.03 us; a plain copy 0.96 us.
# At n=64: 64-row tile with 4 warps 1.16 us, 1 warp 1.37 us. So: smallest tile, always 4 warps.
_TILE_ELEMENTS = 1024

_ID_LIMITS = {
    torch.int8: (1 << 7) - 1,
    torch.uint8: (1 << 8) - 1,
    torch.int16: (1 << 15) - 1,
    torch.int32: (1 << 31) - 1,
    torch.int64: (1 << 63) - 1,
}


def id_limit(dtype: torch.dtype) -> int:
    """Largest id a tensor of integer ``dtype`` holds."""
    return _ID_LIMITS[dtype]


def size_hint(n, fallback: int = 64) -> int:
    """``n`` as an int for a choice that only tunes speed (a tile size): a SymInt's value in the
    example being traced, without a guard, so the compiled graph stays valid for every size (the
    grid it launches is computed from ``n`` itself). ``fallback`` where a SymInt has no example
    value (a data-dependent size)."""
    if not isinstance(n, torch.SymInt):
        return n
    hint = getattr(n.node, "hint", None)
    return int(hint) if isinstance(hint, int) else fallback


def has_symbols(*values) -> bool:
    """True when any of ``values`` is symbolic (torch.compile with dynamic shapes)."""
    return any(isinstance(v, (torch.SymInt, torch.SymBool)) for v in values)


def launch_config(window: int, k_pad: int) -> tuple[int, int]:
    """(rows per program, warps) for a kernel that covers ``window`` rows of ``k_pad`` ids."""
    block_m = max(1, min(_TILE_ELEMENTS // k_pad, next_power_of_2(window)))
    return block_m, 4


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .window import rows_window

    # Triton kernels may only read globals that are constexpr.
    _WINDOW_FAULTS = tl.constexpr(WINDOW_FAULTS)
    _BAD_ID_SLOT = tl.constexpr(FAULT_SLOT[FAULT_BAD_ID])
    _BAD_MAP_SLOT = tl.constexpr(FAULT_SLOT[FAULT_BAD_MAP])
    _N_WINDOW_BITS = tl.constexpr(WINDOW_FAULTS.bit_length())

    @triton.jit
    def record_faults(errors_ptr, flags):
        """Called by program 0 only: a clamped window counts once per call, plus once per bit."""
        if (flags & _WINDOW_FAULTS) != 0:
            tl.atomic_add(errors_ptr, 1)
            bits = tl.arange(0, 4)
            hit = ((flags >> bits) & 1) != 0
            tl.atomic_add(errors_ptr + 1 + bits, hit.to(tl.int32), mask=hit & (bits < _N_WINDOW_BITS))

    @triton.jit
    def record_bad_ids(errors_ptr, bad):
        """Any program: one count per id stored as -1. A masked atomic per id rather than a
        reduction: nothing waits for a cross-thread sum, and where no id is bad (the common case)
        every atomic is predicated off (H200, 61-layer graph at n=1: a row-count reduction here
        cost 0.07 us per layer)."""
        tl.atomic_add(errors_ptr + _BAD_ID_SLOT + bad.to(tl.int32) * 0, bad.to(tl.int32), mask=bad)

    @triton.jit
    def record_bad_map(errors_ptr, bad):
        """As :func:`record_bad_ids`, for ids whose expert-map entry was outside the logical range."""
        tl.atomic_add(errors_ptr + _BAD_MAP_SLOT + bad.to(tl.int32) * 0, bad.to(tl.int32), mask=bad)

    @triton.jit
    def record_stamp(stamps_ptr, step_ptr, layer_id):
        """Called by program 0 only: this layer was captured in the step ``step[0]``."""
        tl.store(stamps_ptr + layer_id, tl.load(step_ptr))

    @triton.jit
    def to_bfloat16(w):
        """``w`` rounded to bfloat16, nearest even, in integer arithmetic on its float32 bits:
        torch's rule (c10's ``round_to_nearest_even``), bit for bit, on the GPU and in the
        interpreter alike (the interpreter's own float32 -> bfloat16 cast truncates: 0.4196 became
        0.41796875, not torch's 0.419921875). A NaN becomes 0x7FC0 (still a NaN)."""
        bits = w.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(w != w, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def store_weights(wbuf_ptr, w, dst_rows, cols, layer_id, mask, stride_vm, stride_vl, stride_vk):
        """Stores a tile of weights ``w`` (BLOCK_M, K_PAD) at rows ``dst_rows`` (int64) of layer
        ``layer_id`` of the weights buffer where ``mask``, cast to its dtype (round to nearest
        even, as torch's ``.to``). Shared by the capture and router kernels."""
        dst = wbuf_ptr + tl.cast(layer_id, tl.int64) * stride_vl + dst_rows[:, None] * stride_vm
        if wbuf_ptr.dtype.element_ty == tl.bfloat16:  # noqa: SIM108 - a compile-time branch of the kernel
            v = to_bfloat16(w)
        else:
            # float32 (exact from every source dtype) or float16 (a hardware cvt.rn, and numpy's
            # round-to-nearest-even cast in the interpreter)
            v = w.to(wbuf_ptr.dtype.element_ty)
        tl.store(dst + cols[None, :] * stride_vk, v, mask=mask)

    @triton.jit
    def checked_ids(ids, mask, ID_MAX: tl.constexpr, CHECK_HIGH: tl.constexpr):
        """(ids with -1 where an id does not fit, where that happened among ``mask``)."""
        bad = ids < 0
        if CHECK_HIGH:
            bad = bad | (ids > ID_MAX)
        bad = bad & mask
        return tl.where(bad, -1, ids), bad

    @triton.jit
    def physical_slots(ids, n_physical):
        """(int64 ids, where an id is outside the map's slots ``[0, n_physical)``). The kernels load
        ``map[ids]`` themselves, masked by the second (never out of bounds): a map pointer passed
        into a helper whose result reaches an atomic's address reads, to torch's mutation analysis
        of traced kernels, as a written map (it would clone the map and copy it back)."""
        wide = ids.to(tl.int64)
        return wide, (wide < 0) | (wide >= n_physical)

    @triton.jit
    def checked_logical(logical, outside, mask, n_logical):
        """(logical ids with -1 where the physical id or its map entry does not fit, physical
        ids outside the map among ``mask`` (FAULT_BAD_ID), entries outside ``[0, n_logical)``
        among ``mask`` (FAULT_BAD_MAP))."""
        bad_id = outside & mask
        logical = logical.to(tl.int64)
        bad_map = ((logical < 0) | (logical >= n_logical)) & ~outside & mask
        return tl.where(bad_id | bad_map, -1, logical), bad_id, bad_map

    # Counts live on the device, so nothing that changes per step is a specialisation key: the
    # row count n_src, the layer and the rank are runtime ints (no recompile per layer or batch).
    # Strides other than the innermost ones are runtime values too: specialising them (Triton keys
    # on stride % 16 and stride == 1) multiplied the compiled variants for no speed-up. The count
    # tensors' strides stay specialised, so contiguous counts (the common case) load with a constant
    # stride of 1; a strided or expanded view compiles a variant of its own.
    @triton.jit(
        do_not_specialize=[
            "n_src",
            "n_dst",
            "layer_id",
            "dp_rank",
            "n_first",
            "top_k",
            "stride_bm",
            "stride_bl",
            "stride_im",
            "n_physical",
            "n_logical",
        ]
    )
    def _capture_rows_kernel(
        ids_ptr,
        wts_ptr,
        # the capture's pointers: moe_ops.capture.spec.KERNEL_POINTERS, in its order
        buf_ptr,
        wbuf_ptr,
        counts_ptr,
        sizes_ptr,
        errors_ptr,
        stamps_ptr,
        step_ptr,
        map_ptr,
        n_src,
        stride_im,
        stride_ik,
        stride_wm,
        stride_wk,
        top_k,
        # the capture's scalars: moe_ops.capture.spec.KERNEL_SCALARS, in its order
        n_dst,
        layer_id,
        dp_rank,
        n_first,
        stride_bm,
        stride_bl,
        stride_bk,
        stride_vm,
        stride_vl,
        stride_vk,
        stride_c,
        stride_s,
        n_physical,
        n_logical,
        stride_map,
        ID_MAX: tl.constexpr,
        CHECK_HIGH: tl.constexpr,
        K_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        S_PAD: tl.constexpr,
        SOURCE_ORDER: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        STAMP: tl.constexpr,
        WEIGHTS: tl.constexpr,
        EXPERT_MAP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row0 = pid * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, K_PAD)
        col_ok = (cols < top_k)[None, :]
        layer_base = buf_ptr + tl.cast(layer_id, tl.int64) * stride_bl + cols[None, :] * stride_bk
        # the window's inputs (see rows_window for why they are loaded here)
        count = tl.load(counts_ptr + tl.cast(dp_rank, tl.int64) * stride_c)
        if HAS_OFFSET:
            s_idx = tl.arange(0, S_PAD)
            sizes = tl.load(sizes_ptr + s_idx.to(tl.int64) * stride_s, mask=s_idx < n_first, other=0)
        else:
            sizes = count  # unused: start is 0
        if SOURCE_ORDER:
            # Programs walk SOURCE rows: the id load does not wait for the counts (its addresses
            # are known at launch), only the store does (row r goes to buffer row r - start). One
            # global-memory round trip less on the critical path of a launch-bound kernel (GATHERED
            # n=1 in a 61-layer CUDA graph on an H200: 1.29 us per layer with the dependent load,
            # 1.13 us this way; a plain copy 0.96 us). Used when start is 0 (LOCAL, rank 0) or the
            # source is small.
            in_src = (rows < n_src)[:, None] & col_ok
            ids = tl.load(
                ids_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :] * stride_ik, mask=in_src
            )
            if WEIGHTS:
                # loaded beside the ids, before the counts arrive, for the same reason
                w = tl.load(
                    wts_ptr + rows.to(tl.int64)[:, None] * stride_wm + cols[None, :] * stride_wk, mask=in_src
                )
            if EXPERT_MAP:
                # the map's load waits only for the ids, not for the counts: issued before the window
                slots, outside = physical_slots(ids, n_physical)
                logical = tl.load(map_ptr + slots * stride_map, mask=in_src & ~outside, other=-1)
            start, c_eff, flags = rows_window(count, sizes, n_src, n_dst, HAS_OFFSET)
            dst_rows = rows.to(tl.int64) - start
            ok = ((dst_rows >= 0) & (dst_rows < c_eff))[:, None] & col_ok
            if EXPERT_MAP:
                ids, bad, bad_map = checked_logical(logical, outside, ok, n_logical)
            else:
                ids, bad = checked_ids(ids, ok, ID_MAX, CHECK_HIGH)
            tl.store(layer_base + dst_rows[:, None] * stride_bm, ids.to(buf_ptr.dtype.element_ty), mask=ok)
            if WEIGHTS:
                store_weights(wbuf_ptr, w, dst_rows, cols, layer_id, ok, stride_vm, stride_vl, stride_vk)
            # last: branches with atomics, which nothing above should wait behind
            record_bad_ids(errors_ptr, bad)
            if EXPERT_MAP:
                record_bad_map(errors_ptr, bad_map)
            if pid == 0:
                record_faults(errors_ptr, flags)
                if STAMP:
                    record_stamp(stamps_ptr, step_ptr, layer_id)
        else:
            # Programs walk DESTINATION rows (large gathers: read only this rank's block).
            start, c_eff, flags = rows_window(count, sizes, n_src, n_dst, HAS_OFFSET)
            if row0 < c_eff:
                mask = (rows < c_eff)[:, None] & col_ok
                src = start + rows
                ids = tl.load(ids_ptr + src[:, None] * stride_im + cols[None, :] * stride_ik, mask=mask)
                if EXPERT_MAP:
                    slots, outside = physical_slots(ids, n_physical)
                    logical = tl.load(map_ptr + slots * stride_map, mask=mask & ~outside, other=-1)
                    ids, bad, bad_map = checked_logical(logical, outside, mask, n_logical)
                else:
                    ids, bad = checked_ids(ids, mask, ID_MAX, CHECK_HIGH)
                dst = layer_base + rows.to(tl.int64)[:, None] * stride_bm
                tl.store(dst, ids.to(buf_ptr.dtype.element_ty), mask=mask)
                if WEIGHTS:
                    src_w = wts_ptr + src.to(tl.int64)[:, None] * stride_wm + cols[None, :] * stride_wk
                    store_weights(
                        wbuf_ptr,
                        tl.load(src_w, mask=mask),
                        rows.to(tl.int64),
                        cols,
                        layer_id,
                        mask,
                        stride_vm,
                        stride_vl,
                        stride_vk,
                    )
                record_bad_ids(errors_ptr, bad)
                if EXPERT_MAP:
                    record_bad_map(errors_ptr, bad_map)
            if pid == 0:
                record_faults(errors_ptr, flags)
                if STAMP:
                    record_stamp(stamps_ptr, step_ptr, layer_id)


def _plan(
    n_src: int,
    top_k: int,
    n_dst: int,
    n_first: int,
    n_sizes: int,
    buf_dtype,
    ids_dtype,
    stamped: bool,
    weighted: bool = False,
    mapped: bool = False,
) -> tuple[tuple[int], int, dict]:
    """(grid, warps, constexprs) of one launch: host arithmetic on shapes and dtypes only.

    The sizes may be SymInts (torch.compile with dynamic shapes): the constexprs that the kernel's
    correctness rests on (K_PAD >= top_k, S_PAD >= n_first, the row order, the flags) guard on
    them; the tile size only tunes speed and is chosen from the traced example's sizes without a
    guard; the grid stays an expression in the sizes, so it covers every row at every size.
    """
    k_pad = next_power_of_2(top_k)
    # Walk source rows when that reads nothing extra (this rank's block starts at row 0) or little
    # (the whole source is at most 8 tiles of 1024 ids); otherwise walk this rank's window only.
    source_order = bool(n_first == 0 or n_src * k_pad <= 8 * _TILE_ELEMENTS)
    rows = n_src if source_order else torch.sym_min(n_src, n_dst)
    block_m, num_warps = launch_config(size_hint(rows), k_pad)
    # At least one program, so a call whose counts overflow an empty source still records its fault.
    grid = (torch.sym_max(1, -(-rows // block_m)),)
    id_max = id_limit(buf_dtype)
    constexprs = dict(
        ID_MAX=id_max,
        CHECK_HIGH=id_limit(ids_dtype) > id_max,
        K_PAD=k_pad,
        BLOCK_M=block_m,
        SOURCE_ORDER=source_order,
        **kernel_constexprs(n_sizes, n_first, stamped, weighted, mapped),
    )
    return grid, num_warps, constexprs


# computed once per shape (about 3 us of Python per call otherwise); SymInts are not hashable
_capture_plan = functools.lru_cache(maxsize=4096)(_plan)


def capture_rows_triton(
    buffer: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights_buffer: torch.Tensor,
    token_counts: torch.Tensor,
    sizes: torch.Tensor,
    errors: torch.Tensor,
    stamps: torch.Tensor,
    step: torch.Tensor,
    expert_map: torch.Tensor,
    layer_id: int,
    dp_rank: int,
    n_first: int,
    num_logical_experts: int,
    *,
    wrap=identity,
) -> None:
    """Launches the slicing kernel (validated arguments assumed; see ``capture_routing``).

    The capture op's arguments, in its order (:data:`moe_ops.capture.spec.CAPTURE_OP`):
    topk_ids: (n, top_k) integer, any strides - source rows
    topk_weights: (n, top_k) float32/bfloat16/float16, any strides - their weights; read only
        when ``weights_buffer`` is 3-D (else any tensor, e.g. the (0,) stand-in)
    the others: a :class:`~moe_ops.capture.spec.CaptureSpec`'s fields (their invariants there);
        ``buffer`` (and ``weights_buffer``) is written in place, rows [0, c_eff) of layer ``layer_id``
    wrap: applied to the ``@triton.jit`` kernel before the launch (``torch.library.wrap_triton``
        when torch.compile traces the op; see :mod:`moe_ops._runtime.library`)
    """
    n_src, top_k = topk_ids.shape
    n_dst = buffer.shape[0]
    plan_args = (
        n_src,
        top_k,
        n_dst,
        n_first,
        sizes.shape[0],
        buffer.dtype,
        topk_ids.dtype,
        stamps.numel() > 0,
        weights_buffer.dim() == 3,
        expert_map.numel() > 0,
    )
    plan = _plan if has_symbols(*plan_args) else _capture_plan
    grid, num_warps, constexprs = plan(*plan_args)
    stride_im, stride_ik = topk_ids.stride()
    # no weights: the (0,) stand-in, never read (WEIGHTS False)
    stride_wm, stride_wk = topk_weights.stride() if topk_weights.dim() == 2 else (0, 0)
    args = kernel_args(
        (topk_ids, topk_weights),
        (n_src, stride_im, stride_ik, stride_wm, stride_wk, top_k),
        buffer,
        weights_buffer,
        token_counts,
        sizes,
        errors,
        stamps,
        step,
        expert_map,
        layer_id,
        dp_rank,
        n_first,
        num_logical_experts,
    )
    if buffer.device.type == "cpu":
        # interpreted Triton updates the fault counter in Python (see capture.errors); on CUDA the
        # kernel's atomics need no lock, and a context manager per launch is host time for nothing
        with cpu_counter_lock(buffer.device):
            wrap(_capture_rows_kernel)[grid](*args, **constexprs, num_warps=num_warps)
    elif wrap is identity:
        _capture_launcher()(grid, args, constexprs, num_warps)
    else:
        wrap(_capture_rows_kernel)[grid](*args, **constexprs, num_warps=num_warps)


@functools.cache
def _capture_launcher() -> KernelLauncher:
    return KernelLauncher(_capture_rows_kernel)


def fault_delta(
    flags: torch.Tensor,
    n_bad: torch.Tensor | int,
    n_bad_map: torch.Tensor | int = 0,
    n_duplicates: torch.Tensor | int = 0,
) -> torch.Tensor:
    """(FAULT_SLOTS,) int32 increments of one call: slot 0 and the window bits' slots from
    ``flags`` (0-d), the bad-id slot from ``n_bad``, the bad-map slot from ``n_bad_map``, the
    duplicate slot from ``n_duplicates``. No host reads."""
    flags = flags.to(torch.int64)
    window = flags & WINDOW_FAULTS
    parts = [(window != 0).to(torch.int64)]
    parts += [(window >> b) & 1 for b in range(WINDOW_FAULTS.bit_length())]
    # a count that is a Python int (0: nothing checked) becomes a device zero without a host-to-
    # device copy (torch.as_tensor of an int on CUDA is one: a sync under a CUDA graph's checks)
    zero = torch.zeros((), dtype=torch.int64, device=flags.device)
    counts = (n_bad, n_bad_map, n_duplicates)
    parts += [n.to(torch.int64) if isinstance(n, torch.Tensor) else zero + n for n in counts]
    parts += [zero] * (FAULT_SLOTS - len(parts))
    return torch.stack(parts).to(torch.int32)


def add_faults(errors: torch.Tensor, delta: torch.Tensor) -> None:
    """Adds ``delta`` to the counter atomically (``index_add_``: atomics on CUDA; CPU callers hold
    :func:`moe_ops.capture.errors.cpu_counter_lock`)."""
    errors.index_add_(0, torch.arange(FAULT_SLOTS, device=errors.device), delta)


def record_stamp_torch(stamps: torch.Tensor, step: torch.Tensor, layer_id: int) -> None:
    """Twin of the kernels' stamp: ``stamps[layer_id] = step[0]`` on the device."""
    if stamps.numel():
        stamps[layer_id : layer_id + 1].copy_(step[:1])


def checked_ids_torch(ids: torch.Tensor, id_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the kernels' id check: (int64 ids with -1 where one does not fit, where that was)."""
    ids = ids.to(torch.int64)
    bad = (ids < 0) | (ids > id_max)
    return torch.where(bad, -1, ids), bad


def mapped_ids_torch(
    ids: torch.Tensor, expert_map: torch.Tensor, num_logical_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of the kernels' expert-map step: (int64 logical ids with -1 where the physical id is
    outside the map or its entry outside ``[0, num_logical_experts)``, where the physical id was
    outside (FAULT_BAD_ID), where the entry was outside (FAULT_BAD_MAP)). Reads the map on the
    device (a gather at clamped slots), never on the host."""
    ids = ids.to(torch.int64)
    n_physical = expert_map.shape[0]
    outside = (ids < 0) | (ids >= n_physical)
    logical = expert_map[ids.clamp(0, n_physical - 1)].to(torch.int64)
    bad_map = ((logical < 0) | (logical >= num_logical_experts)) & ~outside
    return torch.where(outside | bad_map, -1, logical), outside, bad_map


# reference
def capture_rows_torch(
    buffer: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights_buffer: torch.Tensor,
    token_counts: torch.Tensor,
    sizes: torch.Tensor,
    errors: torch.Tensor,
    stamps: torch.Tensor,
    step: torch.Tensor,
    expert_map: torch.Tensor,
    layer_id: int,
    dp_rank: int,
    n_first: int,
    num_logical_experts: int,
) -> None:
    """PyTorch twin of :func:`capture_rows_triton`: same arguments, same writes, same faults.

    Fixed shapes and no host reads (``torch.where`` over the static window ``min(n, rows)``), so it
    runs on any device and inside graphs; on CPU it is the capture op's implementation.
    """
    n_src = topk_ids.shape[0]
    n_dst = buffer.shape[0]
    start, c_eff, flags = rows_window_torch(token_counts, sizes, dp_rank, n_first, n_src, n_dst)
    n_bad = n_bad_map = 0
    window = min(n_src, n_dst)
    with cpu_counter_lock(buffer.device):
        if window > 0:
            rows = torch.arange(window, device=buffer.device)
            src = (start + rows).clamp(max=n_src - 1)
            valid = rows < c_eff
            if expert_map.numel() > 0:
                ids, bad, bad_map = mapped_ids_torch(topk_ids[src], expert_map, num_logical_experts)
                n_bad_map = (bad_map & valid[:, None]).sum()
            else:
                ids, bad = checked_ids_torch(topk_ids[src], id_limit(buffer.dtype))
            n_bad = (bad & valid[:, None]).sum()
            dst = buffer[:window, layer_id]
            dst.copy_(torch.where(valid[:, None], ids.to(buffer.dtype), dst))
            if weights_buffer.dim() == 3:
                # torch's cast (round to nearest even), as the kernel's
                w = topk_weights[src].to(weights_buffer.dtype)
                wdst = weights_buffer[:window, layer_id]
                wdst.copy_(torch.where(valid[:, None], w, wdst))
        add_faults(errors, fault_delta(flags, n_bad, n_bad_map))
        record_stamp_torch(stamps, step, layer_id)
