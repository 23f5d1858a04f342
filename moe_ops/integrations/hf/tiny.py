"""Tiny transformers models (tests, the demo): real config and model classes, random weights, no
downloads; their sizes are in ``_tiny_sizes``. ``transformers`` is imported by the first call of
:func:`tiny_config` or :func:`build_tiny_model`, with its version checked."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import architectures
from ._tiny_sizes import TINY_COMMON
from .architectures import SUPPORTED_ARCHITECTURES, check_transformers_version, needs_release, normalize_arch

__all__ = ["build_tiny_model", "tiny_config"]


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the transformers integration needs transformers: pip install 'moe-ops[hf]'") from e
    # the minimum read at the call, as find_routers reads it (a test raises it on the module)
    check_transformers_version(transformers.__version__, architectures.MIN_TRANSFORMERS_VERSION)
    return transformers


def _class(transformers, name: str, arch: str):
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ImportError(f"transformers {transformers.__version__} has no {name}: {needs_release(arch)}")
    return cls


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
    decoder = {**TINY_COMMON, **spec.tiny}
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
