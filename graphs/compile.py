"""torch.compile helpers: compile a step, mark its row dimension dynamic, count what the compiler did.

Counters come from ``torch._dynamo.utils.counters`` (the same numbers ``TORCH_LOGS`` prints): graph
breaks, distinct graphs compiled (a second graph for one function is a recompile), and inductor's
CUDA-graph skips (e.g. "skipping cudagraphs due to mutated inputs"); the reasons dynamo gave for
each recompile come from ``torch._dynamo.utils.guard_failures``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["COMPILE_MODES", "CompileCounters", "compile_step", "count_graph_breaks", "mark_rows_dynamic"]

# torch.compile modes compile_step accepts: inductor's default, and CUDA-graph trees
COMPILE_MODES = ("default", "reduce-overhead")


def compile_step(
    fn: Callable, *, mode: str = "default", fullgraph: bool = True, dynamic: bool | None = None
) -> Callable:
    """``torch.compile(fn, fullgraph=fullgraph, mode=mode, dynamic=dynamic)`` with the mode checked.

    ``fullgraph=True`` (the default) turns any graph break into an error instead of a silent split;
    ``mode="reduce-overhead"`` makes inductor replay the step from CUDA graphs (CUDA-graph trees; the
    capture buffer, counts and KV caches must be static addresses, see docs/demo.md).
    ``dynamic=None`` lets :func:`mark_rows_dynamic` decide which dimensions are dynamic.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, COMPILE_MODES))}, got {mode!r}")
    return torch.compile(fn, fullgraph=fullgraph, mode=None if mode == "default" else mode, dynamic=dynamic)


def mark_rows_dynamic(*tensors: torch.Tensor, dim: int = 0) -> None:
    """Marks dimension ``dim`` of each tensor dynamic, so one compiled graph serves every row count.

    Dynamo specialises sizes 0 and 1 whatever is marked, so tensors with fewer than 2 rows are left
    alone: a step that runs at 1 row compiles one extra, static graph (once).
    """
    for t in tensors:
        if t.shape[dim] >= 2:
            torch._dynamo.mark_dynamic(t, dim)


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
    # why dynamo recompiled inside the block: the failed guard of each recompile, in order
    recompile_reasons: list[str] = field(default_factory=list)
    _start: dict[str, int] = field(default_factory=dict, repr=False)
    _start_failures: dict[Any, int] = field(default_factory=dict, repr=False)

    def __enter__(self) -> CompileCounters:
        self._start = _snapshot()
        self._start_failures = {code: len(v) for code, v in torch._dynamo.utils.guard_failures.items()}
        return self

    def __exit__(self, *exc: Any) -> None:
        end = _snapshot()
        for key, value in end.items():
            setattr(self, key, value - self._start[key])
        self.recompile_reasons = [
            str(reason)
            for code, reasons in torch._dynamo.utils.guard_failures.items()
            for reason in reasons[self._start_failures.get(code, 0) :]
        ]


def count_graph_breaks(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Number of graph breaks dynamo finds when tracing ``fn(*args, **kwargs)`` (via ``explain``)."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    return explanation.graph_break_count
