"""``moe_ops.replay_routing`` and its registered ops ``moe_ops::replay_routing_`` and
``moe_ops::replay_routing_backward_``.

Destination-passing, like the router: the forward op writes preallocated ``weights``, ``ids`` and
the device fault counter; the backward op writes a preallocated ``grad_logits``. Both are
registered as every Triton op of the package is (:func:`moe_ops._runtime.library.destination_op`):
the Triton kernel on CUDA, the PyTorch twin on the CPU (the kernel where Triton is interpreted), a
``*_reference_`` op for ``backend="torch"``, traceable (under ``torch.compile`` inductor sees and
launches the Triton kernels themselves, ``wrap_triton``), and an eager CUDA call skips the
dispatcher where it would do nothing else (``eager_caller``).

A ``torch.autograd.Function`` sits on top (QuACK's layering: op, thin allocating wrapper, autograd
function, public function), because ``torch.library.register_autograd`` accepts only functional
schemas and rejects ops that mutate their arguments ("Cannot register autograd formula for
non-functional operator"). Dynamo traces the autograd function, so ``torch.compile(fullgraph=True)``
compiles the forward and the backward without a graph break, and CUDA graphs capture both after one
warm-up call (which compiles the Triton kernels and allocates the fault counter).

Arguments: :func:`replay_routing` checks them with ``route``'s own preamble
(:func:`moe_ops.router.args.resolve_routing`), and the ops' schemas are generated from the
routing arguments they read (:data:`REPLAY_OP`, :data:`REPLAY_BACKWARD_OP`); their kernels are the
launchers and twins of :mod:`moe_ops.replay.kernels`, which take the ops' arguments in that order.

Faults go to the device-wide replay counter, one of the package's fault counters
(:mod:`moe_ops._runtime.faults`: one registry, one CPU lock, read-and-subtract checks;
``moe_ops.check_faults`` reads it with the others).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._runtime.faults import check_counter, counters_for, routing_counters
from .._runtime.library import destination_op, eager_caller, reference_op
from .._runtime.triton import HAS_TRITON
from ..capture.spec import Arg
from ..router.args import (
    REPLAY_BACKENDS,
    REPLAY_LOGIT_DTYPES,
    OpSignature,
    RoutingArgs,
    method_from_value,
    resolve_routing,
)
from ..router.kernels import write_shared_columns
from ..router.methods import METHODS, GroupScore, RoutingMethod
from .kernels import (
    REPLAY_FAULT_HASH,
    REPLAY_FAULT_OUT_OF_RANGE,
    REPLAY_FAULT_REPEATED,
    REPLAY_FAULT_ROW_COUNT,
    replay_backward_torch,
    replay_backward_triton,
    replay_rows_torch,
    replay_rows_triton,
)

if HAS_TRITON:
    from .kernels import _replay_backward_kernel, _replay_kernel

__all__ = [
    "BACKENDS",
    "RECORDED_ID_DTYPES",
    "REPLAY_BACKWARD_OP",
    "REPLAY_OP",
    "ReplayFaultError",
    "check_replay_errors",
    "replay_fault_counter",
    "replay_routing",
]

BACKENDS = REPLAY_BACKENDS
# uint8 is what decode_routing gives for up to 256 experts (it cannot hold the -1 of a live row)
RECORDED_ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------------
# The fault counter: the package's one device-side counter (moe_ops._runtime.faults), two slots
# ---------------------------------------------------------------------------------------------------

# the registry's kind of the device-wide replay counter: (2,) int32 [faulty rows, OR of REPLAY_FAULT_*]
_KIND = "replay"

_FAULT_NAMES = {
    REPLAY_FAULT_OUT_OF_RANGE: "an id outside [0, num_experts) in a row that is not all -1",
    REPLAY_FAULT_REPEATED: "an expert recorded twice in one row",
    REPLAY_FAULT_ROW_COUNT: "a router read a different number of rows than the replayer's batch holds "
    "(counted once per router call)",
    REPLAY_FAULT_HASH: "a hash layer's row with a token id outside hash_table's vocabulary or a table "
    "entry outside [0, num_experts) (ids -1, weights 0)",
}


class ReplayFaultError(RuntimeError):
    """Raised by :func:`check_replay_errors` when recorded rows were bad (and were routed live)."""

    def __init__(self, device: torch.device, rows: int, flags: int):
        self.device, self.rows, self.flags = device, rows, flags
        names = "; ".join(name for bit, name in _FAULT_NAMES.items() if flags & bit) or "no fault bits"
        id_faults = flags & ~(REPLAY_FAULT_ROW_COUNT | REPLAY_FAULT_HASH)
        if flags & REPLAY_FAULT_HASH and not id_faults:
            message = (
                f"{rows} replayed row(s) on {device} were hash rows that the table could not route "
                f"({names}); their ids were written as -1 and their weights as 0."
            )
        elif id_faults or not flags:
            message = (
                f"{rows} replayed row(s) on {device} had bad recorded ids ({names}); those rows were "
                "routed live from the trainer's logits instead of replayed. The recorded routing does "
                "not match this model (num_experts, top_k, layer order) or was corrupted on its way here."
            )
        else:
            message = f"{rows} router call(s) on {device} read the replay buffer wrongly ({names})."
        if flags & REPLAY_FAULT_ROW_COUNT:
            message += (
                " A router whose row count differed from the batch's read the first rows of the "
                "buffer: its tokens were replayed with other tokens' ids. Set a batch with the "
                "forward's token layout (RoutingReplayer.layer_ids says more in eager mode)."
            )
        super().__init__(message)


# Under torch.compile this runs at trace time, as plain Python, and the graph holds the counter as a
# constant (a lock or an allocation traced by dynamo would break the graph).
@torch._dynamo.assume_constant_result
def replay_fault_counter(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The persistent (2,) int32 fault counter of ``device``: [faulty rows, OR of fault bits].

    Allocated on first use, then fixed for the process (its address is safe to bake into CUDA
    graphs), and marked as a static address so that inductor's CUDA-graph trees accept the replay
    op's mutation of it. Thread-safe: concurrent first calls get the same tensor. The count is int32:
    it wraps after 2**31 faulty rows without a check.
    """
    return routing_counters(device).replay


def check_replay_errors(device: torch.device | str | int | None = None, *, raise_error: bool = True) -> int:
    """Reads and resets the fault counter of ``device``; returns the faulty rows counted since the
    last check (0 where the counter was never allocated).

    HOST SYNC: copies 8 bytes from the device, which waits for the work queued before it on the
    current stream. Call it where the trainer already synchronises (e.g. after reading the loss),
    never inside a captured or compiled step. Thread-safe and lossless, as every fault counter of
    the package (:mod:`moe_ops._runtime.faults`): the check SUBTRACTS what it read (an atomic
    ``index_add_`` on CUDA, under the CPU counters' lock on the CPU), so a faulty row counted while
    it runs is reported by the next check. The fault bits are a summary: a bit set again while a
    check reads is reported by that check.

    Args:
        device: the device whose counter to read (default: the current CUDA device, else CPU).
        raise_error: raise :class:`ReplayFaultError` when any row was faulty (after the reset).
    """
    return check_counter(_KIND, device, ReplayFaultError, raise_error)


# ---------------------------------------------------------------------------------------------------
# Registered ops
# ---------------------------------------------------------------------------------------------------

# moe_ops::replay_routing_: the logits and the record, the outputs and the counters, the row count to
# check (or None), then the routing arguments the forward reads (the fused shared columns are
# written beside the op: its outputs are views of the routed columns)
REPLAY_OP = OpSignature(
    (
        Arg("router_logits", "Tensor"),
        Arg("recorded_ids", "Tensor"),
        Arg("weights", "Tensor", True),
        Arg("ids", "Tensor", True),
        Arg("errors", "Tensor", True),
        Arg("nonfinite", "Tensor", True),
        Arg("row_count", "Tensor?"),
    ),
    routing=(
        "bias",
        "hash_table",
        "token_ids",
        "method",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "unnormalized",
        "group_top",
    ),
)
# moe_ops::replay_routing_backward_: the incoming gradient, what the forward saved, the gradient it
# writes, and the weight rule's arguments
REPLAY_BACKWARD_OP = OpSignature(
    (
        Arg("grad_weights", "Tensor"),
        Arg("router_logits", "Tensor"),
        Arg("weights", "Tensor"),
        Arg("ids", "Tensor"),
        Arg("grad_logits", "Tensor", True),
    ),
    routing=("method", "routed_scaling_factor", "unnormalized"),
)
for _kernel in (replay_rows_triton, replay_rows_torch):
    REPLAY_OP.check_kernel(_kernel)
for _kernel in (replay_backward_triton, replay_backward_torch):
    REPLAY_BACKWARD_OP.check_kernel(_kernel)


def _register(name: str, signature: OpSignature, launcher, twin, kernels: tuple) -> None:
    """``moe_ops::<name>``: the Triton launcher on CUDA (inductor launches its kernel from its own
    code under torch.compile) and where Triton is interpreted on the CPU, the twin on the CPU
    otherwise; ``moe_ops::<name>reference_``: the twin everywhere, for backend="torch" where a
    kernel would run (moe_ops._runtime.library says why it is an op)."""
    schema, mutates = signature.schema(), signature.mutates
    triton = dict(cuda=launcher, interpreted=launcher, traceable=launcher, kernels=kernels)
    destination_op(name, mutates=mutates, cpu=twin, schema=schema, **(triton if HAS_TRITON else {}))
    reference_op(name, twin, mutates=mutates, schema=schema)


_register(
    "replay_routing_",
    REPLAY_OP,
    replay_rows_triton,
    replay_rows_torch,
    (_replay_kernel,) if HAS_TRITON else (),
)
_register(
    "replay_routing_backward_",
    REPLAY_BACKWARD_OP,
    replay_backward_triton,
    replay_backward_torch,
    (_replay_backward_kernel,) if HAS_TRITON else (),
)
# eager CUDA calls skip the dispatcher where it would do nothing else (moe_ops._runtime.library).
# Forward: the caller's tensors are checked; the outputs were made on the logits' device and the
# counters are that device's. Backward: the incoming gradient and the logits; weights, ids and
# grad_logits are the forward's and this call's own.
_CALLER_TENSORS = ("router_logits", "recorded_ids", "row_count", "bias", "hash_table", "token_ids")
_forward_call = eager_caller("replay_routing_", REPLAY_OP.positions(*_CALLER_TENSORS))
_backward_call = eager_caller(
    "replay_routing_backward_", REPLAY_BACKWARD_OP.positions("grad_weights", "router_logits")
)
_reference_forward = torch.ops.moe_ops.replay_routing_reference_
_reference_backward = torch.ops.moe_ops.replay_routing_backward_reference_


def _forward(
    router_logits: torch.Tensor, recorded_ids: torch.Tensor, row_count: torch.Tensor | None, args: RoutingArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocates the outputs and runs the forward op. With ``num_fused_shared_experts`` the op
    writes the routed columns (views of the outputs) and :func:`write_shared_columns` the constant
    ones: two elementwise writes, only then."""
    n, k = recorded_ids.shape
    n_shared = args.num_fused_shared_experts
    dtype, device = args.compute_dtype, router_logits.device
    weights = torch.empty((n, k + n_shared), dtype=dtype, device=device)
    ids = torch.empty((n, k + n_shared), dtype=torch.int32, device=device)
    counters = counters_for(router_logits)
    forward_ = _forward_call if args.use_triton else _reference_forward
    forward_(
        *REPLAY_OP.values(
            args,
            router_logits=router_logits,
            recorded_ids=recorded_ids,
            weights=weights[:, :k] if n_shared else weights,
            ids=ids[:, :k] if n_shared else ids,
            errors=counters.replay,
            nonfinite=counters.nonfinite,
            row_count=row_count,
        )
    )
    if n_shared:
        write_shared_columns(weights, ids, router_logits.shape[1], n_shared)
    return weights, ids


class ReplayRoutingFunction(torch.autograd.Function):
    """Autograd over the two ops: gradients reach ``router_logits`` only (the ids are
    non-differentiable and the bias only chooses live rows, a piecewise-constant choice).

    ``apply(router_logits, recorded_ids, row_count, args)`` with ``args`` the call's
    :class:`~moe_ops.router.args.RoutingArgs` (its ``compute_dtype`` is the weights' dtype). The
    fused shared columns are constants: their incoming gradient is dropped (none reaches the
    logits).
    """

    @staticmethod
    def forward(ctx, router_logits, recorded_ids, row_count, args):
        weights, ids = _forward(router_logits, recorded_ids, row_count, args)
        ctx.save_for_backward(router_logits, weights, ids)
        ctx.mark_non_differentiable(ids)
        if not torch.compiler.is_compiling():
            # Eager autograd would fill a zero gradient for the ids: one more kernel per backward.
            # (Dynamo refuses this call; AOT autograd gives integer outputs no gradient anyway.)
            ctx.set_materialize_grads(False)
        # what the backward op reads, under REPLAY_BACKWARD_OP's names (ctx is its routing object)
        ctx.method, ctx.unnormalized = args.method, args.unnormalized
        ctx.routed_scaling_factor, ctx.use_triton = args.routed_scaling_factor, args.use_triton
        ctx.n_routed = recorded_ids.shape[1]
        return weights, ids

    @staticmethod
    @once_differentiable  # first order only: double backward raises instead of a graph-less grad
    def backward(ctx, grad_weights, grad_ids):
        router_logits, weights, ids = ctx.saved_tensors
        if grad_weights is None:  # no gradient reached the weights (grads are not materialised)
            return None, None, None, None
        grad_logits = torch.empty(router_logits.shape, dtype=router_logits.dtype, device=router_logits.device)
        backward_ = _backward_call if ctx.use_triton else _reference_backward
        k = ctx.n_routed
        if weights.shape[1] != k:  # fused shared columns: constant weights, their gradient dropped
            grad_weights, weights, ids = grad_weights[:, :k], weights[:, :k], ids[:, :k]
        backward_(
            *REPLAY_BACKWARD_OP.values(
                ctx,
                grad_weights=grad_weights,
                router_logits=router_logits,
                weights=weights,
                ids=ids,
                grad_logits=grad_logits,
            )
        )
        return grad_logits, None, None, None


def _check_recorded_ids(recorded_ids: torch.Tensor, router_logits: torch.Tensor, method) -> None:
    if not isinstance(recorded_ids, torch.Tensor):
        raise TypeError(f"recorded_ids must be a torch.Tensor, got {type(recorded_ids).__name__}")
    if recorded_ids.dim() != 2:
        raise ValueError(f"recorded_ids must be 2-D (n_tokens, top_k), got shape {tuple(recorded_ids.shape)}")
    if recorded_ids.dtype not in RECORDED_ID_DTYPES:
        raise ValueError(f"recorded_ids must be uint8, int8, int16, int32 or int64, got {recorded_ids.dtype}")
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        return  # validate_route_args names the problem with router_logits
    n, num_experts = router_logits.shape
    if recorded_ids.shape[0] != n:
        raise ValueError(
            f"recorded_ids must have one row per token of router_logits ({n}), "
            f"got {recorded_ids.shape[0]} rows"
        )
    top_k = recorded_ids.shape[1]
    if not 1 <= top_k <= max(num_experts, 1):
        raise ValueError(
            f"recorded_ids must have top_k columns in [1, num_experts={num_experts}], got {top_k}"
        )
    if recorded_ids.device != router_logits.device:
        raise ValueError(
            f"recorded_ids must be on router_logits' device {router_logits.device}, got {recorded_ids.device}"
        )
    method = method_from_value(method)  # before the other routing arguments: this check names it
    spec = METHODS[method]  # a fixed top_k is the method table's (LLAMA4: 1)
    if spec.top_k is not None and top_k != spec.top_k:
        picks = "one expert" if spec.top_k == 1 else f"{spec.top_k} experts"
        columns = "1 column" if spec.top_k == 1 else f"{spec.top_k} columns"
        raise ValueError(
            f"{method.name} routing picks {picks} per token: recorded_ids must have {columns}, got {top_k}"
        )


def _check_row_count(row_count: object, router_logits: torch.Tensor) -> torch.Tensor | None:
    if row_count is None:
        return None
    if not isinstance(row_count, torch.Tensor):
        raise TypeError(f"row_count must be a torch.Tensor or None, got {type(row_count).__name__}")
    if row_count.dtype != torch.int32 or tuple(row_count.shape) != (1,):
        raise ValueError(
            f"row_count must be a (1,) int32 tensor, got {row_count.dtype} {tuple(row_count.shape)}"
        )
    if isinstance(router_logits, torch.Tensor) and row_count.device != router_logits.device:
        raise ValueError(
            f"row_count must be on router_logits' device {router_logits.device}, got {row_count.device}"
        )
    return row_count


def replay_routing(
    router_logits: torch.Tensor,
    recorded_ids: torch.Tensor,
    method: RoutingMethod | int = RoutingMethod.RENORMALIZE,
    *,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    renormalize: bool | None = None,
    backend: str = "auto",
    row_count: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    num_fused_shared_experts: int = 0,
    group_score: GroupScore | str | int | None = None,
    weights: str = "computed",
    recorded_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes every token through the experts the rollout recorded, weighted from the live logits.

    Args:
        router_logits: (n, num_experts) float32/bf16/fp16/float64 - the trainer's router outputs;
            may require grad. bf16/fp16 are upcast to float32 inside the kernels; float64 logits
            are computed in float64 (Megatron's ``moe_router_dtype="fp64"``, ``gradcheck``). n may
            be 0.
        recorded_ids: (n, top_k) uint8/int8/int16/int32/int64 - the rollout's choices, any
            strides (e.g. ``routing[:, layer]``); a row of -1 means "route this token live".
        method: the :class:`RoutingMethod` the model routes with.
        bias: (num_experts,) float32/bf16/fp16/float64 - DEEPSEEK_V3/MINIMAX2 selection bias,
            rounded to the compute dtype: chooses the live rows' experts, never enters a weight.
        n_group, topk_group: expert groups (live rows only); ``n_group`` None or <= 1: none.
        group_score: a group's score (live rows only), as in :func:`moe_ops.route`.
        routed_scaling_factor: multiplies every method's weights (None: 1.0; after the rule,
            inside DEEPSEEK_V3's/MINIMAX2's/SQRTSOFTPLUS's: docs/routing.md).
        renormalize: as in :func:`moe_ops.route`: None keeps the method's rule; False on
            DEEPSEEK_V3/MINIMAX2 weights ``s * routed_scaling_factor`` (no division by the sum),
            and the gradient follows.
        backend: "auto" (Triton on CUDA, the PyTorch twins on CPU or for rows wider than the kernel
            tile), "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the twins).
        row_count: (1,) int32 on the logits' device, or None - the rows the batch ``recorded_ids``
            was read from holds (a :class:`~moe_ops.RoutingReplayer`'s ``row_count``): a call
            whose ``n`` differs counts one fault (``REPLAY_FAULT_ROW_COUNT``) for
            :func:`check_replay_errors`. The check runs inside the forward kernel, so a compiled or
            CUDA-graphed step pays nothing for it (what ``attach_replay`` passes).
        hash_table, token_ids: a hash layer's table and each row's token id, as in
            :func:`moe_ops.route`: the replay of a hash layer is a forced replay (the recorded ids
            are the table's), and a row without a record (or with a faulty one) takes
            ``hash_table[token_ids]``, as ``route`` does; a row the table cannot route gets ids -1
            and weights 0 and is counted (``REPLAY_FAULT_HASH``). Gradients reach the logits
            through the method's weight rule only (the table chooses; nothing to differentiate).
        num_fused_shared_experts: s >= 0 - as in :func:`moe_ops.route`: ``s`` columns appended
            after the routed ones, ids ``num_experts + j`` at weight 1.0 (constants: no gradient
            flows through them). ``recorded_ids`` holds the routed columns only (what capture
            records by default); a shared id in it is outside ``[0, num_experts)``, a fault (below).
        weights: "computed" (default) - the weights are the method's rule of the trainer's logits;
            "recorded" - the rollout's weights, ``recorded_weights``, on every replayed row, with
            the gradient of the computed ones (straight-through, docs/replay.md "Recorded
            weights"): ``recorded + (computed - computed.detach())``, whose value is the record
            exactly and whose derivative w.r.t. the logits is the computed weights'. A row routed
            live (no record, a faulty record: its ids differ from the recorded ones) or whose
            recorded weights are not all finite (a layer not captured: NaN) keeps the computed
            weights.
        recorded_weights: (n, top_k) float16/bfloat16/float32/float64 on the logits' device - the
            rollout's weights beside ``recorded_ids`` (its weights channel); ``weights="recorded"``
            only.

    Returns:
        weights: (n, top_k + s) float32 (float64 for float64 logits) - the method's weight rule
            restricted to ``ids`` (docs/replay.md), from the dense logits; differentiable w.r.t.
            ``router_logits`` (the gradient has ``router_logits``' dtype); then ``s`` columns of 1.0.
        ids: (n, top_k + s) int32 - the recorded ids, column order kept; on a row of -1 (and on a faulty
            row) the live routing of that row, exactly what ``moe_ops.route`` returns for it (for
            float64 logits, which ``route`` does not take: route's rule on the float64 keys); then
            the ``s`` shared ids.

    A row whose weights by the method's formula are not all finite (a NaN or inf logit the rule
    reads) gets weights 0 in its routed columns and gradient 0, and is counted for
    :func:`moe_ops.router.nonfinite.check_nonfinite_rows` (docs/routing.md "Non-finite logits").
    A row with an id outside ``[0, num_experts)`` (other than a whole row of -1) or an expert twice
    is faulty: it is routed live, its bad ids are never used as addresses, and it is counted on the
    device for :func:`check_replay_errors` (the caller's next sync point). No host reads, no
    synchronisation; allocates the two outputs (and, in backward, the logits' gradient). Bad
    arguments raise before anything runs (ValueError naming the argument; TypeError for
    non-tensors).
    """
    _check_recorded_ids(recorded_ids, router_logits, method)
    args = resolve_routing(
        router_logits,
        recorded_ids.shape[1],
        method,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        renormalize=renormalize,
        group_score=group_score,
        hash_table=hash_table,
        token_ids=token_ids,
        num_fused_shared_experts=num_fused_shared_experts,
        backend=backend,
        backends=BACKENDS,
        logit_dtypes=REPLAY_LOGIT_DTYPES,
    )
    row_count = _check_row_count(row_count, router_logits)
    recorded_mode = _check_weights_mode(weights, recorded_weights, recorded_ids, router_logits)
    if torch.is_grad_enabled() and router_logits.requires_grad:
        out, ids = ReplayRoutingFunction.apply(router_logits, recorded_ids, row_count, args)
    else:
        out, ids = _forward(router_logits, recorded_ids, row_count, args)
    if recorded_mode:
        out = _straight_through(out, ids, recorded_ids, recorded_weights)
    return out, ids


_WEIGHTS_MODES = ("computed", "recorded")
_RECORDED_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_weights_mode(
    weights: object, recorded_weights: object, recorded_ids: torch.Tensor, router_logits: torch.Tensor
) -> bool:
    """Whether ``weights="recorded"``; ValueError (TypeError for a non-tensor) naming the argument
    otherwise. Shapes, dtypes and devices only (no host sync)."""
    if not isinstance(weights, str) or weights not in _WEIGHTS_MODES:
        raise ValueError(f"weights must be one of {_WEIGHTS_MODES}, got {weights!r}")
    if weights == "computed":
        if recorded_weights is not None:
            raise ValueError('recorded_weights is only used with weights="recorded"; pass None')
        return False
    if recorded_weights is None:
        raise ValueError('weights="recorded" needs recorded_weights: the rollout\'s (n, top_k) float weights')
    if not isinstance(recorded_weights, torch.Tensor):
        raise TypeError(f"recorded_weights must be a torch.Tensor, got {type(recorded_weights).__name__}")
    if tuple(recorded_weights.shape) != tuple(recorded_ids.shape):
        raise ValueError(
            f"recorded_weights must have recorded_ids' shape {tuple(recorded_ids.shape)}, "
            f"got {tuple(recorded_weights.shape)}"
        )
    if recorded_weights.dtype not in _RECORDED_WEIGHT_DTYPES:
        raise ValueError(
            f"recorded_weights must be float16, bfloat16, float32 or float64, got {recorded_weights.dtype}"
        )
    if recorded_weights.device != router_logits.device:
        raise ValueError(
            f"recorded_weights must be on router_logits' device {router_logits.device}, "
            f"got {recorded_weights.device}"
        )
    return True


def _straight_through(
    out: torch.Tensor, ids: torch.Tensor, recorded_ids: torch.Tensor, recorded_weights: torch.Tensor
) -> torch.Tensor:
    """``weights="recorded"``: on each row replayed from its record (returned ids equal to the
    recorded ones) whose recorded weights are finite, ``recorded + (computed - computed.detach())``
    - the record's value exactly (``c - c`` is 0 for a finite ``c``) and the computed weights'
    derivative; the computed weights elsewhere. The routed columns only (fused shared experts keep
    their constant 1.0). Fixed shapes, no host reads."""
    k = recorded_ids.shape[1]
    computed = out[:, :k]
    rec = recorded_weights.to(computed.dtype)
    replayed = (ids[:, :k].to(torch.int64) == recorded_ids.to(torch.int64)).all(dim=1, keepdim=True)
    use = replayed & torch.isfinite(rec).all(dim=1, keepdim=True)
    routed = torch.where(use, rec + (computed - computed.detach()), computed)
    return routed if out.shape[1] == k else torch.cat([routed, out[:, k:]], dim=1)
