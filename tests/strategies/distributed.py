"""Across processes (moe_ops.distributed): process layouts, per-step counts and padding, and the
rank-specific router inputs every rank can recompute for every other rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from moe_ops import BatchLayout, RoutingMethod
from moe_ops.distributed import ParallelLayout

__all__ = [
    "DIST_CAPTURE_SIZES",
    "DIST_MAX_TOKENS",
    "DIST_NUM_EXPERTS",
    "DIST_PADDING",
    "DIST_ROUTERS",
    "DIST_TOP_K",
    "DistCase",
    "DistStep",
    "dist_cases",
    "dist_grids",
    "dist_logits",
    "dist_steps",
]


DIST_MAX_TOKENS = 24  # rows of every rank's capture buffer: the largest padded DP batch
DIST_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24)  # the CUDA-graph sizes a padded step runs at
DIST_NUM_EXPERTS = 16
DIST_TOP_K = 4
# router configurations the distributed cases route with: (method, route keyword arguments)
DIST_ROUTERS = {
    "renormalize": (RoutingMethod.RENORMALIZE, {}),
    "deepseek": (RoutingMethod.DEEPSEEK_V3, {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
}
DIST_PADDING = ("none", "per-rank", "graph", "graph-per-rank")


@dataclass(frozen=True)
class DistStep:
    """One step of a distributed case."""

    # counts[d]: real tokens of DP rank d
    counts: tuple[int, ...]
    # padded[d]: rows of DP rank d's batch, in [counts[d], DIST_MAX_TOKENS]
    padded: tuple[int, ...]


@dataclass(frozen=True)
class DistCase:
    """A process layout and a few steps of counts and padding; the router inputs come from
    :func:`dist_logits`, so the expected ids of any rank are known to every process."""

    # dp_size, tp_size, use_ep and the layout the MoE layer routes
    parallel: ParallelLayout
    # the steps, in order; one plan per distinct padded tuple
    steps: tuple[DistStep, ...]
    # key into DIST_ROUTERS
    router: str
    # seeds the router inputs
    seed: int

    def route_args(self) -> tuple[RoutingMethod, dict]:
        """(method, keyword arguments of moe_ops.route), the DeepSeek-V3 bias included."""
        method, kwargs = DIST_ROUTERS[self.router]
        kwargs = dict(kwargs)
        if method == RoutingMethod.DEEPSEEK_V3:
            g = torch.Generator().manual_seed(self.seed)
            kwargs["bias"] = torch.randn(DIST_NUM_EXPERTS, generator=g) * 0.1
        return method, kwargs


def dist_logits(case: DistCase, step: int, dp_rank: int, layer: int) -> torch.Tensor:
    """(padded, DIST_NUM_EXPERTS) float32: DP rank ``dp_rank``'s router logits of model layer
    ``layer`` in step ``step``. Real token j's row depends on (seed, step, dp_rank, layer, j) only,
    not on the count; padding rows hold a ramp that routes to the last experts, so a padding row
    that reached a capture buffer would show."""
    s = case.steps[step]
    # the fields stay below 31, so distinct (step, dp_rank, layer) give distinct seeds
    g = torch.Generator().manual_seed(((case.seed * 31 + step) * 31 + dp_rank) * 31 + layer)
    table = torch.randn(DIST_MAX_TOKENS, DIST_NUM_EXPERTS, generator=g)
    out = table[: s.padded[dp_rank]].clone()
    out[s.counts[dp_rank] :] = torch.arange(DIST_NUM_EXPERTS, dtype=torch.float32) * 4.0
    return out


def _graph_size(count: int) -> int:
    return min(size for size in DIST_CAPTURE_SIZES if size >= max(count, 1))


def dist_grids(world: int, layout: BatchLayout) -> list[ParallelLayout]:
    """Every ParallelLayout of ``world`` ranks that routes ``layout`` (SHARDED needs EP)."""
    out = []
    for dp in range(1, world + 1):
        if world % dp:
            continue
        for use_ep in (False, True):
            if layout == BatchLayout.SHARDED and not use_ep:
                continue
            out.append(ParallelLayout(dp, world // dp, use_ep=use_ep, layout=layout))
    return out


@st.composite
def dist_steps(draw, dp_size: int, max_tokens: int = DIST_MAX_TOKENS) -> DistStep:
    """Counts (zero-token ranks often) and padding: none, per rank, every rank to one CUDA-graph
    size (vLLM under DP), or every rank to its own CUDA-graph size."""
    count = st.one_of(st.just(0), st.integers(0, max_tokens))
    counts = draw(st.lists(count, min_size=dp_size, max_size=dp_size))
    padding = draw(st.sampled_from(DIST_PADDING))
    if padding == "none":
        padded = list(counts)
    elif padding == "per-rank":
        padded = [draw(st.integers(c, max_tokens)) for c in counts]
    elif padding == "graph":
        padded = [_graph_size(max(counts))] * dp_size
    else:
        padded = [_graph_size(c) for c in counts]
    return DistStep(tuple(counts), tuple(padded))


@st.composite
def dist_cases(draw, world: int, layout: BatchLayout, max_steps: int = 3) -> DistCase:
    """A DistCase of ``world`` ranks routing ``layout``: one of its process layouts, 1..max_steps
    steps (a later step repeats an earlier padding now and then, reusing its plan), a router."""
    parallel = draw(st.sampled_from(dist_grids(world, layout)))
    steps = [draw(dist_steps(parallel.dp_size))]
    for _ in range(draw(st.integers(0, max_steps - 1))):
        new = draw(dist_steps(parallel.dp_size))
        if draw(st.booleans()):  # same shapes, new counts within them: the CUDA-graph case
            prev = steps[-1]
            new = DistStep(tuple(min(c, p) for c, p in zip(new.counts, prev.padded)), prev.padded)
        steps.append(new)
    router = draw(st.sampled_from(sorted(DIST_ROUTERS)))
    return DistCase(parallel, tuple(steps), router, draw(st.integers(0, 2**16)))
