"""Models: the reference MoE transformer of the demo, the end-to-end tests and the benchmark."""

from .reference import PRESETS, ReferenceMoEConfig, ReferenceMoEModel, reference_config

__all__ = ["PRESETS", "ReferenceMoEConfig", "ReferenceMoEModel", "reference_config"]
