"""CUDA-graph and torch.compile integration for moe-ops.

``graphs.compile``: compile helpers and counters (graph breaks, recompiles, CUDA-graph skips).
``graphs.runner``: :class:`StepRunner`, a decode-style step runner that pads a batch up to a captured
size and replays it from a CUDA graph (or runs it compiled or eagerly), updating the routing
capturer's live counts before each step.
"""

from .compile import COMPILE_MODES, CompileCounters, compile_step, count_graph_breaks, mark_rows_dynamic
from .runner import DEFAULT_CAPTURE_SIZES, RunnerMode, RunnerStats, StepInput, StepRunner

__all__ = [
    "COMPILE_MODES",
    "DEFAULT_CAPTURE_SIZES",
    "CompileCounters",
    "RunnerMode",
    "RunnerStats",
    "StepInput",
    "StepRunner",
    "compile_step",
    "count_graph_breaks",
    "mark_rows_dynamic",
]
