"""Transfer: the async device-to-host pipeline (pinned ring, copy stream, snapshot handles)."""

from .pipeline import RingFullError, SnapshotHandle, TransferPipeline, staging_dtype

__all__ = ["RingFullError", "SnapshotHandle", "TransferPipeline", "staging_dtype"]
