"""The transformers architectures the integration takes: where their routers are, which releases.

:data:`SUPPORTED_ARCHITECTURES` (one :class:`HFArchitecture` per ``config.model_type``: config,
model and router classes, the tiny model's sizes), :func:`normalize_arch`, :func:`find_routers`
(every router module of a model with its decoder layer) and the transformers version checks
(:func:`check_transformers_version`, ``MIN_TRANSFORMERS_VERSION``,
``MIN_REPLAY_TRANSFORMERS_VERSION``). The router contract every entry shares: the router module's
``forward(hidden_states)`` returns ``(router_logits, weights, ids)`` whose one integer tensor is
``ids``, ``(n_tokens, top_k)``.

Imports no transformers: the version checks read the one the process imported, if any.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ._tiny_sizes import TINY_DEEPSEEK_V4, TINY_MLA, TINY_QWEN3_5_MOE, fill_deepseek_v4_tables

__all__ = [
    "MIN_REPLAY_TRANSFORMERS_VERSION",
    "MIN_TRANSFORMERS_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "HFArchitecture",
    "check_replay_version",
    "check_transformers_version",
    "find_routers",
    "needs_release",
    "normalize_arch",
]


# The oldest transformers on which every supported architecture has the router module this
# integration wraps (bisected over 4.57.1-5.24 with tests/integrations/test_hf_attach.py and
# tests/integrations/test_replay_attach.py): in 5.0-5.12 DeepSeek-V2 and GraniteMoE have no router
# module (the MoE block routes inline) and the routers of DeepSeek-V3, GLM-4-MoE and dots1 return only
# the logits (4.57: 8 of the 12 have none). The GPU machine runs 5.17.
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


def check_replay_version(arch: str) -> None:
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
    # config fields of the tiny model on top of TINY_COMMON (experts, top_k, dense layers, ...)
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


def _arch(name: str, config_class: str, model_class: str, router: str, **tiny: Any) -> HFArchitecture:
    return HFArchitecture(name, config_class, model_class, (router,), MappingProxyType(tiny))


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
                **TINY_MLA,
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
                **TINY_MLA,
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
                **TINY_MLA,
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
                TINY_DEEPSEEK_V4,
                checked_on="5.24",
                tiny_init=fill_deepseek_v4_tables,
            ),
            # Qwen3.5-MoE as released (model_type "qwen3_5_moe"): the multimodal model, its decoder
            # in text_config, its routers at model.language_model.layers.<i>.mlp.gate; a one-block
            # vision tower that a text-only input never runs
            HFArchitecture(
                "qwen3_5_moe",
                "Qwen3_5MoeConfig",
                "Qwen3_5MoeForConditionalGeneration",
                ("Qwen3_5MoeTopKRouter",),
                TINY_QWEN3_5_MOE,
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
                TINY_QWEN3_5_MOE,
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


def needs_release(arch: str) -> str:
    """Which transformers ``arch`` needs, in words (for errors and skip reasons)."""
    spec = SUPPORTED_ARCHITECTURES[normalize_arch(arch)]
    if spec.checked_on is not None:
        return (
            f"{spec.name} needs a transformers with {', '.join(spec.router_classes)} "
            f"(checked on {spec.checked_on})"
        )
    return f"{spec.name} needs transformers>={MIN_TRANSFORMERS_VERSION}"


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
