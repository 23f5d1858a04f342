"""Hash routing: ``route(..., hash_table=, token_ids=)``, its registered ops ``moe_ops::route_hash_``
and ``moe_ops::route_hash_capture_``, the argument checks replay shares, and the hash fault counter.

A hash layer (DeepSeek-V4's first MoE layers) takes its experts from a frozen table,
``ids = hash_table[token_ids]``; the logits only weigh them, by the routing method's weight rule
(docs/routing.md, "Hash routing"). The ops are destination-passing and registered as the router's
are (:mod:`moe_ops.router.op`), so ``torch.compile(fullgraph=True)`` traces a hashed ``route`` and
CUDA graphs capture it after one warm-up call (which compiles the kernel and allocates the counter).

Faults (a token id outside ``[0, vocab)``, a table entry outside ``[0, num_experts)``) cannot raise
without a host sync: the row's ids are written as -1 and its weights 0, and the row is counted in the
device-wide hash fault counter (:mod:`moe_ops._runtime.faults`, kind ``"hash"``), read by
:func:`check_hash_errors` at the caller's next sync point.
"""

from __future__ import annotations

import torch

from .._runtime.faults import DeviceCounter, check_counter, counter_or_stand_in, device_counter
from .._runtime.library import destination_op, eager_caller, identity, reference_op
from .._runtime.triton import HAS_TRITON
from ..capture.op import capture_into
from ..capture.spec import OpArgs, parse_args
from ..layout import BatchLayout
from ._hash import HASH_FAULT_ENTRY, HASH_FAULT_TOKEN_ID
from .hash_kernels import route_hash_rows_torch, route_hash_rows_triton
from .methods import RouteConfig
from .nonfinite import counter_for

if HAS_TRITON:
    from .hash_kernels import _route_hash_kernel

__all__ = [
    "HASH_FAULT_ENTRY",
    "HASH_FAULT_TOKEN_ID",
    "HASH_ID_DTYPES",
    "HashFaultError",
    "check_hash_args",
    "check_hash_errors",
    "hash_fault_counter",
]

# what hash_table and token_ids may be (transformers' tid2eid is int64, vLLM's int32)
HASH_ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

_KIND = "hash"
_FAULT_NAMES = {
    HASH_FAULT_TOKEN_ID: "a token id outside [0, vocab) of hash_table",
    HASH_FAULT_ENTRY: "a hash_table entry outside [0, num_experts)",
}


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


class HashFaultError(RuntimeError):
    """Raised by :func:`check_hash_errors` when hash rows were faulty (ids -1, weights 0)."""

    def __init__(self, device: torch.device, rows: int, flags: int):
        self.device, self.rows, self.flags = device, rows, flags
        names = "; ".join(name for bit, name in _FAULT_NAMES.items() if flags & bit) or "no fault bits"
        super().__init__(
            f"{rows} hash-routed row(s) on {device} were faulty ({names}); their ids were written as "
            "-1 and their weights as 0. token_ids do not belong to hash_table's vocabulary, or the "
            "table does not match the router's num_experts."
        )


def _make_counter(device: torch.device) -> DeviceCounter:
    return DeviceCounter(2, device)


# Under torch.compile this runs at trace time, as plain Python (as replay_fault_counter).
@torch._dynamo.assume_constant_result
def hash_fault_counter(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The persistent (2,) int32 hash fault counter of ``device``: [faulty rows, OR of
    HASH_FAULT_* bits]. Allocated on first use, then fixed for the process (a static address)."""
    return device_counter(_KIND, device, _make_counter).tensor


def check_hash_errors(device: torch.device | str | int | None = None, *, raise_error: bool = True) -> int:
    """Reads and resets the hash fault counter of ``device``; returns the faulty rows counted since
    the last check (0 where the counter was never allocated).

    HOST SYNC: copies 8 bytes from the device. Call it where the host already synchronises, never
    inside a captured or compiled step. Lossless and thread-safe (:mod:`moe_ops._runtime.faults`).

    Args:
        device: the device whose counter to read (default: the current CUDA device, else CPU).
        raise_error: raise :class:`HashFaultError` when any row was faulty (after the reset).
    """
    return check_counter(_KIND, device, HashFaultError, raise_error)


def _faults_for(router_logits: torch.Tensor) -> torch.Tensor:
    return counter_or_stand_in(router_logits, 2, hash_fault_counter)


# torch.library infers the schema from these annotations.
def _route_hash_twin(
    router_logits: torch.Tensor,
    hash_table: torch.Tensor,
    token_ids: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    faults: torch.Tensor,
    nonfinite: torch.Tensor,
    method: int,
    routed_scaling_factor: float,
    unnormalized: bool,
) -> None:
    """Writes every row's hash routing into ``weights`` and ``ids`` (hash_kernels.py); counts faulty
    rows in ``faults`` and rows with non-finite weights (zeroed) in ``nonfinite``."""
    route_hash_rows_torch(
        router_logits, hash_table, token_ids, weights, ids, faults, method, routed_scaling_factor,
        unnormalized=unnormalized, nonfinite=nonfinite,
    )  # fmt: skip


def _launcher_args(route_args) -> tuple[tuple, dict]:
    """The hash ops' own arguments as the launchers take them: (positional, keywords)."""
    *tensors, nonfinite, method, scale, unnormalized = route_args
    return (*tensors, method, scale), dict(unnormalized=unnormalized, nonfinite=nonfinite)


def _route_hash(*args, wrap=identity) -> None:
    positional, knobs = _launcher_args(args)
    route_hash_rows_triton(*positional, wrap=wrap, **knobs)


_MUTATES = ("weights", "ids", "faults", "nonfinite")
_SCHEMA = torch.library.infer_schema(_route_hash_twin, mutates_args=_MUTATES)
# route_hash_capture_: the hash router's arguments with a CaptureSpec's fused in (as route_capture_)
ROUTE_HASH_CAPTURE = OpArgs.fused(parse_args(_SCHEMA))


def _route_hash_capture(*args, wrap=identity) -> None:
    route_args, capture = ROUTE_HASH_CAPTURE.split(args)
    positional, knobs = _launcher_args(route_args)
    route_hash_rows_triton(*positional, capture, wrap=wrap, **knobs)


def _route_hash_capture_twin(*args) -> None:
    route_args, capture = ROUTE_HASH_CAPTURE.split(args)
    positional, knobs = _launcher_args(route_args)
    route_hash_rows_torch(*positional, capture, **knobs)


_KERNELS = (_route_hash_kernel,) if HAS_TRITON else ()
_TRITON = dict(cuda=_route_hash, interpreted=_route_hash, traceable=_route_hash, kernels=_KERNELS)
_TRITON_CAPTURE = dict(
    cuda=_route_hash_capture, interpreted=_route_hash_capture, traceable=_route_hash_capture, kernels=_KERNELS
)
route_hash_op = destination_op(
    "route_hash_", mutates=_MUTATES, cpu=_route_hash_twin, schema=_SCHEMA, **(_TRITON if HAS_TRITON else {})
)
route_hash_reference_op = reference_op("route_hash_", _route_hash_twin, mutates=_MUTATES, schema=_SCHEMA)
_CAPTURE_SCHEMA = ROUTE_HASH_CAPTURE.schema()
route_hash_capture_op = destination_op(
    "route_hash_capture_",
    mutates=ROUTE_HASH_CAPTURE.mutates,
    cpu=_route_hash_capture_twin,
    schema=_CAPTURE_SCHEMA,
    **(_TRITON_CAPTURE if HAS_TRITON else {}),
)
route_hash_capture_reference_op = reference_op(
    "route_hash_capture_",
    _route_hash_capture_twin,
    mutates=ROUTE_HASH_CAPTURE.mutates,
    schema=_CAPTURE_SCHEMA,
)
# eager CUDA calls skip the dispatcher where it would do nothing else: the caller's tensors are
# checked; the outputs and the counter were made on the logits' device
_route_hash_call = eager_caller("route_hash_", checked=(0, 1, 2))
_route_hash_capture_call = eager_caller(
    "route_hash_capture_",
    checked=ROUTE_HASH_CAPTURE.positions("router_logits", "hash_table", "token_ids", "buffer"),
)


def route_hashed(
    router_logits: torch.Tensor,
    hash_table: torch.Tensor,
    token_ids: torch.Tensor,
    cfg: RouteConfig,
    capture,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route``'s hash path (validated arguments; ``capture`` a checked CaptureTarget or None):
    allocates the outputs and runs the op. SEQUENCE_PARALLEL records with the capture op."""
    n_tokens = router_logits.shape[0]
    device = router_logits.device
    weights = torch.empty((n_tokens, cfg.top_k), dtype=torch.float32, device=device)
    ids = torch.empty((n_tokens, cfg.top_k), dtype=torch.int32, device=device)
    if capture is not None:
        capture.check_num_experts(cfg.num_experts)
        capture.check_ids(ids)
    args = (router_logits, hash_table, token_ids, weights, ids, _faults_for(router_logits))
    args = (*args, counter_for(router_logits))
    scalars = (int(cfg.method), cfg.routed_scaling_factor, cfg.unnormalized)
    route_ = _route_hash_call if use_triton else torch.ops.moe_ops.route_hash_reference_
    if capture is None or capture.layout == BatchLayout.SEQUENCE_PARALLEL:
        route_(*args, *scalars)
        if capture is not None:
            capture_into(capture, ids, weights if capture.has_weights else None)
        return weights, ids
    route_capture = _route_hash_capture_call
    if not use_triton:
        route_capture = torch.ops.moe_ops.route_hash_capture_reference_
    route_capture(*ROUTE_HASH_CAPTURE.join((*args, *scalars), capture.spec))
    return weights, ids
