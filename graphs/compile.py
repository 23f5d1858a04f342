"""torch.compile helpers: count what the compiler did, so tests can assert it did nothing bad.

All counters come from ``torch._dynamo.utils.counters`` (the same numbers ``TORCH_LOGS`` prints):
graph breaks, distinct graphs compiled (a second graph for one function is a recompile), and
inductor's CUDA-graph skips (e.g. "skipping cudagraphs due to mutated inputs").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CompileCounters", "count_graph_breaks"]


def _snapshot() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


@dataclass
class CompileCounters:
    """Context manager: what dynamo/inductor counted while the block ran.

    with CompileCounters() as cc:
        compiled(x); compiled(y)
    assert cc.graph_breaks == 0 and cc.graphs == 1 and cc.cudagraph_skips == 0
    """

    # graph breaks dynamo reported inside the block
    graph_breaks: int = 0
    # graphs dynamo compiled inside the block (1 for one function compiled once; more = recompiles)
    graphs: int = 0
    # inductor CUDA-graph skips (reduce-overhead falling back to no graphs)
    cudagraph_skips: int = 0
    _start: dict[str, int] = field(default_factory=dict, repr=False)

    def __enter__(self) -> CompileCounters:
        self._start = _snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = _snapshot()
        for key, value in end.items():
            setattr(self, key, value - self._start[key])


def count_graph_breaks(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Number of graph breaks dynamo finds when tracing ``fn(*args, **kwargs)`` (via ``explain``)."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    return explanation.graph_break_count
