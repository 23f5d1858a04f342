"""``moe_ops.route`` and its registered custom ops ``moe_ops::route_`` and ``moe_ops::route_capture_``.

Destination-passing, like the capture op: ``route`` allocates the two outputs and calls one op that
writes them (and, with a capture target, the replay buffer, its weights buffer and the fault
counter). Each op declares
what it mutates and has a fake implementation, so ``torch.compile(fullgraph=True)`` traces ``route``
without a graph break and CUDA graphs capture it after one warm-up call (which compiles the Triton
kernel and allocates the fault counter).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._runtime.library import destination_op, eager_caller, identity, reference_op
from .._runtime.triton import HAS_TRITON, triton_runs_on
from ..capture.op import capture_into
from ..capture.spec import OpArgs, parse_args
from ..capture.target import CaptureTarget
from ..layout import BatchLayout
from .hash import check_hash_args, route_hashed
from .kernels import TRITON_MAX_TILE, route_rows_torch, route_rows_triton, tile_shape

if HAS_TRITON:
    from .kernels import _route_kernel
from .methods import GroupScore, RouteConfig, RoutingMethod, validate_route_args
from .nonfinite import counter_for
from .policy import auto_runs_triton
from .shared import check_capture_shared_experts, check_num_fused_shared_experts

__all__ = ["BACKENDS", "route"]

BACKENDS = ("auto", "triton", "torch", "flashinfer")


# torch.library infers the schema from these annotations; it needs typing.Optional, not "X | None".
def _route(
    router_logits: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045 - the schema parser needs Optional
    weights: torch.Tensor,
    ids: torch.Tensor,
    nonfinite: torch.Tensor,
    method: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    unnormalized: bool,
    group_top: int,
    num_fused_shared_experts: int = 0,
    *,
    wrap=identity,
) -> None:
    """Writes every token's routing into ``weights`` and ``ids`` (see kernels.py) and adds the rows
    whose weights were zeroed (not all finite) to ``nonfinite`` (``moe_ops.router.nonfinite``)."""
    route_rows_triton(
        router_logits,
        bias,
        weights,
        ids,
        method,
        n_group,
        topk_group,
        routed_scaling_factor,
        unnormalized=unnormalized,
        group_top=group_top,
        num_fused_shared_experts=num_fused_shared_experts,
        nonfinite=nonfinite,
        wrap=wrap,
    )


def _route_twin(
    router_logits: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045 - the schema parser needs Optional
    weights: torch.Tensor,
    ids: torch.Tensor,
    nonfinite: torch.Tensor,
    method: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    unnormalized: bool,
    group_top: int,
    num_fused_shared_experts: int = 0,
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
        unnormalized=unnormalized,
        group_top=group_top,
        num_fused_shared_experts=num_fused_shared_experts,
        nonfinite=nonfinite,
    )


_ROUTE_MUTATES = ("weights", "ids", "nonfinite")
_ROUTE_SCHEMA = torch.library.infer_schema(_route_twin, mutates_args=_ROUTE_MUTATES)
# route_capture_: route_'s arguments with a CaptureSpec's fused in (moe_ops.capture.spec generates
# the list and the schema): route's tensors, the spec's tensors, route's scalars, the spec's
# scalars, then route's defaulted num_fused_shared_experts (last, so older positional calls hold)
ROUTE_CAPTURE = OpArgs.fused(parse_args(_ROUTE_SCHEMA))


def _launcher_args(args) -> tuple[tuple, dict]:
    """route_capture_'s arguments as the launchers take them: (positional, keywords)."""
    route_args, capture = ROUTE_CAPTURE.split(args)
    logits, bias, weights, ids, nonfinite, *scalars, unnormalized, group_top, n_shared = route_args
    knobs = dict(
        nonfinite=nonfinite, unnormalized=unnormalized, group_top=group_top, num_fused_shared_experts=n_shared
    )
    return (logits, bias, weights, ids, *scalars, capture), knobs


def _route_capture(*args, wrap=identity) -> None:
    """Routes and records this rank's ids into ``buffer[:, layer_id]`` in the same launch.

    ``args``: the op's arguments (:data:`ROUTE_CAPTURE`): ``_route``'s and a
    :class:`~moe_ops.capture.spec.CaptureSpec`'s, as in ``moe_ops::capture_routing_``; the rows are
    LOCAL, GATHERED or SHARDED (``route`` handles SEQUENCE_PARALLEL with the capture op). The spec's
    ``expert_map`` is the empty stand-in (``num_logical_experts`` 0): the router's ids are logical,
    and ``route`` refuses a target with a map (the router kernel does not read one).
    """
    positional, knobs = _launcher_args(args)
    route_rows_triton(*positional, wrap=wrap, **knobs)


def _route_capture_twin(*args) -> None:
    """PyTorch twin of :func:`_route_capture`."""
    positional, knobs = _launcher_args(args)
    route_rows_torch(*positional, **knobs)


_CAPTURE_MUTATES = ROUTE_CAPTURE.mutates
_CAPTURE_SCHEMA = ROUTE_CAPTURE.schema()
# CUDA: the Triton router (inductor launches it from its own code under torch.compile); CPU: the
# twin, or the kernel where Triton is interpreted on the CPU. backend="torch" where the kernel would
# run takes the *_reference op (moe_ops._runtime.library says why it is an op).
# the kernel the traced launchers launch (for the compile caches' keys; moe_ops._runtime.library)
_KERNELS = (_route_kernel,) if HAS_TRITON else ()
_TRITON = dict(cuda=_route, interpreted=_route, traceable=_route, kernels=_KERNELS)
route_op = destination_op(
    "route_",
    mutates=_ROUTE_MUTATES,
    cpu=_route_twin,
    schema=_ROUTE_SCHEMA,
    **(_TRITON if HAS_TRITON else {}),
)
route_reference_op = reference_op("route_", _route_twin, mutates=_ROUTE_MUTATES, schema=_ROUTE_SCHEMA)
_TRITON_CAPTURE = dict(
    cuda=_route_capture, interpreted=_route_capture, traceable=_route_capture, kernels=_KERNELS
)
route_capture_op = destination_op(
    "route_capture_",
    mutates=_CAPTURE_MUTATES,
    cpu=_route_capture_twin,
    schema=_CAPTURE_SCHEMA,
    **(_TRITON_CAPTURE if HAS_TRITON else {}),
)
route_capture_reference_op = reference_op(
    "route_capture_", _route_capture_twin, mutates=_CAPTURE_MUTATES, schema=_CAPTURE_SCHEMA
)
# eager CUDA calls skip the dispatcher where it would do nothing else (moe_ops._runtime.library): the
# logits, the bias and the capture buffer are checked; route made the outputs on their device, the
# target validated the count tensors (int32: no gradient) on the buffer's device
_route_call = eager_caller("route_", checked=(0, 1))
_route_capture_call = eager_caller(
    "route_capture_", checked=ROUTE_CAPTURE.positions("router_logits", "bias", "buffer", "weights_buffer")
)


def choose_triton(backend: str, device: torch.device, cfg: RouteConfig) -> bool:
    """Whether the Triton kernel runs (True) or the PyTorch reference (False); raises for "triton"
    where it cannot run. ``replay_routing`` takes the same rule: its live rows hold the same tile."""
    ng_pad, g_pad = tile_shape(cfg.num_experts, cfg.n_group)
    fits = ng_pad * g_pad <= TRITON_MAX_TILE
    if backend == "torch":
        return False
    if backend == "auto":
        return fits and auto_runs_triton(device)
    if not triton_runs_on(device):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
            f"moe_ops is imported); router_logits are on {device}"
        )
    if not fits:
        raise ValueError(
            f"backend='triton' holds a padded row of at most {TRITON_MAX_TILE} experts; "
            f"num_experts={cfg.num_experts} with n_group={cfg.n_group} pads to {ng_pad * g_pad}. "
            "Use backend='torch' (or 'auto')"
        )
    return True


def _route_flashinfer(
    router_logits, top_k, method, bias, n_group, topk_group, routed_scaling_factor, capture
):
    try:
        from ..flashinfer.routing import route_flashinfer
    except ImportError as exc:
        raise ValueError(
            f"backend='flashinfer' is not available: importing moe_ops.flashinfer.routing failed ({exc})"
        ) from exc
    return route_flashinfer(
        router_logits,
        top_k,
        method,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
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
            inside DEEPSEEK_V3's/MINIMAX2's/SQRTSOFTPLUS's: docs/routing.md).
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
            all-gather first).
        group_score: a group's score (:class:`GroupScore`, its value or its name; methods with
            groups): MAX, TOP2_SUM or TOPK_SHARE_SUM (Megatron's). None: the method's own
            (DEEPSEEK_V3 and SOFTMAX_BIAS TOP2_SUM, DEEPSEEK_V2 MAX). A rule that cannot apply
            raises ValueError naming the reason (a method without groups; a sum on DEEPSEEK_V2,
            which chooses on the logits; TOPK_SHARE_SUM summing none or more than a group holds).
            ``backend="flashinfer"`` takes TOP2_SUM only.
            all-gather first). A target with a ``weights_buffer`` records the returned weights
            there too (the same rows, cast to its dtype: from the kernel's registers, or the twin's
            output).
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
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    cfg = validate_route_args(
        router_logits,
        top_k,
        method,
        bias,
        n_group,
        topk_group,
        routed_scaling_factor,
        renormalize=renormalize,
        group_score=group_score,
    )
    hashed = check_hash_args(router_logits, top_k, hash_table, token_ids, bias, n_group, topk_group)
    n_shared = check_num_fused_shared_experts(num_fused_shared_experts, cfg.num_experts)
    keep_shared = check_capture_shared_experts(capture_shared_experts, n_shared, capture is not None)
    if hashed and n_shared:
        raise ValueError(
            "num_fused_shared_experts > 0 with hash_table: hash routing returns the table's top_k "
            "columns only; append the shared experts after the call"
        )
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
        if hashed:
            raise ValueError(
                "backend='flashinfer' has no hash routing; hash_table runs on 'auto', 'triton' or 'torch'"
            )
        if n_shared:
            raise ValueError(
                "backend='flashinfer' routes the top_k routed experts only; num_fused_shared_experts > 0 "
                "runs on backend 'auto', 'triton' or 'torch'"
            )
        if cfg.unnormalized:
            raise ValueError(
                f"backend='flashinfer' always renormalises {cfg.method.name}; renormalize=False "
                "runs on backend 'auto', 'triton' or 'torch'"
            )
        if cfg.grouped and cfg.group_score != GroupScore.TOP2_SUM:
            raise ValueError(
                f"backend='flashinfer' scores groups by TOP2_SUM only; group_score={cfg.group_score.name} "
                "runs on backend 'auto', 'triton' or 'torch'"
            )
        return _route_flashinfer(
            router_logits, top_k, cfg.method, bias, n_group, topk_group, routed_scaling_factor, capture
        )
    use_triton = choose_triton(backend, device, cfg)
    if hashed:
        return route_hashed(router_logits, hash_table, token_ids, cfg, capture, use_triton)

    n_tokens = router_logits.shape[0]
    weights = torch.empty((n_tokens, top_k + n_shared), dtype=torch.float32, device=device)
    ids = torch.empty((n_tokens, top_k + n_shared), dtype=torch.int32, device=device)
    route_args = (
        int(cfg.method),
        cfg.n_group,
        cfg.topk_group,
        cfg.routed_scaling_factor,
        cfg.unnormalized,
        cfg.group_top,
        n_shared,
    )
    # the op runs the Triton kernel on CUDA (and on the CPU under the interpreter), the twin on the
    # CPU otherwise; the reference ops run the twin everywhere
    route_ = _route_call if use_triton else torch.ops.moe_ops.route_reference_
    outputs = (weights, ids, counter_for(router_logits))
    if capture is None:
        route_(router_logits, bias, *outputs, *route_args)
        return weights, ids

    # what is recorded: the routed columns (a view, no copy), or every column with the knob; the
    # kernels read which from the buffer's width, checked here against the knob
    recorded = ids if keep_shared else ids[:, :top_k]
    capture.check_num_experts(cfg.num_experts + n_shared if keep_shared else cfg.num_experts)
    capture.check_ids(recorded)
    if capture.layout == BatchLayout.SEQUENCE_PARALLEL:
        route_(router_logits, bias, *outputs, *route_args)
        capture_into(capture, recorded, weights[:, : recorded.shape[1]] if capture.has_weights else None)
        return weights, ids
    route_capture = _route_capture_call if use_triton else torch.ops.moe_ops.route_capture_reference_
    route_capture(*ROUTE_CAPTURE.join((router_logits, bias, *outputs, *route_args), capture.spec))
    return weights, ids
