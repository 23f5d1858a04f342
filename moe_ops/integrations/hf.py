"""Hugging Face ``transformers``: record the routing of a MoE model you did not write.

``attach_capture(model, capturer)`` finds the router module of every MoE layer of a transformers
model and wraps its ``forward`` so that the ids the router returns - the very tensor the experts
consume next - also flow into ``capturer.capture(layer, ids, layout=layout)``. No model code is
edited; ``remove()`` (or leaving the ``with`` block) restores every router::

    shape = moe_ops.resolve_routing_shape(model.config)
    capturer = moe_ops.RoutingCapturer(shape, max_num_tokens, device)
    with attach_capture(model, capturer):
        capturer.set_step([num_tokens])
        model(input_ids)           # eager, torch.compile'd or replayed from a CUDA graph

The router contract, shared by every supported architecture in transformers 5.x: the router
module's ``forward(hidden_states)`` returns a tuple ``(router_logits, weights, ids)`` whose one
integer tensor is ``ids``, ``(n_tokens, top_k)`` - the flattened ``(batch * seq)`` tokens in
row-major order. The wrapper picks the integer tensor rather than a position because GraniteMoE
returned ``(ids, weights, logits)`` up to transformers 5.17 and ``(logits, weights, ids)`` since.

The layer index handed to the capturer is the decoder layer parsed from the router's module path
(``model.layers.3.mlp.gate`` -> 3): the MODEL layer index, which ``RoutingCapturer`` maps to its
MoE-only layer axis (dense layers, e.g. DeepSeek's first ``first_k_dense_replace``, have no router
and no column; see docs/shapes.md).

Compile and graph safety: the wrapper is plain Python around the registered capture op, so dynamo
inlines it (no graph break) and a CUDA graph records the op (no host read). It replaces the
router's ``forward`` attribute instead of registering a forward hook because dynamo guards on that
attribute and not on hooks: attaching or removing after a model was compiled recompiles (or reuses
the graph compiled for that state) instead of silently replaying a stale graph.

``transformers`` is imported lazily, by :func:`tiny_config` and :func:`build_tiny_model` only;
``import moe_ops`` never imports it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ..layout import BatchLayout, layout_from_value

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CaptureHandle",
    "HFArchitecture",
    "attach_capture",
    "build_tiny_model",
    "find_routers",
    "normalize_arch",
    "tiny_config",
]


@dataclass(frozen=True)
class HFArchitecture:
    """One supported transformers architecture: where its routers are and how to build a tiny one."""

    # transformers' ``config.model_type`` (the registry key), e.g. "qwen3_moe"
    name: str
    # config class exported by transformers, e.g. "Qwen3MoeConfig"
    config_class: str
    # causal-LM class exported by transformers, e.g. "Qwen3MoeForCausalLM"
    model_class: str
    # class names of the router modules; forward returns (router_logits, weights, ids), ids integer
    router_classes: tuple[str, ...]
    # config fields of the tiny model on top of _TINY_COMMON (experts, top_k, dense layers, ...)
    tiny: Mapping[str, Any] = field(default_factory=dict)


# Sizes every tiny model shares: 3 decoder layers, hidden 64, 4 heads of 16, vocabulary 128. Token
# ids 0-2 are the special tokens (the defaults of some configs lie outside a 128-token vocabulary).
_TINY_COMMON: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
)
# Multi-head latent attention (DeepSeek-V2/V3): small low-rank projections, q head 8 + 8, and as
# many key/value heads as query heads, like the released models (transformers 5.17's sdpa path fails
# to trace under torch.compile with fewer).
_TINY_MLA: Mapping[str, Any] = MappingProxyType(
    {
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "num_key_value_heads": 4,
    }
)


def _arch(name: str, config_class: str, model_class: str, router: str, **tiny: Any) -> HFArchitecture:
    return HFArchitecture(name, config_class, model_class, (router,), MappingProxyType(tiny))


# Every router class here has the same (router_logits, weights, ids) contract and the same class
# name in transformers 5.17 and 5.24 (checked against both sources).
SUPPORTED_ARCHITECTURES: Mapping[str, HFArchitecture] = MappingProxyType(
    {
        a.name: a
        for a in (
            _arch(
                "qwen3_moe",
                "Qwen3MoeConfig",
                "Qwen3MoeForCausalLM",
                "Qwen3MoeTopKRouter",
                head_dim=16,
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
            ),
            _arch(
                "mixtral",
                "MixtralConfig",
                "MixtralForCausalLM",
                "MixtralTopKRouter",
                head_dim=16,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
            _arch(
                "olmoe",
                "OlmoeConfig",
                "OlmoeForCausalLM",
                "OlmoeTopKRouter",
                intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
            ),
            # 16 experts in 4 groups, 2 groups per token, top-4; layer 0 dense
            _arch(
                "deepseek_v3",
                "DeepseekV3Config",
                "DeepseekV3ForCausalLM",
                "DeepseekV3TopkRouter",
                **_TINY_MLA,
                moe_intermediate_size=32,
                n_routed_experts=16,
                num_experts_per_tok=4,
                n_group=4,
                topk_group=2,
                first_k_dense_replace=1,
                n_shared_experts=1,
            ),
            # YaRN factor 4 = max_position_embeddings 256 / original 64 (the default 32 warns)
            _arch(
                "gpt_oss",
                "GptOssConfig",
                "GptOssForCausalLM",
                "GptOssTopKRouter",
                head_dim=16,
                intermediate_size=32,
                num_local_experts=8,
                num_experts_per_tok=2,
                sliding_window=8,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 4.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 64,
                },
            ),
            _arch(
                "qwen2_moe",
                "Qwen2MoeConfig",
                "Qwen2MoeForCausalLM",
                "Qwen2MoeTopKRouter",
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
            ),
            _arch(
                "deepseek_v2",
                "DeepseekV2Config",
                "DeepseekV2ForCausalLM",
                "DeepseekV2TopkRouter",
                **_TINY_MLA,
                moe_intermediate_size=32,
                n_routed_experts=8,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                n_shared_experts=1,
            ),
            _arch(
                "glm4_moe",
                "Glm4MoeConfig",
                "Glm4MoeForCausalLM",
                "Glm4MoeTopkRouter",
                head_dim=16,
                moe_intermediate_size=32,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                n_shared_experts=1,
            ),
            _arch(
                "dots1",
                "Dots1Config",
                "Dots1ForCausalLM",
                "Dots1TopkRouter",
                head_dim=16,
                moe_intermediate_size=32,
                n_routed_experts=8,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                n_shared_experts=1,
            ),
            _arch(
                "flex_olmo",
                "FlexOlmoConfig",
                "FlexOlmoForCausalLM",
                "FlexOlmoTopKRouter",
                intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
            ),
            # sparsemixer routing: top-2 only
            _arch(
                "phimoe",
                "PhimoeConfig",
                "PhimoeForCausalLM",
                "PhimoeTopKRouter",
                head_dim=16,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
            # the router returned (ids, weights, logits) up to 5.17, (logits, weights, ids) since
            _arch(
                "granitemoe",
                "GraniteMoeConfig",
                "GraniteMoeForCausalLM",
                "GraniteMoeTopKRouter",
                intermediate_size=32,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
        )
    }
)


def _supported() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def normalize_arch(arch: str) -> str:
    """The registry key of ``arch``: transformers' ``model_type``, case and '-' forgiven.

    ``"Qwen3-MoE"`` -> ``"qwen3_moe"``, ``"DeepSeek-V3"`` -> ``"deepseek_v3"``, ``"GPT-OSS"`` ->
    ``"gpt_oss"``. ValueError listing the supported architectures for anything else.
    """
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str (a transformers model_type), got {type(arch).__name__}")
    key = arch.strip().lower().replace("-", "_")
    if key not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported (model_type): {_supported()}")
    return key


# ---------------------------------------------------------------------------------------------
# Finding the routers
# ---------------------------------------------------------------------------------------------

# "model.layers.3.mlp.gate" -> 3: the index after the last "layers" component of the path
_LAYER_IN_PATH = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")


def _layer_of(path: str) -> int:
    matches = _LAYER_IN_PATH.findall(path)
    if not matches:
        raise ValueError(
            f"cannot tell the decoder layer of the router at {path!r}: expected a module path like "
            "'model.layers.<i>.mlp.gate'"
        )
    return int(matches[-1])


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(
            f"model must be a transformers model with config.model_type (got {type(model).__name__} "
            f"without one); supported architectures: {_supported()}"
        )
    return model_type


def find_routers(model: nn.Module) -> tuple[str, list[tuple[int, str, nn.Module]]]:
    """The architecture of ``model`` and its routers as ``(decoder layer, module path, module)``.

    Sorted by layer. ValueError for an unsupported ``config.model_type`` (listing the supported
    ones), for a model without routers, for a router outside a ``layers.<i>`` path, and for two
    routers in one decoder layer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model_type = _model_type(model)
    arch = SUPPORTED_ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(
            f"attach_capture does not support model_type {model_type!r} ({type(model).__name__}); "
            f"supported: {_supported()}"
        )
    routers = [
        (_layer_of(path), path, module)
        for path, module in model.named_modules()
        if type(module).__name__ in arch.router_classes
    ]
    if not routers:
        raise ValueError(
            f"found no router ({', '.join(arch.router_classes)}) in this {model_type} model "
            f"({type(model).__name__}): nothing to capture. Was the MoE block replaced, e.g. by a "
            "hub kernel (use_kernels=True) that routes internally?"
        )
    routers.sort(key=lambda r: r[0])
    seen: dict[int, str] = {}
    for layer, path, _ in routers:
        if layer in seen:
            raise ValueError(
                f"two routers in decoder layer {layer} ({seen[layer]!r} and {path!r}): one buffer "
                "column per layer cannot hold both"
            )
        seen[layer] = path
    return arch.name, routers


# ---------------------------------------------------------------------------------------------
# Attaching
# ---------------------------------------------------------------------------------------------


def _routed_ids(output: Any) -> torch.Tensor:
    """The integer tensor of a router's output tuple: ``(n_tokens, top_k)`` expert ids.

    Reads dtypes and shapes only (trace-time metadata under torch.compile), never values.
    """
    if isinstance(output, (tuple, list)):
        ints = [
            t
            for t in output
            if isinstance(t, torch.Tensor)
            and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
        ]
        if len(ints) == 1:
            ids = ints[0]
            return ids if ids.dim() == 2 else ids.reshape(-1, ids.shape[-1])
    raise TypeError(
        "a router's forward must return (router_logits, weights, ids) with exactly one integer tensor "
        f"(the expert ids); got {_describe(output)}"
    )


def _describe(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor {tuple(output.shape)} {output.dtype}"
    if isinstance(output, (tuple, list)):
        return "(" + ", ".join(_describe(o) for o in output) + ")"
    return type(output).__name__


# set on our forward wrappers, so that a second attach_capture on one router is refused
_MARK = "_moe_ops_capture"


def _capturing_forward(original: Callable, capturer: Any, layer: int, layout: BatchLayout) -> Callable:
    """``original`` followed by ``capturer.capture(layer, ids, layout=layout)``; returns its output.

    Dynamo inlines it (a closure over plain Python values and the registered capture op).
    """

    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        capturer.capture(layer, _routed_ids(output), layout=layout)
        return output

    setattr(forward, _MARK, True)
    return forward


def _check_against_shape(capturer: Any, routers: list[tuple[int, str, nn.Module]]) -> None:
    """Checks the routers found against ``capturer.shape`` (a RoutingShape) when it has one."""
    shape = getattr(capturer, "shape", None)
    moe_layers = getattr(shape, "moe_layers", None)
    if moe_layers is None:
        return
    found = tuple(layer for layer, _, _ in routers)
    if tuple(moe_layers) != found:
        raise ValueError(
            f"capturer.shape.moe_layers={tuple(moe_layers)} but the model's routers are in decoder "
            f"layers {found}: build the capturer's shape from this model's config "
            "(moe_ops.resolve_routing_shape(model.config))"
        )
    top_k = getattr(shape, "top_k", None)
    for _, path, module in routers:
        router_k = getattr(module, "top_k", None)
        if isinstance(router_k, int) and top_k is not None and router_k != top_k:
            raise ValueError(
                f"capturer.shape.top_k={top_k} but the router at {path!r} picks top_k={router_k}"
            )


def _check_device(capturer: Any, routers: list[tuple[int, str, nn.Module]]) -> None:
    buffer = getattr(capturer, "buffer", None)
    if not isinstance(buffer, torch.Tensor):
        return
    for _, path, module in routers:
        for p in module.parameters(recurse=False):
            if p.device.type != "meta" and p.device != buffer.device:
                raise ValueError(
                    f"capturer.buffer is on {buffer.device} but the router at {path!r} has its weights on "
                    f"{p.device}: create the capturer on the model's device"
                )
            break


@dataclass
class CaptureHandle:
    """What :func:`attach_capture` attached; ``remove()`` (or leaving a ``with`` block) undoes it."""

    # registry key of the model's architecture (config.model_type), e.g. "deepseek_v3"
    arch: str
    # decoder-layer index of each wrapped router, strictly increasing
    layers: tuple[int, ...]
    # module path of each wrapped router, same order as layers
    paths: tuple[str, ...]
    # (router, forward it had in its instance __dict__ or None, our wrapper); empty once removed
    _wrapped: list[tuple[nn.Module, Callable | None, Callable]] = field(repr=False, default_factory=list)

    @property
    def attached(self) -> bool:
        """True until :meth:`remove`."""
        return bool(self._wrapped)

    def remove(self) -> None:
        """Restores every router's ``forward``; a second call does nothing.

        RuntimeError, before anything is restored, when some router's ``forward`` was replaced by
        someone else after :func:`attach_capture` (remove that wrapper first).
        """
        for path, (module, _, wrapper) in zip(self.paths, self._wrapped):
            if module.__dict__.get("forward") is not wrapper:
                raise RuntimeError(
                    f"the forward of the router at {path!r} was replaced after attach_capture; "
                    "remove that wrapper first"
                )
        for module, previous, _ in self._wrapped:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._wrapped = []

    def __enter__(self) -> CaptureHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def attach_capture(
    model: nn.Module, capturer: Any, *, layout: BatchLayout | int = BatchLayout.LOCAL
) -> CaptureHandle:
    """Records the routing of every MoE layer of a transformers ``model`` into ``capturer``.

    Args:
        model: a transformers model of a supported architecture (``SUPPORTED_ARCHITECTURES``,
            keyed by ``config.model_type``): the ``*ForCausalLM`` or its base model.
        capturer: where ids go, e.g. :class:`moe_ops.RoutingCapturer`: an object with
            ``capture(layer_id, topk_ids, layout=...)`` taking the MODEL layer index. With a
            ``shape`` (RoutingShape) its ``moe_layers`` must be exactly the decoder layers that have
            a router, and its ``top_k`` the routers' top_k.
        layout: the :class:`BatchLayout` of the router's rows (LOCAL for a transformers model run
            on one rank: the flattened ``(batch * seq)`` tokens, padding rows last).

    Returns a :class:`CaptureHandle`; ``handle.remove()`` or ``with attach_capture(...):`` restores
    the routers. Per forward, each router's ids ``(batch * seq, top_k)`` go to
    ``capturer.capture(layer, ids, layout=layout)``, which records rows ``[0, token_counts[rank])``
    (LOCAL): set the capturer's counts before the forward (``capturer.set_step``).

    Everything is checked before any router is touched: ValueError for an unsupported architecture
    (listing the supported ones), a model without routers, a capturer shape or device that does not
    fit the model, or a router that already has a capture attached; TypeError for a capturer
    without ``capture``.

    Attach before or after ``torch.compile``: dynamo guards on the wrapped ``forward``, so the
    first compiled call after attaching (or removing) recompiles, or reuses a graph compiled for
    that state. No host reads and no graph breaks are added; CUDA graphs record the capture op.
    """
    if not callable(getattr(capturer, "capture", None)):
        raise TypeError(
            "capturer must have a capture(layer_id, topk_ids, layout=...) method (e.g. "
            f"moe_ops.RoutingCapturer), got {type(capturer).__name__}"
        )
    layout = layout_from_value(layout)
    arch, routers = find_routers(model)
    _check_against_shape(capturer, routers)
    _check_device(capturer, routers)
    for _, path, module in routers:
        if getattr(module.__dict__.get("forward"), _MARK, False):
            raise ValueError(
                f"the router at {path!r} already has a routing capture attached: remove() that handle first"
            )
    wrapped = []
    for layer, _, module in routers:
        previous = module.__dict__.get("forward")
        wrapper = _capturing_forward(module.forward, capturer, layer, layout)
        module.forward = wrapper
        wrapped.append((module, previous, wrapper))
    return CaptureHandle(
        arch=arch,
        layers=tuple(layer for layer, _, _ in routers),
        paths=tuple(path for _, path, _ in routers),
        _wrapped=wrapped,
    )


# ---------------------------------------------------------------------------------------------
# Tiny models (tests, the demo): real config and model classes, random weights, no downloads
# ---------------------------------------------------------------------------------------------


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the transformers integration needs transformers: pip install 'moe-ops[hf]'") from e
    return transformers


def _class(transformers, name: str, arch: str):
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ImportError(f"transformers {transformers.__version__} has no {name} (needed for {arch})")
    return cls


def tiny_config(arch: str, **overrides: Any):
    """The real transformers config of ``arch`` with tiny sizes; ``overrides`` replace any field.

    Tiny: 3 decoder layers, hidden 64, 4 heads, vocabulary 128, 8 experts top-2 (DeepSeek-V3: 16
    experts in 4 groups, top-4); DeepSeek-V2/V3, GLM-4-MoE and dots1 keep their first layer dense.
    ``arch`` is a key of ``SUPPORTED_ARCHITECTURES`` (see :func:`normalize_arch`).
    """
    spec = SUPPORTED_ARCHITECTURES[normalize_arch(arch)]
    transformers = _transformers()
    config_cls = _class(transformers, spec.config_class, spec.name)
    return config_cls(**{**_TINY_COMMON, **spec.tiny, **overrides})


def build_tiny_model(
    arch: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str = "cpu",
    **overrides: Any,
) -> nn.Module:
    """The real ``*ForCausalLM`` of ``arch`` built from :func:`tiny_config`, random weights, eval mode.

    Weights come from transformers' own initialisation under ``torch.manual_seed(seed)`` on the CPU
    (the global RNG state is restored afterwards), so one seed gives the same model everywhere the
    torch version is the same; then the model moves to ``device`` and ``dtype``.
    """
    spec = SUPPORTED_ARCHITECTURES[normalize_arch(arch)]
    config = tiny_config(spec.name, **overrides)
    model_cls = _class(_transformers(), spec.model_class, spec.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(device=device, dtype=dtype).eval()
