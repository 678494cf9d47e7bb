"""Checkpoints: atomic, verified, background saves of everything needed to continue exactly."""

from hetrain.checkpoint.checkpointer import CheckpointInfo, Checkpointer, CheckpointWarning
from hetrain.checkpoint.errors import CheckpointError
from hetrain.checkpoint.rng import capture_rng, restore_rng

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointWarning", "Checkpointer", "capture_rng", "restore_rng"]
