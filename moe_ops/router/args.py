"""The arguments of one routing call, checked once and resolved: :class:`RoutingArgs`.

``route`` and ``replay_routing`` take the same routing arguments - the method, expert groups and
their score, ``routed_scaling_factor``, ``renormalize``, fused shared experts, a hash layer's table
and token ids, the selection bias - and check them the same way: :func:`resolve_routing` is their
one preamble. It checks every argument against the method table (:mod:`moe_ops.router.methods`;
ValueError naming the argument and the expected value, TypeError for a non-tensor; shapes, dtypes
and devices only, no host sync), chooses the backend, and returns a :class:`RoutingArgs`.

What the ops take of it is :data:`ROUTING_ARGS`, generated from the fields marked for the ops (in
field order): every routing op's schema is its own arguments followed by those it reads
(:class:`OpSignature`), its Python kernels name each argument, and the callers pass them by name
(:meth:`OpSignature.values`). A routing argument added to the ops is a field here (marked, with its
check in :func:`resolve_routing`), a name in the ops' ``routing=`` lists, and its use in the
kernels; ``tests/router/test_route_args.py`` checks that the schemas and the kernels agree with this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._runtime.triton import HAS_TRITON, interpreting
from ..capture.spec import Arg, OpArgs
from .methods import BIAS_METHODS, GROUP_METHODS, METHODS, SCORE_KEYS, GroupScore, RoutingMethod, method_names

__all__ = [
    "BACKENDS",
    "FLOAT32_ROUNDS_TO_INF",
    "HASH_ID_DTYPES",
    "LOGIT_DTYPES",
    "REPLAY_BACKENDS",
    "REPLAY_LOGIT_DTYPES",
    "ROUTING_ARGS",
    "TRITON_MAX_TILE",
    "OpSignature",
    "RouteConfig",
    "RoutingArgs",
    "check_capture_shared_experts",
    "check_hash_args",
    "check_num_fused_shared_experts",
    "check_routed_scaling_factor",
    "choose_triton",
    "group_score_from_value",
    "method_from_value",
    "resolve_routing",
    "tile_shape",
    "validate_route_args",
]

# route's backends ("flashinfer": moe_ops.flashinfer.routing, imported only when asked for) and
# replay_routing's
BACKENDS = ("auto", "triton", "torch", "flashinfer")
REPLAY_BACKENDS = ("auto", "triton", "torch")
# what hash_table and token_ids may be (transformers' tid2eid is int64, vLLM's int32)
HASH_ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# The widest padded row (NG_PAD * G_PAD experts) the Triton router and replay's live rows hold in
# registers (4096 logits are 32 per thread with the 4 warps the router's launch_config gives them);
# a wider row takes the PyTorch reference under backend="auto" (docs/routing.md).
TRITON_MAX_TILE = 4096
# backend="auto" runs Triton on CUDA tensors where Triton compiles (never interpreted CUDA: the
# interpreter is for CPU tests); CPU tensors take the PyTorch reference. A process-wide constant:
# Triton decides at import whether it interprets (moe_ops._runtime.triton).
_AUTO_TRITON_ON_CUDA = HAS_TRITON and not interpreting()


def tile_shape(num_experts: int, n_group: int) -> tuple[int, int]:
    """(NG_PAD, G_PAD): the padded (groups, experts per group) register tile of one token, each a
    power of two (``moe_ops._runtime.triton.next_power_of_2``, written out: every routing call
    asks, and its arguments are >= 1)."""
    if n_group > 1:
        return 1 << (n_group - 1).bit_length(), 1 << (num_experts // n_group - 1).bit_length()
    return 1, 1 << (num_experts - 1).bit_length()


# What route (and its kernel, which computes in float32) takes.
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What replay_routing takes: float64 logits are computed in float64 (weights and gradients too).
REPLAY_LOGIT_DTYPES = (*LOGIT_DTYPES, torch.float64)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}


def _dtype_list(dtypes: tuple[torch.dtype, ...]) -> str:
    names = [_DTYPE_NAMES[d] for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def method_from_value(method: RoutingMethod | int) -> RoutingMethod:
    """Returns ``method`` as a :class:`RoutingMethod`, raising ValueError for anything but a
    RoutingMethod or an int (numpy ints included) naming one: never a float, str or bool."""
    if isinstance(method, RoutingMethod):
        return method
    if not isinstance(method, bool) and isinstance(method, (int, np.integer)):
        try:
            return RoutingMethod(int(method))
        except ValueError:
            pass
    names = ", ".join(f"{m.name}={m.value}" for m in RoutingMethod)
    raise ValueError(f"method must be a RoutingMethod ({names}), got {method!r}")


_OP = {"op": True}


@dataclass(frozen=True)
class RoutingArgs:
    """One routing call's arguments, checked and normalised (:func:`resolve_routing`): host values
    and the tensors the ops read, never a device value. The fields marked ``op`` are what the ops
    take (:data:`ROUTING_ARGS`, in field order); the others are what the host needs to allocate the
    outputs and choose the kernel."""

    # the routing method (an op's int)
    method: RoutingMethod = dataclasses.field(metadata=_OP)
    # experts per token, the routed columns: 1 <= top_k <= num_experts (METHODS[method].top_k where
    # the table fixes it)
    top_k: int
    # experts of the router (the logits' columns), >= 1
    num_experts: int
    # expert groups, dividing num_experts; 1: no grouping
    n_group: int = dataclasses.field(metadata=_OP)
    # groups kept per token, 1 <= topk_group <= n_group (== n_group when there is no grouping)
    topk_group: int = dataclasses.field(metadata=_OP)
    # multiplies every method's weights (1.0 when not given: bit-identical to no factor); finite
    # in float32, the kernels' type
    routed_scaling_factor: float = dataclasses.field(metadata=_OP)
    # renormalize opposite to the method's own (renormalize=False on UNNORMALIZED_METHODS,
    # renormalize=True on RENORMALIZED_METHODS): its other weight rule (MethodSpec.rule)
    unnormalized: bool = dataclasses.field(default=False, metadata=_OP)
    # the group score (the method's own where group_score=None); TOP2_SUM for a method without
    # groups (never read)
    group_score: GroupScore = GroupScore.TOP2_SUM
    # how many of a group's best keys its score sums, the kernels' GROUP_TOP:
    # group_score.keys_summed(top_k, topk_group) with groups, 2 without (never read there)
    group_top: int = dataclasses.field(default=2, metadata=_OP)
    # shared experts fused after the routed columns (ids num_experts + j at weight 1.0), >= 0;
    # num_experts + s - 1 fits int32; 0 with a hash table
    num_fused_shared_experts: int = dataclasses.field(default=0, metadata=_OP)
    # (num_experts,) float, on the logits' device, in the logits' dtypes - the selection bias of
    # BIAS_METHODS; None: none (always None with a hash table)
    bias: torch.Tensor | None = dataclasses.field(default=None, metadata=_OP)
    # (vocab >= 1, top_k) integer on the logits' device - a hash layer's table (with token_ids);
    # None: the method chooses
    hash_table: torch.Tensor | None = dataclasses.field(default=None, metadata=_OP)
    # (n,) integer on the logits' device - each row's token id (with hash_table); None: none
    token_ids: torch.Tensor | None = dataclasses.field(default=None, metadata=_OP)
    # float32, or float64 for float64 logits (replay_routing): the dtype the kernels compute in
    compute_dtype: torch.dtype = torch.float32
    # True: the Triton kernel runs (the registered op); False: the PyTorch reference op
    use_triton: bool = False

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    @property
    def group_size(self) -> int:
        return self.num_experts // self.n_group

    @property
    def hashed(self) -> bool:
        """A hash layer: the ids come from ``hash_table[token_ids]``."""
        return self.hash_table is not None


# validate_route_args' result, by its earlier name
RouteConfig = RoutingArgs


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_route_args(
    router_logits: torch.Tensor,
    top_k: int,
    method: RoutingMethod | int,
    bias: torch.Tensor | None,
    n_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float | None,
    *,
    renormalize: bool | None = None,
    logit_dtypes: tuple[torch.dtype, ...] = LOGIT_DTYPES,
    group_score: GroupScore | str | int | None = None,
) -> RoutingArgs:
    """Checks the method's arguments against the method table, without reading device values;
    returns them normalised (a :class:`RoutingArgs` without tensors, shared columns or a backend:
    :func:`resolve_routing` adds those).

    ``logit_dtypes``: the dtypes the caller computes with, for ``router_logits`` and ``bias`` alike
    (``route``: :data:`LOGIT_DTYPES`; ``replay_routing``: :data:`REPLAY_LOGIT_DTYPES`). Raises
    TypeError for non-tensors and ValueError naming the argument and the expected value otherwise.
    Reads shapes, dtypes and devices only (no host sync).
    """
    return RoutingArgs(
        *_checked_config(
            router_logits,
            top_k,
            method,
            bias,
            n_group,
            topk_group,
            routed_scaling_factor,
            renormalize,
            logit_dtypes,
            group_score,
        )
    )


def _checked_config(
    router_logits, top_k, method, bias, n_group, topk_group, routed_scaling_factor, renormalize,
    logit_dtypes, group_score,
) -> tuple:  # fmt: skip
    """:func:`validate_route_args`' checks; the leading fields of :class:`RoutingArgs` in order (a
    tuple: :func:`resolve_routing` builds its RoutingArgs once, with the rest; each construction of
    the frozen dataclass costs ~3 us of host time, a ``dataclasses.replace`` ~5)."""
    method = method_from_value(method)
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2:
        raise ValueError(
            f"router_logits must be 2-D (n_tokens, num_experts), got shape {tuple(router_logits.shape)}"
        )
    if router_logits.dtype not in logit_dtypes:
        hint = ""
        if router_logits.dtype == torch.float64 and torch.float64 not in logit_dtypes:
            hint = " (the router computes in float32; replay_routing takes float64 logits)"
        raise ValueError(
            f"router_logits must be {_dtype_list(logit_dtypes)}, got {router_logits.dtype}{hint}"
        )
    num_experts = router_logits.shape[1]
    if num_experts < 1:
        raise ValueError("router_logits must have at least one expert column, got num_experts=0")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    spec = METHODS[method]
    if spec.top_k is not None and top_k != spec.top_k:
        picks = "one expert" if spec.top_k == 1 else f"{spec.top_k} experts"
        raise ValueError(
            f"{method.name} routing picks {picks} per token: top_k must be {spec.top_k}, got {top_k}"
        )

    if bias is not None:
        if not spec.bias:
            raise ValueError(
                f"bias is only used by {method_names(BIAS_METHODS)}, not {method.name}; pass None"
            )
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (num_experts,):
            raise ValueError(
                f"bias must have shape (num_experts,) = ({num_experts},), got {tuple(bias.shape)}"
            )
        if bias.dtype not in logit_dtypes:
            raise ValueError(f"bias must be {_dtype_list(logit_dtypes)}, got {bias.dtype}")
        if bias.device != router_logits.device:
            raise ValueError(
                f"bias must be on router_logits' device {router_logits.device}, got {bias.device}"
            )

    if not spec.groups and (n_group is not None or topk_group is not None):
        raise ValueError(
            f"n_group/topk_group are only used by {method_names(GROUP_METHODS)}, not {method.name}; pass None"
        )
    groups, kept = 1, 1
    if n_group is not None:
        if not _is_int(n_group) or n_group < 0:
            raise ValueError(f"n_group must be a non-negative int or None, got {n_group!r}")
        groups = max(n_group, 1)
    if topk_group is not None:
        if n_group is None:
            raise ValueError("topk_group needs n_group (the number of expert groups); pass both or neither")
        if not _is_int(topk_group) or topk_group < 1:
            raise ValueError(f"topk_group must be a positive int, got {topk_group!r}")
        if topk_group > groups:
            raise ValueError(f"topk_group={topk_group} must be <= n_group={n_group}")
        kept = topk_group
    if groups > 1:
        if num_experts % groups:
            raise ValueError(f"n_group={groups} must divide num_experts={num_experts}")
        if topk_group is None:
            raise ValueError(f"n_group={groups} > 1 needs topk_group (groups kept per token)")
        size = num_experts // groups
        if top_k > kept * size:
            raise ValueError(
                f"top_k={top_k} experts cannot be chosen from topk_group={kept} groups of {size} "
                f"experts (n_group={groups}, num_experts={num_experts})"
            )
    else:
        kept = 1

    scale = check_routed_scaling_factor(routed_scaling_factor)
    score = _group_score(method, group_score, top_k, groups, kept)
    unnormalized = _unnormalized(method, renormalize)
    group_top = score.keys_summed(top_k, kept) if groups > 1 else 2
    return method, top_k, num_experts, groups, kept, scale, unnormalized, score, group_top


def group_score_from_value(group_score: GroupScore | str | int) -> GroupScore:
    """``group_score`` as a :class:`GroupScore`: a member, its int value or its name (any case);
    ValueError listing the rules otherwise."""
    if isinstance(group_score, GroupScore):
        return group_score
    if isinstance(group_score, str) and group_score.upper() in GroupScore.__members__:
        return GroupScore[group_score.upper()]
    if not isinstance(group_score, bool) and isinstance(group_score, (int, np.integer)):
        try:
            return GroupScore(int(group_score))
        except ValueError:
            pass
    names = ", ".join(f"{g.name}={g.value}" for g in GroupScore)
    raise ValueError(
        f"group_score must be a GroupScore, its value or its name ({names}) or None, got {group_score!r}"
    )


def _group_score(
    method: RoutingMethod, group_score: object, top_k: int, n_group: int, topk_group: int
) -> GroupScore:
    """The validated group score of ``method`` (its own for None); ValueError naming the reason where
    ``group_score`` cannot apply. Without grouping (``n_group`` 1) any rule is accepted and unread."""
    spec = METHODS[method]
    if group_score is None:
        return spec.group_score if spec.group_score is not None else GroupScore.TOP2_SUM
    if not spec.groups:
        raise ValueError(
            f"group_score is only used by {method_names(GROUP_METHODS)} (methods with expert groups), "
            f"not {method.name}; pass None"
        )
    score = group_score_from_value(group_score)
    if score.keys_summed(top_k, topk_group) > 1 and spec.key not in SCORE_KEYS:
        sums = method_names(frozenset(m for m, s in METHODS.items() if s.groups and s.key in SCORE_KEYS))
        raise ValueError(
            f"group_score={score.name} sums a group's best keys, but {method.name} chooses on the "
            f"logits (its scores keep their order, not their sums); {method.name} takes MAX (or "
            f"TOPK_SHARE_SUM with top_k // topk_group == 1). Methods whose keys are their scores: {sums}"
        )
    # the share never exceeds a group's size: top_k <= topk_group * size is checked above
    if score is GroupScore.TOPK_SHARE_SUM and n_group > 1 and top_k < topk_group:
        raise ValueError(
            f"group_score=TOPK_SHARE_SUM sums top_k // topk_group = {top_k} // {topk_group} = 0 keys "
            "per group: it needs top_k >= topk_group"
        )
    return score


def _unnormalized(method: RoutingMethod, renormalize: object) -> bool:
    """Whether ``renormalize`` selects ``method``'s unnormalized rule; ValueError naming the method
    and the reason where the value cannot apply to it."""
    if renormalize is None:
        return False
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be True, False or None, got {renormalize!r}")
    spec = METHODS[method]
    if spec.renormalizes is None:
        raise ValueError(
            f"renormalize={renormalize} cannot apply to {method.name}: its weights "
            f"({spec.weight.name}) are not a distribution over several chosen experts; pass None"
        )
    if renormalize == spec.renormalizes:
        return False  # the method's own rule
    if not renormalize and spec.unnormalized is not None:
        return True
    if renormalize and spec.renormalized is not None:
        return True
    # the other rule is another method's row (FlashInfer's value for it): name it, never alias
    same = frozenset(m for m, s in METHODS.items() if s.renormalizes is renormalize and not s.bias)
    verb = "renormalise" if renormalize else "do not renormalise"
    raise ValueError(
        f"renormalize={renormalize} cannot apply to {method.name}: that rule is another method; the "
        f"methods that {verb} are {method_names(same)}; pass one of them and renormalize=None"
    )


# the smallest magnitude that rounds to inf in float32 (nearest even): halfway between float32's
# largest value and 2**128
FLOAT32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def check_routed_scaling_factor(value: object) -> float:
    """``routed_scaling_factor`` as a float (None: 1.0); ValueError for a non-number, a bool, or a
    value that is not finite in float32 (the kernels' type: 1e39 would make every weight inf, then
    zeroed and counted as non-finite rows). Host values only."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"routed_scaling_factor must be a float, got {value!r}")
    scale = float(value)
    # not NaN (every comparison is False), and below the magnitude that rounds to inf (inf too)
    if not abs(scale) < FLOAT32_ROUNDS_TO_INF:
        raise ValueError(
            f"routed_scaling_factor must be finite in float32 (|x| < 3.4028235e38, the kernels' "
            f"type), got {value!r}"
        )
    return scale


def check_hash_args(
    router_logits: torch.Tensor,
    top_k: int,
    hash_table: torch.Tensor | None,
    token_ids: torch.Tensor | None,
    bias: torch.Tensor | None,
    n_group: int | None,
    topk_group: int | None,
) -> bool:
    """Whether the call routes by a table (both ``hash_table`` and ``token_ids`` given); raises
    ValueError (TypeError for non-tensors) naming the argument and the expected value for a bad
    pair, one without the other, or a bias or groups beside a table (they choose experts, and a
    table leaves nothing to choose). Reads shapes, dtypes and devices only (no host sync).
    ``router_logits`` and ``top_k`` are assumed valid (``validate_route_args`` first)."""
    if hash_table is None and token_ids is None:
        return False
    if hash_table is None or token_ids is None:
        given, missing = ("hash_table", "token_ids") if token_ids is None else ("token_ids", "hash_table")
        raise ValueError(f"{given} needs {missing}: hash routing takes both (ids = hash_table[token_ids])")
    for name, value in (("hash_table", hash_table), ("token_ids", token_ids)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in HASH_ID_DTYPES:
            raise ValueError(f"{name} must be uint8, int8, int16, int32 or int64, got {value.dtype}")
        if value.device != router_logits.device:
            raise ValueError(
                f"{name} must be on router_logits' device {router_logits.device}, got {value.device}"
            )
    if hash_table.dim() != 2 or hash_table.shape[1] != top_k or hash_table.shape[0] < 1:
        raise ValueError(
            f"hash_table must be 2-D (vocab >= 1, top_k={top_k}), got shape {tuple(hash_table.shape)}"
        )
    n = router_logits.shape[0]
    if tuple(token_ids.shape) != (n,):
        raise ValueError(
            f"token_ids must have shape (n_tokens,) = ({n},) (one per row of router_logits), "
            f"got {tuple(token_ids.shape)}"
        )
    if bias is not None:
        raise ValueError("bias chooses experts, and hash routing takes them from hash_table: pass None")
    if n_group is not None or topk_group is not None:
        raise ValueError(
            "n_group/topk_group choose experts, and hash routing takes them from hash_table: pass None"
        )
    return True


_INT32_MAX = torch.iinfo(torch.int32).max


def check_num_fused_shared_experts(value: object, num_experts: int) -> int:
    """``value`` as the number of fused shared columns (docs/routing.md "Fused shared experts"): an
    int (not a bool) >= 0 whose largest id ``num_experts + value - 1`` fits the int32 ids.
    TypeError / ValueError naming ``num_fused_shared_experts`` otherwise. Host values only."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_fused_shared_experts must be an int >= 0, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"num_fused_shared_experts must be an int >= 0, got {value}")
    if value and num_experts + value - 1 > _INT32_MAX:
        raise ValueError(
            f"num_fused_shared_experts={value} with num_experts={num_experts} gives shared ids up to "
            f"{num_experts + value - 1}, beyond int32 (the ids' dtype, at most {_INT32_MAX})"
        )
    return value


def check_capture_shared_experts(value: object, num_fused_shared_experts: int, has_capture: bool) -> bool:
    """``capture_shared_experts`` as a bool: True only with a capture target and shared columns to
    keep. TypeError / ValueError naming it otherwise. Host values only."""
    if not isinstance(value, bool):
        raise TypeError(f"capture_shared_experts must be a bool, got {type(value).__name__}")
    if value and not has_capture:
        raise ValueError("capture_shared_experts=True needs a capture target; pass capture= or False")
    if value and num_fused_shared_experts == 0:
        raise ValueError(
            "capture_shared_experts=True keeps the shared columns, but num_fused_shared_experts=0 "
            "appends none; pass num_fused_shared_experts > 0 or False"
        )
    return value


def choose_triton(backend: str, device: torch.device, num_experts: int, n_group: int) -> bool:
    """Whether the Triton kernel runs (True) or the PyTorch reference (False) for rows of
    ``num_experts`` in ``n_group`` groups on ``device``; ValueError for ``backend="triton"`` where
    it cannot run. The router and replay's live rows hold the same tile, so both take this rule.
    ``backend="auto"``: Triton on CUDA where it compiles and the padded row fits
    :data:`TRITON_MAX_TILE` (:mod:`moe_ops.router.policy` reports it)."""
    if backend == "torch":
        return False
    ng_pad, g_pad = tile_shape(num_experts, n_group)
    fits = ng_pad * g_pad <= TRITON_MAX_TILE
    if backend == "auto":
        return fits and device.type == "cuda" and _AUTO_TRITON_ON_CUDA
    on_cuda = device.type == "cuda" and HAS_TRITON and not interpreting()
    if not (on_cuda or (device.type == "cpu" and HAS_TRITON and interpreting())):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
            f"moe_ops is imported); router_logits are on {device}"
        )
    if not fits:
        raise ValueError(
            f"backend='triton' holds a padded row of at most {TRITON_MAX_TILE} experts; "
            f"num_experts={num_experts} with n_group={n_group} pads to {ng_pad * g_pad}. "
            "Use backend='torch' (or 'auto')"
        )
    return True


def resolve_routing(
    router_logits: torch.Tensor,
    top_k: int,
    method: RoutingMethod | int,
    *,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    renormalize: bool | None = None,
    group_score: GroupScore | str | int | None = None,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    num_fused_shared_experts: int = 0,
    backend: str = "auto",
    backends: tuple[str, ...] = BACKENDS,
    logit_dtypes: tuple[torch.dtype, ...] = LOGIT_DTYPES,
) -> RoutingArgs:
    """The one preamble of ``route`` and ``replay_routing``: every routing argument checked, the
    backend chosen; returns the :class:`RoutingArgs` the ops are called with.

    ``backends``: what the caller runs (``route``: :data:`BACKENDS`, ``replay_routing``:
    :data:`REPLAY_BACKENDS`); ``logit_dtypes``: the dtypes it computes with (:data:`LOGIT_DTYPES`,
    :data:`REPLAY_LOGIT_DTYPES`: float64 logits compute in float64). ``backend="flashinfer"`` takes
    what FlashInfer's routing kernel computes and refuses the rest, naming the backends that run it.
    Raises before anything runs: ValueError naming the argument and the expected value, TypeError
    for non-tensors. Shapes, dtypes and devices only (no host sync).
    """
    if backend not in backends:
        raise ValueError(f"backend must be one of {', '.join(map(repr, backends))}, got {backend!r}")
    config = _checked_config(
        router_logits,
        top_k,
        method,
        bias,
        n_group,
        topk_group,
        routed_scaling_factor,
        renormalize,
        logit_dtypes,
        group_score,
    )
    method, _, num_experts, groups, _, _, unnormalized, score, _ = config
    hashed = check_hash_args(router_logits, top_k, hash_table, token_ids, bias, n_group, topk_group)
    n_shared = check_num_fused_shared_experts(num_fused_shared_experts, num_experts)
    if hashed and n_shared:
        raise ValueError(
            "num_fused_shared_experts > 0 with hash_table: hash routing takes the table's top_k "
            "columns only; append the shared experts after the call"
        )
    if backend == "flashinfer":
        _check_flashinfer(method, groups > 1, unnormalized, score, hashed, n_shared)
        use_triton = False
    else:
        use_triton = choose_triton(backend, router_logits.device, num_experts, groups)
    return RoutingArgs(
        *config,
        n_shared,
        bias,
        hash_table if hashed else None,
        token_ids if hashed else None,
        torch.float64 if router_logits.dtype == torch.float64 else torch.float32,
        use_triton,
    )


def _check_flashinfer(
    method: RoutingMethod, grouped: bool, unnormalized: bool, score: GroupScore, hashed: bool, n_shared: int
) -> None:
    """What FlashInfer's routing kernel does not compute, refused with the backends that do."""
    others = "runs on backend 'auto', 'triton' or 'torch'"
    name = "backend='flashinfer'"
    if hashed:
        raise ValueError(f"{name} has no hash routing; hash_table {others}")
    if n_shared:
        raise ValueError(
            f"{name} routes the top_k routed experts only; num_fused_shared_experts > 0 {others}"
        )
    if unnormalized:
        raise ValueError(f"{name} always renormalises {method.name}; renormalize=False {others}")
    if grouped and score != GroupScore.TOP2_SUM:
        raise ValueError(f"{name} scores groups by TOP2_SUM only; group_score={score.name} {others}")


# ---------------------------------------------------------------------------------------------------
# What the ops take: ROUTING_ARGS, and each op's signature
# ---------------------------------------------------------------------------------------------------

_SCHEMA_TYPES = {
    "RoutingMethod": "SymInt",
    "int": "SymInt",
    "float": "float",
    "bool": "bool",
    "torch.Tensor | None": "Tensor?",
}
_OP_FIELDS = tuple(f for f in dataclasses.fields(RoutingArgs) if f.metadata.get("op"))


def _routing_args() -> tuple[Arg, ...]:
    args = [Arg(f.name, _SCHEMA_TYPES[f.type]) for f in _OP_FIELDS]
    return (*(a for a in args if a.is_tensor), *(a for a in args if not a.is_tensor))


# The routing arguments of the ops, in the order every op takes them (after its own): the tensors
# (bias, hash_table, token_ids), then the scalars (method, n_group, topk_group,
# routed_scaling_factor, unnormalized, group_top, num_fused_shared_experts): RoutingArgs' fields
# marked "op", tensors first, each group in field order.
ROUTING_ARGS: tuple[Arg, ...] = _routing_args()
ROUTING_NAMES = tuple(a.name for a in ROUTING_ARGS)
# how a RoutingArgs' value becomes an op's argument (the method goes as its int)
_AS_OP = {"method": "int({}.method)"}


def _generated(params: str, items: Sequence[str]) -> Callable:
    """``lambda params: (items...,)`` as generated code: torch.compile traces it, and it costs less
    host time than a loop over names (as :mod:`moe_ops.capture.spec`'s getters)."""
    return eval(f"lambda {params}: ({''.join(item + ', ' for item in items)})")  # names from this module


class OpSignature:
    """A routing op's arguments: its own (``own``, in order), then the routing arguments it reads
    (``routing``: names of :data:`ROUTING_ARGS`, kept in that order); with ``capture=True``, a
    :class:`~moe_ops.capture.spec.CaptureSpec`'s fused in (:meth:`OpArgs.fused`'s order).

    Attributes:
        args: the op's arguments in schema order.
        names: their names.
    """

    def __init__(self, own: Sequence[Arg], routing: Sequence[str] = ROUTING_NAMES, *, capture: bool = False):
        unknown = set(routing) - set(ROUTING_NAMES)
        if unknown:
            raise ValueError(f"routing= names no routing argument: {sorted(unknown)}")
        self.own = tuple(own)
        self.routing = tuple(a for a in ROUTING_ARGS if a.name in routing)
        host = (*self.own, *self.routing)
        self._fused = OpArgs.fused(host) if capture else None
        self.args = self._fused.args if capture else host
        if capture and [a.name for a in host] != [self._fused.names[p] for p in self._fused.host_positions]:
            # join and split take the host arguments in the order values() gives them
            raise ValueError("a capturing op's own arguments must be tensors, listed before its scalars")
        self.names = tuple(a.name for a in self.args)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate argument names in {self.names}")
        own_names = [a.name for a in self.own]
        # values(routing, **own): (a RoutingArgs-like object, the op's own arguments by name) -> the
        # host arguments in order. An attribute, not a method: a call costs one generated lambda
        self.values = _generated(
            ", ".join(["a", *own_names]),
            [*own_names, *(_AS_OP.get(a.name, "{}." + a.name).format("a") for a in self.routing)],
        )
        self.values.__doc__ = (
            "One call's host arguments in order (without a capture spec): the op's own by name, the "
            "routing arguments from the first argument (a RoutingArgs, or any object with those "
            "attributes). Host metadata only."
        )

    def schema(self) -> str:
        """The op's schema, e.g. ``"(Tensor router_logits, Tensor(a1!) weights, ...) -> ()"``."""
        if self._fused is not None:
            return self._fused.schema()
        parts = []
        for i, a in enumerate(self.args):
            type_ = f"Tensor(a{i}!)" + ("?" if a.type == "Tensor?" else "") if a.written else a.type
            parts.append(f"{type_} {a.name}" + ("" if a.default is None else f"={a.default}"))
        return "(" + ", ".join(parts) + ") -> ()"

    @property
    def mutates(self) -> tuple[str, ...]:
        """Names of the written arguments (``destination_op``'s ``mutates``)."""
        return tuple(a.name for a in self.args if a.written)

    def positions(self, *names: str) -> tuple[int, ...]:
        """Positions of the arguments ``names`` in the op's order."""
        return tuple(self.names.index(n) for n in names)

    @property
    def spec_positions(self) -> tuple[int, ...]:
        """A capturing op's positions of the CaptureSpec's fields, in field order."""
        return self._fused.spec_positions

    def join(self, host: tuple, spec) -> tuple:
        """A capturing op's arguments: :meth:`values`' tuple and a CaptureSpec."""
        return self._fused.join(host, spec)

    def split(self, args: Sequence) -> tuple[tuple, object]:
        """A capturing op's arguments as (the host arguments in :meth:`values`' order, the spec)."""
        return self._fused.split(args)

    def check_kernel(self, kernel: Callable) -> Callable:
        """``kernel`` itself, after checking that its positional parameters are this op's host
        arguments in order (what the dispatcher passes it); ValueError at import otherwise."""
        import inspect

        params = [
            p.name
            for p in inspect.signature(kernel).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        want = [a.name for a in (*self.own, *self.routing)]
        if params != want:
            raise ValueError(f"{kernel.__qualname__} must take {want} in order, takes {params}")
        return kernel
