"""FlashInfer's MoE kernels and fused routing as PyTorch custom ops: ``torch.ops.moe_ops.flashinfer_<name>``.

FlashInfer 0.7.2 registers none of these functions with PyTorch (its ``register_custom_op`` helper
returns the function unchanged), so ``torch.compile`` cannot see that a call writes
``routing_replay_out`` (or ``output``): the write is either lost to a graph break or reordered
against later reads. Each function below becomes a destination-passing op
(``_runtime.library.destination_op``) that declares its output buffers as mutated and has a fake
implementation, so an MoE layer that calls it traces with ``fullgraph=True`` and can be captured in
a CUDA graph.

Everything is generated from one table, :data:`SPECS` (one :class:`OpSpec` per FlashInfer function),
which says, per function: its import path, the parameters the op exposes (FlashInfer's own names and
defaults), which of them are written in place, how the fake derives the output buffers' shapes and
dtypes, and how FlashInfer returns its result. ``tests/flashinfer/test_flashinfer_ops.py`` checks the table
against the installed FlashInfer's signatures, so a renamed or dropped ``routing_replay_out`` fails CI.

What a custom-op schema cannot express, and how it is handled:

* ``Optional[Tensor]``, ``Optional[int]``, ``Optional[float]``, ``Optional[bool]``, ``str`` and
  plain defaults map directly (``Tensor?``, ``int?``, ...).
* IntEnum parameters (``weight_layout``, ``fp8_quantization_type``, ``hidden_states_scale_layout``)
  are plain ``int`` in the schema; :attr:`OpSpec.enums` converts them back before the call.
* The routed variants' ``topk_ids: Union[Tensor, Tuple[Tensor, Tensor]]`` becomes two schema
  arguments, ``topk_ids`` and ``topk_weights`` (default None); the op passes FlashInfer the tuple
  when ``topk_weights`` is given (:attr:`OpSpec.synthetic`).
* ``output`` is ``Optional`` in FlashInfer (allocated inside when None). A custom op may not return
  a tensor that aliases an input, nor lose one it allocates, so here ``output`` is a required,
  mutated argument; :func:`call` allocates it (shape and dtype from :attr:`OpSpec.outputs`) when the
  caller passes None. The op itself never allocates its results and returns nothing.
* ``do_finalize`` is fixed to True: with False FlashInfer returns the unfinalised GEMM2 rows, whose
  row count depends on the routing (FlashInfer's own fake needs an unbacked size for it), plus
  kernel-owned buffers. ``gemm1_lora_delta`` of ``trtllm_bf16_routed_moe`` is not exposed for the
  same reason (it adds data-dependent outputs). Both are listed in :attr:`OpSpec.fixed` /
  :attr:`OpSpec.omitted`.
* Schema arguments with defaults must follow those without, so the op's positional order is
  FlashInfer's required parameters (and the output buffers) first, then the defaulted ones; call the
  ops by keyword, or use :func:`call`.

FlashInfer is imported on the first real call, never at import time (``import flashinfer`` takes
about 3 s). The fake implementations do not import it.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._runtime.library import destination_op
from .backends import kernel_support

__all__ = [
    "SPECS",
    "OpSpec",
    "Param",
    "call",
    "check_routing_replay_out",
    "moe_output_shape",
    "op_for",
    "spec_for",
]

_SCHEMA_TYPES = {"Tensor", "Tensor?", "int", "int?", "float", "float?", "bool", "bool?", "str"}


@dataclass(frozen=True)
class Param:
    """One schema argument of a wrapped op (FlashInfer's name, our schema type)."""

    # FlashInfer's parameter name (also the schema argument's name)
    name: str
    # schema type: Tensor, Tensor?, int, int?, float, float?, bool, bool? or str
    type: str
    # True when the argument has a default (then ``default`` holds it)
    has_default: bool
    # the default value (meaningless when has_default is False)
    default: Any = None


def _parse_params(text: str) -> tuple[Param, ...]:
    """``"Tensor a, int? n=None, str s='x'"`` -> Params (types checked, defaults via literal_eval)."""
    params = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        decl, _, default = item.partition("=")
        type_, name = decl.split()
        if type_ not in _SCHEMA_TYPES:
            raise ValueError(f"unsupported schema type {type_!r} for {name}")
        if default:
            params.append(Param(name, type_, True, ast.literal_eval(default.strip())))
        else:
            params.append(Param(name, type_, False))
    return tuple(params)


def moe_output_shape(kw: Mapping[str, Any]) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a finalised trtllm MoE ``output``: ``(num_tokens, width)`` bfloat16.

    ``width`` is ``valid_hidden_size`` when given, else the hidden size of ``hidden_states``
    (``shape[-1]``, doubled for uint8-packed NVFP4 activations: two values per byte). This mirrors
    FlashInfer's own fake implementations (``_fake_trtllm_fp4_block_scale_moe`` and siblings).
    """
    hidden = kw["hidden_states"]
    width = kw.get("valid_hidden_size")
    if width is None:
        width = hidden.shape[-1] * (2 if hidden.dtype == torch.uint8 else 1)
    return (hidden.shape[0], width), torch.bfloat16


def _topk_values_shape(kw: Mapping[str, Any]) -> tuple[tuple[int, ...], torch.dtype]:
    """fused_topk_deepseek's ``topk_values``: (num_tokens, topk) in the dtype of ``scores``."""
    scores = kw["scores"]
    return (scores.shape[0], kw["topk"]), scores.dtype


def _topk_indices_shape(kw: Mapping[str, Any]) -> tuple[tuple[int, ...], torch.dtype]:
    """fused_topk_deepseek's ``topk_indices``: (num_tokens, topk) int32."""
    return (kw["scores"].shape[0], kw["topk"]), torch.int32


def _pack_topk_weights(call_kw: dict[str, Any], kw: Mapping[str, Any]) -> None:
    """Routed variants: ``topk_ids`` plus ``topk_weights`` is FlashInfer's ``(ids, weights)`` tuple form."""
    if kw["topk_weights"] is not None:
        call_kw["topk_ids"] = (kw["topk_ids"], kw["topk_weights"])


@dataclass(frozen=True)
class OpSpec:
    """One wrapped FlashInfer function; :data:`SPECS` holds them all and the ops are generated from it."""

    # FlashInfer's function name; the op is torch.ops.moe_ops.flashinfer_<name>
    name: str
    # "module:attribute" path of the FlashInfer function, imported on the first real call
    target: str
    # exposed parameters in FlashInfer's order (names and defaults as FlashInfer has them)
    params: tuple[Param, ...]
    # parameters the kernel writes in place: declared mutated in the schema
    mutates: tuple[str, ...]
    # output buffers call() allocates when passed None: name -> rule(kwargs) -> (shape, dtype)
    outputs: Mapping[str, Callable[[Mapping[str, Any]], tuple[tuple[int, ...], torch.dtype]]]
    # parameter holding the per-step token count in dim 0 (scores / hidden_states)
    tokens_param: str
    # parameter holding top_k (the width routing_replay_out must have)
    top_k_param: str
    # True: routing runs inside the kernel from logits (monolithic); False: precomputed top-k
    routes_in_kernel: bool
    # True: the kernel fills routing_replay_out[:num_tokens]; False: accepted but left untouched
    writes_replay: bool
    # how FlashInfer returns: "none", "tensor" (the output, do_finalize=True) or "list" ([output])
    returns: str
    # FlashInfer parameters not in the schema, passed with a fixed value: name -> value
    fixed: Mapping[str, Any] = field(default_factory=dict)
    # FlashInfer parameters not exposed at all (left at FlashInfer's default): name -> why
    omitted: Mapping[str, str] = field(default_factory=dict)
    # int schema arguments that FlashInfer types as an IntEnum: name -> "module:Enum"
    enums: Mapping[str, str] = field(default_factory=dict)
    # schema arguments that are not FlashInfer parameters (folded in by ``adapt``): name -> meaning
    synthetic: Mapping[str, str] = field(default_factory=dict)
    # rewrites the FlashInfer keyword arguments from the op's arguments (synthetic ones)
    adapt: Callable[[dict[str, Any], Mapping[str, Any]], None] | None = None

    @property
    def qualname(self) -> str:
        return f"moe_ops::flashinfer_{self.name}"

    @property
    def schema_order(self) -> tuple[Param, ...]:
        """Schema argument order: parameters without defaults first (a schema rule), stable."""
        return tuple(p for p in self.params if not p.has_default) + tuple(
            p for p in self.params if p.has_default
        )

    def schema(self) -> str:
        letters = iter("abcdefghij")
        args = []
        for p in self.schema_order:
            type_ = p.type
            if p.name in self.mutates:
                alias = f"({next(letters)}!)"
                type_ = f"Tensor{alias}?" if p.type == "Tensor?" else f"Tensor{alias}"
            # No defaults in the schema: ops.call passes every argument. torch 2.11's dispatcher
            # drops trailing default-valued arguments before its ADInplaceOrView kernel indexes the
            # mutated ones (IndexError on the H200 machine); 2.13 fills them back in.
            args.append(f"{type_} {p.name}")
        return "(" + ", ".join(args) + ") -> ()"


_MOE_NOTE_FINALIZE = "do_finalize=False returns routing-dependent row counts and kernel-owned buffers"

SPECS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            name="fused_topk_deepseek",
            target="flashinfer.fused_moe:fused_topk_deepseek",
            params=_parse_params(
                "Tensor scores, Tensor bias, int n_group, int topk_group, int topk, "
                "float routed_scaling_factor, Tensor topk_values, Tensor topk_indices, "
                "bool launch_with_pdl=True, Tensor? routing_replay_out=None, str backend='default'"
            ),
            mutates=("topk_values", "topk_indices", "routing_replay_out"),
            outputs={"topk_values": _topk_values_shape, "topk_indices": _topk_indices_shape},
            tokens_param="scores",
            top_k_param="topk",
            routes_in_kernel=True,
            writes_replay=True,
            returns="none",
        ),
        OpSpec(
            name="trtllm_bf16_moe",
            target="flashinfer.fused_moe:trtllm_bf16_moe",
            params=_parse_params(
                "Tensor routing_logits, Tensor? routing_bias, Tensor hidden_states, Tensor gemm1_weights, "
                "Tensor gemm2_weights, int num_experts, int top_k, int? n_group, int? topk_group, "
                "int intermediate_size, int local_expert_offset, int local_num_experts, "
                "float? routed_scaling_factor=None, int routing_method_type=0, "
                "bool use_shuffled_weight=True, int weight_layout=2, bool enable_pdl=True, "
                "int tune_max_num_tokens=8192, int activation_type=3, bool norm_topk_prob=True, "
                "Tensor? routing_replay_out=None, Tensor? gemm1_alpha=None, Tensor? gemm1_beta=None, "
                "Tensor? gemm1_clamp_limit=None, Tensor output"
            ),
            mutates=("routing_replay_out", "output"),
            outputs={"output": moe_output_shape},
            tokens_param="hidden_states",
            top_k_param="top_k",
            routes_in_kernel=True,
            writes_replay=True,
            returns="tensor",
            fixed={"do_finalize": True},
            enums={"weight_layout": "flashinfer.tllm_enums:WeightLayout"},
        ),
        OpSpec(
            name="trtllm_bf16_routed_moe",
            target="flashinfer.fused_moe:trtllm_bf16_routed_moe",
            params=_parse_params(
                "Tensor topk_ids, Tensor hidden_states, Tensor gemm1_weights, Tensor gemm2_weights, "
                "int num_experts, int top_k, int? n_group, int? topk_group, int intermediate_size, "
                "int local_expert_offset, int local_num_experts, float? routed_scaling_factor=None, "
                "int routing_method_type=0, bool use_shuffled_weight=True, int weight_layout=2, "
                "bool enable_pdl=True, int tune_max_num_tokens=8192, int activation_type=3, "
                "Tensor? routing_replay_out=None, Tensor? gemm1_alpha=None, Tensor? gemm1_beta=None, "
                "Tensor? gemm1_clamp_limit=None, Tensor output, Tensor? topk_weights=None"
            ),
            mutates=("routing_replay_out", "output"),
            outputs={"output": moe_output_shape},
            tokens_param="hidden_states",
            top_k_param="top_k",
            routes_in_kernel=False,
            writes_replay=False,
            returns="tensor",
            fixed={"do_finalize": True},
            omitted={"gemm1_lora_delta": "adds the data-dependent gemm1 activation output to the result"},
            enums={"weight_layout": "flashinfer.tllm_enums:WeightLayout"},
            synthetic={"topk_weights": "with topk_ids, FlashInfer's (topk_ids, topk_weights) tuple form"},
            adapt=_pack_topk_weights,
        ),
        OpSpec(
            name="trtllm_fp8_per_tensor_scale_moe",
            target="flashinfer.fused_moe:trtllm_fp8_per_tensor_scale_moe",
            params=_parse_params(
                "Tensor routing_logits, Tensor? routing_bias, Tensor hidden_states, Tensor gemm1_weights, "
                "Tensor output1_scales_scalar, Tensor output1_scales_gate_scalar, Tensor gemm2_weights, "
                "Tensor output2_scales_scalar, int num_experts, int top_k, int? n_group, int? topk_group, "
                "int intermediate_size, int local_expert_offset, int local_num_experts, "
                "float? routed_scaling_factor, bool use_routing_scales_on_input, "
                "int routing_method_type=0, bool? enable_pdl=None, int tune_max_num_tokens=8192, "
                "int activation_type=3, bool norm_topk_prob=True, Tensor? routing_replay_out=None, "
                "Tensor output, Tensor? gemm1_clamp_limit=None"
            ),
            mutates=("routing_replay_out", "output"),
            outputs={"output": moe_output_shape},
            tokens_param="hidden_states",
            top_k_param="top_k",
            routes_in_kernel=True,
            writes_replay=True,
            returns="tensor",
            fixed={"do_finalize": True},
        ),
        OpSpec(
            name="trtllm_fp8_per_tensor_scale_routed_moe",
            target="flashinfer.fused_moe:trtllm_fp8_per_tensor_scale_routed_moe",
            params=_parse_params(
                "Tensor topk_ids, Tensor? routing_bias, Tensor hidden_states, Tensor gemm1_weights, "
                "Tensor output1_scales_scalar, Tensor output1_scales_gate_scalar, Tensor gemm2_weights, "
                "Tensor output2_scales_scalar, int num_experts, int top_k, int? n_group, int? topk_group, "
                "int intermediate_size, int local_expert_offset, int local_num_experts, "
                "float? routed_scaling_factor, bool use_routing_scales_on_input, "
                "int routing_method_type=0, bool? enable_pdl=None, int tune_max_num_tokens=8192, "
                "int activation_type=3, Tensor? routing_replay_out=None, Tensor output, "
                "Tensor? gemm1_clamp_limit=None, Tensor? topk_weights=None"
            ),
            mutates=("routing_replay_out", "output"),
            outputs={"output": moe_output_shape},
            tokens_param="hidden_states",
            top_k_param="top_k",
            routes_in_kernel=False,
            writes_replay=False,
            returns="tensor",
            fixed={"do_finalize": True},
            synthetic={"topk_weights": "with topk_ids, FlashInfer's (topk_ids, topk_weights) tuple form"},
            adapt=_pack_topk_weights,
        ),
        OpSpec(
            name="trtllm_fp8_block_scale_moe",
            target="flashinfer.fused_moe:trtllm_fp8_block_scale_moe",
            params=_parse_params(
                "Tensor routing_logits, Tensor? routing_bias, Tensor hidden_states, "
                "Tensor hidden_states_scale, Tensor gemm1_weights, Tensor gemm1_weights_scale, "
                "Tensor gemm2_weights, Tensor gemm2_weights_scale, int num_experts, int top_k, "
                "int? n_group, int? topk_group, int intermediate_size, int local_expert_offset, "
                "int local_num_experts, float? routed_scaling_factor, int routing_method_type=0, "
                "bool use_shuffled_weight=False, int weight_layout=0, bool? enable_pdl=None, "
                "int tune_max_num_tokens=8192, int fp8_quantization_type=1, "
                "int? num_fused_shared_experts=None, int activation_type=3, bool norm_topk_prob=True, "
                "Tensor? routing_replay_out=None, Tensor? gemm1_alpha=None, Tensor? gemm1_beta=None, "
                "Tensor? gemm1_clamp_limit=None, Tensor output, int? valid_hidden_size=None, "
                "int? valid_intermediate_size=None, Tensor? gemm1_bias=None, Tensor? gemm2_bias=None"
            ),
            mutates=("routing_replay_out", "output"),
            outputs={"output": moe_output_shape},
            tokens_param="hidden_states",
            top_k_param="top_k",
            routes_in_kernel=True,
            writes_replay=True,
            returns="tensor",
            fixed={"do_finalize": True},
            enums={
                "weight_layout": "flashinfer.tllm_enums:WeightLayout",
                "fp8_quantization_type": "flashinfer.tllm_enums:Fp8QuantizationType",
            },
        ),
        OpSpec(
            name="trtllm_fp4_block_scale_moe",
            target="flashinfer.fused_moe:trtllm_fp4_block_scale_moe",
            params=_parse_params(
                "Tensor routing_logits, Tensor? routing_bias, Tensor hidden_states, "
                "Tensor? hidden_states_scale, Tensor gemm1_weights, Tensor gemm1_weights_scale, "
                "Tensor? gemm1_bias, Tensor? gemm1_alpha, Tensor? gemm1_beta, Tensor? gemm1_clamp_limit, "
                "Tensor gemm2_weights, Tensor gemm2_weights_scale, Tensor? gemm2_bias, "
                "Tensor? output1_scale_scalar, Tensor? output1_scale_gate_scalar, "
                "Tensor? output2_scale_scalar, int num_experts, int top_k, int? n_group, "
                "int? topk_group, int intermediate_size, int local_expert_offset, int local_num_experts, "
                "float? routed_scaling_factor, int routing_method_type=0, bool? enable_pdl=None, "
                "int activation_type=3, Tensor? per_token_scale=None, Tensor output, "
                "int tune_max_num_tokens=8192, bool norm_topk_prob=True, "
                "Tensor? routing_replay_out=None, int? num_fused_shared_experts=None, "
                "int? valid_hidden_size=None, int? valid_intermediate_size=None, "
                "int? hidden_states_scale_layout=None"
            ),
            mutates=("output", "routing_replay_out"),
            outputs={"output": moe_output_shape},
            tokens_param="hidden_states",
            top_k_param="top_k",
            routes_in_kernel=True,
            writes_replay=True,
            returns="list",
            fixed={"do_finalize": True},
            enums={"hidden_states_scale_layout": "flashinfer.tllm_enums:SfLayout"},
        ),
        OpSpec(
            name="trtllm_mxint4_block_scale_moe",
            target="flashinfer.fused_moe:trtllm_mxint4_block_scale_moe",
            params=_parse_params(
                "Tensor routing_logits, Tensor? routing_bias, Tensor hidden_states, Tensor gemm1_weights, "
                "Tensor gemm1_weights_scale, Tensor? gemm1_alpha, Tensor? gemm1_beta, "
                "Tensor? gemm1_clamp_limit, Tensor gemm2_weights, Tensor gemm2_weights_scale, "
                "int num_experts, int top_k, int? n_group, int? topk_group, int intermediate_size, "
                "int local_expert_offset, int local_num_experts, float? routed_scaling_factor, "
                "int routing_method_type=0, bool? enable_pdl=None, Tensor output, "
                "int tune_max_num_tokens=8192, bool norm_topk_prob=True, "
                "Tensor? routing_replay_out=None, int? valid_hidden_size=None, "
                "int? valid_intermediate_size=None"
            ),
            mutates=("output", "routing_replay_out"),
            outputs={"output": moe_output_shape},
            tokens_param="hidden_states",
            top_k_param="top_k",
            routes_in_kernel=True,
            writes_replay=True,
            returns="list",
            fixed={"do_finalize": True},
        ),
    )
}


def spec_for(name: str) -> OpSpec:
    """The :class:`OpSpec` of FlashInfer function ``name``; ValueError listing the known names."""
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"no wrapped FlashInfer function named {name!r}; known: {', '.join(SPECS)}")
    return spec


def check_routing_replay_out(
    replay: torch.Tensor | None, top_k: int, num_tokens: int, device: torch.device, where: str
) -> None:
    """FlashInfer's requirements on ``routing_replay_out``, checked before any kernel runs.

    replay: (rows, top_k) int16, contiguous, on ``device``, rows >= num_tokens - the kernel writes
        rows [0, num_tokens) and leaves the others untouched. None: no replay write.

    The same rules as FlashInfer's ``_validate_routing_replay_out`` and its C++ checks, raised as
    ValueError here (also at trace time, from the fake) so that a bad buffer fails before a launch.
    Reads shapes only.
    """
    if replay is None:
        return
    if not isinstance(replay, torch.Tensor):
        raise TypeError(
            f"{where}: routing_replay_out must be a torch.Tensor or None, got {type(replay).__name__}"
        )
    if replay.dtype != torch.int16:
        raise ValueError(
            f"{where}: routing_replay_out must be int16 (FlashInfer writes int16 ids), got {replay.dtype}"
        )
    if replay.dim() != 2:
        raise ValueError(
            f"{where}: routing_replay_out must be 2-D (rows, top_k), got shape {tuple(replay.shape)}"
        )
    if replay.shape[1] != top_k:
        raise ValueError(
            f"{where}: routing_replay_out must have top_k={top_k} columns, got shape {tuple(replay.shape)}"
        )
    if replay.shape[0] < num_tokens:
        raise ValueError(
            f"{where}: routing_replay_out has {replay.shape[0]} rows but the call has {num_tokens} "
            "tokens (the kernel writes one row per token, padding included)"
        )
    if not replay.is_contiguous():
        raise ValueError(f"{where}: routing_replay_out must be contiguous, got strides {replay.stride()}")
    if replay.device != device:
        raise ValueError(f"{where}: routing_replay_out must be on {device}, got {replay.device}")


def _check_buffers(spec: OpSpec, kw: Mapping[str, Any]) -> None:
    """Checks the output buffers against the table's rules and ``routing_replay_out`` (shapes only)."""
    where = f"torch.ops.{spec.qualname.replace('::', '.')}"
    tokens = kw[spec.tokens_param]
    for name, rule in spec.outputs.items():
        buf = kw[name]
        shape, dtype = rule(kw)
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(buf).__name__}")
        if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            raise ValueError(
                f"{where}: {name} must have shape {tuple(shape)} and dtype {dtype}, "
                f"got {tuple(buf.shape)} {buf.dtype}"
            )
        if buf.device != tokens.device:
            raise ValueError(f"{where}: {name} must be on {tokens.device}, got {buf.device}")
    check_routing_replay_out(
        kw["routing_replay_out"], kw[spec.top_k_param], tokens.shape[0], tokens.device, where
    )


def _bind(spec: OpSpec, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments by name: the dispatcher passes them positionally and drops trailing defaults."""
    order = spec.schema_order
    kw = {p.name: a for p, a in zip(order, args)}
    kw.update(kwargs)
    for p in order[len(args) :]:
        if p.name not in kw:
            kw[p.name] = p.default
    return kw


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _run(spec: OpSpec, kw: dict[str, Any]) -> None:
    """The real implementation: checks, then the FlashInfer call with FlashInfer's keyword names."""
    tokens = kw[spec.tokens_param]
    if tokens.device.type != "cuda":
        raise ValueError(
            f"torch.ops.moe_ops.flashinfer_{spec.name} runs a FlashInfer CUDA kernel; "
            f"{spec.tokens_param} is on {tokens.device}"
        )
    _check_buffers(spec, kw)
    support = kernel_support(spec.name, tokens.device)
    if not support.ok:
        raise ValueError(f"torch.ops.moe_ops.flashinfer_{spec.name} cannot run here: {support.reason}")
    call_kw = {p.name: kw[p.name] for p in spec.params if p.name not in spec.synthetic}
    for name, enum_path in spec.enums.items():
        if call_kw[name] is not None:
            call_kw[name] = _resolve(enum_path)(call_kw[name])
    call_kw.update(spec.fixed)
    if spec.adapt is not None:
        spec.adapt(call_kw, kw)
    result = _resolve(spec.target)(**call_kw)
    if spec.returns == "none":
        return
    # FlashInfer 0.7.2 returns the caller's ``output`` (a bare tensor from the "tensor" functions,
    # deprecated in favour of ``[output]`` from v0.8.0). Should a version hand back a fresh tensor
    # instead, copy it so the destination-passing contract holds.
    first = result[0] if isinstance(result, (list, tuple)) else result
    output = kw["output"]
    if first is not output and first.data_ptr() != output.data_ptr():
        output.copy_(first)


def _register(spec: OpSpec):
    def impl(*args, **kwargs):
        _run(spec, _bind(spec, args, kwargs))

    def fake(*args, **kwargs):
        _check_buffers(spec, _bind(spec, args, kwargs))

    impl.__name__ = f"flashinfer_{spec.name}"
    impl.__doc__ = (
        f"FlashInfer ``{spec.target}`` as a destination-passing custom op (see moe_ops.flashinfer.ops)."
    )
    # one kernel for both keys: on the CPU it raises the error that names the device
    name = spec.qualname.partition("::")[2]
    return destination_op(name, mutates=spec.mutates, cuda=impl, fake=fake, schema=spec.schema())


for _spec in SPECS.values():
    _register(_spec)
# name -> torch.ops.moe_ops.flashinfer_<name> (the packet, which dynamo traces as an op call)
_OPS = {name: getattr(torch.ops.moe_ops, f"flashinfer_{name}") for name in SPECS}


def op_for(name: str):
    """The registered op of FlashInfer function ``name`` (``torch.ops.moe_ops.flashinfer_<name>``)."""
    spec_for(name)
    return _OPS[name]


def call(name: str, /, **kwargs: Any) -> Any:
    """Calls the op of FlashInfer function ``name`` by keyword, allocating missing output buffers.

    Takes FlashInfer's parameter names and defaults (see :data:`SPECS`); an output buffer passed as
    None (or left out) is allocated with the shape and dtype the table gives (no allocation when the
    caller passes one, e.g. a static buffer for CUDA graphs). Returns ``output`` for the MoE
    kernels and ``(topk_values, topk_indices)`` for ``fused_topk_deepseek``.

    Raises TypeError for unknown or missing arguments (as a Python call would), ValueError for
    buffers that break FlashInfer's rules (dtype, shape, device), before any kernel runs.
    """
    spec = spec_for(name)
    known = {p.name for p in spec.params}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        hint = ""
        if set(unknown) & (set(spec.fixed) | set(spec.omitted)):
            hint = f" (fixed: {dict(spec.fixed)}; not exposed: {sorted(spec.omitted)})"
        raise TypeError(f"flashinfer {name}: unexpected argument(s) {unknown}{hint}")
    kw = dict(kwargs)
    missing = [
        p.name for p in spec.params if not p.has_default and p.name not in spec.outputs and p.name not in kw
    ]
    if missing:
        raise TypeError(f"flashinfer {name}: missing required argument(s) {missing}")
    for p in spec.params:
        if p.name not in kw:
            kw[p.name] = p.default
    device = kw[spec.tokens_param].device
    for out_name, rule in spec.outputs.items():
        if kw[out_name] is None:
            shape, dtype = rule(kw)
            kw[out_name] = torch.empty(shape, dtype=dtype, device=device)
    _OPS[name](*[kw[p.name] for p in spec.schema_order])
    if spec.returns == "none":
        return tuple(kw[out_name] for out_name in spec.outputs)
    return kw["output"]
