"""What the demo writes per request: ``request_<id>/routing.npz`` (the pictures: :mod:`.train`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..shapes import RoutingShape
from .serve import DemoRequest, ServeResult

__all__ = ["write_routing"]


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
