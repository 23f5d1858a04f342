"""FlashInfer integration: its MoE kernels and fused routing as compile-safe custom ops.

FlashInfer only; the backend-agnostic pieces live elsewhere (the monolithic capture contract in
:mod:`moe_ops.capture.monolithic`, what ``route(backend="auto")`` runs in :mod:`moe_ops.router.policy`,
the report ``moe_ops.backends()`` in :mod:`moe_ops.backend_report`).

* :mod:`.ops` - the table of wrapped FlashInfer functions and the ops generated from it
  (``torch.ops.moe_ops.flashinfer_<name>``), with :func:`call`;
* :mod:`.experts` - :class:`FlashInferExperts`, FlashInfer's kernels under the monolithic contract;
* :mod:`.routing` - :func:`route_flashinfer`, DeepSeek-V3 routing with fused capture;
* :mod:`.backends` - where FlashInfer's kernels run on this machine (:func:`kernel_support`).

FlashInfer itself (``flashinfer-python``, the ``moe-ops[flashinfer]`` extra) is imported lazily, on
the first kernel call or device query: importing this package does not import it.
"""

from .backends import Support
from .experts import FlashInferExperts
from .ops import SPECS, call
from .routing import DEEPSEEK_V3, route_flashinfer

__all__ = [
    "DEEPSEEK_V3",
    "SPECS",
    "FlashInferExperts",
    "Support",
    "call",
    "route_flashinfer",
]
