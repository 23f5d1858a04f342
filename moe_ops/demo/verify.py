"""Checking captured routing: an eager, uncaptured reference run, compared row by row (exactly)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.reference import ReferenceMoEModel
from ..shapes import RoutingShape
from .serve import ServeResult

__all__ = ["Verification", "reference_routing", "verify"]


@torch.no_grad()
def reference_routing(model: ReferenceMoEModel, tokens: Sequence[int]) -> np.ndarray:
    """The routing of ``tokens[:-1]`` from one eager, uncaptured prefill of the model:
    ``(len(tokens) - 1, num_moe_layers, top_k)`` int32 (the last token is never run).

    Uses request slot 0 of the model's KV cache (call it while no request is being served).
    Host sync: the ids are copied to the host.
    """
    n = len(tokens) - 1
    device = model.embed.device
    ids = torch.tensor(list(tokens[:n]), dtype=torch.int64, device=device)
    positions = torch.arange(n, device=device)
    slots = torch.zeros(n, dtype=torch.int64, device=device)
    _, router_ids = model(ids, positions, slots, return_router_ids=True)
    return router_ids.cpu().numpy()


@dataclass
class Verification:
    """Captured routing compared with the reference, over the requests of one run."""

    # requests compared
    requests: int = 0
    # rows compared (sum of num_tokens - 1)
    rows: int = 0
    # rows whose (num_moe_layers, top_k) ids differ from the reference (or that are missing/extra)
    mismatched_rows: int = 0
    # req_id -> (got shape, expected shape) for requests whose routing has the wrong shape
    bad_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # requests served but absent from the captured routing
    missing: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatched_rows == 0 and not self.bad_shapes and not self.missing


def verify(
    result: ServeResult, reference: Callable[[Sequence[int]], np.ndarray], shape: RoutingShape
) -> Verification:
    """Compares every request's captured routing with ``reference(tokens)`` row by row (exactly)."""
    out = Verification()
    for req_id, tokens in sorted(result.sequences.items()):
        expected = reference(tokens)
        want = (len(tokens) - 1, shape.num_layers, shape.top_k)
        assert expected.shape == want, (expected.shape, want)  # the reference model's own contract
        out.requests += 1
        out.rows += want[0]
        got = result.routing.get(req_id)
        if got is None:
            out.missing.append(req_id)
            out.mismatched_rows += want[0]
            continue
        if got.shape != want:
            out.bad_shapes[req_id] = (got.shape, want)
            out.mismatched_rows += max(got.shape[0] if got.ndim else 0, want[0])
            continue
        out.mismatched_rows += int((got.astype(np.int64) != expected).any(axis=(1, 2)).sum())
    return out
