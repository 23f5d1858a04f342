"""Integrations with model libraries. Each imports its library lazily: ``import moe_ops`` needs none.

``moe_ops.integrations.hf``: Hugging Face transformers - :func:`attach_capture` records the routing
of a transformers MoE model without editing its code, :func:`attach_replay` makes its routers
replay recorded ids; tiny real models for tests and the demo; :func:`generate_with_routing` splits
a batched ``generate()`` into one routing array per request (``hf_generate``).

``moe_ops.integrations.megatron``: Megatron-Core - ``attach_replay`` / ``attach_capture`` for its
``TopKRouter`` (fused routing and MTP layers included). Not imported here: import it by name.
"""

from .hf import (
    SUPPORTED_ARCHITECTURES,
    CaptureHandle,
    HFArchitecture,
    attach_capture,
    attach_replay,
    build_tiny_model,
    find_routers,
    normalize_arch,
    tiny_config,
)
from .hf_generate import GeneratedRouting, generate_with_routing

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CaptureHandle",
    "GeneratedRouting",
    "HFArchitecture",
    "attach_capture",
    "attach_replay",
    "build_tiny_model",
    "find_routers",
    "generate_with_routing",
    "normalize_arch",
    "tiny_config",
]
