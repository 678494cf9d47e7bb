"""The one error the checkpoint service raises."""

from __future__ import annotations

from hetrain.errors import HetrainError


class CheckpointError(HetrainError):
    """A checkpoint cannot be written or read: the message names the path, the reason and the fix."""
