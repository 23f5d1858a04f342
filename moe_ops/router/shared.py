"""Fused shared experts: the columns ``route`` and ``replay_routing`` append after the routed top-k.

Serving engines that fuse DeepSeek-style shared experts into the routed MoE kernel run them as
extra experts every token visits: ids ``num_experts .. num_experts + s - 1`` in columns
``top_k .. top_k + s - 1``, at weight 1.0, untouched by ``routed_scaling_factor`` (vLLM's ROCm
AITER path, ``init_aiter_topK_meta_data(..., shared_experts_score=1.0)``, and FlashInfer's
DeepSeek-V3 routing with ``num_fused_shared_experts``; docs/routing.md "Fused shared experts"
compares SGLang's variant). They are constants: nothing chooses them, nothing is learnt through
their weight, and a trainer replays the routed columns only, so capture records those by default.
"""

from __future__ import annotations

import torch

__all__ = ["check_capture_shared_experts", "check_num_fused_shared_experts"]

_INT32_MAX = torch.iinfo(torch.int32).max


def check_num_fused_shared_experts(value: object, num_experts: int) -> int:
    """``value`` as the number of shared columns: an int (not a bool) >= 0 whose largest id
    ``num_experts + value - 1`` fits the int32 ids. TypeError / ValueError naming
    ``num_fused_shared_experts`` otherwise. Host values only."""
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
