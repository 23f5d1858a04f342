"""``CaptureSpec``: the capture's device arguments, written once.

Every path that records ids - the capture op, the router with fused capture, their kernels and
their PyTorch twins - takes the same twelve values: the buffer and the layer they go to, the routing
weights' buffer beside it (or an empty stand-in), the count tensors the row window is computed from
on the device, the fault counter, the layer stamps and the step, and the EPLB expert map with its
logical range (or an empty stand-in and 0). :class:`CaptureSpec` names them
once, with their invariants; everything else is generated from it (as :mod:`moe_ops.flashinfer.ops`
generates FlashInfer's schemas from one table):

* an op's argument list and schema: :class:`OpArgs` - :data:`CAPTURE_OP` for
  ``moe_ops::capture_routing_``, :meth:`OpArgs.fused` for an op that does its own work and captures
  in the same launch (``moe_ops::route_capture_``); a field added here changes both schemas (the
  weights buffer did: graphs compiled against the earlier schemas are traced again);
* the kernels' capture arguments: :func:`kernel_args` / :meth:`CaptureSpec.kernel_args` - a
  capturing Triton kernel takes its own pointers, :data:`KERNEL_POINTERS`, its own scalars,
  :data:`KERNEL_SCALARS` (the rule :meth:`OpArgs.fused` applies to op arguments) - and
  :func:`kernel_constexprs` (:data:`KERNEL_CONSTEXPRS`).

A new capture argument is one field here (with its name in :data:`KERNEL_POINTERS` or
:data:`KERNEL_SCALARS` and its place in :func:`kernel_args`) and its use in the kernels;
``tests/capture/test_capture_spec.py`` checks that the ops' schemas, the launchers and the kernels'
parameter lists agree with this module.

:class:`~moe_ops.capture.target.CaptureTarget` (the validated, user-facing contract) resolves to a
spec (``target.spec``); a spec itself is not validated: it is what a validated target hands on.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._runtime.triton import next_power_of_2

__all__ = [
    "CAPTURE_OP",
    "KERNEL_CONSTEXPRS",
    "KERNEL_POINTERS",
    "KERNEL_SCALARS",
    "Arg",
    "CaptureSpec",
    "OpArgs",
    "kernel_args",
    "kernel_constexprs",
    "parse_args",
]

_WRITTEN = {"written": True}


@dataclass(frozen=True)
class CaptureSpec:
    """Where and how one call records this rank's ids: the capture's device arguments, in the order
    the ops and the kernels take them. Built by :class:`~moe_ops.capture.target.CaptureTarget`
    (validated there); holds tensors, not their values, so one spec serves every step."""

    # (max_tokens, num_layers, top_k) int16/int32/int64, no internal overlap - the replay buffer;
    # written: rows [0, c_eff) of layer layer_id, every other element keeps its value
    buffer: torch.Tensor = dataclasses.field(metadata=_WRITTEN)
    # (max_tokens, num_layers, top_k) float32/bfloat16/float16 - the routing weights beside the ids,
    # same rows, layers and top_k as buffer, no internal overlap, not overlapping buffer; or (0,)
    # float32: no weights (WEIGHTS False). Written like buffer: the same rows of layer layer_id get
    # the weights of the rows whose ids go to buffer, cast to its dtype (round to nearest even)
    weights_buffer: torch.Tensor = dataclasses.field(metadata=_WRITTEN)
    # (dp_size,) int32 on the buffer's device, any stride - real tokens of each DP rank; read on the device
    token_counts: torch.Tensor
    # (S,) int32, any stride - the row counts the layout reads (moe_ops.capture.window.plan_window)
    sizes: torch.Tensor
    # (FAULT_SLOTS,) int32 - the fault counter's tensor (moe_ops.capture.errors); incremented
    errors: torch.Tensor = dataclasses.field(metadata=_WRITTEN)
    # (num_layers,) int32 step stamps, or (0,) int32: no stamp; written: stamps[layer_id] = step[0]
    stamps: torch.Tensor = dataclasses.field(metadata=_WRITTEN)
    # (1,) int32 - the capturer's current step, read on the device (unused without stamps)
    step: torch.Tensor
    # (P,) int32/int64 on the buffer's device, any stride - EPLB's physical -> logical expert map:
    # an id p is stored as expert_map[p]; read on the device at every call (a balancer updates it
    # in place between CUDA-graph replays); or (0,) int32: no map (EXPERT_MAP False), ids as given
    expert_map: torch.Tensor
    # buffer layer the ids go to, in [0, num_layers)
    layer_id: int
    # this rank's index into token_counts, in [0, dp_size)
    dp_rank: int
    # leading entries of sizes that precede this rank's rows, in [0, S]
    n_first: int
    # with expert_map: logical experts, >= 1 (a mapped id outside [0, num_logical_experts) is a
    # fault); 0 without one
    num_logical_experts: int

    def values(self) -> tuple:
        """The fields in order (what ``CaptureSpec(*values)`` rebuilds)."""
        return _values(self)

    def kernel_args(self, pointers: tuple, scalars: tuple) -> tuple:
        """A capturing kernel's runtime arguments: its own ``pointers`` and ``scalars`` with this
        spec's (see :func:`kernel_args`)."""
        return kernel_args(pointers, scalars, *_values(self))

    def kernel_constexprs(self) -> dict:
        """The kernels' capture constexprs (:data:`KERNEL_CONSTEXPRS`)."""
        return kernel_constexprs(
            self.sizes.shape[0],
            self.n_first,
            self.stamps.numel() > 0,
            self.weights_buffer.dim() == 3,
            self.expert_map.numel() > 0,
        )


def _generated(arg: str, items: Sequence[str]) -> Callable:
    """``lambda arg: (items...,)`` as generated code: torch.compile traces it (it cannot trace
    ``operator.itemgetter`` / ``attrgetter``), and it costs less host time than a loop."""
    return eval(f"lambda {arg}: ({''.join(item + ', ' for item in items)})")  # names from this module only


_NAMES = tuple(f.name for f in dataclasses.fields(CaptureSpec))
_values = _generated("spec", [f"spec.{n}" for n in _NAMES])

# The capture's runtime parameters of every capturing kernel: its pointers and its scalars. A
# kernel takes its own pointers, then KERNEL_POINTERS, then its own scalars, then KERNEL_SCALARS
# (the rule OpArgs.fused applies to op arguments); kernel_args builds that list. Pointers come
# first because torch 2.11's mutation analysis of traced kernels maps written parameters to
# tensors by position. Strides other than the innermost are runtime values (see the kernels).
KERNEL_POINTERS = (
    "buf_ptr",
    "wbuf_ptr",
    "counts_ptr",
    "sizes_ptr",
    "errors_ptr",
    "stamps_ptr",
    "step_ptr",
    "map_ptr",
)
KERNEL_SCALARS = (
    "n_dst",
    "layer_id",
    "dp_rank",
    "n_first",
    "stride_bm",
    "stride_bl",
    "stride_bk",
    "stride_vm",
    "stride_vl",
    "stride_vk",
    "stride_c",
    "stride_s",
    "n_physical",
    "n_logical",
    "stride_map",
)
# the capture's constexprs (kernel_constexprs): sizes entries rounded up to a power of two, whether
# this rank's block has an offset, whether the layer is stamped, whether weights are recorded,
# whether ids go through an expert map
KERNEL_CONSTEXPRS = ("S_PAD", "HAS_OFFSET", "STAMP", "WEIGHTS", "EXPERT_MAP")


def kernel_args(
    pointers: tuple,
    scalars: tuple,
    buffer: torch.Tensor,
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
) -> tuple:
    """A capturing kernel's runtime arguments in its order: its own ``pointers``, the capture's
    (:data:`KERNEL_POINTERS`), its own ``scalars``, the capture's (:data:`KERNEL_SCALARS`), from a
    spec's fields in field order (a launcher that has them as separate arguments calls this
    without building a spec). Host metadata only."""
    stride_bm, stride_bl, stride_bk = buffer.stride()
    # no weights: a (0,) stand-in, never read (WEIGHTS False)
    stride_vm, stride_vl, stride_vk = weights_buffer.stride() if weights_buffer.dim() == 3 else (0, 0, 0)
    return (
        *pointers,
        buffer,
        weights_buffer,
        token_counts,
        sizes,
        errors,
        stamps,
        step,
        expert_map,
        *scalars,
        buffer.shape[0],
        layer_id,
        dp_rank,
        n_first,
        stride_bm,
        stride_bl,
        stride_bk,
        stride_vm,
        stride_vl,
        stride_vk,
        token_counts.stride(0),
        sizes.stride(0),
        # no map: the (0,) stand-in, never read (EXPERT_MAP False); P 0 and logical range 0
        expert_map.shape[0],
        num_logical_experts,
        expert_map.stride(0),
    )


def kernel_constexprs(
    n_sizes: int, n_first: int, stamped: bool, weighted: bool = False, mapped: bool = False
) -> dict:
    """:data:`KERNEL_CONSTEXPRS` for ``n_sizes`` sizes entries, ``n_first`` of them before this
    rank's rows, stamps present (``stamped``), a weights buffer present (``weighted``) and an
    expert map present (``mapped``)."""
    return dict(
        S_PAD=next_power_of_2(n_sizes),
        HAS_OFFSET=bool(n_first > 0),
        STAMP=bool(stamped),
        WEIGHTS=bool(weighted),
        EXPERT_MAP=bool(mapped),
    )


def absent_kernel_args(pointers: tuple, scalars: tuple, like: torch.Tensor, *, distinct: bool) -> tuple:
    """:func:`kernel_args` of a kernel launched without a capture (its CAPTURE constexpr False:
    nothing of the capture is read). The capture's pointers are ``like`` itself (``distinct``
    False) or empty tensors of its dtype and device: traced, each pointer needs a tensor of its own,
    because the functional kernel node clones every argument it may write and copies the clones
    back - an alias of an output would copy an unwritten clone over it. Its scalars are 0."""
    n = len(KERNEL_POINTERS)
    capture = tuple(like.new_empty(0) for _ in range(n)) if distinct else (like,) * n
    return (*pointers, *capture, *scalars, *(0,) * len(KERNEL_SCALARS))


@dataclass(frozen=True)
class Arg:
    """One argument of an op schema."""

    # the schema argument's name
    name: str
    # its schema type without alias: Tensor, Tensor?, SymInt or float
    type: str
    # True when the op writes it (declared mutated: Tensor(aN!))
    written: bool = False
    # its schema default as written after "=" (e.g. "0"), or None: a required argument
    default: str | None = None

    @property
    def is_tensor(self) -> bool:
        return self.type in ("Tensor", "Tensor?")


_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "int": "SymInt"}
# the spec's fields as schema arguments (int is SymInt, as torch.library.infer_schema writes it)
SPEC_ARGS = tuple(
    Arg(f.name, _SCHEMA_TYPES[f.type], bool(f.metadata.get("written")))
    for f in dataclasses.fields(CaptureSpec)
)


def parse_args(schema: str) -> tuple[Arg, ...]:
    """The arguments of a schema string such as ``"(Tensor(a0!) x, SymInt n) -> ()"``."""
    inner = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    args = []
    for item in inner.split(", "):
        type_, name = item.rsplit(" ", 1)
        name, _, default = name.partition("=")
        written = "!" in type_
        args.append(Arg(name, re.sub(r"\(a\d+!?\)", "", type_), written, default or None))
    return tuple(args)


def _getter(positions: Sequence[int]) -> Callable[[Sequence], tuple]:
    """Picks ``positions`` out of a sequence as a tuple."""
    return _generated("seq", [f"seq[{i}]" for i in positions])


class OpArgs:
    """The argument list of an op that takes a :class:`CaptureSpec` among its own (host) arguments.

    Args:
        args: the op's arguments in schema order; those named like a spec field are the spec's
            (all twelve, in any order), the others the op's own.

    A destination-passing op: the schema returns nothing and the written arguments are mutated
    (``Tensor(aN!)``, N the argument's position, as ``torch.library.infer_schema`` numbers them).
    """

    def __init__(self, args: Sequence[Arg]):
        self.args = tuple(args)
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate argument names in {names}")
        missing = set(_NAMES) - set(names)
        if missing:
            raise ValueError(f"the op's arguments lack the spec's {sorted(missing)}")
        self.names = tuple(names)
        self.host_positions = tuple(i for i, n in enumerate(names) if n not in _NAMES)
        self.spec_positions = tuple(names.index(n) for n in _NAMES)
        self._host = _getter(self.host_positions)
        self._spec = _getter(self.spec_positions)
        # the op's order from (host..., spec fields...)
        n_host = len(self.host_positions)
        source = {p: i for i, p in enumerate(self.host_positions)}
        source.update({p: n_host + i for i, p in enumerate(self.spec_positions)})
        self._join = _getter([source[p] for p in range(len(names))])
        # the trailing arguments' defaults: the dispatcher leaves out trailing arguments that hold
        # their default when it calls a Python kernel, and split puts them back
        self._defaults = tuple(None if a.default is None else ast.literal_eval(a.default) for a in self.args)

    @classmethod
    def fused(cls, host: Sequence[Arg]) -> OpArgs:
        """An op that does its own work (``host``: its arguments without capture) and captures in
        the same launch: the host's tensors, the spec's tensors, the host's other arguments, the
        spec's other arguments, then the host's arguments with a default (an argument added with
        a default extends the schema at its end, so positional callers of the old one still
        work)."""
        host, spec = tuple(host), SPEC_ARGS
        required = tuple(a for a in host if a.default is None)
        return cls(
            (
                *(a for a in required if a.is_tensor),
                *(a for a in spec if a.is_tensor),
                *(a for a in required if not a.is_tensor),
                *(a for a in spec if not a.is_tensor),
                *(a for a in host if a.default is not None),
            )
        )

    def schema(self) -> str:
        """The op's schema, e.g. ``"(Tensor(a0!) buffer, Tensor topk_ids, ...) -> ()"``."""
        parts = []
        for i, a in enumerate(self.args):
            type_ = a.type
            if a.written:
                type_ = f"Tensor(a{i}!)" + ("?" if a.type == "Tensor?" else "")
            default = "" if a.default is None else f"={a.default}"
            parts.append(f"{type_} {a.name}{default}")
        return "(" + ", ".join(parts) + ") -> ()"

    @property
    def mutates(self) -> tuple[str, ...]:
        """Names of the written arguments (``destination_op``'s ``mutates``)."""
        return tuple(a.name for a in self.args if a.written)

    def positions(self, *names: str) -> tuple[int, ...]:
        """Positions of the arguments ``names`` in the op's order."""
        return tuple(self.names.index(n) for n in names)

    def split(self, args: Sequence) -> tuple[tuple, CaptureSpec]:
        """(the host arguments in the op's order, the spec) of one call's arguments; trailing
        arguments left out (they hold their defaults) are filled in."""
        if len(args) < len(self._defaults):
            args = (*args, *self._defaults[len(args) :])
        return self._host(args), CaptureSpec(*self._spec(args))

    def join(self, host: tuple, spec: CaptureSpec) -> tuple:
        """One call's arguments in the op's order from the host arguments (their order in the op)
        and a spec. Host metadata only."""
        return self._join(host + _values(spec))


# moe_ops::capture_routing_: the buffer, the ids and their weights (an empty tensor when the spec has
# no weights buffer), then the rest of the spec
CAPTURE_OP = OpArgs((SPEC_ARGS[0], Arg("topk_ids", "Tensor"), Arg("topk_weights", "Tensor"), *SPEC_ARGS[1:]))
