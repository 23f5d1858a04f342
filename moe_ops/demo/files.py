"""What the demo writes: ``request_<id>/routing.npz`` per request and the expert-load heatmap."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..shapes import RoutingShape
from .serve import DemoRequest, ServeResult

__all__ = ["expert_load", "plot_expert_load", "write_routing"]


def write_routing(
    out_dir: str, result: ServeResult, shape: RoutingShape, requests: Sequence[DemoRequest]
) -> int:
    """Writes ``out_dir/request_<id>/routing.npz`` per request; returns how many were written.

    Arrays: ``routing`` (num_tokens - 1, num_moe_layers, top_k) narrow uint, ``tokens`` (num_tokens,)
    int64, ``prompt_len`` (), ``moe_layers`` (num_moe_layers,) model-layer index of each column,
    ``num_experts`` ().
    """
    prompt_len = {r.req_id: len(r.prompt) for r in requests}
    for req_id, routing in sorted(result.routing.items()):
        path = os.path.join(out_dir, f"request_{req_id:03d}")
        os.makedirs(path, exist_ok=True)
        np.savez(
            os.path.join(path, "routing.npz"),
            routing=routing,
            tokens=np.asarray(result.sequences[req_id], dtype=np.int64),
            prompt_len=np.int64(prompt_len[req_id]),
            moe_layers=np.asarray(shape.moe_layers, dtype=np.int64),
            num_experts=np.int64(shape.num_experts),
        )
    return len(result.routing)


def expert_load(routing: Sequence[np.ndarray], shape: RoutingShape) -> np.ndarray:
    """(num_moe_layers, num_experts) int64: tokens routed to each expert in each MoE layer."""
    load = np.zeros((shape.num_layers, shape.num_experts), dtype=np.int64)
    for r in routing:
        for layer in range(shape.num_layers):
            load[layer] += np.bincount(r[:, layer].reshape(-1).astype(np.int64), minlength=shape.num_experts)
    return load


def plot_expert_load(load: np.ndarray, shape: RoutingShape, path: str, title: str) -> str | None:
    """Heatmap of ``load`` to ``path``; returns None, or a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'moe-ops[plot]'): skipped expert_load.png"
    fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * shape.num_experts + 2), 0.45 * shape.num_layers + 1.8))
    image = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("model layer")
    ax.set_yticks(range(shape.num_layers))
    ax.set_yticklabels([str(layer) for layer in shape.moe_layers])
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="tokens routed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
