"""FlashInfer's MoE kernels as experts of the monolithic capture contract (:mod:`moe_ops.capture.monolithic`).

:class:`FlashInferExperts` runs one wrapped FlashInfer function (:mod:`moe_ops.flashinfer.ops`) and
fills the contract's hooks: the kernels from logits route inside the kernel and write the chosen ids
into ``routing_replay_out``; the routed variants (precomputed top-k) do not, and their router captures.
"""

from __future__ import annotations

from typing import Any

import torch

from ..capture.monolithic import MoEDispatchConfig, RoutingReplayExperts
from . import ops

__all__ = ["FlashInferExperts"]


class FlashInferExperts(RoutingReplayExperts):
    """Experts running one wrapped FlashInfer MoE function (``moe_ops.flashinfer.ops.SPECS``).

    ``kernel_args`` are the per-layer arguments (weights, scales, ``num_experts``, ``top_k``, ...);
    each call adds the per-step ones (``routing_logits`` or ``topk_ids``, ``hidden_states``, an
    optional ``output``). Monolithic (from logits) kernels support replay capture; the routed
    variants do not (their router captures instead).
    """

    def __init__(self, kernel: str, config: MoEDispatchConfig, **kernel_args: Any):
        spec = ops.spec_for(kernel)
        if spec.name == "fused_topk_deepseek":
            raise ValueError(
                "fused_topk_deepseek only routes; use route_flashinfer for it, not an experts kernel"
            )
        super().__init__(config)
        top_k = kernel_args.get("top_k")
        if top_k != config.top_k:
            raise ValueError(f"kernel_args top_k={top_k!r} must equal config.top_k={config.top_k}")
        for name in ("routing_replay_out", "output", spec.tokens_param):
            if name in kernel_args:
                raise ValueError(f"{name} is a per-call argument, not a kernel_arg")
        self.spec = spec
        self.kernel_name = kernel
        self.monolithic = spec.routes_in_kernel
        self.kernel_args = kernel_args

    def supports_routing_replay_capture(self) -> bool:
        return self.spec.routes_in_kernel and self.spec.writes_replay

    def __call__(self, **inputs: Any) -> torch.Tensor:
        """Runs the kernel on one step's inputs; returns ``output`` (num_tokens, hidden) bfloat16."""
        hidden_states = inputs[self.spec.tokens_param]
        replay = self.routing_replay_out(hidden_states.shape[0], hidden_states.device)
        out = ops.call(self.kernel_name, routing_replay_out=replay, **self.kernel_args, **inputs)
        self.capture_routing_replay(replay)
        return out
