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

``attach_replay(model, replayer)`` is the trainer's mirror: the same routers, wrapped the same way,
return the ids of ``replayer.layer_ids(layer, n)`` (a ``RoutingReplayer``'s buffer) with weights
recomputed from the live logits by each architecture's own rule (:data:`REPLAY_RULES`), so the
experts compute with the rollout's routing and gradients reach the routers (docs/replay.md).

``transformers`` is imported lazily, by :func:`tiny_config` and :func:`build_tiny_model` only;
``import moe_ops`` never imports it.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ..capture.protocol import Capturer, check_capturer
from ..layout import BatchLayout, layout_from_value
from ..models.attach import attach_replay as attach_own_replay
from ..models.attach import lists_its_routers
from ..replay.attach import (
    CAPTURE_MARK,
    AttachHandle,
    ReplayHandle,
    ReplayRule,
    RouterSite,
    attach_wrappers,
    check_against_shape,
    check_device,
    check_replay_sites,
    check_replayer,
    describe_output,
    replaying_forward,
)
from ..router.methods import RoutingMethod

__all__ = [
    "REPLAY_RULES",
    "SUPPORTED_ARCHITECTURES",
    "CaptureHandle",
    "HFArchitecture",
    "ReplayHandle",
    "attach_capture",
    "attach_replay",
    "build_tiny_model",
    "check_transformers_version",
    "find_routers",
    "needs_release",
    "normalize_arch",
    "replay_rule",
    "tiny_config",
]


# The oldest transformers on which every supported architecture has the router module this
# integration wraps (bisected over 4.57.1-5.24 with tests/test_hf_attach.py and
# tests/test_replay_attach.py): in 5.0-5.12 DeepSeek-V2 and GraniteMoE have no router module (the MoE
# block routes inline) and the routers of DeepSeek-V3, GLM-4-MoE and dots1 return only the logits
# (4.57: 8 of the 12 have none). The GPU machine runs 5.17.
MIN_TRANSFORMERS_VERSION = "5.13"

# Replay needs more on some architectures: GraniteMoE's perturbed-router replay test fails on
# 5.13-5.20 (passes from 5.22; 5.21 untried), so attach_replay refuses it there rather than
# replaying wrong ids. (The compiled training step of Qwen3-MoE and DeepSeek-V3 also fails before
# 5.23, inside transformers: a data-dependent guard in its grouped_mm backward under torch.compile;
# eager replay is unaffected, so that is documented, not refused.)
MIN_REPLAY_TRANSFORMERS_VERSION = {"granitemoe": "5.22"}


def check_transformers_version(
    installed: str,
    required: str = MIN_TRANSFORMERS_VERSION,
    why: str = "the router modules of every supported architecture",
) -> None:
    """ImportError naming both versions (and ``why``) when transformers ``installed`` is older than
    ``required``.

    PEP 440 order (``packaging``, a transformers dependency): a pre-release of ``required``
    (``"5.2.0rc1"``, ``"5.2.0.dev0"``) is older than it, a local build (``"5.2.0+cu"``) is not.
    ValueError naming ``installed`` for a string that is no version.
    """
    from packaging.version import InvalidVersion, Version

    try:
        have = Version(installed)
    except (InvalidVersion, TypeError):
        raise ValueError(f"installed must be a PEP 440 version string, got {installed!r}") from None
    if have < Version(required):
        raise ImportError(
            f"moe_ops.integrations.hf needs transformers>={required} ({why}), "
            f"but transformers {installed} is installed: "
            f"pip install 'transformers>={required}'"
        )


def _check_loaded_transformers() -> None:
    """:func:`check_transformers_version` on the transformers this process imported, if any (a
    model of a supported ``model_type`` that is not from transformers needs no version)."""
    transformers = sys.modules.get("transformers")
    version = getattr(transformers, "__version__", None)
    if isinstance(version, str):
        check_transformers_version(version, MIN_TRANSFORMERS_VERSION)


def _check_replay_version(arch: str) -> None:
    """ImportError where the imported transformers is older than ``arch`` needs for replay
    (``MIN_REPLAY_TRANSFORMERS_VERSION``)."""
    required = MIN_REPLAY_TRANSFORMERS_VERSION.get(arch)
    transformers = sys.modules.get("transformers")
    version = getattr(transformers, "__version__", None)
    if required is not None and isinstance(version, str):
        why = f"attach_replay of {arch}: older releases replay other ids"
        check_transformers_version(version, required, why)


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
    # the sub-config holding the decoder's fields in a multimodal config ("text_config"): the tiny
    # fields and the overrides go there; None: the config itself
    decoder_config: str | None = None
    # fields of the outer config of a nested one (a tiny vision tower, ...); empty otherwise
    outer: Mapping[str, Any] = field(default_factory=dict)
    # the transformers release this architecture was checked on, where its classes are newer than
    # MIN_TRANSFORMERS_VERSION (skip reasons and errors name it); None: every release this takes
    checked_on: str | None = None
    # fills what transformers' initialisation leaves to the checkpoint, as a checkpoint would
    # (DeepSeek-V4's hash tables, all zeros at init): (model, generator) -> None; None: nothing
    tiny_init: Callable[[nn.Module, torch.Generator], None] | None = field(default=None, compare=False)


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


# Qwen3.5-MoE's decoder: hybrid attention (Gated DeltaNet linear attention and full attention, both
# kinds in 3 layers), a shared expert beside the routed ones, every layer MoE. Partial rotary 0.5 of
# head 16 gives 4 frequencies, split 2/1/1 over the t/h/w positions as the released 11/11/10 split
# the 32 of its head 256 at 0.25.
_TINY_QWEN3_5_MOE: Mapping[str, Any] = MappingProxyType(
    {
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "full_attention_interval": 2,  # layer_types linear, full, linear, ... (any layer count)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }
)


# DeepSeek-V4: multi-head latent attention with one shared key/value head (its released shape),
# hyper-connections of 2 streams, 8 experts top-2 with sqrtsoftplus scores, layer 0 a hash layer
# (num_hash_layers, which its config folds into mlp_layer_types for any layer count) and the
# others routed; attention as its config defaults for 3 layers (heavily compressed, 128 tokens per
# entry: a tiny batch compresses nothing, the sliding window of 8 does the attending).
_TINY_DEEPSEEK_V4: Mapping[str, Any] = MappingProxyType(
    {
        "num_key_value_heads": 1,
        "head_dim": 16,
        "q_lora_rank": 32,
        "partial_rotary_factor": 0.5,
        "intermediate_size": 32,  # DeepseekV4Config's alias of moe_intermediate_size
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "num_hash_layers": 1,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "sliding_window": 8,
        "hc_mult": 2,
    }
)


def _fill_deepseek_v4_tables(model: nn.Module, gen: torch.Generator) -> None:
    """What a DeepSeek-V4 checkpoint holds and transformers' initialisation zeroes: each hash
    router's ``tid2eid`` (top_k distinct experts per token id, drawn from ``gen``: all zeros would
    route every token to expert 0 top_k times) and each routed router's ``e_score_correction_bias``
    (std 0.02, the order of the tiny model's score spread, so that the bias changes choices)."""
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if name == "DeepseekV4HashRouter":
                vocab, top_k = module.tid2eid.shape
                rows = [torch.randperm(module.num_experts, generator=gen)[:top_k] for _ in range(vocab)]
                module.tid2eid.copy_(torch.stack(rows))
            elif name == "DeepseekV4TopKRouter":
                bias = module.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=gen, dtype=torch.float32) * 0.02)


# Every router class here has the same (router_logits, weights, ids) contract and the same class
# name in transformers 5.17 and 5.24 (checked against both sources; GLM-4.7-Flash's and
# Qwen3.5-MoE's against 5.13 too, the oldest release this integration takes), except those with a
# checked_on release (DeepSeek-V4: 5.24 only; 5.17 has no deepseek_v4 module).
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
            # GLM-4.7-Flash: DeepSeek-V3's latent attention and router (sigmoid scores, correction
            # bias, groups, routed_scaling_factor 1.8); layer 0 dense (mlp_layer_types)
            _arch(
                "glm4_moe_lite",
                "Glm4MoeLiteConfig",
                "Glm4MoeLiteForCausalLM",
                "Glm4MoeLiteTopkRouter",
                **_TINY_MLA,
                moe_intermediate_size=32,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                n_shared_experts=1,
            ),
            # DeepSeek-V4: two router classes, the hash router's forward takes (hidden_states,
            # input_ids), which every wrapper passes through
            HFArchitecture(
                "deepseek_v4",
                "DeepseekV4Config",
                "DeepseekV4ForCausalLM",
                ("DeepseekV4TopKRouter", "DeepseekV4HashRouter"),
                _TINY_DEEPSEEK_V4,
                checked_on="5.24",
                tiny_init=_fill_deepseek_v4_tables,
            ),
            # Qwen3.5-MoE as released (model_type "qwen3_5_moe"): the multimodal model, its decoder
            # in text_config, its routers at model.language_model.layers.<i>.mlp.gate; a one-block
            # vision tower that a text-only input never runs
            HFArchitecture(
                "qwen3_5_moe",
                "Qwen3_5MoeConfig",
                "Qwen3_5MoeForConditionalGeneration",
                ("Qwen3_5MoeTopKRouter",),
                _TINY_QWEN3_5_MOE,
                decoder_config="text_config",
                outer=MappingProxyType(
                    {
                        "vision_config": {
                            "depth": 1,
                            "hidden_size": 32,
                            "intermediate_size": 32,
                            "num_heads": 2,
                            "out_hidden_size": 64,
                        }
                    }
                ),
            ),
            # Qwen3.5-MoE's decoder alone: what AutoModelForCausalLM builds from a Qwen3.5-MoE
            # checkpoint (model_type "qwen3_5_moe_text"), routers at model.layers.<i>.mlp.gate
            HFArchitecture(
                "qwen3_5_moe_text",
                "Qwen3_5MoeTextConfig",
                "Qwen3_5MoeForCausalLM",
                ("Qwen3_5MoeTopKRouter",),
                _TINY_QWEN3_5_MOE,
            ),
        )
    }
)


def _supported() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def normalize_arch(arch: str) -> str:
    """The registry key of ``arch``: transformers' ``model_type``, case and '-' forgiven.

    ``"Qwen3-MoE"`` -> ``"qwen3_moe"``, ``"DeepSeek-V3"`` -> ``"deepseek_v3"``, ``"GPT-OSS"`` ->
    ``"gpt_oss"``, ``"Qwen3.5-MoE"`` -> ``"qwen3_5_moe"``. ValueError listing the supported
    architectures for anything else.
    """
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str (a transformers model_type), got {type(arch).__name__}")
    key = arch.strip().lower().replace("-", "_").replace(".", "_")
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


def find_routers(
    model: nn.Module, *, caller: str = "attach_capture"
) -> tuple[str, list[tuple[int, str, nn.Module]]]:
    """The architecture of ``model`` and its routers as ``(decoder layer, module path, module)``.

    Sorted by layer. ImportError when the imported transformers is older than
    ``MIN_TRANSFORMERS_VERSION``; ValueError for an unsupported ``config.model_type`` (listing the
    supported ones), for a model without routers, for a router outside a ``layers.<i>`` path, and
    for two routers in one decoder layer. ``caller`` names the function in the unsupported-model
    message.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_loaded_transformers()
    model_type = _model_type(model)
    arch = SUPPORTED_ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(
            f"{caller} does not support model_type {model_type!r} ({type(model).__name__}); "
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
        f"(the expert ids); got {describe_output(output)}"
    )


def _sites(routers: list[tuple[int, str, nn.Module]]) -> list[RouterSite]:
    """The routers :func:`find_routers` found, as the sites an attach wraps (their ``forward``)."""
    return [RouterSite(layer, path, module) for layer, path, module in routers]


def _capturing_forward(original: Callable, capturer: Capturer, layer: int, layout: BatchLayout) -> Callable:
    """``original`` followed by ``capturer.capture(layer, ids, layout=layout)``; returns its output.

    Dynamo inlines it (a closure over plain Python values and the registered capture op).
    """

    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        capturer.capture(layer, _routed_ids(output), layout=layout)
        return output

    setattr(forward, CAPTURE_MARK, True)
    return forward


class CaptureHandle(AttachHandle):
    """What :func:`attach_capture` attached; ``remove()`` (or leaving a ``with`` block) undoes it.
    See :class:`~moe_ops.replay.attach.AttachHandle` (``rules`` is ``()``)."""


def attach_capture(
    model: nn.Module, capturer: Capturer, *, layout: BatchLayout | int = BatchLayout.LOCAL
) -> CaptureHandle:
    """Records the routing of every MoE layer of a transformers ``model`` into ``capturer``.

    Args:
        model: a transformers model of a supported architecture (``SUPPORTED_ARCHITECTURES``,
            keyed by ``config.model_type``): the ``*ForCausalLM`` or its base model.
        capturer: where ids go, a :class:`~moe_ops.capture.Capturer` (e.g.
            :class:`moe_ops.RoutingCapturer`); only its ``capture(layer_id, topk_ids,
            layout=...)`` is called, with the MODEL layer index. With a ``shape`` (RoutingShape)
            its ``moe_layers`` must be exactly the decoder layers that have a router, and its
            ``top_k`` the routers' top_k; with a ``buffer``, on the routers' device.
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
    check_capturer(capturer, members=("capture",))
    layout = layout_from_value(layout)
    arch, routers = find_routers(model)
    sites = _sites(routers)
    check_against_shape(capturer, sites, "capturer")
    check_device(capturer, sites, "capturer")
    for site in sites:
        if site.wrapped_by(CAPTURE_MARK):
            raise ValueError(
                f"the router at {site.path!r} already has a routing capture attached: "
                "remove() that handle first"
            )
    wrappers = [_capturing_forward(site.module.forward, capturer, site.layer, layout) for site in sites]
    return attach_wrappers(CaptureHandle, "capture", arch, sites, wrappers)


# ---------------------------------------------------------------------------------------------
# Replaying: every router returns the recorded ids, weighted by its own rule
# ---------------------------------------------------------------------------------------------


def _softmax_topk_rule(router: nn.Module) -> ReplayRule:
    """Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo: softmax over every expert, top-k of it, and with
    ``norm_topk_prob`` the k values renormalised (equal to a softmax over the k logits)."""
    if router.norm_topk_prob:
        return ReplayRule(
            RoutingMethod.RENORMALIZE, description="softmax(x)[ids] renormalised (norm_topk_prob)"
        )
    return ReplayRule(RoutingMethod.DEFAULT, description="softmax(x)[ids], not renormalised")


def _renormalize_rule(router: nn.Module) -> ReplayRule:
    """Mixtral and Qwen3.5-MoE (softmax, top-k, renormalised, with no field to turn it off), GPT-OSS
    and GraniteMoE (softmax over the top-k logits; GPT-OSS's logits include the router's bias)."""
    return ReplayRule(RoutingMethod.RENORMALIZE, description="softmax(x[ids])")


def _sigmoid_weights(
    router_logits: torch.Tensor, ids: torch.Tensor, *, norm: bool, scale: float
) -> torch.Tensor:
    # the DeepSeek-V3 family's weights, in its router's own order of operations
    weights = router_logits.sigmoid().gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


def _sigmoid_bias_rule(router: nn.Module) -> ReplayRule:
    """DeepSeek-V3, GLM-4-MoE, GLM-4.7-Flash, dots1: sigmoid scores, chosen with
    ``e_score_correction_bias`` in groups; weights the unbiased scores, divided by their sum + 1e-20
    with ``norm_topk_prob``, times ``routed_scaling_factor``.

    The weights are torch ops (``_sigmoid_weights``), the scale a multiplier of a tensor: under
    ``torch.compile`` a float field that changed becomes a symbolic float (dynamo's automatic
    dynamic), which a tensor multiply takes but ``replay_routing``'s float argument would not (its
    argument check is a graph break on one). ``replay_routing`` still decides the ids (the bias and
    groups of faulty rows routed live)."""
    groups = dict(n_group=router.num_group, topk_group=router.topk_group if router.num_group else None)
    norm = bool(router.norm_topk_prob)
    return ReplayRule(
        RoutingMethod.DEEPSEEK_V3,
        **groups,
        bias_attr="e_score_correction_bias",
        weights_fn=functools.partial(_sigmoid_weights, norm=norm, scale=router.routed_scaling_factor),
        description=(
            "sigmoid(x)[ids] / (sum + 1e-20) * routed_scaling_factor"
            if norm
            else "sigmoid(x)[ids] * routed_scaling_factor (norm_topk_prob=False)"
        ),
    )


def _scaled_softmax(router_logits: torch.Tensor, ids: torch.Tensor, *, scale: float) -> torch.Tensor:
    # DeepSeek-V2's rule, as its router computes it
    return router_logits.softmax(dim=-1, dtype=torch.float32).gather(1, ids) * scale


def _deepseek_v2_rule(router: nn.Module) -> ReplayRule:
    """DeepSeek-V2: softmax over every expert; ``greedy`` takes its top-k, ``group_limited_greedy``
    the top-k inside the best groups (by their best expert: DEEPSEEK_V2 with its groups, so faulty
    rows route live as the model does); either way the weights are
    ``softmax(x)[ids] * routed_scaling_factor`` (this router never applies ``norm_topk_prob``).

    DEEPSEEK_V2's own rule with ``routed_scaling_factor=`` gives these weights to float32 rounding
    (tested), but the scale stays a tensor multiply (``weights_fn``) for the reason
    :func:`_sigmoid_bias_rule` gives: a changed field is a symbolic float under ``torch.compile``,
    which ``replay_routing``'s float argument turns into a graph break (fullgraph: an error)."""
    if router.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"DeepSeek-V2 topk_method must be 'greedy' or 'group_limited_greedy', got {router.topk_method!r}"
        )
    groups = {}
    if router.topk_method == "group_limited_greedy":
        groups = dict(n_group=router.num_group, topk_group=router.topk_group)
    scale = router.routed_scaling_factor
    if scale == 1.0:
        return ReplayRule(RoutingMethod.DEEPSEEK_V2, **groups, description="softmax(x)[ids]")
    return ReplayRule(
        RoutingMethod.DEEPSEEK_V2,
        **groups,
        weights_fn=functools.partial(_scaled_softmax, scale=scale),
        description="softmax(x)[ids] * routed_scaling_factor",
    )


# DeepSeek-V4's score function (the router's ``score_fn``, transformers' ACT2FN[scoring_func]) by
# class name -> the method whose weight rule is the router's ``score * scale / (sum + 1e-20)``
_DEEPSEEK_V4_SCORES: Mapping[str, tuple[RoutingMethod, str]] = MappingProxyType(
    {
        "SqrtSoftplusActivation": (RoutingMethod.SQRTSOFTPLUS, "sqrt(softplus(x))"),
        "Sigmoid": (RoutingMethod.DEEPSEEK_V3, "sigmoid(x)"),
    }
)


def _scored_weights(
    router_logits: torch.Tensor, ids: torch.Tensor, *, score_fn: nn.Module, scale: float
) -> torch.Tensor:
    # DeepSeek-V4's weights, in its routers' own order of operations with their own score function
    weights = score_fn(router_logits).gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale


def _deepseek_v4_rule(router: nn.Module) -> ReplayRule:
    """DeepSeek-V4: scores ``q = score_fn(x)`` (``scoring_func="sqrtsoftplus"``: SQRTSOFTPLUS;
    ``"sigmoid"``: DEEPSEEK_V3 without groups), weights ``q[ids] * routed_scaling_factor /
    (sum q[ids] + 1e-20)`` always (the router never reads ``norm_topk_prob``). A routed layer
    (``DeepseekV4TopKRouter``) chooses by ``q + e_score_correction_bias``; a hash layer
    (``DeepseekV4HashRouter``) takes ``tid2eid[input_ids]``, its forward's argument 1, for rows
    without a usable record, and has no bias. The method decides the ids (and routes faulty rows
    live); the weights are the router's own operations (``weights_fn``), the scale a tensor
    multiply, for the compile reason :func:`_sigmoid_bias_rule` gives."""
    score = type(router.score_fn).__name__
    if score not in _DEEPSEEK_V4_SCORES:
        raise ValueError(
            f"DeepSeek-V4 scoring_func must be 'sqrtsoftplus' or 'sigmoid' (the router's score_fn "
            f"SqrtSoftplusActivation or Sigmoid), got a router scoring with {score}"
        )
    method, formula = _DEEPSEEK_V4_SCORES[score]
    description = f"q = {formula}; q[ids] * routed_scaling_factor / (sum + 1e-20)"
    weights = functools.partial(_scored_weights, score_fn=router.score_fn, scale=router.routed_scaling_factor)
    if hasattr(router, "tid2eid"):
        return ReplayRule(
            method,
            weights_fn=weights,
            hash_table_attr="tid2eid",
            token_ids_arg=1,
            description=f"{description}; ids tid2eid[input_ids] where not recorded",
        )
    return ReplayRule(
        method,
        weights_fn=weights,
        bias_attr="e_score_correction_bias",
        description=f"{description}; chosen by q + e_score_correction_bias",
    )


def _sparsemixer_weights(
    router_logits: torch.Tensor, ids: torch.Tensor, *, router: nn.Module, multiplier_fn: Any
) -> torch.Tensor:
    """PhiMoE's sparsemixer multipliers at given ids: transformers' ``sparsemixer`` with its
    ``selected_experts`` (the argmax in eval mode, a Gumbel sample in training) replaced by ``ids``.

    Expert 1 gets its softmax over the experts within ``2 * router_jitter_noise`` (relative) of the
    row's best score, expert 2 its softmax over those within that of the best score other than
    expert 1; an expert outside its window gets weight 0 (as a training sample there would). In
    training mode (``router.training``) each multiplier goes through the model's own
    ``PhimoeMultiplier`` (Heun's third-order gradient estimator, its 1 or 1/3 factor drawn with
    ``torch.rand_like`` as the model draws it; ``multiplier_fn`` is that class); in eval mode
    autograd differentiates the softmax.
    """
    eps = router.router_jitter_noise
    scores = router_logits
    selected = (ids[:, :1], ids[:, 1:2])
    multipliers = []
    masked_scores = scores
    for k, chosen in enumerate(selected):
        if k == 1:
            masked_scores = torch.scatter(scores, -1, selected[0], float("-inf"))
        with torch.no_grad():
            threshold = masked_scores.max(dim=-1, keepdim=True).values
            factor = scores.abs().clamp(min=threshold)
            outside = ((threshold - scores) / factor) > (2 * eps)
        masked_gates = torch.softmax(masked_scores.masked_fill(outside, float("-inf")), dim=-1)
        multiplier = masked_gates.gather(dim=-1, index=chosen)
        if router.training:
            max_ind = masked_gates.max(dim=-1, keepdim=True).indices
            mask_for_one = torch.logical_or(chosen == max_ind, torch.rand_like(multiplier) > 0.75)
            mask_for_one = torch.add(0.3333, mask_for_one, alpha=0.6667).type_as(masked_gates)
            multiplier = multiplier_fn.apply(scores, multiplier, chosen, masked_gates, mask_for_one)
        multipliers.append(multiplier)
    return torch.cat(multipliers, dim=-1)


def _phimoe_multiplier(router: nn.Module):
    """transformers' ``PhimoeMultiplier`` (the autograd function of sparsemixer's training branch),
    from the module that defines the router's class."""
    cls = getattr(sys.modules.get(type(router).__module__), "PhimoeMultiplier", None)
    if cls is None:
        raise ValueError(
            f"{type(router).__module__} has no PhimoeMultiplier: this transformers version's PhiMoE "
            "training rule is unknown to attach_replay"
        )
    return cls


def _phimoe_rule(router: nn.Module) -> ReplayRule:
    """PhiMoE: sparsemixer, top-2 only; no method has its weights, so they are computed here
    (``_sparsemixer_weights``). Faulty rows route live with RENORMALIZE, whose top-2 by logit is
    sparsemixer's own choice in eval mode."""
    if router.top_k != 2:
        raise ValueError(f"PhiMoE's sparsemixer routes top-2 only; the router has top_k={router.top_k}")
    return ReplayRule(
        RoutingMethod.RENORMALIZE,
        weights_fn=functools.partial(
            _sparsemixer_weights, router=router, multiplier_fn=_phimoe_multiplier(router)
        ),
        description="sparsemixer multipliers (router_jitter_noise window)",
    )


# The weight rule of every supported architecture, from its router module's own fields; attach_replay
# calls it at every router call, so a field changed after attaching takes effect at the next call.
REPLAY_RULES: Mapping[str, Callable[[nn.Module], ReplayRule]] = MappingProxyType(
    {
        "qwen3_moe": _softmax_topk_rule,
        "mixtral": _renormalize_rule,
        "olmoe": _softmax_topk_rule,
        "deepseek_v3": _sigmoid_bias_rule,
        "gpt_oss": _renormalize_rule,
        "qwen2_moe": _softmax_topk_rule,
        "deepseek_v2": _deepseek_v2_rule,
        "glm4_moe": _sigmoid_bias_rule,
        "dots1": _sigmoid_bias_rule,
        "flex_olmo": _softmax_topk_rule,
        "phimoe": _phimoe_rule,
        "granitemoe": _renormalize_rule,
        "glm4_moe_lite": _sigmoid_bias_rule,
        "qwen3_5_moe": _renormalize_rule,
        "qwen3_5_moe_text": _renormalize_rule,
        "deepseek_v4": _deepseek_v4_rule,
    }
)


def _rule_builder(arch: str) -> Callable[[nn.Module], ReplayRule]:
    builder = REPLAY_RULES.get(normalize_arch(arch))
    if builder is None:  # an architecture added to SUPPORTED_ARCHITECTURES without its rule
        raise ValueError(f"attach_replay has no weight rule for {arch!r}; known: {', '.join(REPLAY_RULES)}")
    return builder


def replay_rule(arch: str, router: nn.Module) -> ReplayRule:
    """The :class:`~moe_ops.replay.attach.ReplayRule` of one router module of ``arch``, from the
    router's fields as they are now."""
    return _rule_builder(arch)(router)


def attach_replay(model: nn.Module, replayer: Any, *, backend: str = "auto") -> ReplayHandle:
    """Makes every MoE router of ``model`` return the ids in ``replayer``, weighted by its own rule.

    Args:
        model: a transformers model of a supported architecture (``SUPPORTED_ARCHITECTURES``, the
            ``*ForCausalLM`` or its base model, or their ``torch.compile`` wrapper). A model that
            lists its own routers (``replay_routers()``: :class:`~moe_ops.models.ReferenceMoEModel`)
            is handed to :func:`moe_ops.models.attach_replay` - the one dispatch, here, so that
            ``moe_ops.attach_replay`` takes both.
        replayer: where the ids come from, e.g. :class:`moe_ops.RoutingReplayer`: an object with
            ``layer_ids(model_layer_index, num_tokens)`` returning ``(num_tokens, top_k)`` ids. With
            a ``shape`` its ``moe_layers`` must be exactly the decoder layers that have a router,
            and its ``top_k`` the routers' top_k.
        backend: ``replay_routing``'s backend ("auto", "triton", "torch").

    Returns a :class:`~moe_ops.replay.attach.ReplayHandle`; ``handle.remove()`` or ``with
    attach_replay(...):`` restores the routers. Each wrapped router runs as before, then returns
    the same tuple (same positions, dtypes, shapes) with its weights and ids replaced by
    :func:`~moe_ops.replay.attach.replay_router_output` of ``replayer.layer_ids(layer, n)``: the
    recorded ids, weighted by the architecture's own rule (``REPLAY_RULES``) from the live logits,
    so gradients reach the router; rows of -1 keep the router's own output. The rule is built from
    the router's fields at every call, as its bias is read: a field changed after attaching
    (``norm_topk_prob``, ``routed_scaling_factor``, ...) takes effect at the next call (under
    ``torch.compile`` dynamo guards on those fields: a change recompiles once).

    Everything is checked before any router is touched: ValueError for an unsupported
    architecture, a model without routers, a replayer shape or device that does not fit the model
    (a router's ``top_k`` other than ``replayer.shape.top_k`` included), a router whose rule
    ``replay_routing`` would refuse, a router that already has a replay attached, or one that has a
    capture attached (the capture would record the live ids, not the replayed ones: attach the
    replay first, then the capture); TypeError for a replayer without ``layer_ids``. At a call,
    ValueError naming the router when its ``top_k`` no longer matches the replayer's rows (changed
    after attaching). Attach before or after ``torch.compile`` (dynamo guards on the wrapped
    attribute, as for ``attach_capture``); no host reads and no graph breaks are added.
    """
    if lists_its_routers(model):
        return attach_own_replay(model, replayer, backend=backend)
    check_replayer(replayer, backend)
    arch, routers = find_routers(model, caller="attach_replay")
    _check_replay_version(arch)
    builder = _rule_builder(arch)
    sites = _sites(routers)
    # the shape first: a rule refuses some top_k itself (PhiMoE's), with a less useful message
    check_against_shape(replayer, sites, "replayer")
    check_device(replayer, sites, "replayer")
    rules = [builder(site.module) for site in sites]
    check_replay_sites(replayer, sites, rules)
    # each wrapper calls the builder on the router's fields at every call
    wrappers = [
        replaying_forward(
            site.module.forward, replayer, site.layer, builder, site.module, backend=backend, path=site.path
        )
        for site in sites
    ]
    return attach_wrappers(ReplayHandle, "replay", arch, sites, wrappers, rules)


# ---------------------------------------------------------------------------------------------
# Tiny models (tests, the demo): real config and model classes, random weights, no downloads
# ---------------------------------------------------------------------------------------------


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the transformers integration needs transformers: pip install 'moe-ops[hf]'") from e
    check_transformers_version(transformers.__version__, MIN_TRANSFORMERS_VERSION)
    return transformers


def _class(transformers, name: str, arch: str):
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ImportError(f"transformers {transformers.__version__} has no {name}: {needs_release(arch)}")
    return cls


def needs_release(arch: str) -> str:
    """Which transformers ``arch`` needs, in words (for errors and skip reasons)."""
    spec = SUPPORTED_ARCHITECTURES[normalize_arch(arch)]
    if spec.checked_on is not None:
        return (
            f"{spec.name} needs a transformers with {', '.join(spec.router_classes)} "
            f"(checked on {spec.checked_on})"
        )
    return f"{spec.name} needs transformers>={MIN_TRANSFORMERS_VERSION}"


# Overrides of a nested (multimodal) config that belong to the outer config: transformers applies
# them to every sub-config from there.
_OUTER_OVERRIDES = frozenset({"experts_implementation", "attn_implementation"})


def tiny_config(arch: str, **overrides: Any):
    """The real transformers config of ``arch`` with tiny sizes; ``overrides`` replace any field.

    Tiny: 3 decoder layers, hidden 64, 4 heads, vocabulary 128, 8 experts top-2 (DeepSeek-V3: 16
    experts in 4 groups, top-4); DeepSeek-V2/V3, GLM-4-MoE, GLM-4.7-Flash and dots1 keep their first
    layer dense. ``arch`` is a key of ``SUPPORTED_ARCHITECTURES`` (see :func:`normalize_arch`). For
    a multimodal config (``HFArchitecture.decoder_config``, Qwen3.5-MoE) the tiny sizes and the
    overrides go to its decoder's sub-config, except ``experts_implementation``,
    ``attn_implementation`` and the outer config's own sub-configs, which stay outside.
    """
    spec = SUPPORTED_ARCHITECTURES[normalize_arch(arch)]
    transformers = _transformers()
    config_cls = _class(transformers, spec.config_class, spec.name)
    decoder = {**_TINY_COMMON, **spec.tiny}
    if spec.decoder_config is None:
        return config_cls(**{**decoder, **overrides})
    outside = _OUTER_OVERRIDES | set(spec.outer) | {spec.decoder_config}
    outer = {k: v for k, v in overrides.items() if k in outside}
    decoder.update((k, v) for k, v in overrides.items() if k not in outside)
    return config_cls(**{**spec.outer, spec.decoder_config: decoder, **outer})


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
    if spec.tiny_init is not None:
        spec.tiny_init(model, torch.Generator().manual_seed(seed))
    return model.to(device=device, dtype=dtype).eval()
