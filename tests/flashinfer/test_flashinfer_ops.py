"""The FlashInfer op table against the installed FlashInfer, and the generated ops' schemas and fakes.

Runs on CPU with the real flashinfer-python package: signatures are read from it, the fake
implementations run on meta tensors (no kernel), and the real implementations are only called to
check that they refuse CPU tensors.
"""

from __future__ import annotations

import enum
import inspect
import typing

import pytest
import torch

flashinfer = pytest.importorskip(
    "flashinfer", reason="flashinfer-python is not installed (moe-ops[flashinfer])"
)

from moe_ops.flashinfer import ops  # noqa: E402 - after the importorskip above
from moe_ops.flashinfer.backends import DEEPSEEK_V3  # noqa: E402

# The FlashInfer functions that take routing_replay_out (checked against FlashInfer 0.7.2.post1).
REPLAY_FUNCTIONS = (
    "trtllm_bf16_moe",
    "trtllm_bf16_routed_moe",
    "trtllm_fp8_per_tensor_scale_moe",
    "trtllm_fp8_per_tensor_scale_routed_moe",
    "trtllm_fp8_block_scale_moe",
    "trtllm_fp4_block_scale_moe",
    "trtllm_mxint4_block_scale_moe",
    "fused_topk_deepseek",
)
# routed variants that take no routing_replay_out at all (so nothing to wrap for replay)
NO_REPLAY_FUNCTIONS = (
    "trtllm_fp8_block_scale_routed_moe",
    "trtllm_fp4_block_scale_routed_moe",
    "trtllm_mxint4_block_scale_routed_moe",
    "trtllm_fp8_per_channel_scale_moe",
)


def _flashinfer_fn(spec: ops.OpSpec):
    module, _, attr = spec.target.partition(":")
    return inspect.unwrap(getattr(__import__(module, fromlist=[attr]), attr))


def _is_optional(annotation) -> bool:
    return typing.get_origin(annotation) is typing.Union and type(None) in typing.get_args(annotation)


def _non_none(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007 - rebuilding a runtime Union


def _accepts(schema_type: str, annotation, name: str, spec: ops.OpSpec) -> bool:
    """Whether FlashInfer's ``annotation`` is what our schema type ``schema_type`` carries."""
    optional = schema_type.endswith("?")
    if name in spec.outputs and schema_type == "Tensor":
        # outputs are required here and Optional (allocated inside) in FlashInfer
        return annotation is torch.Tensor or (
            _is_optional(annotation) and _non_none(annotation) is torch.Tensor
        )
    if optional != _is_optional(annotation):
        return False
    base = _non_none(annotation) if optional else annotation
    kind = schema_type.rstrip("?")
    if kind == "Tensor":
        # the routed variants' topk_ids is Union[Tensor, Tuple[Tensor, Tensor]] (see OpSpec.synthetic)
        return base is torch.Tensor or (
            typing.get_origin(base) is typing.Union and torch.Tensor in typing.get_args(base)
        )
    if kind == "int":
        return base is int or (inspect.isclass(base) and issubclass(base, enum.IntEnum))
    if kind == "str":
        return base is str or (
            typing.get_origin(base) is typing.Literal
            and all(isinstance(a, str) for a in typing.get_args(base))
        )
    return base is {"float": float, "bool": bool}[kind]


@pytest.mark.parametrize("name", list(ops.SPECS))
def test_table_matches_installed_flashinfer_signature(name):
    """Every exposed parameter exists in FlashInfer with a compatible type and the same default; every
    FlashInfer parameter is exposed, fixed, deliberately omitted, or a later optional addition. Fails
    when FlashInfer renames or drops a parameter, or adds a required one. (The ops call FlashInfer by
    keyword, so an optional parameter added later, e.g. 0.7.4's ``workspace_buffer``, keeps its
    default.)"""
    spec = ops.SPECS[name]
    theirs = inspect.signature(_flashinfer_fn(spec)).parameters
    hints = typing.get_type_hints(_flashinfer_fn(spec))
    ours = {p.name: p for p in spec.params}

    unknown_to_us = sorted(set(theirs) - set(ours) - set(spec.fixed) - set(spec.omitted))
    required_unknown = [n for n in unknown_to_us if theirs[n].default is inspect.Parameter.empty]
    assert not required_unknown, (
        f"FlashInfer {name} has required parameters the table does not know: {required_unknown}"
    )
    gone = sorted((set(ours) - set(spec.synthetic) | set(spec.fixed) | set(spec.omitted)) - set(theirs))
    assert not gone, f"FlashInfer {name} no longer has parameters the table wraps: {gone}"

    for p in spec.params:
        if p.name in spec.synthetic:
            continue
        theirs_p = theirs[p.name]
        annotation = hints.get(p.name, theirs_p.annotation)
        assert _accepts(p.type, annotation, p.name, spec), (
            f"{name}.{p.name}: ours {p.type}, FlashInfer {annotation}"
        )
        if p.name in spec.outputs:
            continue
        has_default = theirs_p.default is not inspect.Parameter.empty
        assert p.has_default == has_default, f"{name}.{p.name}: default presence differs from FlashInfer"
        if has_default:
            default = theirs_p.default
            if isinstance(default, enum.Enum):
                default = int(default.value) if not isinstance(default, int) else int(default)
            assert p.default == default and type(p.default) is type(default), (
                f"{name}.{p.name}: default {p.default!r} here, {theirs_p.default!r} in FlashInfer"
            )
    for fixed in spec.fixed:
        assert theirs[fixed].default is not inspect.Parameter.empty, (
            f"{name}.{fixed} is required in FlashInfer"
        )


@pytest.mark.parametrize("name", REPLAY_FUNCTIONS)
def test_routing_replay_out_is_wrapped_and_declared_mutated(name):
    fn = getattr(flashinfer.fused_moe, name)
    assert "routing_replay_out" in inspect.signature(inspect.unwrap(fn)).parameters, (
        f"FlashInfer {name} dropped or renamed routing_replay_out"
    )
    spec = ops.spec_for(name)
    assert "routing_replay_out" in spec.mutates
    schema = ops.op_for(name).default._schema
    mutable = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutable == set(spec.mutates)
    assert len(schema.returns) == 0, "destination-passing ops return nothing"


@pytest.mark.parametrize("name", NO_REPLAY_FUNCTIONS)
def test_functions_without_routing_replay_out(name):
    """These take no replay buffer in 0.7.2; if one gains it, it should be added to the table."""
    params = inspect.signature(inspect.unwrap(getattr(flashinfer.fused_moe, name))).parameters
    assert "routing_replay_out" not in params


def test_replay_flags_match_the_kernels():
    for spec in ops.SPECS.values():
        assert spec.writes_replay == spec.routes_in_kernel, spec.name  # routed variants never write it


def test_deepseek_v3_value_matches_flashinfer():
    from flashinfer.tllm_enums import RoutingMethodType

    assert int(RoutingMethodType.DeepSeekV3) == DEEPSEEK_V3 == 2


def test_flashinfer_does_not_register_its_own_ops():
    """The reason for this module: FlashInfer's register_custom_op is a no-op in 0.7.2."""
    from flashinfer.utils import register_custom_op

    def f(x: torch.Tensor) -> None: ...

    assert register_custom_op("flashinfer::moe_ops_probe", mutates_args=())(f) is f


def _meta_args(spec: ops.OpSpec, n: int, top_k: int, hidden: int = 256, hidden_dtype=torch.bfloat16):
    """Shape-only meta arguments for ``spec`` (weights are never read by the fakes)."""
    kw = {}
    for p in spec.params:
        if p.has_default or p.name in spec.outputs:
            continue
        if p.type.startswith("Tensor"):
            kw[p.name] = torch.empty(1, device="meta")
        elif p.type.startswith("int"):
            kw[p.name] = 1
        elif p.type.startswith("float"):
            kw[p.name] = 1.0
        else:
            kw[p.name] = False
    kw[spec.top_k_param] = top_k
    if spec.name == "fused_topk_deepseek":
        kw["scores"] = torch.empty(n, 64, device="meta")
        kw["bias"] = torch.empty(64, device="meta")
    else:
        kw["hidden_states"] = torch.empty(n, hidden, dtype=hidden_dtype, device="meta")
    return kw


MOE_SPECS = [name for name in ops.SPECS if name != "fused_topk_deepseek"]


@pytest.mark.parametrize("name", MOE_SPECS)
def test_fake_output_follows_flashinfer_shape_rules(name):
    spec = ops.SPECS[name]
    replay = torch.empty(9, 4, dtype=torch.int16, device="meta")
    out = ops.call(name, routing_replay_out=replay, **_meta_args(spec, n=7, top_k=4))
    assert out.shape == (7, 256) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    packed = ops.call(name, **_meta_args(spec, n=3, top_k=4, hidden=128, hidden_dtype=torch.uint8))
    assert packed.shape == (3, 256), "uint8-packed NVFP4 activations carry two values per byte"
    if "valid_hidden_size" in {p.name for p in spec.params}:
        narrow = ops.call(name, valid_hidden_size=200, **_meta_args(spec, n=3, top_k=4))
        assert narrow.shape == (3, 200)


def test_fake_fused_topk_outputs():
    spec = ops.SPECS["fused_topk_deepseek"]
    values, indices = ops.call("fused_topk_deepseek", **_meta_args(spec, n=5, top_k=8))
    assert values.shape == indices.shape == (5, 8)
    assert values.dtype == torch.float32 and indices.dtype == torch.int32


BAD_REPLAY = {
    "int32": (torch.empty(8, 4, dtype=torch.int32, device="meta"), "int16"),
    "1-D": (torch.empty(32, dtype=torch.int16, device="meta"), "2-D"),
    "top_k": (torch.empty(8, 5, dtype=torch.int16, device="meta"), "top_k=4 columns"),
    "rows": (torch.empty(6, 4, dtype=torch.int16, device="meta"), "6 rows but the call has 7 tokens"),
    "strided": (torch.empty(4, 8, dtype=torch.int16, device="meta").t(), "contiguous"),
    "device": (torch.empty(8, 4, dtype=torch.int16), "must be on meta"),
}


@pytest.mark.parametrize("name", ["trtllm_bf16_moe", "fused_topk_deepseek"])
@pytest.mark.parametrize("bad", list(BAD_REPLAY))
def test_bad_routing_replay_out_is_rejected_at_trace_time(name, bad):
    spec = ops.SPECS[name]
    replay, message = BAD_REPLAY[bad]
    if bad == "strided":
        replay = torch.empty(8, 4, dtype=torch.int16, device="meta").t().contiguous().t()
        assert not replay.is_contiguous()
    with pytest.raises(ValueError, match=message):
        ops.call(name, routing_replay_out=replay, **_meta_args(spec, n=7, top_k=4))


def test_bad_output_buffer_is_rejected():
    spec = ops.SPECS["trtllm_bf16_moe"]
    wrong = torch.empty(7, 256, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match=r"output must have shape \(7, 256\) and dtype torch.bfloat16"):
        ops.call("trtllm_bf16_moe", output=wrong, **_meta_args(spec, n=7, top_k=4))


def test_call_rejects_unknown_and_missing_arguments():
    spec = ops.SPECS["trtllm_bf16_moe"]
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['do_finalize'\].*fixed"):
        ops.call("trtllm_bf16_moe", do_finalize=False, **_meta_args(spec, n=2, top_k=4))
    args = _meta_args(spec, n=2, top_k=4)
    del args["gemm1_weights"]
    with pytest.raises(TypeError, match="missing required argument"):
        ops.call("trtllm_bf16_moe", **args)
    with pytest.raises(ValueError, match="no wrapped FlashInfer function named 'nope'"):
        ops.call("nope")


@pytest.mark.parametrize("name", ["trtllm_bf16_moe", "fused_topk_deepseek"])
def test_real_implementation_refuses_cpu_tensors(name):
    """The real implementation (not the fake) runs for CPU tensors and says it needs CUDA."""
    spec = ops.SPECS[name]
    kw = {
        k: (torch.empty_like(v, device="cpu") if isinstance(v, torch.Tensor) else v)
        for k, v in _meta_args(spec, 3, 4).items()
    }
    with pytest.raises(ValueError, match="runs a FlashInfer CUDA kernel"):
        ops.call(name, **kw)


def test_schema_puts_required_arguments_first():
    spec = ops.SPECS["trtllm_fp8_per_tensor_scale_moe"]
    order = [p.name for p in spec.schema_order]
    assert order.index("output") < order.index("routing_method_type")
    assert [p.name for p in spec.schema_order if not p.has_default] == [
        p.name for p in spec.params if not p.has_default
    ]
    schema = ops.op_for(spec.name).default._schema
    assert [a.name for a in schema.arguments] == order


@pytest.mark.parametrize("name", list(ops.SPECS))
def test_every_op_traces_fullgraph_with_its_writes_declared(name):
    """Each generated op compiles without a graph break; after functionalisation the graph returns the
    buffers it wrote (so later reads see the kernel's writes)."""
    from torch._dynamo.backends.common import aot_autograd

    spec = ops.SPECS[name]
    torch._dynamo.reset()
    graphs = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    kw = _meta_args(spec, n=6, top_k=4)
    replay = torch.empty(8, 4, dtype=torch.int16, device="meta")

    def step(replay):
        return ops.call(name, routing_replay_out=replay, **kw)

    compiled = torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=fw_compiler))
    compiled(replay)
    nodes = graphs[0].graph.nodes
    (node,) = [n for n in nodes if n.op == "call_function" and "auto_functionalized" in str(n.target)]
    assert str(node.args[0]) == f"moe_ops.flashinfer_{name}.default"
    for mutated in spec.mutates:
        if f"_{mutated}_base_index" in node.kwargs:  # auto_functionalized_v2: index into _all_bases
            assert node.kwargs[f"_{mutated}_base_index"] is not None, f"{mutated} is not written"
        else:  # v1 passes the mutated tensor by name
            assert node.kwargs.get(mutated) is not None, f"{mutated} is not written"
    (output,) = [n for n in nodes if n.op == "output"]
    assert len(output.args[0]) >= len(spec.mutates), "the written buffers are not returned to the caller"
