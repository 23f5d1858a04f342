"""CUDA-graph and torch.compile integration for moe-ops.

``graphs.compile``: compile helpers and counters (graph breaks, recompiles, CUDA-graph skips).
"""

from .compile import CompileCounters, count_graph_breaks

__all__ = ["CompileCounters", "count_graph_breaks"]
