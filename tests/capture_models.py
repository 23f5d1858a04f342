"""A tiny routed model used by the compile and CUDA-graph tests of the capture op."""

from __future__ import annotations

import torch

from moe_ops import BatchLayout, capture_routing


class TinyRouted(torch.nn.Module):
    """``num_layers`` of softmax + top-k routing, each captured into a module buffer.

    routing: (max_tokens, num_layers, top_k) int32 module buffer - the capture target
    """

    def __init__(
        self,
        hidden=16,
        n_experts=8,
        top_k=2,
        num_layers=3,
        max_tokens=32,
        layout=BatchLayout.LOCAL,
        dp_rank=0,
        seed=0,
    ):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gates = torch.nn.Parameter(torch.randn(num_layers, hidden, n_experts, generator=g))
        self.mix = torch.nn.Parameter(torch.randn(num_layers, hidden, hidden, generator=g) / hidden**0.5)
        self.register_buffer("routing", torch.full((max_tokens, num_layers, top_k), -7, dtype=torch.int32))
        self.top_k, self.num_layers, self.layout, self.dp_rank = top_k, num_layers, layout, dp_rank

    def forward(self, x, token_counts, shard_sizes=None):
        all_ids = []
        for layer in range(self.num_layers):
            probs = torch.softmax(x @ self.gates[layer], dim=-1)
            ids = torch.topk(probs, self.top_k, dim=-1).indices
            capture_routing(
                self.routing,
                ids,
                layer,
                token_counts=token_counts,
                dp_rank=self.dp_rank,
                layout=self.layout,
                shard_sizes=shard_sizes,
            )
            all_ids.append(ids)
            x = torch.tanh(x @ self.mix[layer]) + x
        return x, torch.stack(all_ids, dim=1)


def layout_inputs(layout, counts, padded, spr=2, hidden=16, device="cpu", seed=0):
    """(x rows, token_counts, shard_sizes, start of rank 1's block) for a two-rank batch seen by rank 1."""
    g = torch.Generator().manual_seed(seed)
    counts_t = torch.tensor(counts, dtype=torch.int32, device=device)
    if layout == BatchLayout.LOCAL:
        n, sizes, start = padded[1], None, 0
    elif layout == BatchLayout.GATHERED:
        n, sizes, start = sum(padded), torch.tensor(padded, dtype=torch.int32, device=device), padded[0]
    else:
        per = [-(-p // spr) for p in padded]
        shard = [s for s in per for _ in range(spr)]
        n, start = sum(shard), per[0] * spr
        sizes = torch.tensor(shard, dtype=torch.int32, device=device)
    x = torch.randn(n, hidden, generator=g).to(device)
    return x, counts_t, sizes, start
