"""``moe_ops.route`` and its registered custom ops: ``moe_ops::route_`` (the router),
``moe_ops::route_hash_`` (a hash layer's table), and each with a capture fused in
(``route_capture_``, ``route_hash_capture_``).

Destination-passing, like the capture op: ``route`` resolves its arguments once
(:func:`moe_ops.router.args.resolve_routing`), allocates the two outputs and calls one op that
writes them (and, with a capture target, the replay buffer, its weights buffer and the fault
counter). Each op's schema is its own arguments followed by the routing arguments it reads, both
generated (:class:`~moe_ops.router.args.OpSignature`; the capture's from
:class:`~moe_ops.capture.spec.CaptureSpec`), and ``route`` passes them by name. Each op declares what
it mutates and has a fake, so ``torch.compile(fullgraph=True)`` traces ``route`` without a graph
break (inductor launches the Triton kernels itself) and CUDA graphs capture it after one warm-up
call (which compiles the Triton kernel and allocates the fault counters).
"""

from __future__ import annotations

import torch

from .._runtime.faults import counters_for
from .._runtime.library import destination_op, eager_caller, identity, reference_op
from .._runtime.triton import HAS_TRITON
from ..capture.op import capture_into
from ..capture.spec import Arg
from ..capture.target import CaptureTarget
from ..layout import BatchLayout
from .args import (
    BACKENDS,
    OpSignature,
    RoutingArgs,
    check_capture_shared_experts,
    resolve_routing,
)
from .hash_kernels import route_hash_rows_torch, route_hash_rows_triton
from .kernels import route_rows_torch, route_rows_triton
from .methods import GroupScore, RoutingMethod

if HAS_TRITON:
    from .hash_kernels import _route_hash_kernel
    from .kernels import _route_kernel

__all__ = ["BACKENDS", "ROUTE_CAPTURE", "ROUTE_HASH", "ROUTE_HASH_CAPTURE", "ROUTE_OP", "route"]

_OUT = (Arg("weights", "Tensor", True), Arg("ids", "Tensor", True), Arg("nonfinite", "Tensor", True))
# route_: the logits, the outputs and the non-finite rows counter, then the routing arguments the
# router kernel reads (the table's are route_hash_'s)
ROUTE_OP = OpSignature(
    (Arg("router_logits", "Tensor"), *_OUT),
    routing=(
        "bias",
        "method",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "unnormalized",
        "group_top",
        "num_fused_shared_experts",
    ),
)
# route_hash_: a hash layer's ids come from its table; the logits only weigh them (no bias, no groups,
# no shared columns), and a row the table cannot route counts in the hash fault counter
ROUTE_HASH = OpSignature(
    (Arg("router_logits", "Tensor"), *_OUT, Arg("faults", "Tensor", True)),
    routing=("hash_table", "token_ids", "method", "routed_scaling_factor", "unnormalized"),
)
# each with a CaptureSpec's arguments fused in (moe_ops.capture.spec: route's tensors, the spec's
# tensors, route's scalars, the spec's scalars)
ROUTE_CAPTURE = OpSignature(ROUTE_OP.own, [a.name for a in ROUTE_OP.routing], capture=True)
ROUTE_HASH_CAPTURE = OpSignature(ROUTE_HASH.own, [a.name for a in ROUTE_HASH.routing], capture=True)


# ---------------------------------------------------------------------------------------------------
# The ops' kernels: each takes the op's arguments by name (checked against the signature at import)
# ---------------------------------------------------------------------------------------------------


def _route(
    router_logits,
    weights,
    ids,
    nonfinite,
    bias,
    method,
    n_group,
    topk_group,
    routed_scaling_factor,
    unnormalized,
    group_top,
    num_fused_shared_experts,
    *,
    capture=None,
    wrap=identity,
) -> None:
    """Writes every token's routing into ``weights`` and ``ids`` (kernels.py), records this rank's
    rows into ``capture`` (a CaptureSpec) when given, and adds the rows whose weights were zeroed
    (not all finite) to ``nonfinite`` (``moe_ops.router.nonfinite``)."""
    route_rows_triton(
        router_logits,
        bias,
        weights,
        ids,
        method,
        n_group,
        topk_group,
        routed_scaling_factor,
        capture,
        unnormalized=unnormalized,
        group_top=group_top,
        num_fused_shared_experts=num_fused_shared_experts,
        nonfinite=nonfinite,
        wrap=wrap,
    )


def _route_twin(
    router_logits,
    weights,
    ids,
    nonfinite,
    bias,
    method,
    n_group,
    topk_group,
    routed_scaling_factor,
    unnormalized,
    group_top,
    num_fused_shared_experts,
    *,
    capture=None,
) -> None:
    """PyTorch twin of :func:`_route`."""
    route_rows_torch(
        router_logits,
        bias,
        weights,
        ids,
        method,
        n_group,
        topk_group,
        routed_scaling_factor,
        capture,
        unnormalized=unnormalized,
        group_top=group_top,
        num_fused_shared_experts=num_fused_shared_experts,
        nonfinite=nonfinite,
    )


def _route_hash(
    router_logits,
    weights,
    ids,
    nonfinite,
    faults,
    hash_table,
    token_ids,
    method,
    routed_scaling_factor,
    unnormalized,
    *,
    capture=None,
    wrap=identity,
) -> None:
    """Writes every row's hash routing (hash_kernels.py): ids from the table, weights by the method's
    rule at them; a row the table cannot route gets ids -1 and weights 0 and counts in ``faults``."""
    route_hash_rows_triton(
        router_logits,
        hash_table,
        token_ids,
        weights,
        ids,
        faults,
        method,
        routed_scaling_factor,
        capture,
        unnormalized=unnormalized,
        nonfinite=nonfinite,
        wrap=wrap,
    )


def _route_hash_twin(
    router_logits,
    weights,
    ids,
    nonfinite,
    faults,
    hash_table,
    token_ids,
    method,
    routed_scaling_factor,
    unnormalized,
    *,
    capture=None,
) -> None:
    """PyTorch twin of :func:`_route_hash`."""
    route_hash_rows_torch(
        router_logits,
        hash_table,
        token_ids,
        weights,
        ids,
        faults,
        method,
        routed_scaling_factor,
        capture,
        unnormalized=unnormalized,
        nonfinite=nonfinite,
    )


def _fused(signature: OpSignature, kernel, *, traced: bool):
    """The kernel of a capturing op: its arguments split into the host's and the spec."""
    if traced:

        def run(*args, wrap=identity) -> None:
            host, spec = signature.split(args)
            kernel(*host, capture=spec, wrap=wrap)

    else:

        def run(*args) -> None:
            host, spec = signature.split(args)
            kernel(*host, capture=spec)

    run.__name__ = f"{kernel.__name__}_capture"
    return run


def _register(name: str, signature: OpSignature, launcher, twin, kernels: tuple):
    """``moe_ops::<name>`` (the launcher on CUDA and interpreted CPU, traced by torch.compile into
    its Triton kernels; the twin on the CPU) and ``moe_ops::<name>reference_`` (the twin
    everywhere: backend="torch"); see moe_ops._runtime.library."""
    schema, mutates = signature.schema(), signature.mutates
    triton = dict(cuda=launcher, interpreted=launcher, traceable=launcher, kernels=kernels)
    op = destination_op(name, mutates=mutates, cpu=twin, schema=schema, **(triton if HAS_TRITON else {}))
    reference = reference_op(name, twin, mutates=mutates, schema=schema)
    return op, reference


for _sig, _kernel, _twin in ((ROUTE_OP, _route, _route_twin), (ROUTE_HASH, _route_hash, _route_hash_twin)):
    _sig.check_kernel(_kernel)
    _sig.check_kernel(_twin)

_KERNELS = (_route_kernel,) if HAS_TRITON else ()
_HASH_KERNELS = (_route_hash_kernel,) if HAS_TRITON else ()
route_op, route_reference_op = _register("route_", ROUTE_OP, _route, _route_twin, _KERNELS)
route_capture_op, route_capture_reference_op = _register(
    "route_capture_",
    ROUTE_CAPTURE,
    _fused(ROUTE_CAPTURE, _route, traced=True),
    _fused(ROUTE_CAPTURE, _route_twin, traced=False),
    _KERNELS,
)
route_hash_op, route_hash_reference_op = _register(
    "route_hash_", ROUTE_HASH, _route_hash, _route_hash_twin, _HASH_KERNELS
)
route_hash_capture_op, route_hash_capture_reference_op = _register(
    "route_hash_capture_",
    ROUTE_HASH_CAPTURE,
    _fused(ROUTE_HASH_CAPTURE, _route_hash, traced=True),
    _fused(ROUTE_HASH_CAPTURE, _route_hash_twin, traced=False),
    _HASH_KERNELS,
)
# eager CUDA calls skip the dispatcher where it would do nothing else (moe_ops._runtime.library):
# the caller's tensors are checked; route made the outputs and took the counters on their device,
# and the target validated the count tensors (int32: no gradient) on the buffer's device
_CAPTURED = ("buffer", "weights_buffer")
_CALLS = {
    # (hashed, captured) -> (the op where the kernel runs, the reference op)
    (False, False): (eager_caller("route_", ROUTE_OP.positions("router_logits", "bias")), route_reference_op),
    (False, True): (
        eager_caller("route_capture_", ROUTE_CAPTURE.positions("router_logits", "bias", *_CAPTURED)),
        route_capture_reference_op,
    ),
    (True, False): (
        eager_caller("route_hash_", ROUTE_HASH.positions("router_logits", "hash_table", "token_ids")),
        route_hash_reference_op,
    ),
    (True, True): (
        eager_caller(
            "route_hash_capture_",
            ROUTE_HASH_CAPTURE.positions("router_logits", "hash_table", "token_ids", *_CAPTURED),
        ),
        route_hash_capture_reference_op,
    ),
}


def _route_flashinfer(router_logits: torch.Tensor, args: RoutingArgs, capture, n_group, topk_group):
    try:
        from ..flashinfer.routing import route_flashinfer
    except ImportError as exc:
        raise ValueError(
            f"backend='flashinfer' is not available: importing moe_ops.flashinfer.routing failed ({exc})"
        ) from exc
    return route_flashinfer(
        router_logits,
        args.top_k,
        args.method,
        bias=args.bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=args.routed_scaling_factor,
        capture=capture,
    )


def route(
    router_logits: torch.Tensor,
    top_k: int,
    method: RoutingMethod | int = RoutingMethod.RENORMALIZE,
    *,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    renormalize: bool | None = None,
    capture: CaptureTarget | None = None,
    backend: str = "auto",
    group_score: GroupScore | str | int | None = None,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    num_fused_shared_experts: int = 0,
    capture_shared_experts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes every token to ``top_k`` experts and, with ``capture``, records the ids for replay.

    Args:
        router_logits: (n, num_experts) float32/bf16/fp16 - router outputs; bf16/fp16 are upcast
            to float32 inside the kernel. n may be 0. float64 is refused (the kernel and the
            registered ops compute in float32); ``replay_routing`` takes float64 logits.
        top_k: experts per token, in [1, num_experts] (1 for LLAMA4).
        method: a :class:`RoutingMethod` (semantics and weight formulas in
            :mod:`moe_ops.router.methods`).
        bias: (num_experts,) float - DEEPSEEK_V3/MINIMAX2 selection bias (None: no bias).
        n_group, topk_group: expert groups (DEEPSEEK_V3, DEEPSEEK_V2, SOFTMAX_BIAS);
            ``n_group`` None or <= 1 means no grouping.
        routed_scaling_factor: multiplies every method's weights (None: 1.0; after the rule,
            inside DEEPSEEK_V3's/MINIMAX2's/SQRTSOFTPLUS's: docs/routing.md); finite in float32.
        renormalize: None keeps the method's own rule; False on DEEPSEEK_V3/MINIMAX2 weights the
            chosen experts ``s * routed_scaling_factor``, without the division by their sum
            (vLLM's/SGLang's ``renormalize=False``, transformers' ``norm_topk_prob=False``); False
            on SOFTMAX_BIAS weights ``softmax(x)[sel]``; True on DEEPSEEK_V2 weights
            ``p[sel] / sum p[sel]`` (``norm_topk_prob=True``); the method's own value is accepted
            and changes nothing; any other value raises ValueError naming the method and the
            reason (a rule another method has, or no rule at all).
        capture: a :class:`CaptureTarget`: write the ids into ``capture.buffer[:, layer_id]`` as
            ``capture_routing`` would. LOCAL, GATHERED and SHARDED are recorded by the router kernel
            itself; SEQUENCE_PARALLEL routes, then calls ``capture_routing`` (it needs its TP
            all-gather first). A target with a ``weights_buffer`` records the returned weights
            there too (the same rows, cast to its dtype: from the kernel's registers, or the twin's
            output).
        group_score: a group's score (:class:`GroupScore`, its value or its name; methods with
            groups): MAX, TOP2_SUM or TOPK_SHARE_SUM (Megatron's). None: the method's own
            (DEEPSEEK_V3 and SOFTMAX_BIAS TOP2_SUM, DEEPSEEK_V2 MAX). A rule that cannot apply
            raises ValueError naming the reason (a method without groups; a sum on DEEPSEEK_V2,
            which chooses on the logits; TOPK_SHARE_SUM summing none or more than a group holds).
            ``backend="flashinfer"`` takes TOP2_SUM only.
        backend: "auto" (Triton on CUDA, the PyTorch reference on CPU or for rows wider than the
            kernel's tile; never FlashInfer, see docs/routing.md; imports nothing of
            ``moe_ops.flashinfer``), "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the
            reference), "flashinfer" (``moe_ops.flashinfer.routing.route_flashinfer``; its column
            order is the kernel's).
        hash_table: (vocab, top_k) integer on the logits' device, with ``token_ids`` - hash
            routing (DeepSeek-V4's hash layers, docs/routing.md "Hash routing"): the ids are
            ``hash_table[token_ids]``, no selection, and the weights the method's weight rule at
            those ids (its ``routed_scaling_factor`` and ``renormalize`` as usual); ``bias`` and
            groups are refused. A row whose token id is outside ``[0, vocab)`` or whose entries
            are outside ``[0, num_experts)`` gets ids -1 and weights 0 and is counted on the device
            (:func:`moe_ops.router.hash.check_hash_errors`); nothing is read out of bounds.
            Not on backend "flashinfer".
        token_ids: (n,) integer on the logits' device - each row's token id (the model's
            ``input_ids``, flattened); only with ``hash_table``.
        num_fused_shared_experts: s >= 0 - shared experts fused into the routed MoE: ``s`` columns
            appended after the ``top_k`` routed ones, ids ``num_experts + j`` at weight 1.0, not
            scaled by ``routed_scaling_factor`` (vLLM's and FlashInfer's rule; docs/routing.md
            "Fused shared experts"). Not with ``backend="flashinfer"``.
        capture_shared_experts: what ``capture`` records: False (default) the ``top_k`` routed
            columns only, what a trainer replays (the buffer is ``top_k`` wide); True the shared
            columns too (the buffer is ``top_k + s`` wide and its dtype holds
            ``num_experts + s - 1``). True needs ``capture`` and ``s > 0``.

    Returns:
        weights: (n, top_k + s) float32 - routing weights, in the order of ``ids``, always finite: a
            row whose routed weights by the method's formula are not all finite (a NaN or inf
            logit the rule reads) is written as 0 in its routed columns and counted on the device
            for :func:`moe_ops.router.nonfinite.check_nonfinite_rows` (docs/routing.md
            "Non-finite logits"; not with ``backend="flashinfer"``). They carry no
            gradient: ``route`` is the inference router. A training step that must send each token
            through recorded experts while the gate still learns uses :func:`moe_ops.replay_routing`.
        ids: (n, top_k + s) int32 - chosen experts by descending selection score; among equal scores
            the lowest expert index wins (and comes first); then the ``s`` shared ids.

    No host reads, no synchronisation, no allocation beyond the two outputs (the Triton and
    reference paths; SEQUENCE_PARALLEL with tp_size > 1 adds the capture's all-gather output).
    Bad arguments raise before anything is written (ValueError naming the argument; TypeError for
    non-tensors; IndexError for a capture layer out of range).
    """
    args = resolve_routing(
        router_logits,
        top_k,
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
    )
    n_shared = args.num_fused_shared_experts
    keep_shared = check_capture_shared_experts(capture_shared_experts, n_shared, capture is not None)
    device = router_logits.device
    if capture is not None:
        if not isinstance(capture, CaptureTarget):
            raise TypeError(f"capture must be a CaptureTarget or None, got {type(capture).__name__}")
        if capture.buffer.device != device:
            raise ValueError(
                f"router_logits must be on the capture buffer's device {capture.buffer.device}, got {device}"
            )
        capture.check_router_capture()
    if backend == "flashinfer":
        return _route_flashinfer(router_logits, args, capture, n_group, topk_group)

    n_tokens = router_logits.shape[0]
    weights = torch.empty((n_tokens, top_k + n_shared), dtype=torch.float32, device=device)
    ids = torch.empty((n_tokens, top_k + n_shared), dtype=torch.int32, device=device)
    counters = counters_for(router_logits)
    hashed = args.hashed
    own = dict(router_logits=router_logits, weights=weights, ids=ids, nonfinite=counters.nonfinite)
    if hashed:
        signature, fused = ROUTE_HASH, ROUTE_HASH_CAPTURE
        own["faults"] = counters.hash
    else:
        signature, fused = ROUTE_OP, ROUTE_CAPTURE
    # the op runs the Triton kernel on CUDA (and on the CPU under the interpreter), the twin on the
    # CPU otherwise; the reference ops run the twin everywhere
    host = signature.values(args, **own)
    if capture is None:
        _CALLS[hashed, False][0 if args.use_triton else 1](*host)
        return weights, ids

    # what is recorded: the routed columns (a view, no copy), or every column with the knob; the
    # kernels read which from the buffer's width, checked here against the knob
    recorded = ids if keep_shared else ids[:, :top_k]
    capture.check_num_experts(args.num_experts + n_shared if keep_shared else args.num_experts)
    capture.check_ids(recorded)
    if capture.layout == BatchLayout.SEQUENCE_PARALLEL:
        _CALLS[hashed, False][0 if args.use_triton else 1](*host)
        capture_into(capture, recorded, weights[:, : recorded.shape[1]] if capture.has_weights else None)
        return weights, ids
    _CALLS[hashed, True][0 if args.use_triton else 1](*fused.join(host, capture.spec))
    return weights, ids
