"""Config guards: refuse serving setups whose routing the capture cannot deliver correctly.

Each refusal names the setting, its value, and why, so that an engine can surface it at start-up
instead of returning wrong rows later:

- pipeline parallelism > 1: each stage runs only its own layers, so no rank's capture buffer holds
  every MoE layer of a token, and the step's rows would have to be merged across stages (not built).
- CPU weight offloading: offloaded layers run through a different path (weights streamed in per
  step, typically outside CUDA graphs); the capture's ordering rules were not verified there.
- KV caches filled from outside the engine (disaggregated prefill, KV connectors, KV transfer):
  those tokens never passed through this engine's routers, so their slots hold no routing of them
  (or a previous request's, if the blocks were reused).
- non-MoE models: there is nothing to capture.
"""

from __future__ import annotations

from typing import Any

from .shapes import RoutingShape, resolve_routing_shape

__all__ = ["UnsupportedConfigError", "validate_serving_config"]


class UnsupportedConfigError(ValueError):
    """A serving configuration the routing capture cannot serve; ``reasons`` lists every problem."""

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        lines = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"routing capture cannot serve this configuration:\n{lines}")


def validate_serving_config(
    model_config: Any = None,
    *,
    pipeline_parallel_size: int = 1,
    cpu_offload_gb: float = 0,
    kv_connector: str | None = None,
    disaggregated_prefill: bool = False,
) -> RoutingShape | None:
    """Checks a serving setup and returns the model's :class:`RoutingShape` (None without a model).

    Args:
        model_config: the model's Hugging Face style config (object or dict), checked to be MoE
            with :func:`resolve_routing_shape`; None skips the model check.
        pipeline_parallel_size: pipeline-parallel stages; must be 1.
        cpu_offload_gb: weights offloaded to CPU memory (vLLM's ``cpu_offload_gb``); must be 0.
        kv_connector: name of a KV connector / KV transfer backend filling the cache from outside
            (e.g. vLLM's ``kv_transfer_config.kv_connector``); must be None.
        disaggregated_prefill: True when prefill runs on another instance and the KV cache arrives
            by transfer; must be False.

    Raises:
        UnsupportedConfigError (a ValueError): every problem found, one line each.
    """
    reasons = []
    if isinstance(pipeline_parallel_size, bool) or not isinstance(pipeline_parallel_size, int):
        reasons.append(f"pipeline_parallel_size must be an int, got {pipeline_parallel_size!r}")
    elif pipeline_parallel_size != 1:
        reasons.append(
            f"pipeline_parallel_size={pipeline_parallel_size}: pipeline parallelism > 1 is not supported "
            "(each stage holds only its own layers' routing); use pipeline_parallel_size=1"
        )
    if cpu_offload_gb is None or not isinstance(cpu_offload_gb, (int, float)) or cpu_offload_gb < 0:
        reasons.append(f"cpu_offload_gb must be a number >= 0, got {cpu_offload_gb!r}")
    elif cpu_offload_gb > 0:
        reasons.append(
            f"cpu_offload_gb={cpu_offload_gb}: CPU weight offloading is not supported (offloaded layers "
            "run outside the verified capture path); use cpu_offload_gb=0"
        )
    if kv_connector is not None:
        reasons.append(
            f"kv_connector={kv_connector!r}: KV caches filled from outside the engine are not supported "
            "(transferred tokens never ran through this engine's routers, so their routing is unknown)"
        )
    if disaggregated_prefill:
        reasons.append(
            "disaggregated_prefill=True: prefill on another instance is not supported (the prompt's "
            "routing is computed there and never reaches this engine's capture buffer)"
        )
    shape = None
    if model_config is not None:
        try:
            shape = resolve_routing_shape(model_config)
        except ValueError as e:
            reasons.append(f"not a mixture-of-experts model the capture understands: {e}")
    if reasons:
        raise UnsupportedConfigError(reasons)
    return shape
