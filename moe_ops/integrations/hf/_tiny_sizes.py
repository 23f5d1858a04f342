"""The sizes of the tiny models and what fills them: what the architecture table's tiny entries
share (:mod:`.architectures`) and :func:`~moe_ops.integrations.hf.tiny.tiny_config` starts from.
Data and one filler only; imports nothing of the integration."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

__all__ = ["TINY_COMMON", "TINY_DEEPSEEK_V4", "TINY_MLA", "TINY_QWEN3_5_MOE", "fill_deepseek_v4_tables"]

# Sizes every tiny model shares: 3 decoder layers, hidden 64, 4 heads of 16, vocabulary 128. Token
# ids 0-2 are the special tokens (the defaults of some configs lie outside a 128-token vocabulary).
TINY_COMMON: Mapping[str, Any] = MappingProxyType(
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
TINY_MLA: Mapping[str, Any] = MappingProxyType(
    {
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "num_key_value_heads": 4,
    }
)

# Qwen3.5-MoE's decoder: hybrid attention (Gated DeltaNet linear attention and full attention, both
# kinds in 3 layers), a shared expert beside the routed ones, every layer MoE. Partial rotary 0.5 of
# head 16 gives 4 frequencies, split 2/1/1 over the t/h/w positions as the released 11/11/10 split
# the 32 of its head 256 at 0.25.
TINY_QWEN3_5_MOE: Mapping[str, Any] = MappingProxyType(
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
TINY_DEEPSEEK_V4: Mapping[str, Any] = MappingProxyType(
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


def fill_deepseek_v4_tables(model: nn.Module, gen: torch.Generator) -> None:
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
