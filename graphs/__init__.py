"""CUDA-graph and torch.compile integration for moe-ops, installed as ``moe_ops.graphs``.

The source lives in the top-level ``graphs/`` folder of the repository; the wheel and an editable
install map it to ``moe_ops.graphs`` (``package-dir`` in pyproject.toml), and a plain checkout on
``PYTHONPATH`` reaches it through ``moe_ops/graphs/__init__.py``. Import it as ``moe_ops.graphs``:
a top-level ``graphs`` is another distribution's name on PyPI, and any ``graphs/`` folder in the
working directory would shadow it.

``moe_ops.graphs.compile``: compile helpers and counters (graph breaks, recompiles, CUDA-graph skips).
``moe_ops.graphs.runner``: :class:`StepRunner`, a decode-style step runner that pads a batch up to a captured
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
