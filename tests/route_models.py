"""A tiny routed model whose layers route with moe_ops.route and capture in the same call."""

from __future__ import annotations

import torch

from moe_ops import BatchLayout, CaptureTarget, RoutingMethod, route


class RoutedMoE(torch.nn.Module):
    """``num_layers`` DeepSeek-V3-style routers (grouped, biased), each capturing into a buffer.

    routing: (max_tokens, num_layers, top_k) int32 module buffer - the capture target
    """

    def __init__(
        self,
        hidden=16,
        n_experts=32,
        top_k=4,
        n_group=4,
        topk_group=2,
        num_layers=3,
        max_tokens=32,
        layout=BatchLayout.LOCAL,
        dp_rank=0,
        backend="auto",
        seed=0,
    ):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gates = torch.nn.Parameter(torch.randn(num_layers, hidden, n_experts, generator=g))
        self.register_buffer("bias", torch.randn(num_layers, n_experts, generator=g) * 0.1)
        self.mix = torch.nn.Parameter(torch.randn(num_layers, hidden, hidden, generator=g) / hidden**0.5)
        self.register_buffer("routing", torch.full((max_tokens, num_layers, top_k), -7, dtype=torch.int32))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.num_layers, self.layout, self.dp_rank, self.backend = num_layers, layout, dp_rank, backend

    def forward(self, x, token_counts, shard_sizes=None):
        all_ids = []
        for layer in range(self.num_layers):
            weights, ids = route(
                x @ self.gates[layer],
                self.top_k,
                RoutingMethod.DEEPSEEK_V3,
                bias=self.bias[layer],
                n_group=self.n_group,
                topk_group=self.topk_group,
                routed_scaling_factor=2.5,
                capture=CaptureTarget(
                    self.routing,
                    layer,
                    token_counts=token_counts,
                    dp_rank=self.dp_rank,
                    layout=self.layout,
                    shard_sizes=shard_sizes,
                ),
                backend=self.backend,
            )
            all_ids.append(ids)
            x = torch.tanh(x @ self.mix[layer]) * weights.sum(-1, keepdim=True) + x
        return x, torch.stack(all_ids, dim=1)
