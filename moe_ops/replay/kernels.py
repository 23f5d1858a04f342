"""The replay kernels: recorded ids -> (weights, ids) forward, and the gradient w.r.t. the logits.

Two implementations of each destination-passing contract, side by side:

* :func:`replay_rows_triton` / :func:`replay_backward_triton` - Triton kernels (CUDA; CPU tensors
  under ``TRITON_INTERPRET=1``);
* :func:`replay_rows_torch` / :func:`replay_backward_torch` - their PyTorch twins, the CPU path and
  the test oracle.

Both compute in the dtype of ``weights``: float32 (bf16/fp16 logits are upcast), or float64 for
float64 logits (the kernels then key the live selection in 64 bits: ``moe_ops.router._select``).

Forward contract (both). A row of ``recorded_ids`` is

* **recorded**: every id in ``[0, num_experts)`` and no id twice - ``ids[t]`` is the recorded row,
  column order kept;
* **live**: every entry ``-1`` - ``ids[t]`` is the live routing of the row, exactly what
  ``moe_ops.route`` returns for it;
* **faulty**: anything else (an id outside ``[0, num_experts)`` other than a whole row of ``-1``,
  or an id twice) - routed live like a ``-1`` row, and counted: ``errors[0] += 1`` per faulty row,
  ``errors[1] |=`` its :data:`REPLAY_FAULT_OUT_OF_RANGE` / :data:`REPLAY_FAULT_REPEATED` bits. A
  faulty id is never used as an address.

With a hash table (``hash_table``, ``token_ids``: a hash layer), "routed live" means the table's ids,
``hash_table[token_ids[t]]``, as ``moe_ops.route`` gives them; a live or faulty row whose token id or
table entry is out of range gets ids ``-1`` and weights ``0`` and is counted once with
:data:`REPLAY_FAULT_HASH` (:mod:`moe_ops.router._hash`). The backward gives such a row a zero
gradient (no ``-1`` is ever an address).

``weights[t]`` is the method's weight rule evaluated at ``ids[t]`` from the live logits, gathered
from the dense scores (:func:`replay_weights`); a row whose weights are not all finite is written
as 0 and counted in ``nonfinite`` (``moe_ops.router.nonfinite``; the backward gives it gradient 0).
The backward writes the whole dense gradient row: zero for experts outside ``ids[t]`` except for
DEFAULT, whose full softmax couples every expert.

Per method, with ``xs = x[ids]``, ``s = sigmoid(xs)``, ``g`` the incoming gradient of the weights
and ``dot = sum(g * w)``; the gradient w.r.t. ``x[ids]`` (DEFAULT: w.r.t. every ``x``)::

    TOPK                       g
    RENORMALIZE(_NAIVE)        w * (g - dot)
    DEFAULT                    p * (onehot(ids) . g - dot),   p = softmax(x) over the row
    DEEPSEEK_V3, MINIMAX2      (scale * g - dot) / (sum s + 1e-20) * s * (1 - s)
      with renormalize=False   scale * g * s * (1 - s)               (weights s * scale)
    SIGMOID_RENORM             (g - [sum s >= 1e-20] * dot) / max(sum s, 1e-20) * s * (1 - s)
    LLAMA4, SIGMOID, TOPK_SIGMOID   g * s * (1 - s)
    SQRTSOFTPLUS               (scale * g - dot) / (sum q + 1e-20) * dq/dx,  q = sqrt(softplus(xs)),
                               dq/dx = softplus'(xs) / (2 q), 0 where q == 0
      with renormalize=False   scale * g * dq/dx                     (weights q * scale)

Every method but DEEPSEEK_V3 and MINIMAX2 (whose rules hold ``routed_scaling_factor``) weighs
``scale * w``; its gradient is the formula above at ``g -> scale * g`` and the unscaled
``w -> w / scale`` (``moe_ops.router.reference.unscaled_gradient_inputs``; 1 / 0 taken as 1).
"""

from __future__ import annotations

import torch

from .._runtime.faults import cpu_counter_lock
from .._runtime.library import identity
from .._runtime.triton import HAS_TRITON, interpreting, next_power_of_2
from ..capture.kernels import size_hint
from ..router._hash import hash_ids_torch
from ..router.args import tile_shape
from ..router.kernels import launch_config
from ..router.methods import METHODS, RoutingMethod, WeightRule
from ..router.nonfinite import count_zeroed_rows, nonfinite_counter
from ..router.reference import (
    rule_gradient,
    rule_weights,
    select_experts,
    selection_keys,
    zero_nonfinite_rows,
)

__all__ = [
    "REPLAY_FAULT_HASH",
    "REPLAY_FAULT_OUT_OF_RANGE",
    "REPLAY_FAULT_REPEATED",
    "REPLAY_FAULT_ROW_COUNT",
    "add_count",
    "backward_launch_config",
    "forward_launch_config",
    "replay_backward_torch",
    "replay_backward_triton",
    "replay_rows_torch",
    "replay_rows_triton",
    "replay_weights",
]

REPLAY_FAULT_OUT_OF_RANGE = 1  # an id outside [0, num_experts) in a row that is not all -1
REPLAY_FAULT_REPEATED = 2  # an id twice in one row
# a router read a different number of rows than the replayer's batch holds (RoutingReplayer's
# device-side check, in compiled and CUDA-graphed steps); counted per router call, not per row
REPLAY_FAULT_ROW_COUNT = 4
# a hash layer's row that needed the table (live or faulty record) had a token id outside
# [0, vocab) or a table entry outside [0, num_experts): ids -1, weights 0 (moe_ops.router._hash)
REPLAY_FAULT_HASH = 8

# Backward tile: 1024 logits per program, 4 warps. The output tile's layout gives each thread 8
# contiguous experts of one row (one 16-byte bf16 store), so 1024 logits are one row per thread:
# its k per-row values are loaded once per thread, not once per row it holds. At 4096 tokens of 256
# experts that is 1024 programs of 128 threads, 8 per SM of an H200: one wave. Chosen from the
# TTGIR/SASS (no layout conversion, no shared memory, 2 x STG.128), not timed on a GPU yet:
# `benchmarks/bench_replay.py --sweep-backward` times the alternatives.
_BACKWARD_TILE = 1024
_BACKWARD_WARPS = 4


def backward_launch_config(n_tokens: int, e_pad: int) -> tuple[int, int]:
    """(rows per program, warps) of the backward kernel for rows of ``e_pad`` padded experts."""
    if interpreting():
        # The interpreter pays per program and per operation, hardly per element: few programs.
        return min(next_power_of_2(n_tokens), 64), 1
    return max(1, min(next_power_of_2(n_tokens), _BACKWARD_TILE // e_pad)), _BACKWARD_WARPS


# Forward tile: up to 1024 logits per program (the live branch's register tile of BLOCK_M rows, and
# DEFAULT's row denominator), 4 warps: at RENORMALIZE 128/8 that is 8 rows per program, 512 programs
# at 4096 tokens (the backward's grid, 1.06 us as a do-nothing kernel in the 61-call graph, H200)
# where the router's configuration launches 2048 programs of one warp (about 1.9 us of launch
# floor). A recorded block reads 4 * k bytes of ids and k gathered logits per row, so its work does
# not grow with the tile. Rows wider than the tile keep the router's configuration (one row).
# `benchmarks/bench_replay.py --sweep-forward` times the alternatives; not yet timed on a GPU.
_FORWARD_TILE = 1024
_FORWARD_WARPS = 4


def forward_launch_config(n_tokens: int, ng_pad: int, g_pad: int) -> tuple[int, int]:
    """(rows per program, warps) of the forward kernel for a ``(ng_pad, g_pad)`` expert tile
    (:func:`moe_ops.router.args.tile_shape`)."""
    if interpreting():
        # The interpreter pays per program and per operation, hardly per element: few programs.
        return min(next_power_of_2(n_tokens), 64), 1
    e_tile = ng_pad * g_pad
    if e_tile > _FORWARD_TILE:
        return launch_config(n_tokens, ng_pad, g_pad)
    return max(1, min(next_power_of_2(n_tokens), _FORWARD_TILE // e_tile)), _FORWARD_WARPS


def replay_weights(
    x: torch.Tensor, ids: torch.Tensor, method: RoutingMethod, scale: float, unnormalized: bool = False
) -> torch.Tensor:
    """The method's weights of the experts ``ids``: its table row's ``weight.computed`` rule (its
    ``unnormalized`` rule's where ``unnormalized``: ``renormalize=False``;
    :func:`moe_ops.router.reference.rule_weights`), what the router and replay kernels compute.

    x: (n, E) float - logits in the compute dtype
    ids: (n, k) int64 - distinct, in-range experts per row
    Returns (n, k) in ``x``'s dtype.

    RENORMALIZE_NAIVE (``p[ids] / sum p[ids]``, ``p = softmax(x)``) is thus computed as
    ``softmax(x[ids])``, its exact equal in real arithmetic: the literal form underflows to
    0 / 0 = NaN in float32 when every recorded expert lies about 104 below the row's best logit,
    which a replayed (not top-k) row can.
    """
    return rule_weights(x, ids, METHODS[method].computed(unnormalized)[0], scale)


def _classify(rec: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(live, out_of_range, repeated): (n,) bool each, for (n, k) int64 recorded ids."""
    live = (rec == -1).all(1)
    out_of_range = ~((rec >= 0) & (rec < num_experts)).all(1) & ~live
    ordered = torch.sort(rec, dim=1)[0]
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(1) & ~live
    return live, out_of_range, repeated


# reference
def replay_rows_torch(
    router_logits: torch.Tensor,
    recorded_ids: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    errors: torch.Tensor,
    nonfinite: torch.Tensor | None,
    row_count: torch.Tensor | None,
    bias: torch.Tensor | None,
    hash_table: torch.Tensor | None,
    token_ids: torch.Tensor | None,
    method: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    unnormalized: bool,
    group_top: int,
) -> None:
    """PyTorch twin of :func:`replay_rows_triton`: same arguments, same writes, same fault record.
    The arguments are ``moe_ops::replay_routing_``'s, in its order
    (:data:`moe_ops.replay.op.REPLAY_OP`): the op's CPU kernel.

    router_logits: (n, E) float - live router outputs
    recorded_ids: (n, k) integer - the rollout's ids; rows of -1 are routed live
    weights: (n, k) float32, or float64 for float64 logits - written; the compute dtype
    ids: (n, k) int32 - written
    errors: (2,) int32 - [faulty rows, OR of fault bits], added to
    nonfinite: (1,) int32 or None - the non-finite rows counter (``moe_ops.router.nonfinite``):
        rows whose weights were not all finite are written as 0 and counted there; None: the
        logits' device's
    row_count: (1,) int32 or None - the rows the recorded batch holds (a ``RoutingReplayer``'s
        ``row_count``); when it is not ``n``, one faulty call with :data:`REPLAY_FAULT_ROW_COUNT`
    bias: (E,) float or None - the selection bias of BIAS_METHODS (live rows only; never in weights)
    hash_table: (vocab, k) integer or None - a hash layer's table: live and faulty rows take
        ``hash_table[token_ids]`` (module doc)
    token_ids: (n,) integer or None - each row's token id (with ``hash_table``)
    method, n_group, topk_group, routed_scaling_factor: the routing arguments
        (:class:`moe_ops.router.args.RoutingArgs`)
    unnormalized: the method's other weight rule (``RoutingArgs.unnormalized``)
    group_top: the keys a group score sums (``RoutingArgs.group_top``; live rows with groups)

    Live ids are :func:`moe_ops.router.reference.select_experts` of every row in the compute dtype
    (the route twin's rule, so equal to ``route(backend="torch")`` bit for bit), used where needed.
    No host reads; allocates its intermediates.
    """
    k = recorded_ids.shape[1]
    num_experts = router_logits.shape[1]
    method = RoutingMethod(method)
    x = router_logits.to(weights.dtype)
    rec = recorded_ids.to(torch.int64)
    live, out_of_range, repeated = _classify(rec, num_experts)
    faulty = out_of_range | repeated
    if hash_table is None:
        live_ids = select_experts(selection_keys(x, method, bias), k, n_group, topk_group, group_top)
        hash_bad = torch.zeros_like(live)
    else:
        live_ids, table_bad, _ = hash_ids_torch(hash_table, token_ids, num_experts)
        hash_bad = table_bad & (live | faulty)
    final = torch.where((live | faulty)[:, None], live_ids, rec)
    # a bad hash row's -1 ids are never an address: row 0's experts stand in, weighed 0
    safe = torch.where(hash_bad[:, None], 0, final)
    w = replay_weights(x, safe, method, routed_scaling_factor, unnormalized)
    w, zeroed = zero_nonfinite_rows(torch.where(hash_bad[:, None], 0.0, w))
    count_zeroed_rows(nonfinite_counter(x.device) if nonfinite is None else nonfinite, zeroed)
    weights.copy_(w)
    ids.copy_(final)
    flags = torch.where(out_of_range.any(), REPLAY_FAULT_OUT_OF_RANGE, 0) | torch.where(
        repeated.any(), REPLAY_FAULT_REPEATED, 0
    )
    flags = flags | torch.where(hash_bad.any(), REPLAY_FAULT_HASH, 0)
    count = (faulty | hash_bad).sum()
    if row_count is not None:
        wrong_rows = (row_count[0] != router_logits.shape[0]).to(count.dtype)
        count = count + wrong_rows
        flags = flags | wrong_rows * REPLAY_FAULT_ROW_COUNT
    # the CPU counters' lock: the twin's update is atomic with respect to every other update and to
    # a check's read-and-subtract (moe_ops._runtime.faults). On CUDA the count is an atomic add
    # (index_add_), as the kernels' atomic_add: a read-modify-write of errors[0] would write back
    # over a check's subtraction or another stream's increment landing between its load and store
    with cpu_counter_lock(errors.device):
        add_count(errors, count)
        errors[1] |= flags.to(errors.dtype)


def add_count(errors: torch.Tensor, count: torch.Tensor) -> None:
    """``errors[0] += count`` (0-d or (1,) integer) as an atomic add on CUDA (``index_add_``); CPU
    callers hold :func:`moe_ops._runtime.faults.cpu_counter_lock`. No host reads."""
    slot = torch.zeros(1, dtype=torch.int64, device=errors.device)
    errors.index_add_(0, slot, count.to(errors.dtype).reshape(1))


# reference
def replay_backward_torch(
    grad_weights: torch.Tensor,
    router_logits: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    grad_logits: torch.Tensor,
    method: int,
    routed_scaling_factor: float,
    unnormalized: bool,
) -> None:
    """PyTorch twin of :func:`replay_backward_triton`: writes ``grad_logits``, the method's gradient
    rule (module doc formulas; :func:`moe_ops.router.reference.rule_gradient`). The arguments are
    ``moe_ops::replay_routing_backward_``'s, in its order (``REPLAY_BACKWARD_OP``).

    grad_weights: (n, k) float - gradient of the loss w.r.t. the forward's weights (any strides)
    router_logits: (n, E) float - the forward's logits
    weights: (n, k) float32, or float64 for float64 logits - the forward's weights; the compute dtype
    ids: (n, k) int32 - the forward's ids (distinct, in range; a bad hash row's all -1)
    grad_logits: (n, E) router_logits' dtype - written, every element (0 on a row of -1 ids)
    """
    dtype = weights.dtype
    g = grad_weights.to(dtype)
    x = router_logits.to(dtype)
    weight_rule, rule = METHODS[RoutingMethod(method)].computed(unnormalized)
    ids = ids.long()
    dead = (ids < 0).any(1, keepdim=True)  # a bad hash row (forward: ids -1, weights 0)
    safe = torch.where(dead, 0, ids)
    # a row the forward zeroed (non-finite weights): its weights are the constant 0, so its gradient
    # is 0 - zeroed here explicitly, as the kernel does: autograd through a where would give NaN
    # (the unselected branch's NaN times 0). Known from what the forward saved, as the kernel's
    # zeroed_evidence: the LOGIT rule's weights are the logits (a chosen logit not finite), every
    # other rule's weights all 0 (a finite row whose scores all underflowed to 0 has gradient 0 by
    # the rule too).
    if weight_rule == WeightRule.LOGIT:
        zeroed = ~torch.isfinite(x.gather(1, safe)).all(dim=1)
    else:
        zeroed = (weights == 0).all(dim=1)
    dead = dead | zeroed[:, None]
    grad = rule_gradient(g, weights, x, safe, rule, routed_scaling_factor)
    grad_logits.copy_(torch.where(dead, 0.0, grad))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..router._hash import hash_ids
    from ..router._select import keep_groups, ordered_keys, topk_rounds
    from ..router._weights import (
        N_METHODS,
        chosen_weights,
        finite_rows,
        gathered_row_softmax,
        gradient_column,
        gradient_rows,
        gradient_sigmoid,
        record_zeroed,
        row_softmax,
        unscaled_gradient_inputs,
        zeroed_by_forward,
        zeroed_evidence,
    )

    # Triton kernels may only read globals that are constexpr.
    _OUT_OF_RANGE = tl.constexpr(REPLAY_FAULT_OUT_OF_RANGE)
    _REPEATED = tl.constexpr(REPLAY_FAULT_REPEATED)
    _ROW_COUNT = tl.constexpr(REPLAY_FAULT_ROW_COUNT)
    _HASH = tl.constexpr(REPLAY_FAULT_HASH)

    # The live routing below runs the router's own selection helpers (moe_ops.router._select) and
    # both paths the router's weight helpers (moe_ops.router._weights), so a live row's ids equal
    # route(backend="triton")'s bit for bit; the tests compare them exactly.

    @triton.jit
    def _live_topk(
        logits_ptr,
        bias_ptr,
        row_off,
        row_ok,
        group_size,
        n_group,
        topk_group,
        stride_le,
        METHOD: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GROUPED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        NG_PAD: tl.constexpr,
        G_PAD: tl.constexpr,
        K_PAD: tl.constexpr,
        COMPUTE: tl.constexpr,
        GROUP_TOP: tl.constexpr,
    ):
        """(BLOCK_M, K_PAD) int32: the router's top-k of each row (descending key, ties to the lowest
        index), from a (BLOCK_M, NG_PAD, G_PAD) register tile of the rows' logits in ``COMPUTE``
        (float32, or float64: 64-bit keys)."""
        grp = tl.arange(0, NG_PAD)
        col = tl.arange(0, G_PAD)
        expert = grp[:, None] * group_size + col[None, :]
        expert_ok = (grp[:, None] < n_group) & (col[None, :] < group_size)
        expert3 = expert[None, :, :]
        ok3 = row_ok[:, None, None] & expert_ok[None, :, :]
        x = tl.load(logits_ptr + row_off[:, None, None] + expert3 * stride_le, mask=ok3, other=0.0)
        x = x.to(COMPUTE)
        # the rows' softmax where the key reads it (SOFTMAX_BIAS; unread, and so not computed, by
        # every other key: a weight rule's softmax in METHOD's column is dead code here)
        x_max, z = row_softmax(x, ok3, row_ok, METHOD, False)
        okey = ordered_keys(x, bias_ptr, expert, expert_ok, ok3, x_max, z, METHOD, HAS_BIAS)
        if GROUPED:
            okey = keep_groups(okey, row_ok, n_group, topk_group, BLOCK_M, NG_PAD, G_PAD, GROUP_TOP)
        ids = topk_rounds(okey, expert3, BLOCK_M, K_PAD)
        return ids

    @triton.jit
    def _gathered_weights(
        logits_ptr,
        row_off,
        ids,
        ok,
        rows_ok,
        group_size,
        n_group,
        scale,
        stride_le,
        METHOD: tl.constexpr,
        NG_PAD: tl.constexpr,
        G_PAD: tl.constexpr,
        COMPUTE: tl.constexpr,
    ):
        """(BLOCK_M, K_PAD) ``COMPUTE`` (float32 or float64): the method's weights at ``ids`` (the
        router kernel's formulas), from the k gathered logits of each row; DEFAULT alone also reads
        the whole row (its softmax denominator). ``row_off``, ``rows_ok``: (BLOCK_M, K_PAD), each
        row's value in every column; only cells where ``ok`` (within the ``rows_ok`` rows) are read
        or valid. ``scale``: ``routed_scaling_factor`` in ``COMPUTE``."""
        xs = tl.load(logits_ptr + row_off + ids.to(tl.int64) * stride_le, mask=ok, other=0.0)
        xs = xs.to(COMPUTE)
        # the method's weights (moe_ops.router._weights), per-row values kept in the tile's layout
        x_max, z = gathered_row_softmax(
            logits_ptr, row_off, rows_ok, xs, group_size, n_group, stride_le, METHOD, NG_PAD, G_PAD, COMPUTE
        )
        w = chosen_weights(xs, ok, rows_ok, scale, x_max, z, METHOD, True)
        return w

    # As in the router: nothing that changes per step or per layer is a specialisation key (the
    # token count, top_k, the group shape and the row strides are runtime ints).
    @triton.jit(
        do_not_specialize=[
            "n_tokens",
            "group_size",
            "n_group",
            "top_k",
            "topk_group",
            "stride_lm",
            "stride_rm",
            "stride_rk",
            "stride_wm",
            "stride_im",
            "vocab",
            "stride_hv",
            "stride_t",
        ]
    )
    def _replay_kernel(
        logits_ptr,
        rec_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        errors_ptr,
        # (1,) int32: the non-finite rows counter (moe_ops.router.nonfinite)
        nonfinite_ptr,
        row_count_ptr,
        table_ptr,
        tok_ptr,
        n_tokens,
        group_size,
        n_group,
        top_k,
        topk_group,
        scale: tl.float64,  # passed as a double: float64 weights take routed_scaling_factor unrounded
        stride_lm,
        stride_le,
        stride_rm,
        stride_rk,
        stride_wm,
        stride_wk,
        stride_im,
        stride_ik,
        vocab,
        stride_hv,
        stride_hk,
        stride_t,
        METHOD: tl.constexpr,
        UNNORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GROUPED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        NG_PAD: tl.constexpr,
        G_PAD: tl.constexpr,
        K_PAD: tl.constexpr,
        CHECK_ROWS: tl.constexpr,
        HASH: tl.constexpr,
        GROUP_TOP: tl.constexpr,
    ):
        # The recorded rows' path works in the layout of one (BLOCK_M, K_PAD) tile: every per-row
        # value is a keep_dims reduction of it broadcast over the columns, so the path has one load
        # of the record, one gather, two stores and no layout conversion (TTGIR at 128/8; (BLOCK_M,)
        # or (BLOCK_M, 1) tensors took layouts of their own: 9 converts, each a shared-memory round
        # trip). The live rows' path is a branch that stores its own rows and yields nothing, so the
        # live tile's layout cannot leak into the recorded path (when the branch yielded the ids, the
        # gather's addresses and the id store were converted from it, and a (BLOCK_M, K_PAD, K_PAD)
        # pair test loaded the record in four layouts).
        # the compute dtype is the weights': float32, or float64 for float64 logits
        COMPUTE: tl.constexpr = weights_ptr.dtype.element_ty
        # the weight rules' column (moe_ops.router._weights): UNNORM, the renormalize=False rule
        RULES: tl.constexpr = METHOD + N_METHODS * UNNORM
        scale_c = tl.full([], scale, COMPUTE)
        pid = tl.program_id(0)
        if CHECK_ROWS:  # loaded first: its latency hides behind the row work (checked last)
            held_rows = tl.load(row_count_ptr)
        kcol = tl.arange(0, K_PAD)[None, :]
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)[:, None] + kcol * 0
        row_ok = rows < n_tokens
        rows64 = rows.to(tl.int64)
        k_ok = kcol < top_k
        out_ok = row_ok & k_ok
        num_experts = n_group * group_size

        # Classify each row from its recorded ids alone (k loads per row); masked cells read -1.
        rec = tl.load(rec_ptr + rows64 * stride_rm + kcol * stride_rk, mask=out_ok, other=-1)
        rec = rec.to(tl.int64)  # int64: a wide id never wraps into range, uint8 never reads as -1
        row_live = tl.min((rec == -1).to(tl.int32), axis=1, keep_dims=True) == 1
        bad = out_ok & ((rec < 0) | (rec >= num_experts))
        out_of_range = row_ok & ~row_live & (tl.max(bad.to(tl.int32), axis=1, keep_dims=True) > 0)
        # an id twice: column j against the columns after it, j taken out of the tile by a reduction
        # (2 * (K_PAD - 1) row reductions, each within the threads that hold a row)
        dup = tl.zeros([BLOCK_M, K_PAD], dtype=tl.int32)
        for j in tl.static_range(K_PAD - 1):
            rec_j = tl.sum(tl.where(kcol == j, rec, 0), axis=1, keep_dims=True)
            same = out_ok & (kcol > j) & (rec == rec_j)
            dup = tl.maximum(dup, tl.max(same.to(tl.int32), axis=1, keep_dims=True))
        repeated = row_ok & ~row_live & (dup > 0)
        faulty = out_of_range | repeated
        need_live = row_ok & (row_live | faulty)

        # Recorded rows: weights from the k gathered logits (DEFAULT: and its row's denominator).
        row_off = rows64 * stride_lm
        w_dst = weights_ptr + rows64 * stride_wm + kcol * stride_wk
        ids_dst = ids_ptr + rows64 * stride_im + kcol * stride_ik
        keep = row_ok & ~need_live
        keep_ok = keep & k_ok  # only in-range, distinct ids are ever addresses
        ids = rec.to(tl.int32)
        w = _gathered_weights(
            logits_ptr, row_off, ids, keep_ok, keep, group_size, n_group, scale_c, stride_le,
            RULES, NG_PAD, G_PAD, COMPUTE,
        )  # fmt: skip
        # a row with a non-finite weight: zeroed, counted once below (with the live rows')
        w, zeroed = finite_rows(w, keep_ok, True)
        n_zeroed = tl.sum(zeroed.to(tl.int32))
        tl.store(w_dst, w, mask=keep_ok)
        tl.store(ids_dst, ids, mask=keep_ok)

        # Live rows, only where a block holds one: the full row, the keys and the top-k rounds are
        # skipped for fully recorded blocks (the common case of a replay).
        if tl.max(need_live.to(tl.int32)) > 0:
            if HASH:
                # a hash layer: the table's ids (moe_ops.router._hash), in the recorded tile's
                # layout; a bad row gets ids -1 and weights 0 and is counted once
                live_ids, hash_bad, _ = hash_ids(
                    table_ptr, tok_ptr, rows64, need_live, kcol, k_ok, vocab, num_experts,
                    stride_t, stride_hv, stride_hk,
                )  # fmt: skip
                live_ok = need_live & k_ok & ~hash_bad
                lw = _gathered_weights(
                    logits_ptr, row_off, live_ids, live_ok, need_live & ~hash_bad, group_size, n_group,
                    scale_c, stride_le, RULES, NG_PAD, G_PAD, COMPUTE,
                )  # fmt: skip
                lw, live_zeroed = finite_rows(tl.where(live_ok, lw, 0.0), live_ok, True)
                n_zeroed += tl.sum(live_zeroed.to(tl.int32))
                tl.store(w_dst, lw, mask=need_live & k_ok)
                tl.store(ids_dst, live_ids, mask=need_live & k_ok)
                if tl.max(hash_bad.to(tl.int32)) > 0:
                    # rows a faulty record already counts are not counted again
                    n_hash = tl.sum(tl.where((kcol == 0) & ~faulty, hash_bad, False).to(tl.int32))
                    tl.atomic_add(errors_ptr, n_hash)
                    tl.atomic_or(errors_ptr + 1, _HASH)
            else:
                live_rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
                live_ids = _live_topk(
                    logits_ptr, bias_ptr, live_rows.to(tl.int64) * stride_lm, live_rows < n_tokens,
                    group_size, n_group, topk_group, stride_le,
                    METHOD, HAS_BIAS, GROUPED, BLOCK_M, NG_PAD, G_PAD, K_PAD, COMPUTE, GROUP_TOP,
                )  # fmt: skip
                live_ok = need_live & k_ok
                lw = _gathered_weights(
                    logits_ptr, row_off, live_ids, live_ok, need_live, group_size, n_group, scale_c,
                    stride_le, RULES, NG_PAD, G_PAD, COMPUTE,
                )  # fmt: skip
                lw, live_zeroed = finite_rows(lw, live_ok, True)
                n_zeroed += tl.sum(live_zeroed.to(tl.int32))
                tl.store(w_dst, lw, mask=live_ok)
                tl.store(ids_dst, live_ids, mask=live_ok)
        # one atomic per program that zeroed a row (recorded or live)
        record_zeroed(nonfinite_ptr, n_zeroed)
        # Last: a branch with atomics, one pair per program that saw a faulty row. The per-row values
        # are repeated over the K_PAD columns: column 0 counts the rows.
        n_faulty = tl.sum(tl.where(kcol == 0, faulty, False).to(tl.int32))
        if n_faulty > 0:
            flags = tl.where(tl.max(out_of_range.to(tl.int32)) > 0, _OUT_OF_RANGE, 0)
            flags |= tl.where(tl.max(repeated.to(tl.int32)) > 0, _REPEATED, 0)
            tl.atomic_add(errors_ptr, n_faulty)
            tl.atomic_or(errors_ptr + 1, flags)
        # The replayer's row count against this call's: one faulty call when they differ (program 0
        # only; the launch has at least one program when checking). Fused here rather than its own
        # op: a separate check cost 5.4 us per call in the 61-call graph (5 small torch kernels)
        # against the forward's 1.7 us at n = 1 (H200, bench_replay's replay-slot row).
        if CHECK_ROWS:  # noqa: SIM102 - a constexpr branch: Triton drops it when False; `and` would not
            if (pid == 0) & (held_rows != n_tokens):
                tl.atomic_add(errors_ptr, 1)
                tl.atomic_or(errors_ptr + 1, _ROW_COUNT)

    @triton.jit
    def _backward_column(
        grad_w_ptr,
        logits_ptr,
        weights_ptr,
        ids_ptr,
        rows64,
        row_ok,
        i,
        top_k,
        stride_gm,
        stride_gk,
        stride_lm,
        stride_le,
        stride_wm,
        stride_wk,
        stride_im,
        stride_ik,
        scale,
        inv_scale,
        METHOD: tl.constexpr,
        COMPUTE: tl.constexpr,
    ):
        """(id, g, w, s, ds) of column ``i`` of ``BLOCK_M`` rows, each (BLOCK_M,): the expert id (-1
        on masked rows and past ``top_k``), the incoming gradient and weight in ``COMPUTE`` (the
        weights' dtype; 0 where masked) as the gradient rule reads them (a rule that does not hold
        routed_scaling_factor: ``scale * g`` and the unscaled ``w``, ``unscaled_gradient_inputs``)
        and, for the sigmoid methods, ``s = sigmoid(x[id])`` (the weight itself where ``w = s``);
        for SQRTSOFTPLUS ``s = sqrt(softplus(x[id]))`` and ``ds`` its derivative
        (``gradient_sigmoid``)."""
        # (i < top_k as a tensor: the interpreter cannot broadcast a scalar bool into a mask)
        ok = row_ok & (tl.zeros_like(rows64) + i < top_k)
        id_i = tl.load(ids_ptr + rows64 * stride_im + i * stride_ik, mask=ok, other=-1)
        ok = ok & (id_i >= 0)  # a bad hash row's -1: never an address, weighed 0
        g_i = tl.load(grad_w_ptr + rows64 * stride_gm + i * stride_gk, mask=ok, other=0.0).to(COMPUTE)
        w_i = tl.load(weights_ptr + rows64 * stride_wm + i * stride_wk, mask=ok, other=0.0)
        g_i, w_i = unscaled_gradient_inputs(g_i, w_i, scale, inv_scale, METHOD)
        s_i, ds_i = gradient_sigmoid(logits_ptr, rows64, id_i, ok, w_i, stride_lm, stride_le, METHOD)
        return id_i, g_i, w_i, s_i, ds_i

    # Like the forward: nothing that changes per step or per layer is a specialisation key (the token
    # count and the row strides of the incoming gradient, which autograd may hand over expanded, and
    # of the saved tensors). num_experts and top_k are fixed per model and stay keys: with E a
    # multiple of 16 the store mask is constant over 16 columns and the row is stored in 16-byte
    # vectors (as runtime ints they gave one 2-byte store per element, 16 per thread at E = 256).
    @triton.jit(
        do_not_specialize=["n_tokens", "stride_gm", "stride_gk", "stride_lm", "stride_wm", "stride_im"]
    )
    def _replay_backward_kernel(
        grad_w_ptr,
        logits_ptr,
        weights_ptr,
        ids_ptr,
        grad_ptr,
        n_tokens,
        num_experts,
        top_k,
        scale: tl.float64,  # passed as a double, as in the forward
        stride_gm,
        stride_gk,
        stride_lm,
        stride_le,
        stride_wm,
        stride_wk,
        stride_im,
        stride_ik,
        stride_om,
        stride_oe,
        METHOD: tl.constexpr,
        UNNORM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        E_PAD: tl.constexpr,
        K_PAD: tl.constexpr,
    ):
        # Every per-row value lives in the slice layout of the (BLOCK_M, E_PAD) output tile: the k
        # columns are loaded one by one as (BLOCK_M,) vectors (each thread reads its rows' values; the
        # threads of a row share the cache line), so the kernel has no layout conversion and no shared
        # memory. Gathering the k values out of a (BLOCK_M, K_PAD) tile instead cost one shared-memory
        # round trip and barrier per column (8 converts at DeepSeek-V3's shape, in the TTGIR).
        # the compute dtype is the forward weights': float32, or float64 for float64 logits
        COMPUTE: tl.constexpr = weights_ptr.dtype.element_ty
        # the gradient rules' column (moe_ops.router._weights): UNNORM, the renormalize=False rule
        RULES: tl.constexpr = METHOD + N_METHODS * UNNORM
        scale_c = tl.full([], scale, COMPUTE)
        # 1 / scale, once per program (1 for a scale of 0, whose weights and gradients are 0)
        one = tl.full([], 1.0, COMPUTE)
        inv_scale = one / tl.where(scale_c == 0, one, scale_c)
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_tokens
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, E_PAD)
        ok2 = row_ok[:, None] & (cols[None, :] < num_experts)

        # Pass 1: the row sums, dot = sum(g * w) and (sigmoid methods) total = sum(s).
        dot = tl.zeros([BLOCK_M], dtype=COMPUTE)
        total = tl.zeros([BLOCK_M], dtype=COMPUTE)
        # rows with an expert (a bad hash row has none: its gradient is 0, as the twin's)
        has_id = tl.zeros([BLOCK_M], dtype=tl.int32)
        # what says which rows the forward zeroed (non-finite weights), from the saved tensors
        evidence = tl.zeros([BLOCK_M], dtype=tl.int32)
        for i in tl.static_range(K_PAD):
            id_i, g_i, w_i, s_i, _ = _backward_column(
                grad_w_ptr, logits_ptr, weights_ptr, ids_ptr, rows64, row_ok, i, top_k,
                stride_gm, stride_gk, stride_lm, stride_le, stride_wm, stride_wk, stride_im, stride_ik,
                scale_c, inv_scale, RULES, COMPUTE,
            )  # fmt: skip
            dot += g_i * w_i
            total += s_i
            has_id = tl.maximum(has_id, (id_i >= 0).to(tl.int32))
            evidence += zeroed_evidence(logits_ptr, rows64, id_i, w_i, stride_lm, stride_le, RULES)

        # DEFAULT's dense part (its full softmax couples every expert), dot and the denominator
        dense, dot, denom = gradient_rows(
            logits_ptr, rows64, cols, ok2, row_ok, dot, total, stride_lm, stride_le,
            RULES, BLOCK_M, E_PAD, COMPUTE,
        )  # fmt: skip

        # Pass 2: each column's value added where its expert sits (ids are distinct: no collisions;
        # -1 past top_k and on masked rows hits nothing), then one store of the whole row (a zero
        # store and a scatter store to the same addresses would race between threads). The loads
        # repeat pass 1's (L1 hits) rather than keep 4 * K_PAD values per row live in registers.
        for i in tl.static_range(K_PAD):
            id_i, g_i, w_i, s_i, ds_i = _backward_column(
                grad_w_ptr, logits_ptr, weights_ptr, ids_ptr, rows64, row_ok, i, top_k,
                stride_gm, stride_gk, stride_lm, stride_le, stride_wm, stride_wk, stride_im, stride_ik,
                scale_c, inv_scale, RULES, COMPUTE,
            )  # fmt: skip
            gs = gradient_column(g_i, w_i, s_i, ds_i, dot, denom, scale_c, RULES)
            dense += tl.where(cols[None, :] == id_i[:, None], gs[:, None], 0.0)
        # rows the forward zeroed (non-finite weights, the constant 0): gradient 0 (NaN * 0 would
        # otherwise reach the row), known from the saved weights (the LOGIT rule: the chosen logits)
        # rather than by evaluating the forward's rule again (3 us more at DeepSeek-V3's 4096 rows)
        zeroed = zeroed_by_forward(evidence, has_id > 0, RULES)
        dense = tl.where((has_id[:, None] > 0) & ~zeroed[:, None], dense, 0.0)
        dst = grad_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_oe
        tl.store(dst, dense.to(grad_ptr.dtype.element_ty), mask=ok2)


def replay_rows_triton(
    router_logits: torch.Tensor,
    recorded_ids: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    errors: torch.Tensor,
    nonfinite: torch.Tensor | None,
    row_count: torch.Tensor | None,
    bias: torch.Tensor | None,
    hash_table: torch.Tensor | None,
    token_ids: torch.Tensor | None,
    method: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    unnormalized: bool,
    group_top: int,
    *,
    block_m: int | None = None,
    num_warps: int | None = None,
    wrap=identity,
) -> None:
    """Launches the forward kernel (arguments as :func:`replay_rows_torch`, the op's, in its order;
    ``weights`` float32, or float64 for float64 logits: the kernel computes in the weights' dtype).

    block_m, num_warps: override the launch configuration (tests and tuning); the default is
    :func:`forward_launch_config`. A block that needs live routing holds a (block_m, NG_PAD, G_PAD)
    register tile of logits, as the router does.
    wrap: applied to the ``@triton.jit`` kernel before the launch (``torch.library.wrap_triton``
        when torch.compile traces the op; see :mod:`moe_ops._runtime.library`)

    One launch, no host reads, no allocation: CUDA-graph capturable.
    """
    n_tokens, num_experts = router_logits.shape
    top_k = recorded_ids.shape[1]
    ng_pad, g_pad = tile_shape(num_experts, n_group)
    # n_tokens may be a SymInt (traced with dynamic shapes): the tile only tunes speed
    default_m, default_warps = forward_launch_config(size_hint(n_tokens), ng_pad, g_pad)
    block_m = block_m or default_m
    num_warps = num_warps or default_warps
    programs = triton.cdiv(n_tokens, block_m)
    if row_count is not None:
        programs = torch.sym_max(programs, 1)  # a call of 0 rows still checks the count
    elif programs == 0:
        return
    # never read (HAS_BIAS / CHECK_ROWS off): eagerly any tensor does; traced, each pointer gets a
    # tensor of its own, because the functional kernel node clones every argument it may write and
    # copies the clones back (an alias of ``errors`` would copy an unwritten clone over it)
    traced = wrap is not identity
    bias_arg = bias if bias is not None else (router_logits.new_empty(0) if traced else router_logits)
    rows_arg = row_count if row_count is not None else (errors.new_empty(0) if traced else errors)
    hashed = hash_table is not None
    if nonfinite is None:
        nonfinite = nonfinite_counter(router_logits.device)
    table_arg = hash_table if hashed else (recorded_ids.new_empty(0) if traced else recorded_ids)
    tok_arg = token_ids if hashed else (recorded_ids.new_empty(0) if traced else recorded_ids)
    args = (
        router_logits,
        recorded_ids,
        bias_arg,
        weights,
        ids,
        errors,
        nonfinite,
        rows_arg,
        table_arg,
        tok_arg,
        n_tokens,
        num_experts // n_group,
        n_group,
        top_k,
        topk_group,
        float(routed_scaling_factor),
        router_logits.stride(0),
        router_logits.stride(1),
        recorded_ids.stride(0),
        recorded_ids.stride(1),
        weights.stride(0),
        weights.stride(1),
        ids.stride(0),
        ids.stride(1),
        hash_table.shape[0] if hashed else 0,
        hash_table.stride(0) if hashed else 0,
        hash_table.stride(1) if hashed else 0,
        token_ids.stride(0) if hashed else 0,
    )
    constexprs = dict(
        METHOD=int(method),
        UNNORM=bool(unnormalized),
        HAS_BIAS=bias is not None,
        GROUPED=n_group > 1,
        BLOCK_M=block_m,
        NG_PAD=ng_pad,
        G_PAD=g_pad,
        K_PAD=next_power_of_2(top_k),
        CHECK_ROWS=row_count is not None,
        HASH=hashed,
        # one variant without groups whatever the rule (unread there)
        GROUP_TOP=int(group_top) if n_group > 1 else 2,
    )
    launch = wrap(_replay_kernel)[(programs,)]
    if errors.device.type == "cpu":
        # interpreted Triton updates the fault counters in Python: the CPU counters' lock makes the
        # launch atomic with respect to a check's read-and-subtract (moe_ops._runtime.faults); on
        # CUDA the kernel's atomics need no lock
        with cpu_counter_lock(errors.device):
            launch(*args, **constexprs, num_warps=num_warps)
    else:
        launch(*args, **constexprs, num_warps=num_warps)


def replay_backward_triton(
    grad_weights: torch.Tensor,
    router_logits: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    grad_logits: torch.Tensor,
    method: int,
    routed_scaling_factor: float,
    unnormalized: bool,
    *,
    block_m: int | None = None,
    num_warps: int | None = None,
    wrap=identity,
) -> None:
    """Launches the backward kernel (arguments as :func:`replay_backward_torch`; ``weights``
    float32, or float64: the kernel computes in the weights' dtype; ``wrap`` as
    :func:`replay_rows_triton`). One launch, no host reads, no allocation."""
    n_tokens, num_experts = router_logits.shape
    top_k = ids.shape[1]
    e_pad = next_power_of_2(num_experts)
    default_m, default_warps = backward_launch_config(size_hint(n_tokens), e_pad)
    block_m = block_m or default_m
    num_warps = num_warps or default_warps
    programs = triton.cdiv(n_tokens, block_m)
    if programs == 0:
        return
    wrap(_replay_backward_kernel)[(programs,)](
        grad_weights,
        router_logits,
        weights,
        ids,
        grad_logits,
        n_tokens,
        num_experts,
        top_k,
        float(routed_scaling_factor),
        grad_weights.stride(0),
        grad_weights.stride(1),
        router_logits.stride(0),
        router_logits.stride(1),
        weights.stride(0),
        weights.stride(1),
        ids.stride(0),
        ids.stride(1),
        grad_logits.stride(0),
        grad_logits.stride(1),
        METHOD=int(method),
        UNNORM=bool(unnormalized),
        BLOCK_M=block_m,
        E_PAD=e_pad,
        K_PAD=next_power_of_2(top_k),
        num_warps=num_warps,
    )
