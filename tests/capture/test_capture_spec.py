"""CaptureSpec is the one place the capture's device arguments are written: the registered ops'
schemas, the launchers' argument lists and the kernels' capture parameters all come from it, and
the ops' schemas are the ones written out below (a field added to the spec changes them: the
weights buffer did)."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from strategies import capture_cases

import moe_ops.router.op  # noqa: F401 - registers the route ops
from moe_ops.capture.errors import FaultCounter, capture_error_counter
from moe_ops.capture.kernels import capture_rows_torch, capture_rows_triton
from moe_ops.capture.spec import (
    CAPTURE_OP,
    KERNEL_CONSTEXPRS,
    KERNEL_POINTERS,
    KERNEL_SCALARS,
    CaptureSpec,
    absent_kernel_args,
    kernel_args,
)
from moe_ops.capture.target import CaptureTarget
from moe_ops.router.op import ROUTE_CAPTURE

# The schemas these ops are registered with (compiled graphs, exported programs and callers of
# torch.ops.moe_ops.* hold them), written out: a generated schema must be this string. The weights
# buffer added topk_weights and weights_buffer to the capture op, weights_buffer to route_capture_;
# the EPLB expert map added expert_map (after step) and num_logical_experts (after n_first) to both.
# route_capture_ is route_'s own arguments (the logits, the outputs, the non-finite rows counter),
# then the routing arguments it reads in the order moe_ops.router.args.ROUTING_ARGS gives them
# (tensors: the bias; scalars: method ... num_fused_shared_experts), with the spec's tensors after
# route's tensors and the spec's scalars after route's scalars.
CAPTURE_SCHEMA = (
    "(Tensor(a0!) buffer, Tensor topk_ids, Tensor topk_weights, Tensor(a3!) weights_buffer, "
    "Tensor token_counts, Tensor sizes, Tensor(a6!) errors, Tensor(a7!) stamps, Tensor step, "
    "Tensor expert_map, SymInt layer_id, SymInt dp_rank, SymInt n_first, SymInt num_logical_experts) -> ()"
)
ROUTE_CAPTURE_SCHEMA = (
    "(Tensor router_logits, Tensor(a1!) weights, Tensor(a2!) ids, Tensor(a3!) nonfinite, Tensor? bias, "
    "Tensor(a5!) buffer, Tensor(a6!) weights_buffer, Tensor token_counts, Tensor sizes, "
    "Tensor(a9!) errors, Tensor(a10!) stamps, Tensor step, Tensor expert_map, SymInt method, SymInt n_group, "
    "SymInt topk_group, float routed_scaling_factor, bool unnormalized, SymInt group_top, "
    "SymInt num_fused_shared_experts, SymInt layer_id, SymInt dp_rank, SymInt n_first, "
    "SymInt num_logical_experts) -> ()"
)


@pytest.mark.parametrize(
    ("op", "layout", "legacy"),
    [
        ("capture_routing_", CAPTURE_OP, CAPTURE_SCHEMA),
        ("route_capture_", ROUTE_CAPTURE, ROUTE_CAPTURE_SCHEMA),
        ("route_capture_reference_", ROUTE_CAPTURE, ROUTE_CAPTURE_SCHEMA),
    ],
)
def test_registered_schema_is_the_generated_one_and_unchanged(op, layout, legacy):
    registered = str(getattr(torch.ops.moe_ops, op).default._schema)
    assert registered == f"moe_ops::{op}{layout.schema()}"
    assert layout.schema() == legacy


def test_spec_fields_are_the_capture_arguments_of_both_ops():
    fields = [f.name for f in CaptureSpec.__dataclass_fields__.values()]
    for layout in (CAPTURE_OP, ROUTE_CAPTURE):
        assert [layout.names[p] for p in layout.spec_positions] == fields
    # what kernel_args takes after the kernel's own arguments, in the spec's order
    assert list(inspect.signature(kernel_args).parameters)[2:] == fields


def test_capture_launchers_take_the_op_arguments():
    """The capture op's kernels are registered as they are: they receive the op's arguments."""
    assert list(inspect.signature(capture_rows_torch).parameters) == list(CAPTURE_OP.names)
    triton_params = [n for n in inspect.signature(capture_rows_triton).parameters if n != "wrap"]
    assert triton_params == list(CAPTURE_OP.names)


def _runtime_params(kernel) -> tuple[list[str], list[str]]:
    params = list(inspect.signature(kernel.fn).parameters.values())
    constexpr = [p.name for p in params if "constexpr" in str(p.annotation)]
    runtime = [p.name for p in params if p.name not in constexpr]
    return runtime, constexpr


@pytest.mark.parametrize("kernel_name", ["capture", "route"])
def test_kernels_take_the_capture_arguments_in_the_spec_order(kernel_name):
    """Each capturing kernel's runtime parameters are its own pointers, KERNEL_POINTERS, its own
    scalars, KERNEL_SCALARS (what kernel_args builds); pointers first (torch 2.11's mutation
    analysis of traced kernels maps written parameters to tensors by position); the capture
    constexprs are among the kernel's."""
    pytest.importorskip("triton")
    if kernel_name == "capture":
        from moe_ops.capture.kernels import _capture_rows_kernel as kernel
    else:
        from moe_ops.router.kernels import _route_kernel as kernel
    runtime, constexpr = _runtime_params(kernel)
    n_pointers = sum(name.endswith("_ptr") for name in runtime)
    pointers, scalars = runtime[:n_pointers], runtime[n_pointers:]
    assert all(name.endswith("_ptr") for name in pointers)
    assert tuple(pointers[-len(KERNEL_POINTERS) :]) == KERNEL_POINTERS
    assert tuple(scalars[-len(KERNEL_SCALARS) :]) == KERNEL_SCALARS
    assert set(KERNEL_CONSTEXPRS) <= set(constexpr)


def test_absent_kernel_args_fill_the_capture_slots():
    own_pointers, own_scalars = (torch.zeros(1), torch.zeros(2)), (7, 8.5)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    n = len(KERNEL_POINTERS)
    shared = absent_kernel_args(own_pointers, own_scalars, ids, distinct=False)
    own = absent_kernel_args(own_pointers, own_scalars, ids, distinct=True)
    for args in (shared, own):
        assert len(args) == 4 + n + len(KERNEL_SCALARS)
        assert args[0] is own_pointers[0] and args[1] is own_pointers[1]
        assert args[2 + n : 4 + n] == own_scalars
        assert args[4 + n :] == (0,) * len(KERNEL_SCALARS)
    assert all(t is ids for t in shared[2 : 2 + n])
    capture = own[2 : 2 + n]
    assert len({id(t) for t in capture}) == n and all(t.numel() == 0 and t is not ids for t in capture)


@settings(max_examples=60, deadline=None)
@given(case=capture_cases(), stamped=..., own_counter=..., weighted=..., mapped=...)
def test_target_resolves_to_the_spec_the_ops_and_kernels_take(
    case, stamped: bool, own_counter: bool, weighted: bool, mapped: bool
):
    """Every layout and memory layout (strided, sliced, expanded): the target's spec holds the
    target's tensors, the op's arguments are the order the capture op has always taken, and the
    kernels' capture arguments are the tensors and their strides under their parameter names."""
    buffer, topk_ids, counts, sizes = case.tensors("cpu")
    counter = FaultCounter("cpu") if own_counter else None
    stamps = torch.zeros(case.num_layers, dtype=torch.int32) if stamped else None
    step = torch.ones(1, dtype=torch.int32) if stamped else None
    # a strided view (a column slice of a wider tensor): its strides reach the kernels as they are
    wide = torch.zeros(case.max_tokens, case.num_layers, case.top_k + 1, dtype=torch.bfloat16)
    weights_buffer = wide[..., 1:] if weighted else None
    # a column of a (P, 3) map: stride 3 reaches the kernels as it is
    expert_map = torch.zeros(20, 3, dtype=torch.int64)[:, 1] if mapped else None
    target = CaptureTarget(
        buffer,
        case.layer_id,
        token_counts=counts,
        dp_rank=case.dp_rank,
        layout=case.layout,
        shard_sizes=sizes,
        fault_counter=counter,
        layer_stamps=stamps,
        step_tensor=step,
        weights_buffer=weights_buffer,
        expert_map=expert_map,
        num_logical_experts=16 if mapped else None,
    )
    spec = target.spec
    errors = counter.tensor if own_counter else capture_error_counter("cpu")
    assert spec.buffer is buffer and spec.token_counts is counts and spec.sizes is target.sizes
    assert spec.errors is errors
    if stamped:
        assert spec.stamps is stamps and spec.step is step
    else:
        assert spec.stamps.shape == (0,) and spec.step.shape == (0,)
    if weighted:
        assert spec.weights_buffer is weights_buffer
    else:
        assert spec.weights_buffer.shape == (0,) and spec.weights_buffer.dtype == torch.float32
    if mapped:
        assert spec.expert_map is expert_map and spec.num_logical_experts == 16
    else:
        assert spec.expert_map.shape == (0,) and spec.expert_map.dtype == torch.int32
        assert spec.num_logical_experts == 0
    assert spec.expert_map is not spec.stamps  # the op reads one and writes the other
    assert (spec.layer_id, spec.dp_rank, spec.n_first) == (case.layer_id, case.dp_rank, target.n_first)

    topk_weights = torch.zeros(topk_ids.shape)
    op_args = CAPTURE_OP.join((topk_ids, topk_weights), spec)
    order = (
        buffer,
        topk_ids,
        topk_weights,
        spec.weights_buffer,
        counts,
        target.sizes,
        errors,
        spec.stamps,
        spec.step,
        spec.expert_map,
    )
    assert all(a is b for a, b in zip(op_args[:10], order, strict=True))
    assert op_args[10:] == (case.layer_id, case.dp_rank, target.n_first, spec.num_logical_experts)
    assert CAPTURE_OP.split(op_args)[1] == spec

    own_pointers, own_scalars = (topk_ids,), (topk_ids.shape[0], 5)
    args = spec.kernel_args(own_pointers, own_scalars)
    n = len(KERNEL_POINTERS)
    assert args[0] is topk_ids and args[1 + n : 3 + n] == own_scalars
    names = KERNEL_POINTERS + KERNEL_SCALARS
    by_name = dict(zip(names, args[1 : 1 + n] + args[3 + n :], strict=True))
    pointers = dict(
        buf_ptr=buffer,
        wbuf_ptr=spec.weights_buffer,
        counts_ptr=counts,
        sizes_ptr=target.sizes,
        errors_ptr=errors,
        stamps_ptr=spec.stamps,
        step_ptr=spec.step,
        map_ptr=spec.expert_map,
    )
    assert all(by_name[name] is t for name, t in pointers.items())
    ints = {name: v for name, v in by_name.items() if name not in pointers}
    assert ints == dict(
        n_dst=case.max_tokens,
        layer_id=case.layer_id,
        dp_rank=case.dp_rank,
        n_first=target.n_first,
        stride_bm=buffer.stride(0),
        stride_bl=buffer.stride(1),
        stride_bk=buffer.stride(2),
        stride_vm=weights_buffer.stride(0) if weighted else 0,
        stride_vl=weights_buffer.stride(1) if weighted else 0,
        stride_vk=weights_buffer.stride(2) if weighted else 0,
        stride_c=counts.stride(0),
        stride_s=target.sizes.stride(0),
        n_physical=20 if mapped else 0,
        n_logical=16 if mapped else 0,
        stride_map=3 if mapped else 1,
    )
    n_sizes = target.sizes.shape[0]
    assert spec.kernel_constexprs() == dict(
        S_PAD=1 << max(0, (n_sizes - 1).bit_length()),
        HAS_OFFSET=target.n_first > 0,
        STAMP=stamped,
        WEIGHTS=weighted,
        EXPERT_MAP=mapped,
    )


def test_route_capture_arguments_round_trip():
    """route's arguments and a spec, joined into the op's order and split back."""
    host = (*(torch.full((1,), i) for i in range(5)), 0, 1, 1, 2.5, False, 3, 2)  # group_top 3, 2 shared
    spec = CaptureSpec(*(torch.full((1,), 10 + i) for i in range(8)), 3, 1, 2, 16)
    args = ROUTE_CAPTURE.join(host, spec)
    assert len(args) == len(ROUTE_CAPTURE_SCHEMA.split(", "))
    back_host, back_spec = ROUTE_CAPTURE.split(args)
    assert all(a is b for a, b in zip(back_host, host, strict=True))
    assert back_spec == spec
