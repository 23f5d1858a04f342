"""The indexer's own top-k selection as a Triton kernel that records as it selects (the DSA rule),
as the router with fused capture does for experts.

``select_indexer_topk(scores, k, kv_lens=..., target=...)``: per query row of ``scores`` (n, T),
the k positions of the largest scores among the row's keys ``[0, min(kv_lens[row], T))`` (a causal
mask and the sequence's end: a position beyond them is never chosen), ties to the lower position,
returned ascending (a set: see docs/indexer.md), -1 after them where the row has fewer than k keys.
With a capture ``target`` (an indexer buffer's :class:`~moe_ops.capture.target.CaptureTarget`) the
same launch writes this rank's rows into the record with the routing capture's row rule.

Scores are ordered as numbers (float32; bfloat16/float16 widened exactly; -0.0 ties with 0.0), a NaN
below every number (never chosen before a real score). The selection is exact, a radix select as
``torch.topk``'s: the k-th largest key (32 bits, ordered as the numbers) is found 8 bits at a time,
each pass a 256-bin histogram of the next digit over the keys whose higher digits are those chosen so
far; then one pass keeps the keys above it and, of the keys equal to it, the first ones by position.
5 passes over a row of T scores (it was 33 with a binary search over the bits: 2-33x slower than
``torch.topk`` on an H100). A row is split across programs while the rows alone leave SMs idle
(one query row of a 128K context: 32 programs); its programs sum their histograms atomically and,
before writing, count what the chunks before them take (a sixth pass), so every launch is
graph-safe with no host reads: 5 launches unsplit, 6 split, whatever the scores.

* :func:`select_topk_triton` - the kernel's launcher (CUDA; CPU tensors under ``TRITON_INTERPRET=1``);
* :func:`select_topk_torch` - its PyTorch twin (a stable sort; the CPU path and the test oracle).
"""

from __future__ import annotations

import functools

import torch

from .._runtime.launcher import KernelLauncher
from .._runtime.library import destination_op, identity, reference_op
from .._runtime.triton import HAS_TRITON, next_power_of_2
from ..capture.errors import cpu_counter_lock
from ..capture.kernels import add_faults, fault_delta, record_stamp_torch
from ..capture.spec import Arg, CaptureSpec, OpArgs, absent_kernel_args
from ..capture.target import CaptureTarget
from ..capture.window import rows_window_torch

__all__ = ["select_indexer_topk", "select_topk_torch", "select_topk_triton"]

_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# scores per step of a pass
_BLOCK_T = 1024
# the k-th largest key is found 8 bits at a time: 4 histogram passes of 256 bins
_PASSES, _BINS = 4, 256
# the fewest keys a program of a split row reads: below it a launch's fixed cost outweighs the reads
_MIN_CHUNK = 4096
_NO_CAPTURE = dict(S_PAD=1, HAS_OFFSET=False, STAMP=False, WEIGHTS=False, EXPERT_MAP=False)


def orderable_keys_torch(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) ordered as the float32 values of ``scores``: equal numbers equal
    keys (-0.0 is 0.0), NaN lowest (0)."""
    bits = scores.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = torch.where(scores == 0, 0x80000000, key)
    return torch.where(scores.isnan(), 0, key)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..capture.kernels import record_faults, record_stamp
    from ..capture.window import rows_window

    # _PASSES and _BINS as the kernels see them (a kernel reads only constexpr globals)
    _K_PASSES = tl.constexpr(_PASSES)
    _K_BINS = tl.constexpr(_BINS)

    @triton.jit
    def orderable_keys(s):
        """Triton twin of :func:`orderable_keys_torch` (int64)."""
        f = s.to(tl.float32)
        bits = f.to(tl.uint32, bitcast=True).to(tl.int64)
        key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
        key = tl.where(f == 0, 0x80000000, key)
        return tl.where(f != f, 0, key)

    # the helpers take loaded values, never pointers: torch's mutation analysis counts a pointer
    # passed to a called function as written, and a traced launch would clone kv_lens to copy it back

    @triton.jit
    def _row_limit(length, live, n_keys):
        """The keys a row may choose from, [0, limit): its kv_lens clamped to [0, T] (int64; 0 for
        a program past the rows)."""
        limit = tl.minimum(tl.maximum(length.to(tl.int64), 0), n_keys)
        return tl.where(live, limit, 0)

    @triton.jit
    def _next_digit(hist, q, prefix, need):
        """One pass's digit of the k-th largest key from its 256-bin histogram over the keys whose
        higher digits are ``prefix``: the largest d with count(digit >= d) >= need; the keys of a
        higher digit are all taken. Returns the prefix with it and what is still to take."""
        bins = tl.arange(0, _K_BINS)
        hist = hist.to(tl.int64)
        total = tl.sum(hist, axis=0)
        below_or_at = tl.cumsum(hist, axis=0)
        digit = tl.max(tl.where(total - below_or_at + hist >= need, bins, 0), axis=0)
        need -= tl.sum(tl.where(bins == digit, total - below_or_at, 0), axis=0)
        return prefix | (digit.to(tl.int64) << (24 - 8 * q)), need

    @triton.jit(
        do_not_specialize=["n_rows", "n_keys", "top_k", "stride_sm", "stride_len", "chunk", "pass_idx"]
    )
    def _select_hist_kernel(
        scores_ptr,
        lens_ptr,
        hist_ptr,
        n_rows,
        n_keys,
        top_k,
        stride_sm,
        stride_st,
        stride_len,
        chunk,
        pass_idx,
        BLOCK_T: tl.constexpr,
        HAS_LENS: tl.constexpr,
        ATOMIC: tl.constexpr,
    ):
        """Pass ``pass_idx``: the histogram of digit ``pass_idx`` (8 bits, high first) of the keys of
        one chunk of a row whose higher digits are the prefix the earlier passes chose."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        row64 = tl.cast(row, tl.int64)
        length = n_keys
        if HAS_LENS:
            length = tl.load(lens_ptr + row64 * stride_len)
        limit = _row_limit(length, row < n_rows, n_keys)
        prefix = tl.cast(0, tl.int64)
        need = tl.minimum(tl.cast(top_k, tl.int64), limit)
        for q in range(0, pass_idx):
            hist = tl.load(hist_ptr + (row64 * _K_PASSES + q) * _K_BINS + tl.arange(0, _K_BINS))
            prefix, need = _next_digit(hist, q, prefix, need)
        shift = 24 - 8 * pass_idx
        high = prefix >> (shift + 8)
        first = tl.cast(part, tl.int64) * chunk
        end = tl.minimum(first + chunk, limit)
        offs = tl.arange(0, BLOCK_T)
        base = scores_ptr + row64 * stride_sm
        hist = tl.zeros([_K_BINS], dtype=tl.int32)
        for start in range(0, chunk, BLOCK_T):
            pos = first + start + offs
            ok = pos < end
            key = orderable_keys(tl.load(base + pos * stride_st, mask=ok, other=0.0))
            in_play = ok & ((key >> (shift + 8)) == high)
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), _K_BINS, mask=in_play)
        dst = hist_ptr + (row64 * _K_PASSES + pass_idx) * _K_BINS + tl.arange(0, _K_BINS)
        if ATOMIC:
            tl.atomic_add(dst, hist, sem="relaxed")
        else:
            tl.store(dst, hist)

    @triton.jit(do_not_specialize=["n_rows", "n_keys", "top_k", "stride_sm", "stride_len", "chunk"])
    def _select_count_kernel(
        scores_ptr,
        lens_ptr,
        hist_ptr,
        tally_ptr,
        n_rows,
        n_keys,
        top_k,
        stride_sm,
        stride_st,
        stride_len,
        chunk,
        BLOCK_T: tl.constexpr,
        HAS_LENS: tl.constexpr,
    ):
        """A split row's chunks: each counts its keys above the k-th largest key and equal to it,
        so that the writing programs place their positions after the chunks before them."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        row64 = tl.cast(row, tl.int64)
        length = n_keys
        if HAS_LENS:
            length = tl.load(lens_ptr + row64 * stride_len)
        limit = _row_limit(length, row < n_rows, n_keys)
        kth = tl.cast(0, tl.int64)
        ties_wanted = tl.minimum(tl.cast(top_k, tl.int64), limit)
        for q in range(0, _K_PASSES):
            hist = tl.load(hist_ptr + (row64 * _K_PASSES + q) * _K_BINS + tl.arange(0, _K_BINS))
            kth, ties_wanted = _next_digit(hist, q, kth, ties_wanted)
        first = tl.cast(part, tl.int64) * chunk
        end = tl.minimum(first + chunk, limit)
        offs = tl.arange(0, BLOCK_T)
        base = scores_ptr + row64 * stride_sm
        above = tl.cast(0, tl.int64)
        ties = tl.cast(0, tl.int64)
        for start in range(0, chunk, BLOCK_T):
            pos = first + start + offs
            ok = pos < end
            key = orderable_keys(tl.load(base + pos * stride_st, mask=ok, other=0.0))
            above += tl.sum(((key > kth) & ok).to(tl.int64), axis=0)
            ties += tl.sum(((key == kth) & ok).to(tl.int64), axis=0)
        n_parts = tl.num_programs(1)
        tl.store(tally_ptr + (row64 * n_parts + part) * 2, above.to(tl.int32))
        tl.store(tally_ptr + (row64 * n_parts + part) * 2 + 1, ties.to(tl.int32))

    @triton.jit(
        do_not_specialize=["n_rows", "n_keys", "top_k", "stride_sm", "stride_len", "stride_om", "chunk"]
    )
    def _select_kernel(
        scores_ptr,
        lens_ptr,
        hist_ptr,
        tally_ptr,
        out_ptr,
        # the capture's pointers: moe_ops.capture.spec.KERNEL_POINTERS, in its order
        buf_ptr,
        wbuf_ptr,
        counts_ptr,
        sizes_ptr,
        errors_ptr,
        stamps_ptr,
        step_ptr,
        map_ptr,
        n_rows,
        n_keys,
        top_k,
        stride_sm,
        stride_st,
        stride_len,
        stride_om,
        stride_ok,
        chunk,
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
        BLOCK_T: tl.constexpr,
        K_PAD: tl.constexpr,
        HAS_LENS: tl.constexpr,
        SPLIT: tl.constexpr,
        CAPTURE: tl.constexpr,
        S_PAD: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        STAMP: tl.constexpr,
        WEIGHTS: tl.constexpr,
        EXPERT_MAP: tl.constexpr,
    ):
        """The last pass: a chunk's keys above the k-th largest key, and of the keys equal to it the
        first ones by position, written at their rank in the row (ascending positions), recorded
        with the capture's row rule; the program of chunk 0 writes the row's -1 padding."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        row64 = tl.cast(row, tl.int64)
        live = row < n_rows
        length = n_keys
        if HAS_LENS:
            # HAS_LENS only with n_rows >= 1 entries: row 0 stands in for a program past the rows
            length = tl.load(lens_ptr + tl.where(live, row64, 0) * stride_len)
        limit = _row_limit(length, live, n_keys)
        want = tl.minimum(tl.cast(top_k, tl.int64), limit)
        # the k-th largest key, and how many keys equal to it are taken (the first by position)
        kth = tl.cast(0, tl.int64)
        ties_wanted = want
        for q in range(0, _K_PASSES):
            hist = tl.load(hist_ptr + (row64 * _K_PASSES + q) * _K_BINS + tl.arange(0, _K_BINS))
            kth, ties_wanted = _next_digit(hist, q, kth, ties_wanted)
        offs = tl.arange(0, BLOCK_T)
        cols = tl.arange(0, K_PAD)
        # `live` as vectors (a scalar predicate and'ed into a block mask is refused by the interpreter)
        live_t = (offs * 0 + row) < n_rows
        live_k = (cols * 0 + row) < n_rows
        base = scores_ptr + row64 * stride_sm
        # what the chunks before this one take: their keys above, their ties up to ties_wanted
        taken = tl.cast(0, tl.int64)
        ties_taken = tl.cast(0, tl.int64)
        if SPLIT:
            n_parts = tl.num_programs(1)
            for j0 in range(0, part, BLOCK_T):
                j = j0 + offs
                before = j < part
                tally = tally_ptr + (row64 * n_parts + j) * 2
                taken += tl.sum(tl.load(tally, mask=before, other=0).to(tl.int64), axis=0)
                ties_taken += tl.sum(tl.load(tally + 1, mask=before, other=0).to(tl.int64), axis=0)
            taken += tl.minimum(ties_taken, ties_wanted)
        if CAPTURE:
            count_c = tl.load(counts_ptr + tl.cast(dp_rank, tl.int64) * stride_c)
            if HAS_OFFSET:
                s_idx = tl.arange(0, S_PAD)
                sizes = tl.load(sizes_ptr + s_idx.to(tl.int64) * stride_s, mask=s_idx < n_first, other=0)
            else:
                sizes = count_c
            w_start, c_eff, flags = rows_window(count_c, sizes, n_rows, n_dst, HAS_OFFSET)
            dst = row64 - w_start
            dst_t = offs.to(tl.int64) * 0 + dst  # vectors, as live_t
            dst_k = cols.to(tl.int64) * 0 + dst
            in_window_t = (dst_t >= 0) & (dst_t < c_eff)
            in_window_k = (dst_k >= 0) & (dst_k < c_eff)
            buf_row = buf_ptr + tl.cast(layer_id, tl.int64) * stride_bl + dst * stride_bm
        first = tl.cast(part, tl.int64) * chunk
        end = tl.minimum(first + chunk, limit)
        for start in range(0, chunk, BLOCK_T):
            pos = first + start + offs
            ok = pos < end
            key = orderable_keys(tl.load(base + pos * stride_st, mask=ok, other=0.0))
            tie = (key == kth) & ok
            tie_rank = ties_taken + tl.cumsum(tie.to(tl.int64), axis=0) - tie.to(tl.int64)
            chosen = ((key > kth) & ok) | (tie & (tie_rank < ties_wanted))
            slot = taken + tl.cumsum(chosen.to(tl.int64), axis=0) - chosen.to(tl.int64)
            tl.store(out_ptr + row64 * stride_om + slot * stride_ok, pos.to(tl.int32), mask=chosen & live_t)
            if CAPTURE:
                tl.store(
                    buf_row + slot * stride_bk,
                    pos.to(buf_ptr.dtype.element_ty),
                    mask=chosen & live_t & in_window_t,
                )
            taken += tl.sum(chosen.to(tl.int64), axis=0)
            ties_taken += tl.sum(tie.to(tl.int64), axis=0)
        # -1 after the row's min(k, keys) positions, written once (chunk 0)
        pad = (cols >= want) & (cols < top_k) & ((cols * 0 + part) == 0)
        tl.store(
            out_ptr + row64 * stride_om + cols * stride_ok, tl.full([K_PAD], -1, tl.int32), mask=pad & live_k
        )
        if CAPTURE:
            tl.store(
                buf_row + cols * stride_bk,
                tl.full([K_PAD], -1, buf_ptr.dtype.element_ty),
                mask=pad & live_k & in_window_k,
            )
            if (row == 0) & (part == 0):
                record_faults(errors_ptr, flags)
                if STAMP:
                    record_stamp(stamps_ptr, step_ptr, layer_id)


def _programs_per_row(
    n_rows: int, n_keys: int, device: torch.device, min_chunk: int, sm_count: int | None = None
) -> tuple[int, int]:
    """(programs per row, keys per program): a row is split into chunks of >= ``min_chunk`` keys
    while the rows alone would leave SMs idle (about 4 programs per SM in flight). ``sm_count``:
    the device's SMs (None: asked once per device)."""
    if n_rows == 0 or n_keys <= min_chunk:
        return 1, max(n_keys, 1)
    sms = _sm_count(device) if sm_count is None else sm_count
    parts = min(-(-4 * sms // n_rows), -(-n_keys // min_chunk))
    if parts <= 1:
        return 1, n_keys
    chunk = -(-n_keys // parts)
    if chunk > _BLOCK_T:  # whole blocks per program: aligned loads
        chunk = -(-chunk // _BLOCK_T) * _BLOCK_T
    return -(-n_keys // chunk), chunk


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # TRITON_INTERPRET=1 on CPU tensors: split rows as a small GPU would
    return torch.cuda.get_device_properties(device).multi_processor_count


def select_topk_triton(
    out: torch.Tensor,
    scores: torch.Tensor,
    kv_lens: torch.Tensor,
    capture: CaptureSpec | None = None,
    *,
    wrap=identity,
    min_chunk: int = _MIN_CHUNK,
) -> None:
    """Launches the selection (validated arguments assumed; see :func:`select_indexer_topk`).

    out: (n, k) int32, written; scores: (n, T) float, any strides; kv_lens: (n,) int32/int64 or
    (0,): no per-row limit; capture: where to record this rank's rows, or None. ``min_chunk``:
    the fewest keys a program of a split row reads (tests lower it to split small rows)."""
    n_rows, n_keys = scores.shape
    top_k = out.shape[1]
    if capture is None and n_rows == 0:
        return
    has_lens = bool(kv_lens.dim() == 1 and kv_lens.numel() > 0)
    stride_len = kv_lens.stride(0) if has_lens else 0
    parts, chunk = _programs_per_row(n_rows, n_keys, scores.device, min_chunk)
    block = min(_BLOCK_T, max(16, next_power_of_2(chunk)))
    rows = max(n_rows, 1)  # a call over no rows still records its window fault
    # the digit histograms (rows, passes, bins): summed over a split row's programs, else stored
    hist = (torch.zeros if parts > 1 or n_rows == 0 else torch.empty)(
        (rows, _PASSES, _BINS), dtype=torch.int32, device=scores.device
    )
    # per program of a split row: its keys above the k-th largest and equal to it (unread unsplit)
    tally = scores.new_empty((rows, parts, 2), dtype=torch.int32)
    common = (scores, kv_lens)
    row_scalars = (n_rows, n_keys, top_k, *scores.stride(), stride_len)
    launch = _launch_on(scores.device, wrap)
    if n_rows > 0:
        for pass_idx in range(_PASSES):
            launch(
                "hist", (n_rows, parts), (*common, hist, *row_scalars, chunk, pass_idx),
                dict(BLOCK_T=block, HAS_LENS=has_lens, ATOMIC=parts > 1),
            )  # fmt: skip
        if parts > 1:
            launch(
                "count", (n_rows, parts), (*common, hist, tally, *row_scalars, chunk),
                dict(BLOCK_T=block, HAS_LENS=has_lens),
            )  # fmt: skip
    pointers = (*common, hist, tally, out)
    scalars = (*row_scalars, *out.stride(), chunk)
    if capture is None:
        args = absent_kernel_args(pointers, scalars, out, distinct=wrap is not identity)
        capture_constexprs = _NO_CAPTURE
    else:
        args = capture.kernel_args(pointers, scalars)
        capture_constexprs = capture.kernel_constexprs()
    constexprs = dict(
        BLOCK_T=block,
        K_PAD=next_power_of_2(max(top_k, 1)),
        HAS_LENS=has_lens,
        SPLIT=parts > 1,
        CAPTURE=capture is not None,
        **capture_constexprs,
    )
    launch("select", (rows, parts), args, constexprs)


def _launch_on(device: torch.device, wrap):
    """launch(kernel name, grid, args, constexprs): the precompiled launcher on CUDA, the kernel's
    own launch when traced (``wrap``) or interpreted (under the CPU counter lock)."""
    kernels = {"hist": _select_hist_kernel, "count": _select_count_kernel, "select": _select_kernel}

    def launch(name, grid, args, constexprs):
        kernel = kernels[name]
        if device.type == "cpu":
            with cpu_counter_lock(device):
                wrap(kernel)[grid](*args, **constexprs, num_warps=4)
        elif wrap is identity:
            _launcher(name)(grid, args, constexprs, 4)
        else:
            wrap(kernel)[grid](*args, **constexprs, num_warps=4)

    return launch


@functools.cache
def _launcher(name: str) -> KernelLauncher:
    return KernelLauncher(
        {"hist": _select_hist_kernel, "count": _select_count_kernel, "select": _select_kernel}[name]
    )


# reference
def select_topk_torch(
    out: torch.Tensor,
    scores: torch.Tensor,
    kv_lens: torch.Tensor,
    capture: CaptureSpec | None = None,
) -> None:
    """PyTorch twin of :func:`select_topk_triton`: same arguments, same writes, same faults."""
    n_rows, n_keys = scores.shape
    top_k = out.shape[1]
    key = orderable_keys_torch(scores)
    pos = torch.arange(n_keys, device=scores.device)
    if kv_lens.dim() == 1 and kv_lens.numel() > 0:
        limit = kv_lens.to(torch.int64).clamp(0, n_keys)[:, None]
    else:
        limit = torch.full((n_rows, 1), n_keys, dtype=torch.int64, device=scores.device)
    allowed = pos[None, :] < limit
    key = torch.where(allowed, key, -1)
    # descending by key, ties by position (a stable sort of rows already in position order)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :top_k]
    taken = torch.gather(allowed, 1, order)
    chosen = torch.where(taken, order, n_keys).sort(dim=1).values
    rows = torch.where(chosen < n_keys, chosen, -1).to(torch.int32)
    if rows.shape[1] < top_k:
        rows = torch.cat([rows, rows.new_full((n_rows, top_k - rows.shape[1]), -1)], dim=1)
    out.copy_(rows)
    if capture is None:
        return
    spec = capture
    buffer = spec.buffer
    n_dst = buffer.shape[0]
    start, c_eff, flags = rows_window_torch(
        spec.token_counts, spec.sizes, spec.dp_rank, spec.n_first, n_rows, n_dst
    )
    window = min(n_rows, n_dst)
    with cpu_counter_lock(buffer.device):
        if window > 0:
            r = torch.arange(window, device=buffer.device)
            src = (start + r).clamp(max=n_rows - 1)
            layer = buffer[:window, spec.layer_id]
            layer.copy_(torch.where((r < c_eff)[:, None], rows[src].to(buffer.dtype), layer))
        add_faults(spec.errors, fault_delta(flags, 0))
        record_stamp_torch(spec.stamps, spec.step, spec.layer_id)


# moe_ops::select_indexer_topk_ (no capture) and ::select_indexer_topk_capture_ (the capture spec's
# arguments after the selection's, as the router's fused capture op takes them)
_SELECT_ARGS = (Arg("out", "Tensor", written=True), Arg("scores", "Tensor"), Arg("kv_lens", "Tensor"))
SELECT_CAPTURE_OP = OpArgs.fused(_SELECT_ARGS)


def _select(out: torch.Tensor, scores: torch.Tensor, kv_lens: torch.Tensor, *, wrap=identity) -> None:
    select_topk_triton(out, scores, kv_lens, None, wrap=wrap)


def _select_twin(out: torch.Tensor, scores: torch.Tensor, kv_lens: torch.Tensor) -> None:
    select_topk_torch(out, scores, kv_lens, None)


def _select_capture(*args, wrap=identity) -> None:
    host, spec = SELECT_CAPTURE_OP.split(args)
    select_topk_triton(*host, spec, wrap=wrap)


def _select_capture_twin(*args) -> None:
    host, spec = SELECT_CAPTURE_OP.split(args)
    select_topk_torch(*host, spec)


_KERNELS = (_select_hist_kernel, _select_count_kernel, _select_kernel) if HAS_TRITON else ()
_SELECT_SCHEMA = "(Tensor(a0!) out, Tensor scores, Tensor kv_lens) -> ()"
select_op = destination_op(
    "select_indexer_topk_",
    mutates=("out",),
    cuda=_select if HAS_TRITON else None,
    cpu=_select_twin,
    interpreted=_select if HAS_TRITON else None,
    traceable=_select if HAS_TRITON else None,
    kernels=_KERNELS,
    schema=_SELECT_SCHEMA,
)
select_reference_op = reference_op(
    "select_indexer_topk_", _select_twin, mutates=("out",), schema=_SELECT_SCHEMA
)
select_capture_op = destination_op(
    "select_indexer_topk_capture_",
    mutates=SELECT_CAPTURE_OP.mutates,
    cuda=_select_capture if HAS_TRITON else None,
    cpu=_select_capture_twin,
    interpreted=_select_capture if HAS_TRITON else None,
    traceable=_select_capture if HAS_TRITON else None,
    kernels=_KERNELS,
    schema=SELECT_CAPTURE_OP.schema(),
)
select_capture_reference_op = reference_op(
    "select_indexer_topk_capture_",
    _select_capture_twin,
    mutates=SELECT_CAPTURE_OP.mutates,
    schema=SELECT_CAPTURE_OP.schema(),
)


def select_indexer_topk(
    scores: torch.Tensor,
    k: int,
    *,
    kv_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    target: CaptureTarget | None = None,
) -> torch.Tensor:
    """The indexer's top-k positions of each query row (see the module docstring), recorded into
    ``target`` in the same launch when one is given.

    Args:
        scores: (n, T) float32/bfloat16/float16, any strides - the index scores of n query rows
            over T keys.
        k: positions per row (>= 1).
        kv_lens: (n,) int32/int64 on the scores' device, any stride - the keys each row may choose
            from (``[0, kv_lens[row])``, clamped to T); read on the device. None: all T.
        out: (n, k) int32 on the scores' device to write (destination-passing); None allocates.
        target: a :class:`~moe_ops.capture.target.CaptureTarget` of an int32 indexer buffer
            (max_tokens, num_indexer_layers, k), without weights or expert map - records this
            rank's rows (its layout's row rule), counts read on the device; None: no record.

    Returns ``out``. No host reads, no synchronisation: CUDA-graph capturable, traced by
    torch.compile. ValueError/TypeError naming the argument for bad input.
    """
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2 or scores.dtype not in _SCORE_DTYPES:
        raise ValueError(
            f"scores must be (n, T) float32/bfloat16/float16, got {scores.dtype} {tuple(scores.shape)}"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    n = scores.shape[0]
    if kv_lens is None:
        lens = scores.new_empty(0, dtype=torch.int32)
    else:
        if not isinstance(kv_lens, torch.Tensor) or kv_lens.dtype not in (torch.int32, torch.int64):
            raise ValueError("kv_lens must be an int32/int64 torch.Tensor or None")
        if kv_lens.shape != (n,) or kv_lens.device != scores.device:
            raise ValueError(
                f"kv_lens must be ({n},) on {scores.device}, got {tuple(kv_lens.shape)} on {kv_lens.device}"
            )
        lens = kv_lens
    if out is None:
        out = torch.empty((n, k), dtype=torch.int32, device=scores.device)
    elif (
        not isinstance(out, torch.Tensor)
        or out.shape != (n, k)
        or out.dtype != torch.int32
        or out.device != scores.device
    ):
        raise ValueError(f"out must be ({n}, {k}) int32 on {scores.device}")
    if target is None:
        select_op(out, scores, lens)
        return out
    if not isinstance(target, CaptureTarget):
        raise TypeError(f"target must be a CaptureTarget or None, got {type(target).__name__}")
    buffer = target.buffer
    if buffer.dtype != torch.int32 or buffer.shape[2] != k or target.has_weights or target.has_expert_map:
        raise ValueError(
            f"target must record into an int32 (max_tokens, num_indexer_layers, {k}) buffer without weights "
            f"or expert map, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    if buffer.device != scores.device:
        raise ValueError(
            f"target's buffer must be on the scores' device {scores.device}, got {buffer.device}"
        )
    select_capture_op(*SELECT_CAPTURE_OP.join((out, scores, lens), target.spec))
    return out
