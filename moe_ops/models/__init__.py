"""Models: the reference MoE transformer of the demo, the end-to-end tests and the benchmark, and
its replay attach path (:func:`attach_replay`)."""

from .attach import attach_replay
from .reference import PRESETS, ReferenceMoEConfig, ReferenceMoEModel, reference_config

__all__ = ["PRESETS", "ReferenceMoEConfig", "ReferenceMoEModel", "attach_replay", "reference_config"]
