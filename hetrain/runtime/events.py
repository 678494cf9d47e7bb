"""The records a Session reports (their home is hetrain.metrics.events, the floor of their observers)."""

from hetrain.metrics.events import CheckpointRecord, StepRecord

__all__ = ["CheckpointRecord", "StepRecord"]
